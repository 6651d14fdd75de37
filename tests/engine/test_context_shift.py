"""Context shift (--context-shift, --keep / n_keep) on fake models: llama-server's arithmetic,
and lossless under speculation.

A context of 24 and 60 tokens to generate: the history fills the context several times.
Each time, the first n_keep tokens stay, half of the rest of the cache goes and the tail
moves down. The reference is that loop written out by hand over the fake model (whose rows
read positions by index, so they move with the shift as RoPE's do); plain decoding must
equal it, and every drafter at every draft length must equal plain decoding: the shifts
happen at the same history whatever the draft did.
"""

from __future__ import annotations

from collections.abc import Sequence

import httpx
import pytest
from fakes import FakeBackend, FakeBatch, FakeModel, RandomDrafter

from specwire.config import ConfigError, DraftParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import KEEP, NgramDrafter
from specwire.engine.context_shift import Shift, plan_shift
from specwire.engine.engine import Engine, Request
from specwire.link.threaded import ThreadedDrafter
from specwire.sample import sampling

V = 32
TARGET = FakeModel(n_vocab=V, seed=3)
OTHER = TARGET.perturbed(0.7, seed=5)
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2]
N_CTX = 24
N = 60
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, min_p=0.02, seed=77)
PENALISED = SamplingParams(temperature=0.8, top_k=12, repeat_penalty=1.3, repeat_last_n=6,
                           seed=5)


def reference(params: SamplingParams, n_keep: int, n: int = N) -> tuple[list[int], int]:
    """llama-server's loop by hand: shift when the cache holds n_ctx - 1 tokens (the
    history, which counts the token still to be evaluated, n_ctx). (tokens, shifts)."""
    hist, out, shifts = list(PROMPT), [], 0
    for _ in range(n):
        if len(hist) >= N_CTX:
            keep = min(N_CTX - 4, len(PROMPT) if n_keep < 0 else n_keep)
            drop = (len(hist) - 1 - keep) // 2
            hist = hist[:keep] + hist[keep + drop:]
            shifts += 1
        t = sampling.coupled(TARGET.row(hist), params, len(hist),
                             sampling.recent_window(hist, params))
        out.append(t)
        hist.append(t)
    return out, shifts


def make(kind: str):
    if kind == "none":
        return None
    if kind == "same":
        return ModelDrafter(FakeBackend(TARGET, n_ctx=64, name="twin.gguf"))
    if kind == "other":
        return ModelDrafter(FakeBackend(OTHER, n_ctx=64, name="other.gguf"))
    if kind == "ngram":
        return NgramDrafter(4, 1, keep=KEEP)
    if kind == "random":
        return RandomDrafter(V, seed=4)
    if kind == "threaded":
        return ThreadedDrafter(FakeBackend(TARGET, n_ctx=64, name="threaded.gguf"))
    if kind == "sync":
        return ThreadedDrafter(FakeBackend(TARGET, n_ctx=64, name="sync.gguf"), pipelined=False)
    raise ValueError(kind)


def run(kind: str, params: SamplingParams, n_max: int = 4, n_keep: int = 0,
        target: FakeBackend | None = None, shift: bool = True):
    target = target or FakeBackend(TARGET, n_ctx=N_CTX)
    drafter = make(kind)
    engine = Engine(target, drafter)
    if shift:
        engine.enable_context_shift()
    dp = DraftParams(n_max=n_max, p_min=0.0, enabled=drafter is not None)
    gen = engine.generate(Request(list(PROMPT), N, params, dp, n_keep=n_keep))
    gen.run()
    if drafter is not None:
        drafter.close()
    return gen, target


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALISED],
                         ids=["greedy", "sampled", "penalised"])
@pytest.mark.parametrize("n_keep", [0, 3, -1])
def test_plain_decoding_shifts_as_llama_server_does(params, n_keep) -> None:
    ref, shifts = reference(params, n_keep)
    gen, target = run("none", params, n_keep=n_keep)
    assert gen.tokens == ref
    assert gen.shifts == shifts == len(target.shifts) >= 3
    keep = len(PROMPT) if n_keep < 0 else n_keep
    assert all(k == keep for k, _ in target.shifts)
    assert gen.stop_type == "limit" and gen.truncated and len(gen.tokens) == N
    assert target.n_past <= N_CTX


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALISED],
                         ids=["greedy", "sampled", "penalised"])
@pytest.mark.parametrize("kind", ["same", "other", "ngram", "random", "threaded", "sync"])
def test_the_output_with_a_draft_is_the_output_without_one(kind, params) -> None:
    """Every draft length, with n_keep 3 (the prompt is cut inside): the same tokens and
    the same shifts as plain decoding, and the target never asked past its context."""
    plain, plain_target = run("none", params, n_keep=3)
    for n_max in (1, 2, 4, 8, 16):
        gen, target = run(kind, params, n_max=n_max, n_keep=3)
        assert gen.tokens == plain.tokens, (kind, n_max)
        assert target.shifts == plain_target.shifts, (kind, n_max)
        if kind == "same" and params.greedy:
            assert gen.stats.draft_n_accepted > 0


@pytest.mark.parametrize("kind", ["same", "sync"])
def test_a_shift_restarts_the_drafters_sequence_on_the_shifted_history(kind: str) -> None:
    """The twin (a local draft model, or one behind the draft link's session, waited
    for) drafts on after each shift: its sequence starts again on the shifted history,
    so nearly every token comes from an accepted draft."""
    gen, _ = run(kind, GREEDY, n_max=4)
    assert gen.shifts >= 3
    assert gen.stats.draft_n_accepted == gen.stats.draft_n
    assert gen.stats.draft_n_accepted >= 0.7 * N, gen.stats.to_dict()


def test_without_context_shift_generation_stops_at_the_context() -> None:
    gen, target = run("same", GREEDY, shift=False)
    assert gen.stop_type == "limit" and gen.truncated and gen.shifts == 0
    assert len(PROMPT) + len(gen.tokens) == N_CTX
    assert target.shifts == []


def test_batched_sequences_shift_each_their_own_cache() -> None:
    """Two sequences of one batch, one with n_keep 0 and one with -1: each shifts as it
    would alone."""
    batch = FakeBatch(TARGET, 2, n_ctx=N_CTX)
    engine = Engine(batch, [make("same"), make("ngram")])
    engine.enable_context_shift()
    dp = DraftParams(n_max=4, p_min=0.0)
    gens = [engine.generate(Request(list(PROMPT), N, GREEDY, dp, n_keep=k), seq=i)
            for i, k in enumerate((0, -1))]
    while not all(g.done for g in gens):
        engine.step()
    assert gens[0].tokens == reference(GREEDY, 0)[0]
    assert gens[1].tokens == reference(GREEDY, -1)[0]


class _Rigid(FakeBackend):
    def can_shift(self) -> bool:
        return False


def test_a_target_that_cannot_shift_is_refused() -> None:
    engine = Engine(_Rigid(TARGET, n_ctx=N_CTX))
    with pytest.raises(ConfigError, match="--context-shift: .* cannot shift"):
        engine.enable_context_shift()


@pytest.mark.parametrize(("args", "want"), [
    ((23, 10, 0, 24, False), Shift(0, 11)),
    ((23, 10, -1, 24, False), Shift(10, 6)),
    ((23, 10, 4, 24, True), Shift(5, 9)),       # BOS is kept beside n_keep
    ((23, 30, -1, 24, False), Shift(20, 1)),    # at most n_ctx - 4 kept
    ((23, 10, 0, 24, False, 5), Shift(0, 5)),   # n_discard
    ((23, 10, 0, 24, False, 99), Shift(0, 23)),
    ((21, 30, -1, 24, True), None),             # nothing left to drop
])
def test_the_shift_arithmetic_is_llama_servers(args: Sequence, want) -> None:
    assert plan_shift(*args) == want


@pytest.mark.parametrize(("field", "value"), [("n_keep", -2), ("n_discard", -1)])
def test_bad_n_keep_and_n_discard_are_refused(field: str, value: int) -> None:
    with pytest.raises(ConfigError, match=f"{field}: must be >= "):
        Request(list(PROMPT), 4, **{field: value})


# ------------------------------------------------------------------- over HTTP (fake target)


@pytest.fixture(scope="module")
def shifting_server():
    from toy_server import serve_app

    from specwire.server import ServerSettings, create_app
    engine = Engine(FakeBackend(TARGET, n_ctx=N_CTX), make("same"))
    engine.enable_context_shift()
    settings = ServerSettings(sampling=GREEDY, n_keep=3, context_shift=True,
                              draft=DraftParams(n_max=4, p_min=0.0))
    with serve_app(create_app(engine, settings)) as url:
        yield url


def _complete(url: str, **body) -> httpx.Response:
    return httpx.post(url + "/completion", timeout=60,
                      json={"prompt": PROMPT, "n_predict": N, "return_tokens": True, **body})


@pytest.mark.parametrize("n_keep", [None, 0, -1])
def test_a_request_shifts_its_context_with_its_n_keep(shifting_server, n_keep) -> None:
    """n_keep from the request, else --keep (3): llama-server's shifts, the same tokens
    with the draft and without it (speculative false), and truncated in the answer."""
    extra = {} if n_keep is None else {"n_keep": n_keep}
    drafted = _complete(shifting_server, **extra).json()
    plain = _complete(shifting_server, speculative=False, **extra).json()
    want, _ = reference(GREEDY, 3 if n_keep is None else n_keep)
    assert drafted["tokens"] == plain["tokens"] == want
    assert drafted["truncated"] and drafted["stop_type"] == "limit"
    assert drafted["timings"]["draft_n_accepted"] > 0


@pytest.mark.parametrize(("body", "needle"), [
    ({"n_keep": -2}, "n_keep: must be >= -1"),
    ({"n_keep": "all"}, "n_keep"),
    ({"n_discard": -1}, "n_discard: must be >= 0"),
    ({"n_discard": 1.5}, "n_discard"),
])
def test_bad_n_keep_or_n_discard_is_a_400_naming_it(shifting_server, body, needle) -> None:
    r = _complete(shifting_server, **body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_n_predict_minus_one_has_no_limit_with_context_shift() -> None:
    from specwire.server import ServerSettings, schemas
    f = schemas.Fields({"n_predict": -1})
    assert schemas.n_predict(f, ServerSettings(), 512) == 512
    assert schemas.n_predict(f, ServerSettings(context_shift=True), 512) == 2**31 - 1
    # the request's -1 wins over the server's -n, as in llama-server
    assert schemas.n_predict(f, ServerSettings(context_shift=True, n_predict=64),
                             512) == 2**31 - 1
    assert schemas.n_predict(schemas.Fields({}), ServerSettings(n_predict=64), 512) == 64


def test_the_flags_parse_and_a_bad_keep_stops_serve(caplog) -> None:
    import argparse
    import logging

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    a = parser.parse_args(["serve", "--context-shift", "--keep", "-1"])
    assert a.context_shift and a.keep == -1
    a = parser.parse_args(["serve", "--context-shift", "--no-context-shift"])
    assert not a.context_shift and a.keep == 0
    bad = parser.parse_args(["serve", "-m", "/nonexistent.gguf", "--keep", "-2"])
    with pytest.raises(CliError, match="--keep: must be >= -1"):
        bad.func(bad)
    # --keep without --context-shift says it does nothing (then the missing model stops it)
    lone = parser.parse_args(["serve", "-m", "/nonexistent.gguf", "--keep", "5"])
    with (caplog.at_level(logging.WARNING, "specwire.flags"),
          pytest.raises(ConfigError, match="model file not found")):
        lone.func(lone)
    assert "--keep: ignored: it is what a context shift keeps" in caplog.text
