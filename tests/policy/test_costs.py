"""One verification-cost model per target: the engine feeds it, every other part reads it.
One drafting-cost model per draft backend, which the engine keeps and hands out.

The policies, the drafters that weigh their own rounds (n-gram, hybrid) and the bubble
rule are handed the engine's VerifyCost and add nothing to it; a part built outside an
engine feeds one of its own. Drafters declare that they stop their own drafts; they
write nothing into the policy. The policies, the hybrid and the lockstep drafts read
the draft backend's DraftCost (the sequences of one shared draft context share one),
and no reader keeps a draft line of its own.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
from branch_fakes import ScriptedDrafter
from fakes import FakeBackend, FakeBatch, FakeModel

from specwire.config import DraftParams, SamplingParams
from specwire.drafters import lockstep
from specwire.drafters.hybrid import HybridDrafter, HybridEstimates
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request
from specwire.policy.adaptive import AdaptivePolicy
from specwire.policy.costs import DraftCost, VerifyCost
from specwire.policy.throughput import LineFit

V = 32
TARGET = FakeModel(n_vocab=V, seed=0)
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2]
GREEDY = SamplingParams(temperature=0.0)
ADAPTIVE = DraftParams(n_max=4, p_min=0.0, policy="adaptive")


def test_a_decode_feeds_the_line_and_the_means_per_size() -> None:
    c = VerifyCost()
    assert c.seconds(3) is None and c.times(3) is None
    for _ in range(50):
        c.observe(1, 0.010)
        c.observe(5, 0.014)
    assert c.seconds(1) == pytest.approx(0.010, rel=0.02)
    assert c.seconds(5) == pytest.approx(0.014, rel=0.02)
    assert c.per_token() == pytest.approx(0.001, rel=0.05)
    assert c.times(5) == pytest.approx(0.014) and c.times.largest() == 5


def test_the_engine_hands_its_costs_to_every_part_that_reads_them() -> None:
    ngram = NgramDrafter(4, 1)
    hybrid = HybridDrafter(NgramDrafter(4, 1), ModelDrafter(FakeBackend(TARGET, name="d.gguf")))
    branch = ScriptedDrafter(pipelined=True)
    for drafter in (ngram, hybrid, branch):
        engine = Engine(FakeBackend(TARGET), drafter)
        costs = engine.costs
        if drafter is ngram:
            assert ngram.cost.costs is costs and not ngram.cost.own_costs
        elif drafter is hybrid:
            assert hybrid.costs is costs and not hybrid.own_costs
            assert hybrid.ngram.cost.costs is costs
        else:
            assert branch.bubble.costs is costs and not branch.bubble.own_costs
    engine = Engine(FakeBackend(TARGET), NgramDrafter(4, 1))
    gen = engine.generate(Request(list(PROMPT), 12, GREEDY, ADAPTIVE))
    gen.run()
    assert gen.policy.costs is engine.costs and not gen.policy.own_costs
    assert engine.costs.line.w > 0 and engine.costs.times.rounds() > 0


def test_only_the_engine_feeds_a_handed_cost_model() -> None:
    """The policy's and the drafter's observations add nothing to the engine's costs:
    their weight is the engine's count of decodes of rounds."""
    target = FakeBackend(TARGET)
    engine = Engine(target, NgramDrafter(4, 1))
    engine.generate(Request(list(PROMPT), 12, GREEDY, ADAPTIVE)).run()
    rounds = sum(1 for _, tokens in target.evals[1:])     # every eval after the prompt's
    line = engine.costs.line
    assert line.w == pytest.approx(sum((1 - line.alpha) ** i for i in range(rounds)))


def test_a_drafter_that_stops_itself_writes_nothing_into_the_policy() -> None:
    """begin hands the policy over and neither it nor end writes its fields; the engine
    tells the policy, from the drafter's declaration, to ask for the most, and undoes it
    after."""
    policy = AdaptivePolicy(8)
    before = dataclasses.asdict(policy)
    for drafter in (NgramDrafter(4, 1), HybridDrafter(
            NgramDrafter(4, 1), ModelDrafter(FakeBackend(TARGET, name="d.gguf")))):
        assert drafter.capabilities.stops
        drafter.begin(list(PROMPT), GREEDY, ADAPTIVE, policy=policy)
        drafter.end()
        assert dataclasses.asdict(policy) == before
    seen: list[bool] = []
    ngram = NgramDrafter(4, 1)
    engine = Engine(FakeBackend(TARGET), ngram)
    gen = engine.generate(Request(list(PROMPT), 12, GREEDY, ADAPTIVE))
    propose = ngram.propose
    ngram.propose = lambda h, k: (seen.append(gen.policy.drafter_stops), propose(h, k))[1]
    gen.run()
    assert seen and all(seen) and not gen.policy.drafter_stops


DRAFT = TARGET.perturbed(0.8, seed=5)


def _draft_lines(obj: object) -> list[str]:
    """The names of obj's fields that hold a line fit or a dict (a line per key)."""
    names = [f.name for f in dataclasses.fields(obj)] if dataclasses.is_dataclass(obj) \
        else list(vars(obj))
    return [n for n in names if isinstance(getattr(obj, n), (LineFit, dict))
            and n != "counters"]


def test_no_reader_keeps_a_drafting_line_of_its_own() -> None:
    """The policy, the hybrid and its estimates, and the lockstep module hold no line of
    their own: what drafting costs is the DraftCost they are handed."""
    hybrid = HybridDrafter(NgramDrafter(4, 1), ModelDrafter(FakeBackend(DRAFT, name="d")))
    assert _draft_lines(AdaptivePolicy(8)) == []
    assert _draft_lines(HybridEstimates()) == []
    assert _draft_lines(hybrid) == []
    state = {k: v for k, v in vars(lockstep).items() if not k.startswith("__")}
    assert not [k for k, v in state.items() if isinstance(v, (LineFit, dict))
                or type(v).__name__.startswith("WeakKey")]


def test_the_engine_hands_one_drafting_cost_per_draft_backend() -> None:
    """Lockstep drafters of one draft context share the engine's one DraftCost, which their
    shared decodes feed and every sequence's policy reads; another context's is apart."""
    drafts = FakeBatch(DRAFT, 2)
    engine = Engine(FakeBatch(TARGET, 2), ModelDrafter.per_sequence(drafts))
    cost = engine.memories[0].draft
    assert engine.memories[1].draft is cost
    assert all(d.cost is cost for d in engine.drafters)
    gens = [engine.generate(Request(list(PROMPT), 12, GREEDY, ADAPTIVE)),
            engine.generate(Request(list(PROMPT[:5]), 12, GREEDY, ADAPTIVE))]
    while not all(g.done for g in gens):
        engine.step()
    assert all(g.policy.draft is cost for g in gens)
    assert cost.decode.w > 0 and cost.line.w > 0
    other = Engine(FakeBatch(TARGET, 2), ModelDrafter.per_sequence(FakeBatch(DRAFT, 2)))
    assert other.memories[0].draft is not cost and other.memories[0].draft.decode.w == 0
    alone = [ModelDrafter(FakeBackend(DRAFT, name="d")) for _ in range(2)]
    apart = Engine(FakeBatch(TARGET, 2), alone)
    assert apart.memories[0].draft is not apart.memories[1].draft
    assert [d.cost for d in alone] == [m.draft for m in apart.memories]
    hybrid = HybridDrafter(NgramDrafter(4, 1), ModelDrafter(FakeBackend(DRAFT, name="d")))
    engine = Engine(FakeBackend(TARGET), hybrid)
    gen = engine.generate(Request(list(PROMPT), 12, GREEDY, ADAPTIVE))
    gen.run()
    assert hybrid.draft is engine.policies.draft is gen.policy.draft
    assert hybrid.model.cost is hybrid.draft


def _feeders(monkeypatch) -> list[str]:
    """Who calls DraftCost.observe and observe_decode, by function name."""
    seen: list[str] = []
    for name in ("observe", "observe_decode"):
        method = getattr(DraftCost, name)

        def spy(self, *a, _method=method, _name=name):
            seen.append(f"{_name}:{sys._getframe(1).f_code.co_name}")
            return _method(self, *a)
        monkeypatch.setattr(DraftCost, name, spy)
    return seen


def test_only_whoever_times_the_draft_model_feeds_its_cost(monkeypatch) -> None:
    """A model drafter's rounds reach the drafting cost through the policy, a shared draft
    context's decodes through the lockstep step, a hybrid's model through the hybrid alone
    (the policy, told the drafter stops its own drafts, adds none of the lookup's rounds)."""
    seen = _feeders(monkeypatch)
    Engine(FakeBackend(TARGET), ModelDrafter(FakeBackend(DRAFT, name="d"))).generate(
        Request(list(PROMPT), 12, GREEDY, ADAPTIVE)).run()
    assert seen and set(seen) == {"observe:observe"}     # AdaptivePolicy.observe
    seen.clear()
    engine = Engine(FakeBatch(TARGET, 2), ModelDrafter.per_sequence(FakeBatch(DRAFT, 2)))
    gens = [engine.generate(Request(list(PROMPT), 12, GREEDY, ADAPTIVE)) for _ in range(2)]
    while not all(g.done for g in gens):
        engine.step()
    assert {"observe:observe", "observe_decode:_step"} <= set(seen)
    seen.clear()
    hybrid = HybridDrafter(NgramDrafter(4, 1), ModelDrafter(FakeBackend(DRAFT, name="d")))
    Engine(FakeBackend(TARGET), hybrid).generate(
        Request(list(PROMPT * 3), 24, GREEDY, ADAPTIVE)).run()
    assert seen and set(seen) == {"observe:propose"}     # HybridDrafter.propose
    p = AdaptivePolicy(8)
    p.drafter_stops = True
    for _ in range(3):
        p.choose(8)
        p.observe(p.state.k, 2, 0.01, 0.02)
    assert p.draft.line.w == 0


def test_catching_up_is_priced_by_the_draft_backend_alone(monkeypatch) -> None:
    """What catching up costs (the prompt, tokens missed while not asked) is the draft
    backend's DraftCost's: the policy feeds it for a drafter it times, the hybrid for its
    model, and neither the policy's state nor the hybrid's estimates keep one of their own."""
    from specwire.policy.adaptive import AdaptiveState
    from specwire.policy.costs import PerToken

    def own(obj: object) -> list[str]:
        names = [f.name for f in dataclasses.fields(obj)]
        return [n for n in names if "catch" in n or "prompt" in n
                or isinstance(getattr(obj, n), PerToken)]
    assert own(AdaptiveState()) == [] and own(HybridEstimates()) == []
    seen: list[str] = []
    add = PerToken.add

    def spy(self, *a):
        seen.append(sys._getframe(1).f_code.co_name)
        return add(self, *a)
    monkeypatch.setattr(PerToken, "add", spy)
    p = AdaptivePolicy(8)
    p.draft.observe(2, 0.05)                        # a draft's own time, known already
    p.start(behind=6)
    p.state.k, p.state.skipped = 2, 6
    p.observe(2, 2, 0.3, 0.02)                      # a request's first round: its prompt
    assert p.draft.prompt() == pytest.approx((0.3 - p.draft.seconds(2)) / 6, rel=1e-6)
    for _ in range(3):
        p.state.k = 0
        p.observe(0, 0, 0.0, 0.02)
    p.state.k = 2
    p.observe(2, 2, p.draft.seconds(2) + 0.03, 0.02)   # after three plain steps
    assert p.catch_up_cost() == pytest.approx(0.01, rel=1e-6)
    assert seen == ["observe", "observe"]
    seen.clear()
    stops = AdaptivePolicy(8)
    stops.drafter_stops = True
    stops.state.k, stops.state.skipped = 2, 6
    stops.observe(2, 2, 0.3, 0.02)
    assert seen == [] and stops.draft.prompt.tokens == 0
    hybrid = HybridDrafter(NgramDrafter(4, 1), ModelDrafter(FakeBackend(DRAFT, name="d")))
    engine = Engine(FakeBackend(TARGET), hybrid)
    engine.generate(Request(list(PROMPT * 3), 24, GREEDY, ADAPTIVE)).run()
    assert seen and set(seen) == {"propose"}        # HybridDrafter.propose
    assert hybrid.draft.prompt.tokens > 0 or hybrid.draft.catch_up.tokens > 0
