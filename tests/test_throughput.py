"""One throughput model: `specwire plan`, the adaptive policy and bench's predictions
give the same numbers for the same inputs."""

from __future__ import annotations

import pytest

from specwire.bench.predict import Rounds, fit_acceptance, predict
from specwire.bench.runner import Config
from specwire.policy import AdaptivePolicy
from specwire.throughput import (
    VERIFY_SLOPE,
    LineFit,
    PlanInputs,
    VerifyCurve,
    draft_line,
    expected_tokens,
    local_rate,
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
    p = AdaptivePolicy(n_max, accepted=1000.0 * a, rejected=1000.0 * (1 - a),
                       continued=1.0, stopped=0.0)
    p.draft = _exact_line([(x, (x + STOP) * T_D) for x in range(1, 9)])
    p.verify = _exact_line([(x, T_S * CURVE.cost(x + 1)) for x in range(0, 9)])
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
    predicted = predict(Config("local", draft_max=k), 1 / T_S, 1 / T_D, rounds, CURVE,
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
    assert AdaptivePolicy(8).verify.guess == verify_line().guess == VERIFY_SLOPE
    line = verify_line()
    for _ in range(5):
        line.add(3, 2.0)          # one size seen: the prior's slope splits it
    c, d = line.coefficients()
    assert d / c == pytest.approx(VERIFY_SLOPE)
    assert draft_line().guess == AdaptivePolicy(8).draft.guess


def test_verify_share_is_what_a_round_adds_to_the_decode() -> None:
    """Alone a round pays the whole decode; with B other tokens, cost(B + n) - cost(B)."""
    assert verify_share(CURVE.cost, 4) == CURVE.cost(4)
    assert verify_share(CURVE.cost, 4, batch=0) == CURVE.cost(4)
    assert verify_share(CURVE.cost, 4, batch=16) == pytest.approx(CURVE.cost(20) - CURVE.cost(16))
    assert verify_share(CURVE.cost, 4, batch=16) == pytest.approx(0.4)
