"""The adaptive policy in a batch: it drafts where drafting pays at the batch's size.

A simulated machine whose decode costs a fixed part plus a part per token in the
batch: alone, a good drafter's tokens are nearly free to verify and drafting pays;
beside 31 other tokens, the same draft's tokens cost the whole batch's time and the
others' tokens already fill the step, so plain steps win.
"""

from __future__ import annotations

import time

import numpy as np
from fakes import FakeBackend, FakeBatch, FakeClock, FakeModel

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.engine.engine import Engine, Request
from specwire.policy.adaptive import AdaptivePolicy

TARGET = FakeModel(n_vocab=40, seed=0)
DRAFT = TARGET.perturbed(0.3, seed=5)


def simulate(policy: AdaptivePolicy, batches: list[int], rounds: int, seed: int = 0) -> dict:
    rs = np.random.default_rng(seed)
    chosen: dict[int, list[int]] = {b: [] for b in set(batches)}
    for i in range(rounds):
        b = batches[i % len(batches)]
        k = policy.choose(8, batch_tokens=b)
        accepted = 0
        while accepted < k and rs.random() < 0.8:
            accepted += 1
        policy.observe(k, accepted, 0.002 + 0.02 * k if k else 0.0, 0.1 + 0.01 * (k + b))
        chosen[b].append(k)
    return chosen


def test_drafts_alone_and_not_beside_a_full_batch() -> None:
    chosen = simulate(AdaptivePolicy(8), [0, 31], 600)
    alone, full = chosen[0][-100:], chosen[31][-100:]
    assert min(alone) > 0, alone
    assert sum(k == 0 for k in full) >= 80, full          # probes aside, plain steps
    assert np.mean(full) < np.mean(alone)


def test_alone_the_batch_keyword_changes_nothing() -> None:
    a, b = AdaptivePolicy(8), AdaptivePolicy(8)
    for _ in range(50):
        ka, kb = a.choose(8), b.choose(8, batch_tokens=0)
        assert ka == kb
        for p, k in ((a, ka), (b, kb)):
            p.observe(k, min(k, 2), 0.01 * k, 0.1 + 0.01 * k)


# --------------------------------------------------------------------------- in the engine


class TimedBatch(FakeBatch):
    """A target whose decode costs `fixed` plus `per_row` per logits row and `per_prompt`
    per other token (a prompt chunk's tokens, one row per chunk, cost far less each)."""

    def __init__(self, clock: FakeClock, fixed: float, per_row: float, per_prompt: float,
                 n_seq: int) -> None:
        super().__init__(TARGET, n_seq)
        self.clock, self.fixed, self.per_row, self.per_prompt = clock, fixed, per_row, per_prompt

    def decode(self, parts) -> list[np.ndarray]:
        rows = sum(len(p.tokens) for p in parts if p.logits == "all")
        other = sum(len(p.tokens) for p in parts if p.logits != "all")
        self.clock.charge(self.fixed + self.per_row * rows + self.per_prompt * other)
        return super().decode(parts)


def first_alone_then_joined(monkeypatch, per_row: float, per_eval: float,
                            drafted: bool = True) -> dict[str, float]:
    """Request 0 decodes alone for 30 steps; then twelve requests with 60-token prompts
    join it, three at a time running beside it (one joins when another ends). Rounds
    that asked the drafter: request 0's alone, and everyone's while others run; and the
    tokens per second of all of them then."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    # a draft evaluation costs per_eval, and a little per token of a catch-up
    drafts = [FakeBackend(DRAFT, name="draft.gguf", clock=clock, cost=(per_eval, 0.0005))
              for _ in range(4)]
    engine = Engine(TimedBatch(clock, 0.04, per_row, 0.002, 4),
                    [ModelDrafter(d) for d in drafts])
    params = DraftParams(n_max=8, p_min=0.0, policy="adaptive", enabled=drafted)

    def request(seed: int, n: int, length: int) -> Request:
        prompt = np.random.default_rng(seed).integers(0, TARGET.real_tokens, length)
        return Request([int(t) for t in prompt], n, SamplingParams(temperature=0.0), params)

    first = engine.generate(request(0, 1000, 5))
    for _ in range(30):
        engine.step()
    alone, t0, n0 = first.stats.asked_rounds, clock.now, len(first.tokens)
    others, waiting = [], [request(s, 20, 60) for s in range(1, 13)]
    while waiting or not all(g.done for g in others):
        while waiting and sum(not g.done for g in others) < 3:
            others.append(engine.generate(waiting.pop()))
        engine.step()
    together = first.stats.asked_rounds - alone + sum(g.stats.asked_rounds for g in others)
    tokens = len(first.tokens) - n0 + sum(len(g.tokens) for g in others)
    first.close()
    return {"alone": alone, "together": together, "rate": tokens / (clock.now - t0)}


def test_a_request_that_drafted_alone_stops_where_the_batch_makes_drafting_cost(
        monkeypatch) -> None:
    """Verification costs a fifth of a step per token (a compute-bound target) and a
    draft token half a step: alone a good draft pays, beside other sequences it does
    not. Neither the first request's drafting alone, nor the others' prompt chunks (off
    the verification curve), nor the first drafts of requests that join make the batch
    draft: it loses at most a few percent of plain decoding's throughput (probes)."""
    got = first_alone_then_joined(monkeypatch, per_row=0.01, per_eval=0.02)
    plain = first_alone_then_joined(monkeypatch, per_row=0.01, per_eval=0.02, drafted=False)
    assert got["alone"] >= 25, got
    assert got["rate"] >= 0.97 * plain["rate"], (got, plain)


def test_where_verification_is_nearly_free_the_batch_keeps_drafting(monkeypatch) -> None:
    """A memory-bound target (a verified token costs a fiftieth of a step) and a cheap
    draft: drafting pays in the batch too, and the sequences go on drafting."""
    got = first_alone_then_joined(monkeypatch, per_row=0.001, per_eval=0.002)
    plain = first_alone_then_joined(monkeypatch, per_row=0.001, per_eval=0.002, drafted=False)
    assert got["alone"] >= 25, got
    assert got["rate"] >= 1.15 * plain["rate"], (got, plain)


class TimedDraft(FakeBatch):
    """A draft context of n_seq sequences whose shared decode costs `fixed` (reading the
    weights) plus `per_token` for every token in it, once; a sequence's eval alone costs
    the same for its own tokens."""

    def __init__(self, clock: FakeClock, fixed: float, per_token: float, n_seq: int) -> None:
        super().__init__(DRAFT, n_seq, clock=clock, cost=(fixed, per_token))
        self.clock, self.fixed, self.per_token = clock, fixed, per_token

    def decode(self, parts) -> list[np.ndarray]:
        self.clock.charge(self.fixed + self.per_token * sum(len(p.tokens) for p in parts))
        for b in self.seqs:       # the parts' evals are this decode, charged once above
            b.clock = None
        try:
            return super().decode(parts)
        finally:
            for b in self.seqs:
                b.clock = self.clock


def four_at_once(monkeypatch, drafted: bool) -> float:
    """Four requests joining together on a memory-bound target (a verified token costs a
    hundredth of a step) with a lockstep draft context whose decode costs a tenth of a
    step whatever its sequences: their tokens per second."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    engine = Engine(TimedBatch(clock, 0.1, 0.001, 0.0005, 4),
                    ModelDrafter.per_sequence(TimedDraft(clock, 0.01, 0.0002, 4)))
    params = DraftParams(n_max=8, p_min=0.0, policy="adaptive", enabled=drafted)
    gens = []
    for seed in range(4):
        prompt = np.random.default_rng(seed).integers(0, TARGET.real_tokens, 20)
        gens.append(engine.generate(Request([int(t) for t in prompt], 120,
                                            SamplingParams(temperature=0.0), params)))
    t0 = clock.now
    while not all(g.done for g in gens):
        engine.step()
    return sum(len(g.tokens) for g in gens) / (clock.now - t0)


def test_lockstep_sequences_draft_together_where_their_shared_draft_pays(monkeypatch) -> None:
    """Each sequence's draft position costs the step one shared draft decode: priced as
    if each drafted alone beside the others' plain tokens, no sequence drafts (a draft
    position holds up the whole step for one sequence's gain); priced as the lockstep
    it is, all four draft and the batch beats plain decoding clearly."""
    got = four_at_once(monkeypatch, drafted=True)
    plain = four_at_once(monkeypatch, drafted=False)
    assert got >= 1.2 * plain, (got, plain)   # priced alone: 1.01x


def test_a_lockstep_step_pays_a_draft_position_once() -> None:
    """step_rate with peers: the ones still to choose draft alike (their rounds in place
    of their one token), and drafting within what earlier ones asked costs only its
    verification; with neither, the step of one drafting sequence."""
    from specwire.policy.throughput import drafted_tokens, expected_tokens, step_rate

    def draft(n: float) -> float:
        return 0.01 + 0.01 * n

    def verify(n: float) -> float:
        return 0.1 + 0.001 * n

    a, k, b = 0.8, 4, 3
    e = expected_tokens(a, k)
    alone = step_rate(a, k, draft, verify, batch=b)
    assert alone == (e + b) / (draft(k) + verify(1 + k + b))
    mirrored = step_rate(a, k, draft, verify, batch=b, peers=3)
    assert mirrored == 4 * e / (draft(k) + verify(4 * (1 + k)))
    assert mirrored > alone
    paid = step_rate(a, k, draft, verify, batch=b, paid=draft(drafted_tokens(1.0, 8)))
    assert paid == (e + b) / verify(1 + k + b)
