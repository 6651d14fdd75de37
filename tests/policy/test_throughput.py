"""One throughput model: `specwire plan`, the adaptive policy and bench's predictions
give the same numbers for the same inputs, and the policy prices a round by what it
adds to a shared target decode."""

from __future__ import annotations

from dataclasses import replace

import pytest

from specwire.bench.predict import Rounds, fit_acceptance, predict
from specwire.bench.runner import RunParams
from specwire.policy.adaptive import AdaptivePolicy, AdaptiveState, FixedPolicy
from specwire.policy.throughput import (
    VERIFY_SLOPE,
    LineFit,
    PlanInputs,
    VerifyCurve,
    draft_line,
    expected_tokens,
    local_rate,
    pipelined_rate,
    sync_rate,
    verify_line,
    verify_share,
)

T_S, T_D, STOP = 0.05, 0.005, 0.25        # a plain step, a draft token, stop evaluations
CURVE = VerifyCurve.parse("1:1,9:1.8")    # linear: 10% of a step per extra token


def _exact_line(points: list[tuple[float, float]]) -> LineFit:
    """A line fitted to exact points with no prior, as a policy would learn it."""
    f = LineFit(0.1, guess=1.0, prior=0.0)
    for x, y in points * 3:
        f.add(x, y)
    return f


def _policy(a: float, n_max: int = 8) -> AdaptivePolicy:
    """An adaptive policy that has learnt acceptance a, a drafter that never stops early,
    the drafter's cost (k + STOP) t_d and CURVE's verification."""
    p = AdaptivePolicy(n_max, state=AdaptiveState(accepted=1000.0 * a,
                                                  rejected=1000.0 * (1 - a),
                                                  continued=1.0, stopped=0.0))
    p.draft.line = _exact_line([(x, (x + STOP) * T_D) for x in range(1, 9)])
    p.costs.line = _exact_line([(x, T_S * CURVE.cost(x + 1)) for x in range(0, 9)])
    return p


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("kept", [0.4, 1.3, 2.5])
def test_plan_policy_and_predict_agree(k: int, kept: float) -> None:
    """A local draft model asked for k tokens, keeping `kept` a round: the plan's local
    rate, the policy's rate for k and bench's prediction from the counted rounds are
    one figure."""
    kept = min(kept, k * 0.9)
    a = fit_acceptance(kept, k)
    inputs = PlanInputs(target_tps=1 / T_S, draft_tps=1 / T_D, acceptance=a, verify=CURVE,
                        draft_max=k, stop_evals=STOP)
    planned = local_rate(inputs, k)
    policy = _policy(a)
    assert policy.rate(k) == pytest.approx(planned, rel=1e-9)
    rounds = Rounds(rounds=400, drafting_rounds=400, drafted=400 * k,
                    accepted=round(400 * kept), short=round(400 * STOP))
    predicted = predict(RunParams("local", draft_max=k), 1 / T_S, 1 / T_D, rounds, CURVE,
                        measured_tps=planned)
    assert predicted is not None
    assert predicted["predicted_tps"] == pytest.approx(planned, rel=1e-6)
    assert planned == pytest.approx(expected_tokens(a, k) / (
        (k + STOP) * T_D + T_S * CURVE.cost(k + 1)), rel=1e-12)


def test_one_set_of_priors() -> None:
    """The plan's assumed curve, the policy's curve before it has timed anything and the
    online lines' prior slope are the same VERIFY_SLOPE."""
    assumed = VerifyCurve()
    assert assumed.cost(5) == pytest.approx(1 + 4 * VERIFY_SLOPE)
    assert AdaptivePolicy(8).verify_cost(5) == pytest.approx(assumed.cost(5))
    assert AdaptivePolicy(8).costs.line.guess == verify_line().guess == VERIFY_SLOPE
    line = verify_line()
    for _ in range(5):
        line.add(3, 2.0)          # one size seen: the prior's slope splits it
    c, d = line.coefficients()
    assert d / c == pytest.approx(VERIFY_SLOPE)
    assert draft_line().guess == AdaptivePolicy(8).draft.line.guess


def test_verify_share_is_what_a_round_adds_to_the_decode() -> None:
    """Alone a round pays the whole decode; with B other tokens, cost(B + n) - cost(B)."""
    assert verify_share(CURVE.cost, 4) == CURVE.cost(4)
    assert verify_share(CURVE.cost, 4, batch=0) == CURVE.cost(4)
    assert verify_share(CURVE.cost, 4, batch=16) == pytest.approx(CURVE.cost(20) - CURVE.cost(16))
    assert verify_share(CURVE.cost, 4, batch=16) == pytest.approx(0.4)


# --------------------------------------------------------------------------- batch-aware


def _batch_policy() -> AdaptivePolicy:
    """A target whose decode costs 10 ms to read the weights plus 1 ms a token; a drafter
    at 0.5 ms a round and 0.5 ms a token, kept at a = 0.6; past the early rounds."""
    p = AdaptivePolicy(8, state=AdaptiveState(accepted=600.0, rejected=400.0, continued=1.0,
                                              stopped=0.0))
    p.draft.line = _exact_line([(x, 0.0005 + 0.0005 * x) for x in range(1, 9)])
    p.costs.line = _exact_line([(x, 0.010 + 0.001 * (x + 1)) for x in range(0, 40, 3)])
    p.state.asked_rounds = p.params.settle
    return p


def test_batch_tokens_zero_is_todays_choice() -> None:
    """The keyword's default changes nothing: same k and same round rate, round after
    round, as a policy asked without it."""
    a, b = _batch_policy(), _batch_policy()
    for i in range(40):
        limit = 1 + i % 8
        assert a.choose(limit) == b.choose(limit, batch_tokens=0)
        assert a.state.round_rate == b.state.round_rate
        a.observe(a.state.k, a.state.k // 2, 0.002, 0.013)
        b.observe(b.state.k, b.state.k // 2, 0.002, 0.013)


def test_a_big_batch_makes_drafting_stop_where_it_stops_paying() -> None:
    """Alone, a round pays the 10 ms weight read, and a draft spreads it over ~2 tokens;
    in a decode already carrying 32 tokens the read is paid anyway, and a draft's 2 ms of
    drafting, which holds up the whole step, no longer earns its tokens: the step's rate
    (its tokens over its time) is best without it."""
    p = _batch_policy()
    alone = p.choose(8)
    assert alone >= 2
    shared = p.choose(8, batch_tokens=32)
    assert shared == 0
    assert p.rate(0, 32) == pytest.approx(33 / (0.010 + 0.001 * 33), rel=1e-6)
    assert p.rate(3, 32) == pytest.approx(
        (expected_tokens(0.6, 3) + 32) / (0.0005 + 0.0005 * 3 + 0.010 + 0.001 * 36), rel=1e-6)
    assert p.rate(3, 0) == pytest.approx(
        expected_tokens(0.6, 3) / (0.0005 + 0.0005 * 3 + 0.010 + 0.001 * 4), rel=1e-6)


class _Curved(AdaptivePolicy):
    """A policy that knows a curved verification cost: flat to 8 tokens, then steep."""

    CURVE = VerifyCurve.parse("1:1,8:1.2,16:2.4,64:12")

    def verify_cost(self, n: float) -> float:
        return 0.01 * self.CURVE.cost(n)


def test_drafting_shrinks_as_the_batch_grows() -> None:
    """With a verification that turns compute-bound (each token dearer past 8), the chosen
    k never grows with the batch and ends at 0."""
    p = _Curved(8, state=AdaptiveState(accepted=800.0, rejected=200.0, continued=1.0,
                                       stopped=0.0))
    p.draft.line = _exact_line([(x, 0.0002 * x) for x in range(1, 9)])
    p.state.asked_rounds = p.params.settle
    ks = [p.choose(8, batch_tokens=b) for b in (0, 4, 8, 16, 32, 63)]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] > 0 and ks[-1] == 0


def test_fixed_policy_ignores_the_batch() -> None:
    assert FixedPolicy(6).choose(8, batch_tokens=100) == 6
    assert FixedPolicy(6).choose(4, batch_tokens=0) == 4


def test_a_request_pays_for_its_drafts_prompt_read() -> None:
    """The draft reads a request's prompt before its first draft: in this process on the
    decoding's time; a draft node while the target reads its own (only the excess is
    late); a pipelined target decodes plainly meanwhile. A steady run (no prompt, or no
    reply length) is priced as before. A pipelined request's first round is a plain step
    however early the draft is: the target's first decode starts as its prompt ends."""
    base = PlanInputs(target_tps=1 / T_S, draft_tps=1 / T_D, acceptance=0.8, verify=CURVE)
    req = replace(base, prompt_tokens=801, reply_tokens=64, target_prompt_tps=4000.0)
    read = T_D * CURVE.cost(801)             # along the curve's shape: 81 draft tokens
    assert req.draft_read_s(801) == pytest.approx(read)
    steady = local_rate(base, 4)
    assert local_rate(req, 4) == pytest.approx(64 / (64 / steady + read))
    late = read - 801 / 4000
    assert late > 0.1
    assert sync_rate(req, 4) == pytest.approx(64 / (64 / sync_rate(base, 4) + late))
    pipe = pipelined_rate(base, 4)
    plain = min(64, 1 + late / T_S)
    assert pipelined_rate(req, 4) == pytest.approx(
        64 / (64 / pipe + plain * T_S - plain / pipe))
    early = replace(req, target_prompt_tps=100.0)     # the draft done reading first
    assert early.prompt_lag_s(True) == 0.0
    assert pipelined_rate(early, 4) == pytest.approx(64 / (64 / pipe + T_S - 1 / pipe))
    assert local_rate(replace(req, reply_tokens=0), 4) == steady
    assert local_rate(req, 0) == 1 / T_S
    fast = replace(req, draft_prompt_tps=2000.0)
    assert fast.draft_read_s(801) == pytest.approx(T_D + 800 / 2000)
    assert fast.catch_up_s(10) == pytest.approx(10 / 2000)
