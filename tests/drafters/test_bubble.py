"""Waiting for a fresh branch after a rejection (drafters/bubble.py), and when not to.

Pure arithmetic on measured times, then a pipelined BranchDrafter whose chunks
arrive from a script: it waits for them only where the measured costs say a wait
beats a plain step.
"""

from __future__ import annotations

from branch_fakes import ScriptedDrafter
from fakes import FakeBackend, FakeBatch, FakeModel, Forward

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.bubble import BubbleWait
from specwire.drafters.hybrid import HybridDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine
from specwire.link.branch import BranchDrafter
from specwire.link.messages import Chunk
from specwire.policy.throughput import VerifyTimes, monotone

V = 100
PROMPT = [1, 2, 3, 4]
STEP = 0.05  # a plain step, seconds


def primed(verify: dict[int, float], per_token: float, first: float = 0.002,
           acceptance_rounds: int = 20) -> BubbleWait:
    """A BubbleWait that has seen rounds costing verify[n] for a batch of n, a drafter
    whose fresh branch's n-th token arrives first + n * per_token after the verdict, and
    drafts kept at a = 0.8 (four of five tokens, then a rejection)."""
    b = BubbleWait()
    for _ in range(acceptance_rounds):
        for n, s in verify.items():
            b.observe_round(n - 1, min(n - 1, 4), s)
    for _ in range(8):
        for n in (1, 3, 5):
            b.observe_arrival(n, first + n * per_token)
    return b


GPU = {1: STEP, 5: 1.03 * STEP, 9: 1.06 * STEP}  # a batch of 9 costs about a step
CPU = {1: STEP, 5: 1.87 * STEP, 9: 2.45 * STEP}  # the bundled pair on one thread


def test_verify_times_interpolate_and_extrapolate() -> None:
    t = VerifyTimes()
    assert t(3) is None
    t.add(1, 1.0)
    t.add(9, 3.0)
    assert t(1) == 1.0 and t(9) == 3.0
    assert abs(t(5) - 2.0) < 1e-9
    assert t(17) > 3.0
    t2 = VerifyTimes()
    t2.add(4, 2.0)
    assert 0.0 < t2(1) < 2.0 < t2(8)


def test_no_wait_before_anything_is_measured() -> None:
    assert BubbleWait().aim(0, 8, 0.0, fresh=True) == (0, 0.0)


def test_a_flat_verification_curve_waits_for_a_few_fast_tokens() -> None:
    b = primed(GPU, per_token=0.1 * STEP)
    m, wait = b.aim(0, 8, 0.0, fresh=True)
    assert m >= 2
    assert 0.0 < wait < STEP


def test_a_wait_in_vain_stops_waiting_until_the_drafter_is_heard_again() -> None:
    """A stalled or dead drafter costs one wait, not one per round: after a wait that got
    nothing no round waits, until a fresh branch's token arrives again."""
    b = primed(GPU, per_token=0.1 * STEP)
    assert b.aim(0, 8, 0.0, fresh=True)[0] >= 2
    b.missed()
    assert b.aim(0, 8, 0.0, fresh=True) == (0, 0.0)
    b.observe_arrival(1, 0.002 + 0.1 * STEP)
    assert b.aim(0, 8, 0.0, fresh=True)[0] >= 2


def test_a_steep_verification_curve_decodes_plainly_instead() -> None:
    """On a CPU target a plain step yields a token while the drafter drafts: waiting loses."""
    b = primed(CPU, per_token=0.25 * STEP)
    assert b.aim(0, 8, 0.0, fresh=True) == (0, 0.0)


def test_a_slow_drafter_is_not_waited_for() -> None:
    b = primed(GPU, per_token=1.5 * STEP)
    assert b.aim(0, 8, 0.0, fresh=True) == (0, 0.0)


def test_a_full_draft_never_waits() -> None:
    b = primed(GPU, per_token=0.1 * STEP)
    assert b.aim(8, 8, 0.0, fresh=False) == (8, 0.0)


def _rejected_round(d: ScriptedDrafter, bubble: BubbleWait | None) -> list[int]:
    """Open, a draft of [7, 8, 9], the target keeping 7 and then its own 30: gen 0 is dead.
    Then the drafter's timings are `bubble`'s (the scripted round took no time)."""
    d.begin(PROMPT, SamplingParams(temperature=0.0), DraftParams(n_max=4, p_min=0.0))
    d.on_chunk(d.session, Chunk(0, 4, [7, 8, 9], done=False))
    assert d.propose(PROMPT, 4).tokens == [7, 8, 9]
    history = [*PROMPT, 7, 30]
    d.learn(history, 1, 2)
    assert d.counters.rejections == 1
    d.bubble = bubble
    d.script = [Chunk(1, 6, [40, 41], done=False), Chunk(1, 8, [42, 43], done=False)]
    return history


def test_a_pipelined_round_waits_for_the_fresh_branch_where_it_pays() -> None:
    d = ScriptedDrafter(pipelined=True)
    history = _rejected_round(d, primed(GPU, per_token=0.1 * STEP))
    draft = d.propose(history, 4)
    assert draft.tokens[:2] == [40, 41] and d.waits >= 1
    assert d.counters.waited_rounds == 1 and d.counters.starved_rounds == 0
    assert d.counters.fresh_branches == 1 and d.counters.fresh_first_ms > 0.0


def test_a_pipelined_round_decodes_plainly_where_waiting_does_not_pay() -> None:
    for bubble in (primed(CPU, per_token=0.25 * STEP), None):
        d = ScriptedDrafter(pipelined=True)
        history = _rejected_round(d, bubble)
        assert d.propose(history, 4).tokens == []
        assert d.waits == 0
        assert d.counters.waited_rounds == 0 and d.counters.starved_rounds == 1


def test_never_wait() -> None:
    """A pipelined branch declares that it may hold a round (waits) until told never to;
    a synchronous one never declares it."""
    d = ScriptedDrafter(pipelined=True)
    assert d.bubble is not None and d.capabilities.waits
    d.never_wait()
    assert d.bubble is None and not d.capabilities.waits
    sync = BranchDrafter(Forward(), V, pipelined=False)
    assert sync.bubble is None and not sync.capabilities.waits
    assert sync.capabilities.asks_ahead and not d.capabilities.asks_ahead


def test_who_never_waits() -> None:
    """A batch engine's drafters and a hybrid's model never hold a round for a fresh
    branch (the step carries other sequences; the lookup's draft may be ready); a drafter
    alone does."""
    alone = ScriptedDrafter(pipelined=True)
    Engine(FakeBackend(FakeModel(V)), alone)
    assert alone.bubble is not None
    batch = [ScriptedDrafter(pipelined=True) for _ in range(2)]
    Engine(FakeBatch(FakeModel(V), 2), batch)
    assert all(d.bubble is None for d in batch)
    model = ScriptedDrafter(pipelined=True)
    HybridDrafter(NgramDrafter(), model)
    assert model.bubble is None


def test_no_wait_for_a_batch_size_never_timed() -> None:
    """Only plain steps timed: the rule would price a batch on the assumed (GPU) slope,
    so it does not wait, however fast the drafter; a round of 5 timed at a GPU's cost
    lets it wait for up to 4 tokens."""
    b = primed({1: STEP}, per_token=0.05 * STEP)
    assert b.aim(0, 8, 0.0, fresh=True) == (0, 0.0)
    b = primed({1: STEP, 5: 1.03 * STEP}, per_token=0.05 * STEP)
    m, wait = b.aim(0, 8, 0.0, fresh=True)
    assert 2 <= m <= 4 and 0.0 < wait < STEP


def test_a_bigger_batch_never_prices_cheaper() -> None:
    t = VerifyTimes()
    for n, s in ((1, 1.0), (3, 1.6), (4, 1.34), (5, 1.09), (9, 2.4)):
        t.add(n, s)
    costs = [t(n) for n in range(1, 10)]
    assert all(a <= b + 1e-12 for a, b in zip(costs, costs[1:], strict=False))
    assert abs(t(4) - (1.6 + 1.34 + 1.09) / 3) < 1e-9  # 3, 4, 5 pooled, equal weights
    assert t(1) == 1.0 and t(9) == 2.4
    assert monotone({1: (1.0, 1.0), 2: (0.5, 3.0)}) == {1: 0.625, 2: 0.625}


def test_what_the_rule_learned_carries_over_to_the_next_drafter() -> None:
    """bench builds a pipelined drafter per prompt: handed the last one's estimates, the
    next begins where it ended (as a server's drafter per slot does), per cache scope;
    without them, a drafter begins from the priors."""
    from specwire.policy.scoped import Scoped

    store = Scoped(BubbleWait, BubbleWait())
    first = BranchDrafter(Forward(), V, pipelined=True, bubbles=store)
    first.bubble.observe_arrival(1, 0.01)
    first.bubbles.get("tenant").observe_arrival(2, 0.02)
    second = BranchDrafter(Forward(), V, pipelined=True, bubbles=store)
    assert second.bubble is first.bubble and second.bubble.arrivals == 1
    assert second.bubbles.peek("tenant").arrivals == 1
    fresh = BranchDrafter(Forward(), V, pipelined=True)
    assert fresh.bubble is not first.bubble and fresh.bubble.arrivals == 0
    assert BranchDrafter(Forward(), V, pipelined=False, bubbles=store).bubble is None

