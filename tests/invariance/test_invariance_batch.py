"""Invariance under batching, on the real bundled models: a request's output does not
depend on the requests that share its decode.

Four requests run in one target context of four sequences (serve -np 4): different
prompts and lengths, two drafting with the bundled draft model, one with n-gram
drafting... one plain, one joining after a few steps, one cancelled midway. Each one's
greedy and seeded tokens must equal what plain decoding gives it alone in a context of
its own, for every draft length; the cancelled one's tokens must be a prefix of its
own. A near-tie flipped by a different batch shape is reported with both logit rows
(`explain_mismatch`), never tolerated.
"""

from __future__ import annotations

import bundled
import pytest
from invariance_checks import explain_mismatch

from specwire.assets import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request

pytestmark = pytest.mark.slow

PROMPTS = [
    "The old lighthouse keeper climbed the stairs every evening, and",
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n",
    "Q: What is the capital of France?\nA:",
    "Once upon a time, in a small village by the sea, there lived a",
]
N_PREDICT = [24, 16, 20, 24]
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1234)
GREEDY = SamplingParams(temperature=0.0)
#: Draft lengths: the shortest and longest in the default run, the two between in the
#: extended tier (docs/testing.md).
LENGTHS = [1, pytest.param(2, marks=pytest.mark.extended),
           pytest.param(4, marks=pytest.mark.extended), 8]


@pytest.fixture(scope="module")
def single() -> LlamaBackend:
    return LlamaBackend(ModelParams(str(bundled.target()), n_ctx=512))


@pytest.fixture(scope="module")
def batched(single) -> Engine:
    target = LlamaBackend(single.params, single.model, n_seq=4)
    dp = ModelParams(str(models.default_draft()), n_ctx=512)
    draft = load_model(dp)
    drafters = [ModelDrafter(LlamaBackend(dp, draft)), NgramDrafter(),
                ModelDrafter(LlamaBackend(dp, draft)), ModelDrafter(LlamaBackend(dp, draft))]
    return Engine(target, drafters)


@pytest.fixture(scope="module")
def alone(single) -> dict:
    out = {}
    for s in (GREEDY, SEEDED):
        for i, p in enumerate(PROMPTS):
            single.truncate(0)
            req = Request(single.tokenize(p), N_PREDICT[i], s, DraftParams(enabled=False))
            out[(i, s.temperature)] = Engine(single).generate(req).run()
    return out


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", LENGTHS)
def test_each_request_gets_its_own_tokens_in_a_batch(single, batched, alone, sampling, k):
    target = batched.target

    def request(i: int, drafted: bool) -> Request:
        return Request(target.tokenize(PROMPTS[i]), N_PREDICT[i], sampling,
                       DraftParams(n_max=k, p_min=0.0, enabled=drafted), cache_prompt=False)

    gens = {i: batched.generate(request(i, i != 1), seq=i) for i in (0, 1, 3)}
    for step in range(12):
        batched.step()
        if step == 2:                                    # joins after three steps
            gens[2] = batched.generate(request(2, True), seq=2)
        if step == 5:                                    # its client went away
            gens[3].close()
    while any(not g.done for g in gens.values()):
        batched.step()
    for i, gen in gens.items():
        ref = alone[(i, sampling.temperature)]
        assert gen.error is None, gen.error
        got = gen.tokens
        want = ref[:len(got)] if i == 3 else ref
        if got != want:
            pytest.fail(f"request {i}, draft-max {k}:\n"
                        + explain_mismatch(single, PROMPTS[i], ref, got))
    assert 0 < len(gens[3].tokens) < N_PREDICT[3], "the cancelled request ended early"
    assert gens[0].stats.draft_n > 0 and gens[2].stats.draft_n > 0
    assert gens[1].stats.draft_n == 0


def test_a_sequence_keeps_its_own_cache_between_requests(single, batched, alone) -> None:
    """Sequence 2's next request starts from its own cached prefix (cache_prompt), and with
    --cache-reuse a chunk of its cache is shifted into place on its own cells; the other
    sequences' caches are untouched, and the output equals the same two requests in a
    context of their own (a shifted chunk is not a fresh prefill: it remembers the
    dropped passage, as in llama-server)."""
    target, plain = batched.target, DraftParams(enabled=False)
    view = batched.batch.seq(2)
    head, a, b = (target.tokenize(t) for t in PROMPTS[:3])
    first, second = head + a[1:] + b[1:], head + b[1:]
    others = [list(batched.batch.seq(i).tokens) for i in (0, 1, 3)]
    batched.cache_reuse = 4
    try:
        batched.generate(Request(first, 4, GREEDY, plain), seq=2).run()
        g = batched.generate(Request(second, 8, GREEDY, plain), seq=2)
        out = g.run()
    finally:
        batched.cache_reuse = 0
    assert g.stats.cache_n == len(second) - 1, g.stats.to_dict()   # prefix + shifted chunk
    assert list(view.tokens[:len(second)]) == second
    assert [list(batched.batch.seq(i).tokens) for i in (0, 1, 3)] == others
    single.truncate(0)
    solo = Engine(single)
    solo.cache_reuse = 4
    solo.generate(Request(first, 4, GREEDY, plain)).run()
    assert out == solo.generate(Request(second, 8, GREEDY, plain)).run()


@pytest.fixture(scope="module")
def lockstep(single) -> Engine:
    """serve -np 4 with the draft model: one draft context of four sequences too."""
    target = LlamaBackend(single.params, single.model, n_seq=4)
    dp = ModelParams(str(models.default_draft()), n_ctx=512)
    return Engine(target, ModelDrafter.per_sequence(LlamaBackend(dp, load_model(dp), n_seq=4)))


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", LENGTHS)
def test_drafting_in_lockstep_keeps_each_request_its_own_tokens(single, lockstep, alone,
                                                                sampling, k):
    """Four requests drafting together (a draft position of all four per draft decode),
    one joining late: each one's tokens are what plain decoding gives it alone."""
    target = lockstep.target
    draft_decodes = lockstep.drafters[0].shared.decode_s

    def request(i: int) -> Request:
        return Request(target.tokenize(PROMPTS[i]), N_PREDICT[i], sampling,
                       DraftParams(n_max=k, p_min=0.0), cache_prompt=False)

    gens = {i: lockstep.generate(request(i), seq=i) for i in (0, 1, 2)}
    lockstep.step()
    gens[3] = lockstep.generate(request(3), seq=3)
    while any(not g.done for g in gens.values()):
        lockstep.step()
    for i, gen in gens.items():
        assert gen.error is None, gen.error
        if gen.tokens != alone[(i, sampling.temperature)]:
            pytest.fail(f"request {i}, draft-max {k}:\n" + explain_mismatch(
                single, PROMPTS[i], alone[(i, sampling.temperature)], gen.tokens))
        assert gen.stats.draft_n > 0 and "guard_failures" not in gen.stats.drafter
    spent = lockstep.drafters[0].shared.decode_s - draft_decodes
    assert spent > 0
    # each request's draft decode_ms is its own share of the shared draft context's time
    own = [gen.stats.drafter["decode_ms"] for gen in gens.values()]
    assert all(0 < ms < 1000 * spent for ms in own)
    assert sum(own) == pytest.approx(1000 * spent, rel=1e-6)
