"""The batch step on fakes: many sequences in one decode give each what it gets alone.

A FakeBatch holds several fake sequences and logs every decode's parts, so these
tests see that a step is one decode for every running sequence, that a long
prompt is read in chunks beside sequences that keep decoding, that a generation
joins at the next step and leaves at once, and that one failing sequence leaves
the others alone.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import FakeBackend, FakeBatch, FakeClock, FakeModel, SpyDrafter

from specwire.backend.base import BackendError
from specwire.config import DraftParams, SamplingParams
from specwire.drafters import lockstep
from specwire.drafters.lockstep import draft_together
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request
from specwire.engine.scheduler import BatchFull

V = 40
TARGET = FakeModel(n_vocab=V, seed=0)
OTHER = TARGET.perturbed(0.8, seed=5)
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, seed=77)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [11, 12]]


def drafter(kind: str):
    if kind == "model":
        return ModelDrafter(FakeBackend(OTHER, name="other.gguf"))
    if kind == "ngram":
        return NgramDrafter()
    return None


def request(i: int, sampling: SamplingParams, k: int, n: int = 30) -> Request:
    return Request(list(PROMPTS[i % len(PROMPTS)]), n, sampling,
                   DraftParams(n_max=k, p_min=0.0, enabled=k > 0))


def alone(req: Request, kind: str) -> list[int]:
    return Engine(FakeBackend(TARGET), drafter(kind)).generate(req).run()


def batch_engine(n_seq: int, kinds: list[str], n_batch: int = 512) -> tuple[Engine, FakeBatch]:
    batch = FakeBatch(TARGET, n_seq, n_batch=n_batch)
    drafters = [drafter(k) or drafter("ngram") for k in kinds]
    return Engine(batch, drafters), batch


def run_all(engine: Engine, gens) -> None:
    while any(not g.done for g in gens):
        engine.step()


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_each_sequence_gets_what_it_gets_alone(sampling, k) -> None:
    kinds = ["model", "ngram", "model", "model"]
    reqs = [request(i, sampling, k if i != 1 else 0) for i in range(4)]
    want = [alone(r, kind) for r, kind in zip(reqs, kinds, strict=True)]
    engine, batch = batch_engine(4, kinds)
    gens = [engine.generate(r) for r in reqs]
    run_all(engine, gens)
    assert [g.tokens for g in gens] == want
    assert all(g.error is None and g.stop_type == "limit" for g in gens)
    # every step was one decode with a part per running sequence, never two of one sequence
    assert max(len(parts) for parts in batch.decodes) == 4
    assert sum(g.stats.draft_n for g in gens) > 0


def test_a_long_prompt_is_read_in_chunks_while_the_others_decode() -> None:
    engine, batch = batch_engine(2, ["ngram", "ngram"], n_batch=8)
    short = engine.generate(request(1, GREEDY, 0, n=40))
    engine.step()                                   # the short prompt alone: 3 tokens
    long_prompt = [(5 * i) % (V - 8) for i in range(30)]
    long = engine.generate(Request(long_prompt, 5, GREEDY, DraftParams(enabled=False)))
    run_all(engine, [short, long])
    chunks = [(n_past, len(toks)) for parts in batch.decodes for s, n_past, toks in parts
              if s == long.seq and n_past < len(long_prompt)]
    assert [n for _, n in chunks] == [7, 7, 7, 7, 2]    # -b 8 less the short one's token
    steps_with_both = [parts for parts in batch.decodes if len(parts) == 2]
    assert len(steps_with_both) >= 5, "the short sequence decoded beside every chunk"
    assert short.tokens == alone(request(1, GREEDY, 0, n=40), "none")
    assert long.tokens == alone(Request(long_prompt, 5, GREEDY, DraftParams(enabled=False)),
                                "none")


def test_join_midway_cancel_and_reuse_of_a_freed_sequence() -> None:
    spy = SpyDrafter(drafter("model"))
    engine, _ = batch_engine(2, ["model", "model"])
    engine.drafters[1] = spy
    engine.guards[1].drafter = spy
    a = engine.generate(request(0, SEEDED, 4))
    for _ in range(3):
        engine.step()
    b = engine.generate(request(2, SEEDED, 4))          # joins at the next step
    assert b.seq == 1
    with pytest.raises(BatchFull, match="busy"):
        engine.generate(request(3, GREEDY, 0))
    engine.step()
    engine.step()
    b.close()                                           # cancelled: leaves at once
    assert b.done and spy.calls.count("end") == 1 and b.seq not in {g.seq for g in
                                                                     engine.scheduler.running}
    c = engine.generate(request(3, GREEDY, 2))          # takes the freed sequence
    assert c.seq == 1
    run_all(engine, [a, c])
    assert a.tokens == alone(request(0, SEEDED, 4), "model")
    assert c.tokens == alone(request(3, GREEDY, 2), "model")


def test_a_failing_sequence_leaves_the_others_running() -> None:
    engine, _ = batch_engine(2, ["ngram", "ngram"])
    ok = engine.generate(request(0, GREEDY, 4))
    bad = engine.generate(Request(list(range(V - 8)) * 20, 4, GREEDY))   # > the context
    run_all(engine, [ok, bad])
    assert ok.tokens == alone(request(0, GREEDY, 4), "ngram")
    with pytest.raises(Exception, match="do not fit the context"):
        bad.run()


def test_one_drafter_cannot_serve_several_sequences() -> None:
    with pytest.raises(Exception, match="drafter of its own"):
        Engine(FakeBatch(TARGET, 2), NgramDrafter())


def solo_rounds(req: Request) -> tuple[list[int], int, int]:
    """A request alone with the draft model in a context of its own: its tokens, the
    tokens drafted, those accepted."""
    g = Engine(FakeBackend(TARGET), drafter("model")).generate(req)
    g.run()
    return g.tokens, g.stats.draft_n, g.stats.draft_n_accepted


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_drafts_in_lockstep_are_what_each_sequence_drafts_alone(sampling, k) -> None:
    """One fake draft "context" of four sequences: a draft position of every drafting
    sequence in one draft decode, the first with each one's catch-up; every request's
    tokens, drafts and acceptance equal its own alone."""
    drafts = FakeBatch(OTHER, 4)
    engine = Engine(FakeBatch(TARGET, 4), ModelDrafter.per_sequence(drafts))
    reqs = [request(i, sampling, k if i != 1 else 0) for i in range(4)]
    gens = [engine.generate(r) for r in reqs]
    run_all(engine, gens)
    for g, r in zip(gens, reqs, strict=True):
        assert g.error is None
        tokens, drafted, accepted = solo_rounds(r)
        assert (g.tokens, g.stats.draft_n, g.stats.draft_n_accepted) == (
            tokens, drafted, accepted)
    assert gens[1].stats.draft_n == 0 and not drafts.seqs[1].evals   # plain: no draft
    first = drafts.decodes[0]       # the catch-up: the prompt and the first token
    assert sorted((s, n_past, len(t)) for s, n_past, t in first) == [
        (i, 0, len(PROMPTS[i]) + 1) for i in (0, 2, 3)]
    # the draft model's decodes: three sequences at once, never one decode per sequence
    assert max(len(parts) for parts in drafts.decodes) == 3
    per_sequence = sum(len(b.evals) for b in drafts.seqs)
    assert len(drafts.decodes) * 2 < per_sequence


def test_catch_ups_too_long_for_one_draft_decode_go_alone() -> None:
    """The draft context's -b is the budget: catch-ups that overflow it are read by each
    sequence's own eval, then the drafts go on together."""
    drafts = FakeBatch(OTHER, 2, n_batch=12)
    engine = Engine(FakeBatch(TARGET, 2), ModelDrafter.per_sequence(drafts))
    reqs = [request(2, GREEDY, 4), request(0, GREEDY, 4)]     # 10 + 5 prompt tokens > 12
    gens = [engine.generate(r) for r in reqs]
    run_all(engine, gens)
    assert [g.tokens for g in gens] == [solo_rounds(r)[0] for r in reqs]
    assert len(drafts.decodes) > 0 and all(sum(len(t) for _, _, t in parts) <= 12
                                           for parts in drafts.decodes)


class FailingDraftBatch(FakeBatch):
    """A draft batch whose decodes fail from the n-th on."""

    def __init__(self, *a, fail_from: int, **kw) -> None:
        super().__init__(*a, **kw)
        self.fail_from = fail_from

    def decode(self, parts):
        if len(self.decodes) >= self.fail_from:
            raise BackendError("draft decode failed")
        return super().decode(parts)


def test_a_failing_draft_decode_is_plain_decoding_for_its_sequences() -> None:
    drafts = FailingDraftBatch(OTHER, 2, fail_from=3)
    engine = Engine(FakeBatch(TARGET, 2), ModelDrafter.per_sequence(drafts))
    reqs = [request(0, GREEDY, 4), request(3, SEEDED, 4)]
    gens = [engine.generate(r) for r in reqs]
    run_all(engine, gens)
    assert all(g.error is None for g in gens)
    assert [g.tokens for g in gens] == [solo_rounds(r)[0] for r in reqs]
    assert all(g.stats.drafter.get("guard_failures", 0) >= 1 for g in gens)


class AskingDrafter(NgramDrafter):
    """An n-gram drafter that logs, in one shared list, when it is asked and proposes."""

    capabilities = replace(NgramDrafter.capabilities, asks_ahead=True)

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        super().__init__()
        self.label, self.log = name, log

    def ask(self, history, k: int) -> None:
        self.log.append(("ask", self.label))

    def propose(self, history, k: int):
        self.log.append(("propose", self.label))
        return super().propose(history, k)


def test_every_drafter_is_asked_before_any_proposes() -> None:
    """A step asks all its drafting sequences first (a remote drafter's verdicts all go
    out), then collects each draft: no proposal comes before the last ask of its step."""
    log: list[tuple[str, str]] = []
    batch = FakeBatch(TARGET, 3, n_batch=512)
    engine = Engine(batch, [AskingDrafter(str(i), log) for i in range(3)])
    gens = [engine.generate(request(i, GREEDY, 4)) for i in range(3)]
    run_all(engine, gens)
    steps, step = [], []
    for kind, who in log:
        if kind == "ask" and step and step[-1][0] == "propose":
            steps.append(step)
            step = []
        step.append((kind, who))
    steps.append(step)
    assert any(sum(k == "ask" for k, _ in s) == 3 for s in steps)
    for s in steps:
        asked = [who for k, who in s if k == "ask"]
        proposed = [who for k, who in s if k == "propose"]
        assert s[:len(asked)] == [("ask", w) for w in asked], s
        assert sorted(proposed) == sorted(asked), s


def test_generate_on_a_full_batch_is_one_clear_error_and_leaves_the_batch_alone() -> None:
    """A third generation on two sequences is refused, naming the cause and the way out;
    the running ones go on untouched, and once one is closed the next one gets its
    sequence. A single-sequence target says the same of its one sequence."""
    engine, _ = batch_engine(2, ["ngram", "ngram"])
    a, b = (engine.generate(request(i, GREEDY, 4)) for i in (0, 2))
    engine.step()
    with pytest.raises(BatchFull, match=r"all 2 sequences .* busy .* close\(\) one"):
        engine.generate(request(3, GREEDY, 0))
    with pytest.raises(BatchFull, match="sequence 1 is busy"):
        engine.generate(request(3, GREEDY, 0), seq=1)
    with pytest.raises(BatchFull, match="sequence 5 outside 0..1"):
        engine.generate(request(3, GREEDY, 0), seq=5)
    b.close()
    c = engine.generate(request(3, GREEDY, 0))
    assert c.seq == 1
    run_all(engine, [a, c])
    assert a.tokens == alone(request(0, GREEDY, 4), "ngram")
    assert c.tokens == alone(request(3, GREEDY, 0), "none")
    one = Engine(FakeBackend(TARGET))
    first = one.generate(request(0, GREEDY, 0))
    with pytest.raises(BatchFull, match="all 1 sequence of the target are busy"):
        one.generate(request(1, GREEDY, 0))
    assert first.run() == alone(request(0, GREEDY, 0), "none")
    assert one.generate(request(1, GREEDY, 0)).run() == alone(request(1, GREEDY, 0), "none")


def clocked_batch(monkeypatch, n_seq: int) -> FakeBatch:
    """A FakeBatch whose decodes cost fixed times on a FakeClock that lockstep measures."""
    clock = FakeClock().install(monkeypatch, lockstep)
    return FakeBatch(OTHER, n_seq, n_ctx=1024, clock=clock)


def test_a_lockstep_draft_is_charged_its_own_share_not_another_s_catch_up(monkeypatch) -> None:
    """Sequence 0 drafts one token beside sequence 1 catching up with a long history in
    the same draft decode: each draft's `spent` (what the adaptive policy learns from) is
    what drafting costs it alone, so sequence 0 is not charged sequence 1's catch-up."""
    drafts = clocked_batch(monkeypatch, 2)
    d0, d1 = ModelDrafter.per_sequence(drafts)
    params = DraftParams(n_max=1, p_min=0.0)
    short, long_ = [1, 2, 3], [(7 * i) % (V - 8) for i in range(400)]
    for d, prompt in ((d0, short), (d1, long_)):
        d.begin(prompt, GREEDY, params)
    d0.draft_from(short, 1)                            # sequence 0 has caught up
    runs = [d0.draft_in_steps([*short, 5], 1), d1.draft_in_steps(long_, 1)]
    draft_together(runs)
    assert [len(t) for _, _, t in drafts.decodes[-1]] == [1, 400]   # one decode for both
    assert all(r.error is None and len(r.draft) == 1 for r in runs)
    assert 0 < 20 * runs[0].spent < runs[1].spent


def test_lockstep_catch_ups_are_each_charged_their_own_part_of_the_decode(monkeypatch) -> None:
    """Four sequences catching up with long prompts in one draft decode: each is charged
    about its own tokens' part of it (together about the decode's time), not the whole
    decode each."""
    drafts = clocked_batch(monkeypatch, 4)
    drafters = ModelDrafter.per_sequence(drafts)
    prompts = [[(i + 3 * j) % (V - 8) for j in range(100)] for i in range(4)]
    for d, prompt in zip(drafters, prompts, strict=True):
        d.begin(prompt, GREEDY, DraftParams(n_max=1, p_min=0.0))
    runs = [d.draft_in_steps(p, 1) for d, p in zip(drafters, prompts, strict=True)]
    draft_together(runs)
    assert [len(t) for _, _, t in drafts.decodes[-1]] == [100] * 4
    decode_s = sum(b.decode_s for b in drafts.seqs)
    assert all(0 < r.spent < 0.75 * decode_s for r in runs)     # the whole: 1x each
    assert sum(r.spent for r in runs) < 2.5 * decode_s


def test_a_draft_after_a_catch_up_also_says_what_it_would_cost_caught_up(monkeypatch) -> None:
    """A lockstep draft of 3 tokens behind a long catch-up: steady_s, its cost as if the
    drafter had been caught up, leaves the catch-up's decode out (so a probe teaches the
    policy the drafter's own cost); a draft of one decode has none."""
    drafts = clocked_batch(monkeypatch, 2)
    d0, d1 = ModelDrafter.per_sequence(drafts)
    history = [(5 * i) % (V - 8) for i in range(300)]
    for d in (d0, d1):
        d.begin(history, GREEDY, DraftParams(n_max=3, p_min=0.0))
    long_, one = d0.draft_in_steps(history, 3), d1.draft_in_steps(history[:5], 1)
    draft_together([long_, one])
    assert long_.decodes == 3 and len(long_.draft) == 3 and one.steady_s is None
    assert 0 < long_.steady_s < long_.spent / 3


def test_the_verification_line_is_the_target_s_fed_once_per_decode_of_rounds() -> None:
    """Every adaptive policy of a batch engine prices rounds on one line, the engine's,
    which each decode of rounds feeds once at the decode's size; a step that reads a prompt
    chunk is off the curve and feeds nothing. A one-sequence engine's policy reads its
    engine's too, and fits none of its own."""
    engine, batch = batch_engine(2, ["model", "model"])
    line = engine.costs.line
    params = DraftParams(n_max=2, p_min=0.0, policy="adaptive")
    gens = [engine.generate(Request(list(PROMPTS[0]), 6, GREEDY, params))]
    engine.step()                                       # sequence 0's prompt
    engine.step()                                       # its first round, alone
    gens.append(engine.generate(Request(list(PROMPTS[2]), 6, GREEDY, params)))
    engine.step()                                       # a round beside a prompt chunk
    assert line.w == 1.0
    run_all(engine, gens)
    policies = [engine.memories[i].policies[("adaptive", 2)] for i in range(2)]
    assert all(p.costs is engine.costs and not p.own_costs for p in policies)
    rounds = sum(all(len(t) <= 3 for _, _, t in d) for d in batch.decodes)  # prompts: 5, 10
    assert line.w == pytest.approx(sum((1 - line.alpha) ** i for i in range(rounds)))
    alone = Engine(FakeBackend(TARGET), drafter("model"))
    alone.generate(Request(list(PROMPTS[0]), 6, GREEDY, params)).run()
    own = alone.memories[0].policies[("adaptive", 2)]
    assert own.costs is alone.costs and not own.own_costs and alone.costs.line.w > 0
