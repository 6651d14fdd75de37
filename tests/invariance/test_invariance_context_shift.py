"""Context shift on the real bundled pair: llama.cpp's KV shift, lossless under speculation.

A target context of 256 tokens (llama.cpp's smallest), a prompt of about 200 and 110
tokens to generate, 16 dropped per shift: llama.cpp's cache is shifted several times
(llama_memory_seq_rm + seq_add, its keys re-rotated on the next decode).
The output with each drafter (a draft model in process, one on its own thread behind the
draft link's session, n-gram) and each draft length must be the plain output token for
token, greedy and seeded; and a shift must change the output against a bigger context's
(the shifted cache really is what the target reads).
"""

from __future__ import annotations

import bundled
import pytest

from specwire.assets import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request
from specwire.link.threaded import ThreadedDrafter

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]
STORY = ("The old lighthouse keeper climbed the stairs every evening, lit the lamp, and "
         "wrote in his log what the sea had done that day. ")
PROMPT = "Notes from a lighthouse:\n" + STORY * 7 + "The next evening"
N_CTX = 256
N = 110
#: The end-to-end runs (serve, generate) past the context of 256: two shifts, not four.
N_E2E = 80
DISCARD = 16
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1234)


@pytest.fixture(scope="module")
def target() -> LlamaBackend:
    return LlamaBackend(ModelParams(str(bundled.target()), n_ctx=N_CTX))


@pytest.fixture(scope="module")
def drafters():
    p = ModelParams(str(models.default_draft()), n_ctx=256)
    model = load_model(p)
    return {"model": ModelDrafter(LlamaBackend(p, model)),
            "threaded": ThreadedDrafter(LlamaBackend(p, model)),
            "ngram": NgramDrafter()}


def generate(target, drafter, sampling: SamplingParams, k: int = 8, n_keep: int = 4,
             shift: bool = True, n_discard: int = DISCARD):
    target.truncate(0)
    engine = Engine(target, drafter)
    if shift:
        engine.enable_context_shift()
    dp = DraftParams(n_max=k, p_min=0.0, enabled=drafter is not None)
    gen = engine.generate(Request(target.tokenize(PROMPT), N, sampling, dp, ignore_eos=True,
                                  n_keep=n_keep, n_discard=n_discard))
    gen.run()
    return gen


@pytest.fixture(scope="module")
def plain(target):
    return {s.temperature: generate(target, None, s) for s in (GREEDY, SEEDED)}


def test_plain_decoding_shifts_and_goes_on(target, plain) -> None:
    gen = plain[0.8]
    assert len(gen.tokens) == N and gen.shifts >= 3 and gen.truncated
    assert target.n_ctx == N_CTX and target.n_past <= N_CTX
    # The shifted cache is what the target reads: a context that never fills samples
    # the same tokens up to the first shift, and others after it.
    roomy = LlamaBackend(ModelParams(target.params.path, n_ctx=512), target.model)
    try:
        unshifted = generate(roomy, None, SEEDED, shift=False)
    finally:
        roomy.close()
    n_first = N_CTX - len(target.tokenize(PROMPT))   # tokens before the first shift
    assert unshifted.shifts == 0
    assert unshifted.tokens[:n_first] == gen.tokens[:n_first]
    assert unshifted.tokens != gen.tokens


@pytest.mark.parametrize(("drafter", "sampling", "k"), [
    ("model", GREEDY, 2), ("model", SEEDED, 8), ("threaded", GREEDY, 8),
    ("threaded", SEEDED, 2), ("ngram", GREEDY, 2), ("ngram", SEEDED, 8)],
    ids=["model-greedy-2", "model-seeded-8", "threaded-greedy-8", "threaded-seeded-2",
         "ngram-greedy-2", "ngram-seeded-8"])
def test_same_tokens_with_a_draft_under_context_shift(target, drafters, plain, drafter,
                                                      sampling, k) -> None:
    """Every drafter greedy and seeded, each at a short and at a long draft (the lengths
    take turns: the two shifts of a 110-token run meet both; docs/testing.md)."""
    ref = plain[sampling.temperature]
    gen = generate(target, drafters[drafter], sampling, k)
    assert gen.tokens == ref.tokens, (drafter, k)
    assert gen.shifts == ref.shifts
    if drafter == "model" and sampling.greedy:
        assert gen.stats.draft_n_accepted > 0, gen.stats.to_dict()


def test_keep_all_of_the_prompt(target, drafters) -> None:
    """n_keep -1: the whole prompt stays through every shift, with and without a draft."""
    a = generate(target, None, GREEDY, n_keep=-1, n_discard=0)
    b = generate(target, drafters["model"], GREEDY, 4, n_keep=-1, n_discard=0)
    assert a.tokens == b.tokens and a.shifts >= 2
    prompt = target.tokenize(PROMPT)
    assert list(target.tokens[:len(prompt)]) == prompt


def test_serve_with_a_draft_node_shifts_losslessly(tmp_path) -> None:
    """serve --context-shift with --draft-url: the draft node's session starts again on
    each shifted history, and the tokens are those of the same request without a draft."""
    import httpx
    from serve_process import run_serve
    from wire_helpers import node_process

    body = {"prompt": PROMPT, "n_predict": N_E2E, "n_keep": 4, "n_discard": DISCARD,
            "temperature": 0, "ignore_eos": True, "return_tokens": True}
    with node_process(tmp_path) as node, run_serve(
            "-t", "1", "-c", str(N_CTX), "--context-shift", "--draft-url", node.url,
            "--draft-mode", "sync", "--draft-max", "4", "--draft-p-min", "0",
            "--draft-policy", "fixed", no_traceback=True) as (url, _):
        drafted = httpx.post(url + "/completion", json=body, timeout=600).json()
        plain = httpx.post(url + "/completion", json={**body, "speculative": False},
                           timeout=600).json()
    assert len(plain["tokens"]) == N_E2E and plain["truncated"]
    assert drafted["tokens"] == plain["tokens"]
    assert drafted["timings"]["draft_n_accepted"] > 0


def test_generate_shifts_with_and_without_a_draft() -> None:
    """specwire generate --context-shift --keep 4: past the context of 256, the same
    tokens with the bundled draft and with --no-draft."""
    import json
    import subprocess
    import sys

    def run(*extra: str) -> dict:
        r = subprocess.run([sys.executable, "-m", "specwire", "generate", PROMPT, "-c",
                            str(N_CTX), "-n", str(N_E2E), "--ignore-eos", "--temp", "0", "-t", "1",
                            "--context-shift", "--keep", "4", "--json", *extra,
                            "-m", str(models.default_target())],   # a draft that pays
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    drafted, plain = run("-td", "1", "--draft-max", "4"), run("--no-draft")
    assert len(plain["tokens"]) == N_E2E and plain["truncated"]
    assert drafted["tokens"] == plain["tokens"] and drafted["timings"]["draft_n"] > 0
