"""The speculative loop on fake models: lossless, bounded, and honest in its counters.

Greedy and coupled verification make the output the target's own keyed samples,
so for every drafter (the target's twin: all kept; a perturbed model: some kept;
random junk: none kept; n-gram lookup) and every draft length the tokens must
equal plain decoding, which itself must equal a hand-written sampling loop.
Rejection mode is only lossless in distribution (see test_verify.py); here it
must be deterministic for a seed. Then the edges: EOS inside a draft, the
n_predict limit, a full context, the draft model's cache, draft_min, the
statistics, configuration errors and closing a generation early.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
from fakes import (
    FakeBackend,
    FakeClock,
    FakeModel,
    FixedDrafter,
    RandomDrafter,
    SpyDrafter,
)

from specwire.backend.base import BackendError
from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Draft
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import KEEP, NgramDrafter
from specwire.engine import engine as engine_mod
from specwire.engine import round as round_mod
from specwire.engine import sequence as sequence_mod
from specwire.engine.engine import Engine, Generation, Request
from specwire.sample import sampling

V = 32
TARGET = FakeModel(n_vocab=V, seed=0)
OTHER = TARGET.perturbed(0.7, seed=5)
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
N = 40
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, seed=1234)
PENALISED = SamplingParams(temperature=0.8, top_k=12, top_p=0.95, min_p=0.02,
                           repeat_penalty=1.3, repeat_last_n=8, seed=7)
KINDS = ["same", "other", "random", "ngram"]


def reference(params: SamplingParams, n: int = N, prompt: Sequence[int] = PROMPT,
              eog: Sequence[int] = ()) -> list[int]:
    """Plain decoding written out by hand: one keyed sample per position."""
    hist, out = list(prompt), []
    for _ in range(n):
        row = TARGET.row(hist)
        t = sampling.coupled(row, params, len(hist), sampling.recent_window(hist, params))
        if t in eog:
            break
        out.append(t)
        hist.append(t)
    return out


def make_drafter(kind: str, n_ctx: int = 512):
    if kind == "same":
        return ModelDrafter(FakeBackend(TARGET, n_ctx=n_ctx, name="twin.gguf"))
    if kind == "other":
        return ModelDrafter(FakeBackend(OTHER, n_ctx=n_ctx, name="other.gguf"))
    if kind == "random":
        return RandomDrafter(V, seed=99)
    if kind == "ngram":
        return NgramDrafter(4, 1, keep=KEEP)     # a fixed stop: fake rounds take no time
    if kind == "none":
        return None
    raise ValueError(kind)


def run(drafter, params: SamplingParams, n_max: int = 8, n_predict: int = N,
        target: FakeBackend | None = None, prompt: Sequence[int] = PROMPT,
        **draft_kw) -> tuple[Generation, FakeBackend]:
    target = target or FakeBackend(TARGET)
    dp = DraftParams(n_max=n_max, p_min=0.0, **draft_kw)
    gen = Engine(target, drafter).generate(Request(list(prompt), n_predict, params, dp))
    gen.run()
    return gen, target


def check_stats(gen: Generation, target: FakeBackend, prompt_n: int = len(PROMPT)) -> None:
    """The counters against the target's own log of evaluations."""
    st = gen.stats
    rounds = target.evals[1:]                         # the first eval is the prompt
    assert target.evals[0] == (0, tuple(PROMPT[:prompt_n]))
    assert st.rounds == len(rounds)
    assert st.draft_n == sum(len(toks) - 1 for _, toks in rounds)
    assert st.predicted_n == len(gen.tokens)
    assert 0 <= st.draft_n_accepted <= st.draft_n
    assert sum(st.hist) == sum(1 for _, toks in rounds if len(toks) > 1)
    assert sum(i * c for i, c in enumerate(st.hist)) == st.draft_n_accepted
    assert sum(d for d, _ in st.by_position) == st.draft_n
    assert sum(a for _, a in st.by_position) == st.draft_n_accepted
    drafted = [d for d, _ in st.by_position]
    assert drafted == sorted(drafted, reverse=True)
    assert all(a <= d for d, a in st.by_position)
    if gen.stop_type == "limit" and not gen.truncated:
        # Every round yields its kept draft tokens plus one; nothing was cut.
        assert len(gen.tokens) == 1 + st.rounds + st.draft_n_accepted


# ---------------------------------------------------------------------------------- fakes


def test_the_fake_backend_keeps_llama_cpps_contract() -> None:
    """The guards the other tests rely on: rows are a function of the prefix, the buffer is
    overwritten by the next eval (stale rows are NaN), overflow and bad truncation raise."""
    be = FakeBackend(TARGET, n_ctx=6)
    rows = be.eval([1, 2, 3], logits="all")
    assert rows.shape == (3, V)
    np.testing.assert_array_equal(rows[2], TARGET.row([1, 2, 3]))
    assert not np.array_equal(TARGET.row([1, 2, 3]), TARGET.row([1, 9, 3]))   # previous token
    assert not np.array_equal(TARGET.row([1, 2, 3]), TARGET.row([0, 1, 2, 3]))  # position
    last = be.eval([4], logits="last")
    assert last.shape == (1, V) and np.isnan(rows[1]).all()
    assert be.tokens == (1, 2, 3, 4) and be.n_past == 4
    with pytest.raises(BackendError):
        be.eval([5, 6, 7])
    be.truncate(2)
    assert be.tokens == (1, 2)
    with pytest.raises(BackendError):
        be.truncate(3)
    with pytest.raises(BackendError):
        be.eval([V])
    assert be.eval([5], logits="none").shape == (0, V)


# ------------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALISED], ids=["greedy", "t0.8", "penalty"])
def test_plain_engine_is_the_reference_loop(params: SamplingParams) -> None:
    """Without a drafter the engine samples exactly the hand-written loop's tokens."""
    gen, target = run(None, params)
    assert gen.tokens == reference(params)
    assert gen.stop_type == "limit" and not gen.truncated
    assert gen.stats.draft_n == 0 and gen.stats.rounds == N - 1
    check_stats(gen, target)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("n_max", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("kind", KINDS)
def test_speculation_is_token_identical_to_plain(kind: str, n_max: int,
                                                params: SamplingParams) -> None:
    """Greedy and coupled: the same tokens as plain decoding, twice over, for every drafter;
    and the drafter behaves as its kind says (all, some or none of its tokens kept)."""
    want = reference(params)
    first, target = run(make_drafter(kind), params, n_max)
    second, _ = run(make_drafter(kind), params, n_max)
    assert first.tokens == want
    assert second.tokens == want
    assert first.stop_type == "limit"
    st = first.stats
    check_stats(first, target)
    assert st.to_dict()["draft_n"] == second.stats.draft_n
    if kind == "same":
        assert st.draft_n > 0 and st.draft_n_accepted == st.draft_n
        assert st.rounds < N - 1                     # speculation did save rounds
    elif kind == "other":
        assert st.draft_n > 0 and 0 < st.draft_n_accepted < st.draft_n
    elif kind == "random":
        assert st.draft_n > 0 and st.draft_n_accepted == 0
    else:
        assert st.draft_n > 0


@pytest.mark.parametrize("kind", ["same", "other"])
def test_repeat_penalty_and_adaptive_policy_stay_lossless(kind: str) -> None:
    """The penalty window includes drafted tokens; the adaptive policy varies k: same tokens."""
    for policy in ("fixed", "adaptive"):
        gen, target = run(make_drafter(kind), PENALISED, 6, policy=policy)
        assert gen.tokens == reference(PENALISED)
        check_stats(gen, target)


def test_the_adaptive_policy_outlives_a_request_and_plain_ones_leave_it_alone(
        monkeypatch) -> None:
    """A second request reuses what the first learned; a plain request does not touch it.
    The policy's choices follow measured round times: a FakeClock makes them fixed costs,
    the same on a busy machine."""
    clock = FakeClock().install(monkeypatch, engine_mod, round_mod, sequence_mod)
    target = FakeBackend(TARGET, clock=clock)     # 10 ms a step, 1 ms a token
    drafter = SpyDrafter(make_drafter("random"), on_propose=lambda _: clock.charge(0.5e-3))
    engine = Engine(target, drafter)
    adaptive = DraftParams(n_max=8, p_min=0.0, policy="adaptive")
    first = engine.generate(Request(list(PROMPT), N, GREEDY, adaptive))
    first.run()
    (policy,) = engine.policies.policies.values()
    learned = policy.acceptance
    assert learned < 0.5                               # random drafts: mostly rejected
    plain = engine.generate(Request(list(PROMPT), N, GREEDY, replace(adaptive, enabled=False)))
    assert plain.run() == reference(GREEDY)
    assert plain.stats.draft_n == 0 and policy.acceptance == learned
    second = engine.generate(Request(list(PROMPT), N, GREEDY, adaptive))
    assert second.run() == reference(GREEDY)
    assert engine.policies.policies == {("adaptive", 8): policy}
    # No fresh optimism: the second request starts from what the first learned, so it drafts
    # less than the first (a probe at most), which a fresh policy would repeat exactly.
    assert second.stats.draft_n < first.stats.draft_n and policy.acceptance < 0.5


def test_the_adaptive_policy_ends_drafts_and_learns_from_their_confidence() -> None:
    """An adaptive request steers a draft model's stop (no --draft-p-min) and calibrates on
    what verification kept; afterwards the drafter is back on its own rule, and a fixed
    request at p_min 0 computes no confidences at all."""
    target, drafter = FakeBackend(TARGET), make_drafter("other")
    engine = Engine(target, drafter)
    adaptive = DraftParams(n_max=8, p_min=1.0, policy="adaptive")   # p_min 1: never a draft
    gen = engine.generate(Request(list(PROMPT), N, GREEDY, adaptive))
    assert gen.run() == reference(GREEDY)
    assert gen.stats.draft_n > 0 and drafter.stop_rule is None
    (policy,) = engine.policies.policies.values()
    seen = list(policy.calibration.seen)
    assert sum(seen) > 2.0 * len(seen)                 # tokens judged beyond the prior's
    fixed = engine.generate(Request(list(PROMPT), N, GREEDY, DraftParams(n_max=8, p_min=0.0)))
    assert fixed.run() == reference(GREEDY) and policy.calibration.seen == seen
    assert drafter.propose([*PROMPT], 4).confidence is None


def test_rejection_mode_is_deterministic_for_a_seed() -> None:
    """Rejection mode: same seed, same tokens; another seed, other tokens; never a token the
    target's filters drop (the junk ids); a twin drafter is almost always kept."""
    outs = {}
    for seed in (1, 2):
        for attempt in range(2):
            gen, target = run(make_drafter("other"), replace(SAMPLED, seed=seed), 4,
                              mode=VerifyMode.REJECTION, top_k_q=4)
            outs[seed, attempt] = gen.tokens
            assert len(gen.tokens) == N
            assert max(gen.tokens) < TARGET.real_tokens
            check_stats(gen, target)
            assert 0 < gen.stats.draft_n_accepted < gen.stats.draft_n
    assert outs[1, 0] == outs[1, 1]
    assert outs[2, 0] == outs[2, 1]
    assert outs[1, 0] != outs[2, 0]
    twin, _ = run(make_drafter("same"), SAMPLED, 4, mode=VerifyMode.REJECTION, top_k_q=12)
    assert twin.stats.acceptance > 0.9
    junk, _ = run(make_drafter("random"), SAMPLED, 4, mode=VerifyMode.REJECTION)
    assert junk.stats.draft_n > 0 and junk.stats.draft_n_accepted == 0
    assert max(junk.tokens) < TARGET.real_tokens


def test_rejection_mode_with_the_ngram_drafter() -> None:
    """A lookup drafter has no distribution of its own: in rejection mode it sends a point
    mass q (lossless, see test_verify's point-mass case). It must run, deterministically."""
    a, target = run(make_drafter("ngram"), SAMPLED, 4, mode=VerifyMode.REJECTION)
    b, _ = run(make_drafter("ngram"), SAMPLED, 4, mode=VerifyMode.REJECTION)
    assert a.tokens == b.tokens and len(a.tokens) == N
    assert a.stats.draft_n > 0
    check_stats(a, target)


def test_rejection_mode_at_temperature_zero_is_greedy() -> None:
    """With T = 0 every mode verifies by argmax: the plain greedy tokens."""
    gen, _ = run(make_drafter("other"), GREEDY, 4, mode=VerifyMode.REJECTION)
    assert gen.tokens == reference(GREEDY)


# ---------------------------------------------------------------------------------- edges


def _eos_after(ref: list[int], at_least: int) -> tuple[int, int]:
    """A token of the reference output whose first occurrence is at index >= at_least."""
    for j in range(at_least, len(ref)):
        if ref[j] not in ref[:j]:
            return ref[j], j
    raise AssertionError("no fresh token in the reference output")


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_eos_inside_a_draft_stops_the_generation(params: SamplingParams) -> None:
    """An EOS the target accepts inside a draft ends generation there: the tokens before it,
    EOS itself not emitted, stop_type 'eos', no more rounds."""
    ref = reference(params)
    eos, j = _eos_after(ref, 3)
    spy = SpyDrafter(make_drafter("same"))
    target = FakeBackend(TARGET, eog=[eos])
    gen, _ = run(spy, params, 8, target=target)
    assert gen.tokens == ref[:j]
    assert eos not in gen.tokens
    assert gen.stop_type == "eos" and not gen.truncated
    assert any(eos in d[:-1] for _, _, d in spy.proposals)       # it was inside a draft
    assert spy.calls[-1] == "end" and spy.calls.count("end") == 1
    check_stats(gen, target)
    plain, _ = run(None, params, target=FakeBackend(TARGET, eog=[eos]))
    assert plain.tokens == ref[:j] and plain.stop_type == "eos"


@pytest.mark.parametrize("extra", [0, 5])
def test_n_predict_is_exact_and_nothing_is_verified_past_it(extra: int) -> None:
    """For every n_predict up to 12 with draft_max 8: exactly n_predict tokens, 'limit', and
    no target evaluation beyond position prompt + n_predict - 1, even when the drafter
    returns more tokens than asked for (extra) and the engine must cut the draft."""
    ref = reference(GREEDY, 12)
    for n in range(1, 13):
        spy = SpyDrafter(make_drafter("same"), extra=extra)
        gen, target = run(spy, GREEDY, 8, n_predict=n)
        assert gen.tokens == ref[:n]
        assert gen.stop_type == "limit" and not gen.truncated
        assert max(start + len(toks) for start, toks in target.evals) <= len(PROMPT) + n - 1
        if extra and n >= 3:                       # the engine did have to cut
            assert any(len(d) > asked for _, asked, d in spy.proposals)
        check_stats(gen, target)


def test_n_predict_zero_generates_nothing() -> None:
    """n_predict 0: no tokens, stop 'limit', the drafter is never started."""
    spy = SpyDrafter(make_drafter("same"))
    gen, target = run(spy, GREEDY, n_predict=0)
    assert gen.tokens == [] and gen.stop_type == "limit"
    assert spy.calls == [] and target.evals == []


def test_an_empty_draft_is_a_plain_step() -> None:
    """A drafter with nothing to offer: plain decoding, no draft counted, one token a round."""
    gen, target = run(FixedDrafter(lambda h, n: []), SAMPLED, 8)
    assert gen.tokens == reference(SAMPLED)
    assert gen.stats.draft_n == 0 and gen.stats.hist == [] and gen.stats.rounds == N - 1
    assert all(len(toks) == 1 for _, toks in target.evals[1:])
    check_stats(gen, target)


@pytest.mark.parametrize("kind", ["none", "same", "other", "ngram"])
def test_a_nearly_full_context_stops_with_limit_and_never_overflows(kind: str) -> None:
    """n_ctx 20 with an 8-token prompt and n_predict 100: the generation stops on its own
    ('limit', truncated) without the backend ever refusing an eval (it raises past n_ctx),
    with plain decoding's tokens up to where it stopped."""
    ref = reference(GREEDY, 30)
    gen, target = run(make_drafter(kind, n_ctx=20), GREEDY, 8, n_predict=100,
                      target=FakeBackend(TARGET, n_ctx=20))
    assert gen.stop_type == "limit" and gen.truncated
    assert 20 - len(PROMPT) - 1 <= len(gen.tokens) <= 20 - len(PROMPT) + 1
    assert gen.tokens == ref[:len(gen.tokens)]
    assert target.n_past <= 20
    check_stats(gen, target)


@pytest.mark.parametrize("kind", ["same", "other"])
def test_a_full_context_ends_where_plain_decoding_ends(kind: str) -> None:
    """Lossless includes the length: at a full context the speculative output is exactly
    the plain output, not one token longer."""
    plain, _ = run(None, GREEDY, n_predict=100, target=FakeBackend(TARGET, n_ctx=20))
    gen, _ = run(make_drafter(kind), GREEDY, 8, n_predict=100,
                 target=FakeBackend(TARGET, n_ctx=20))
    assert gen.tokens == plain.tokens


def test_a_draft_model_with_a_smaller_context_just_drafts_less() -> None:
    """The draft backend's own n_ctx (16) is smaller than the target's: it stops proposing
    when full, the target carries on; output unchanged and nothing raised."""
    gen, target = run(make_drafter("same", n_ctx=16), GREEDY, 4)
    assert gen.tokens == reference(GREEDY)
    assert 0 < gen.stats.draft_n < N
    check_stats(gen, target)


class CheckedModelDrafter(ModelDrafter):
    """A model drafter that checks its cache around every proposal."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(backend)
        self.suffix_lengths: list[int] = []
        self.full_blocks = 0
        self._last: tuple[list[int], list[int]] | None = None

    def propose(self, history: Sequence[int], k: int) -> Draft:
        be = self.backend
        cached = list(be.tokens)
        assert cached == list(history[:len(cached)])            # a prefix of the history
        if self._last is not None:
            prev, drafted = self._last
            if list(history[len(prev):len(prev) + len(drafted)]) == drafted:
                self.full_blocks += 1                           # the last draft was kept whole
                assert len(cached) == len(history) - 2          # ... and only [d_k, bonus] is new
        n_evals = len(be.evals)
        draft = super().propose(history, k)
        self.suffix_lengths.append(len(be.evals[n_evals][1]))
        assert list(be.tokens) == [*history, *draft.tokens[:-1]]
        self._last = (list(history), list(draft.tokens))
        return draft


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "t0.8"])
def test_the_draft_cache_continues_after_a_fully_accepted_block(params) -> None:
    """After a block is kept whole the draft model's cache holds history minus its last two
    tokens, and the next proposal evaluates just those two: no re-prefill, correct drafts."""
    dr = CheckedModelDrafter(FakeBackend(TARGET, name="twin.gguf"))
    gen, target = run(dr, params, 4)
    assert gen.tokens == reference(params)
    assert gen.stats.draft_n_accepted == gen.stats.draft_n
    assert dr.full_blocks >= 5
    assert dr.suffix_lengths[0] == len(PROMPT) + 1
    assert max(dr.suffix_lengths[1:]) <= 2
    check_stats(gen, target)


def test_drafts_shorter_than_draft_min_are_not_verified() -> None:
    """A 2-token draft (the right tokens, even) is dropped when draft_min is 3: plain steps
    only; with draft_min 2 it is verified and kept."""
    ref = reference(GREEDY)

    def oracle(history: Sequence[int], n: int) -> list[int]:
        done = len(history) - len(PROMPT)
        return ref[done:done + min(n, 2)]

    skipped, target = run(FixedDrafter(oracle), GREEDY, 4, n_min=3)
    assert skipped.tokens == ref
    assert skipped.stats.draft_n == 0
    assert all(len(toks) == 1 for _, toks in target.evals[1:])
    used, target = run(FixedDrafter(oracle), GREEDY, 4, n_min=2)
    assert used.tokens == ref
    assert used.stats.draft_n > 0 and used.stats.draft_n_accepted == used.stats.draft_n
    check_stats(used, target)


def test_configuration_errors() -> None:
    """An empty prompt is refused at once; a prompt that leaves no room in the context
    is refused when the generation starts; one that leaves a token's room is fine."""
    with pytest.raises(ConfigError, match="prompt"):
        Request([], 4)
    with pytest.raises(ConfigError, match="n_predict"):
        Request([1], -1)
    too_long = Engine(FakeBackend(TARGET, n_ctx=16)).generate(Request(list(range(16)), 4))
    with pytest.raises(ConfigError, match="context"):
        too_long.run()
    ok = Engine(FakeBackend(TARGET, n_ctx=16)).generate(Request(list(range(15)), 4, GREEDY))
    assert len(ok.run()) == 1 and ok.truncated


def test_closing_a_generation_midway_ends_the_drafter() -> None:
    """close() after the first chunk ends the drafter's sequence at once, exactly once."""
    spy = SpyDrafter(make_drafter("other"))
    gen = Engine(FakeBackend(TARGET), spy).generate(
        Request(list(PROMPT), N, SAMPLED, DraftParams(n_max=4, p_min=0.0)))
    first = next(gen)
    second = next(gen)
    assert first and second
    assert spy.calls[0] == "begin" and "end" not in spy.calls
    gen.close()
    assert spy.calls[-1] == "end" and spy.calls.count("end") == 1
    assert len(gen.tokens) < N
    with pytest.raises(StopIteration):
        next(gen)
    done = SpyDrafter(make_drafter("other"))
    run(done, SAMPLED, 4)
    assert done.calls[0] == "begin" and done.calls.count("end") == 1 and done.calls[-1] == "end"


@pytest.mark.parametrize("kind", ["same", "ngram"])
def test_each_request_reports_its_own_share_of_the_drafters_counters(kind: str) -> None:
    """Drafter.stats counts over the drafter's life; a request's timings show its share.
    (A drafter that reset its counters at begin() made bench subtract the previous
    request's from this one's: negative decode times.)"""
    drafter = make_drafter(kind)
    engine = Engine(FakeBackend(TARGET), drafter)
    dp = DraftParams(n_max=4, p_min=0.0)
    shares = []
    for n in (30, 12, 24):
        gen = engine.generate(Request(list(PROMPT), n, GREEDY, dp, cache_prompt=False))
        gen.run()
        assert gen.stats.drafter["drafted"] == gen.stats.draft_n > 0
        assert all(v >= 0 for v in gen.stats.drafter.values())
        shares.append(gen.stats.drafter["drafted"])
    assert drafter.stats()["drafted"] == sum(shares)
