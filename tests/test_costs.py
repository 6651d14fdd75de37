"""One verification-cost model per target: the engine feeds it, every other part reads it.

The policies, the drafters that weigh their own rounds (n-gram, hybrid) and the bubble
rule are handed the engine's VerifyCost and add nothing to it; a part built outside an
engine feeds one of its own. Drafters declare that they stop their own drafts; they
write nothing into the policy.
"""

from __future__ import annotations

import dataclasses

import pytest
from fakes import FakeBackend, FakeModel
from test_branch import ScriptedDrafter

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.hybrid import HybridDrafter
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request
from specwire.policy.adaptive import AdaptivePolicy
from specwire.policy.costs import VerifyCost

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
