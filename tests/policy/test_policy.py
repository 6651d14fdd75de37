"""Draft-length policies: the expected-tokens formula and the adaptive choice of k.

The adaptive policy is driven in a closed loop by a simulated system (acceptance
rate, draft cost per token, verify cost by batch size) and must settle where
expected tokens per second, E(k) / (k t_d + t_v(k + 1)), is highest.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from specwire.policy.adaptive import (
    AdaptivePolicy,
    AdaptiveState,
    CalibratedStop,
    Calibration,
    FixedPolicy,
    PolicyMemory,
    make_policy,
)
from specwire.policy.throughput import expected_tokens


@pytest.mark.parametrize("a", [0.0, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("k", [0, 1, 2, 5, 16])
def test_expected_tokens_is_the_geometric_sum(a: float, k: int) -> None:
    """E(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a): the kept prefix plus one."""
    assert expected_tokens(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)), rel=1e-12)


def test_expected_tokens_limits() -> None:
    """a = 1: every draft kept, k + 1 tokens; a = 0: only the target's own token."""
    assert expected_tokens(1.0, 7) == 8.0
    assert expected_tokens(0.0, 7) == 1.0
    assert expected_tokens(0.8, 4) < expected_tokens(0.8, 5) < expected_tokens(0.9, 5)


def test_fixed_policy_asks_for_draft_max_within_the_limit() -> None:
    """fixed: min(n_max, limit), whatever was observed."""
    p = make_policy("fixed", 8)
    assert isinstance(p, FixedPolicy)
    p.observe(8, 0, 1.0, 10.0)
    assert [p.choose(n) for n in (0, 3, 8, 20)] == [0, 3, 8, 8]
    assert isinstance(make_policy("adaptive", 8), AdaptivePolicy)


def _drive(policy: AdaptivePolicy, accept: Callable[[int, int], int], draft_s: float,
           verify: Callable[[int], float], rounds: int = 200) -> list[int]:
    """Closed loop: the policy picks k, the simulated system answers; returns the ks."""
    ks = []
    for r in range(rounds):
        k = policy.choose(16)
        assert 0 <= k <= policy.n_max
        policy.observe(k, accept(k, r), k * draft_s, verify(k + 1))
        ks.append(k)
    return ks


def test_adaptive_stops_drafting_when_nothing_is_accepted_and_verifying_costs() -> None:
    """Acceptance 0 and verification growing with the batch: k falls to 0 but for rare probes."""
    p = AdaptivePolicy(8)
    ks = _drive(p, lambda k, r: 0, 0.002, lambda n: 0.01 * (1 + 0.3 * (n - 1)))
    assert ks[0] >= 1                                   # it starts optimistic
    tail = ks[-64:]
    # Only one-token probes remain, one every `probe_every` rounds.
    assert max(tail) <= 1 and sum(tail) <= len(tail) // p.params.probe_every + 1, tail
    assert p.acceptance < 0.25


def test_adaptive_drafts_long_when_everything_is_accepted_and_verifying_is_cheap() -> None:
    """Acceptance 1, a near-flat verify cost and cheap drafts: k climbs to draft_max."""
    p = AdaptivePolicy(8)
    ks = _drive(p, lambda k, r: k, 0.0001, lambda n: 0.01 * (1 + 0.005 * (n - 1)))
    assert ks[-20:] == [8] * 20
    assert p.acceptance > 0.95


def test_adaptive_settles_on_the_best_intermediate_k() -> None:
    """Per-token acceptance 0.7 (each round keeps a seeded geometric prefix), verify cost
    growing 10% per token, drafts at 5% of a step: k settles near the true optimum of
    E(k) / (k t_d + t_v(k + 1)) (k = 3 here) and gets 95% of its rate, where k = 0 or
    draft_max would get less than 75%."""
    gen = random.Random(5)
    p = AdaptivePolicy(12)

    def verify(n: int) -> float:
        return 0.01 * (1 + 0.1 * (n - 1))

    def accept(k: int, r: int) -> int:
        n = 0
        while n < k and gen.random() < 0.7:
            n += 1
        return n

    ks = _drive(p, accept, 0.0005, verify, rounds=400)
    assert 0.5 < p.acceptance < 0.9             # an exponentially weighted, noisy estimate

    def rate(k: int) -> float:                  # the true expected tokens per second
        return expected_tokens(0.7, k) / (k * 0.0005 + verify(k + 1))

    best = max(range(13), key=rate)
    assert 2 <= best < 12
    assert all(abs(k - best) <= 2 for k in ks[-50:])
    assert sum(rate(k) for k in ks[-50:]) / 50 >= 0.95 * rate(best)
    assert rate(0) < 0.75 * rate(best) and rate(12) < 0.75 * rate(best)


def test_verify_cost_is_a_line_through_what_was_measured() -> None:
    """t_v(n): the line through the measured batch sizes (n = 2 took 2 s, n = 6 took 6 s),
    extrapolated past them. The prior line (10% of a step per extra token, far from this
    one's 100%) still pulls a little: within 15%."""
    p = AdaptivePolicy(8)
    for _ in range(20):
        p.observe(1, 1, 0.001, 2.0)
        p.observe(5, 5, 0.005, 6.0)
    for n in (1, 2, 4, 10):
        assert p.verify_cost(n) == pytest.approx(float(n), rel=0.15)


def test_adaptive_respects_the_limit() -> None:
    """Never more than the engine's limit (tokens left, room in the context)."""
    p = AdaptivePolicy(8)
    _drive(p, lambda k, r: k, 0.0001, lambda n: 0.01)
    assert [p.choose(n) for n in (0, 1, 3)] == [0, 1, 3]


def test_adaptive_recovers_when_the_drafter_becomes_good() -> None:
    """After a stretch of total rejection, a drafter that is now always right (and cheap to
    verify) must get drafting again within a few hundred rounds."""
    p = AdaptivePolicy(8)
    _drive(p, lambda k, r: 0, 0.002, lambda n: 0.01 * (1 + 0.3 * (n - 1)))
    ks = _drive(p, lambda k, r: k, 0.0001, lambda n: 0.01 * (1 + 0.005 * (n - 1)), rounds=300)
    assert max(ks) >= 1


def test_catch_up_work_is_not_charged_to_draft_length() -> None:
    """The drafter's first round evaluates the whole prompt, and a round after plain steps
    catches up on them: neither is what a draft token costs. A round costs the drafter
    c + d k (c: evaluating the target's token and the position --draft-p-min declined);
    the policy learns c and d and keeps drafting at the k that maximises E(k) / T(k)."""
    gen = random.Random(11)
    p = AdaptivePolicy(16)
    c, d = 0.02, 0.01

    def verify(n: int) -> float:
        return 0.08 * (1 + 0.2 * (n - 1))

    def rate(k: int) -> float:
        return expected_tokens(0.9, k) / ((c + d * k if k else 0.0) + verify(k + 1))

    ks, previous = [], 0
    for r in range(300):
        k = p.choose(16)
        kept = 0
        while kept < k and gen.random() < 0.9:
            kept += 1
        catch_up = 2.0 if (r == 0 or previous == 0) and k else 0.0
        p.observe(k, kept, catch_up + (c + d * k if k else 0.0), verify(k + 1))
        ks.append(k)
        previous = k
    assert min(ks[1:]) >= 1, ks[:20]
    assert p.draft_cost(4) == pytest.approx(c + 4 * d, rel=0.1)
    best = max(range(17), key=rate)
    assert sum(rate(k) for k in ks[-100:]) / 100 >= 0.95 * rate(best)


def test_line_fit_splits_a_round_cost_into_intercept_and_slope() -> None:
    """y = 3 + 2x recovered from varied x; constant x charges it all to the slope."""
    from specwire.policy.throughput import LineFit
    f = LineFit(0.1, guess=1.0, prior=0.0)
    for x in [0, 1, 2, 5, 3, 1, 4] * 5:
        f.add(x, 3 + 2 * x)
    assert f.coefficients() == pytest.approx((3.0, 2.0))
    # one x only: the prior line y = c (1 + guess x) splits it
    g = LineFit(0.1, guess=1.0)
    for _ in range(5):
        g.add(4, 10.0)
    assert g.coefficients() == pytest.approx((2.0, 2.0))
    # the prior's pull fades as varied data comes in
    h = LineFit(0.1, guess=1.0)
    for x in [0, 1, 2, 5, 3, 1, 4] * 5:
        h.add(x, 3 + 2 * x)
    assert h.coefficients() == pytest.approx((3.0, 2.0), rel=0.1)
    assert LineFit(0.1, guess=1.0).coefficients() == (0.0, 0.0)


def _drive_stopping(p: AdaptivePolicy, g: float, a: float, c: float, d: float,
                    verify: Callable[[int], float], rounds: int = 300,
                    seed: int = 3) -> list[int]:
    """A drafter that goes on to a next token with probability g (asked for k, it may
    stop sooner) and costs c + d per token; each drafted token kept with probability a."""
    gen = random.Random(seed)
    ks = []
    for _ in range(rounds):
        k = p.choose(16)
        drafted = 0
        while drafted < k and gen.random() < g:
            drafted += 1
        kept = 0
        while kept < drafted and gen.random() < a:
            kept += 1
        p.observe(drafted, kept, c + d * drafted if k else 0.0, verify(drafted + 1))
        ks.append(k)
    return ks


def test_a_drafter_that_mostly_declines_is_not_worth_its_round_cost() -> None:
    """Like a draft model at --draft-p-min on free text: it drafts a first token only 30% of
    the time but every round costs it an evaluation (c = a quarter step). What it drafts is
    kept (a = 0.9), so a policy that only looked at a would go on asking; counting the rounds
    that ended early, drafting yields less than it costs, and the policy mostly decodes
    plainly: its probes cost under 2% of the plain rate."""
    g, a, c, d = 0.3, 0.9, 0.025, 0.02

    def verify(n: float) -> float:
        return 0.1 * (1 + 0.25 * (n - 1))

    def true_rate(k: int) -> float:
        if k == 0:
            return 1 / verify(1)
        drafted = sum(g ** i for i in range(1, k + 1))
        return expected_tokens(g * a, k) / (c + d * drafted + verify(1 + drafted))

    p = AdaptivePolicy(8)
    ks = _drive_stopping(p, g=g, a=a, c=c, d=d, verify=verify)
    assert p.acceptance > 0.7 and p.continuation < 0.45
    assert max(range(9), key=true_rate) == 0
    tail = ks[-100:]
    assert sum(1 for k in tail if k == 0) >= 60, tail
    assert sum(true_rate(k) for k in tail) / 100 >= 0.98 * true_rate(0)


def test_a_free_drafter_that_often_has_nothing_ready_keeps_drafting() -> None:
    """Like a pipelined drafter after a rejection: often nothing ready (g = 0.5), but waiting
    costs nothing (c = d = 0) and an empty round verifies one token, as a plain step. Asking
    costs nothing, so the policy must keep asking for long drafts."""
    p = AdaptivePolicy(8)
    ks = _drive_stopping(p, g=0.5, a=0.9, c=0.0, d=0.0,
                         verify=lambda n: 0.1 * (1 + 0.1 * (n - 1)))
    assert min(ks[-100:]) >= 4


def test_memory_keeps_what_a_policy_learned_for_the_next_request() -> None:
    """One policy per (name, draft-max); a new request keeps the estimates, not the round."""
    mem = PolicyMemory()
    p = mem.policy("adaptive", 8)
    assert isinstance(p, AdaptivePolicy)
    _drive(p, lambda k, r: 0, 0.002, lambda n: 0.01 * (1 + 0.3 * (n - 1)), rounds=60)
    learned = p.acceptance
    assert learned < AdaptivePolicy(8).acceptance / 2   # well below the prior: it learned
    p.state.k, p.state.idle_rounds = 3, 5
    again = mem.policy("adaptive", 8)
    assert again is p
    st = again.state
    assert (st.k, st.warm, st.idle_rounds) == (0, False, 5)   # probes go on
    assert again.acceptance == learned
    assert again.choose(8) == 0                     # no fresh optimism on the next request
    assert mem.policy("adaptive", 4) is not p
    assert isinstance(mem.policy("fixed", 8), FixedPolicy)


def test_plain_steps_are_charged_what_the_drafter_redoes_when_drafting_resumes() -> None:
    """A draft model that sat out m plain steps evaluates those m tokens when asked again.
    The policy learns that cost per skipped token from rounds after a stretch of plain
    steps (never from a sequence's first round, which evaluates the prompt) and adds it to
    a plain step's cost; a drafter that catches up for free leaves plain steps as they are."""
    def run(per_token: float) -> AdaptivePolicy:
        p = AdaptivePolicy(8)
        p.start()
        p.state.k = 4
        p.observe(4, 4, 5.0, 0.1)                  # the prompt: seconds, not learnt
        assert p.catch_up_cost() == 0.0
        for _ in range(20):
            p.state.k = 0
            for _ in range(3):                     # three plain steps
                p.observe(0, 0, 0.0, 0.08)
            p.state.k = 2
            p.observe(2, 2, p.draft.seconds(2) + 3 * per_token, 0.1)
        return p

    slow = run(0.01)
    assert slow.catch_up_cost() == pytest.approx(0.01, rel=1e-6)
    assert slow.rate(0) == pytest.approx(1 / (slow.verify_cost(1) + 0.01))
    free = run(0.0)
    assert free.catch_up_cost() == 0.0
    assert free.rate(0) == pytest.approx(1 / free.verify_cost(1))
    fresh = AdaptivePolicy(8)
    fresh.start()
    fresh.observe(0, 0, 0.0, 0.08)                 # plain steps before any draft: no catch-up
    fresh.state.k = 2
    fresh.observe(2, 2, 3.0, 0.1)
    assert fresh.catch_up_cost() == 0.0


def test_calibration_learns_what_verification_keeps() -> None:
    """Tokens are judged up to the first rejected one: a bin the draft doubts but the
    target always keeps climbs towards 1, a confident bin that is always rejected falls."""
    p = AdaptivePolicy(8)
    cal = p.calibration
    doubted, sure = 0.65, 0.97
    before = cal(doubted), cal(sure)
    assert before[0] == pytest.approx(0.65 ** 0.5) and before[1] == pytest.approx(0.97 ** 0.5)
    for _ in range(300):
        # two doubted tokens kept, then a sure one rejected, then one never judged
        p.observe(4, 2, 0.04, 0.1, [doubted, doubted, sure, 0.05])
    assert cal(doubted) > 0.95
    assert cal(sure) < 0.1
    assert cal(0.05) == pytest.approx(0.05 ** 0.5)   # after the rejection: untouched


def test_keep_drafting_goes_on_while_a_token_pays_the_round_rate() -> None:
    """The stop weighs P(all kept so far) against rate x (draft + extra verify) per token,
    so one doubtful token ends a round that already carries doubt, not a fresh one."""
    p = AdaptivePolicy(16)
    for _ in range(60):   # drafting 10 ms a token, verifying 100 ms + 10 ms per token
        p.observe(4, 4, 0.004 + 0.04, 0.1 + 0.04, None)
    p.calibration.seen = [1.0] * len(p.calibration.seen)
    p.calibration.hits = [0.6] * len(p.calibration.hits)     # every bin: kept 60% of the time
    assert p.choose(16) > 0 and p.state.round_rate > 0

    def pays(i: int) -> bool:  # token i's P(all kept) against what it costs at the round rate
        extra = p.draft.per_token() + p.verify_cost(i + 2) - p.verify_cost(i + 1)
        return 0.6 ** (i + 1) >= p.state.round_rate * extra

    kept = [p.keep_drafting(i, 0.5) for i in range(16)]
    n = kept.index(False)
    assert n >= 1 and all(kept[:n])
    assert [pays(i) for i in range(n + 1)] == [True] * n + [False]
    assert p.keep_drafting(0, 0.5)          # a new round starts from certainty again
    # What a draft node is sent: the same rule as one threshold on P(all kept so far).
    stop = CalibratedStop(p.calibration, p.stop_threshold())
    assert [stop(i, 0.5) for i in range(16)] == kept


def test_calibrated_stop_follows_its_threshold() -> None:
    """CalibratedStop multiplies calibrated chances along a draft: a threshold of 0 never
    stops, one above any chance stops before the first token, and each draft (i = 0)
    starts again from certainty."""
    cal = Calibration()
    cal.seen, cal.hits = [1.0] * len(cal.seen), [0.5] * len(cal.hits)
    assert all(CalibratedStop(cal, 0.0)(i, 0.9) for i in range(64))
    assert not CalibratedStop(cal, 0.51)(0, 0.9)
    stop = CalibratedStop(cal, 0.2)
    assert [stop(i, 0.9) for i in range(4)] == [True, True, False, False]
    assert stop(0, 0.9) and stop.kept == 0.5


def test_alone_a_prompt_read_that_the_request_cannot_repay_keeps_it_plain() -> None:
    """A draft that must first read a long prompt (here 300 tokens at 10 ms each, 3 s)
    pays only if the request is long enough to win it back: the same learnt figures
    draft for a 2000-token reply and not for a 16-token one (throughput.request_rate)."""
    from specwire.policy.costs import PerToken

    def learnt() -> AdaptivePolicy:
        p = AdaptivePolicy(8, state=AdaptiveState(accepted=900.0, rejected=100.0,
                                                  continued=1.0, stopped=0.0))
        for k in range(1, 9):
            p.draft.observe(k, 0.01 * k)
            p.costs.observe(k + 1, 0.1 * (1 + 0.1 * k))
        p.draft.prompt = PerToken(seconds=3.0, tokens=300.0)
        p.start(behind=300)
        return p

    assert learnt().choose(2000) > 0
    assert learnt().choose(16) == 0
    once = learnt()
    once.state.begun = True              # the read is paid: drafting pays again
    assert once.choose(16) > 0
    # it does not probe while only the read stands in the way (a probe would pay it and
    # learn nothing), and does where the acceptance itself looks too low to pay
    for a, probes in ((0.9, False), (0.05, True)):
        p = learnt()
        p.state.accepted, p.state.rejected = 1000.0 * a, 1000.0 * (1 - a)
        ks = []
        for _ in range(200):
            ks.append(p.choose(16))
            p.observe(ks[-1], 0, 0.0 if not ks[-1] else 3.0, 0.1)
            if ks[-1]:
                break
        assert any(ks) is probes, (a, ks)
