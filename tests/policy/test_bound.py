"""The free-drafter bound: what a drafter that costs nothing would reach on this target.

Hand-computed cases for plan.free_rate / free_bound, the bench record's `bound`
(acceptance fitted from the rounds, share of the measured rate) and the two places
it is shown: `specwire plan` and the bench table.
"""

from __future__ import annotations

import argparse
import json

import pytest

from specwire.bench import predict, report
from specwire.bench.predict import Rounds
from specwire.bench.runner import PromptRun, RunParams
from specwire.cli.commands import plan as plan_cmd
from specwire.policy.plan import free_bound, plan
from specwire.policy.throughput import PlanInputs, VerifyCurve, free_rate

# a batch of n costs 1 + 0.25 (n - 1) plain steps
STEEP = VerifyCurve(((1, 1.0), (2, 1.25), (9, 3.0)), assumed=False)


def _inputs(a: float, k_max: int = 8, verify: VerifyCurve = STEEP) -> PlanInputs:
    return PlanInputs(target_tps=20.0, draft_tps=1e6, acceptance=a, verify=verify,
                      draft_max=k_max)


def test_free_rate_is_expected_tokens_over_verification_only() -> None:
    """a = 0.5, k = 2: 1 + 0.5 + 0.25 = 1.75 tokens in t_v(3) = 1.5 steps of 50 ms."""
    assert free_rate(_inputs(0.5), 2) == pytest.approx(1.75 / (1.5 * 0.05))
    assert free_rate(_inputs(0.5), 0) == pytest.approx(20.0)       # k = 0: a plain step


def test_free_bound_picks_the_best_k_and_never_drops_below_plain() -> None:
    """a = 0.9 with steep verification: the best k is where E(k)/t_v(k+1) peaks (checked
    by hand over every k); a = 0 makes every draft a loss, so the bound is plain."""
    p = _inputs(0.9)
    rates = {k: free_rate(p, k) for k in range(9)}
    best = max(rates, key=rates.__getitem__)
    b = free_bound(p)
    assert (b.k, b.tokens_per_s) == (best, pytest.approx(rates[best]))
    assert 0 < b.k < 8
    assert b.speedup == pytest.approx(rates[best] / 20.0)
    zero = free_bound(_inputs(0.0))
    assert (zero.k, zero.tokens_per_s, zero.speedup) == (0, pytest.approx(20.0), 1.0)


def test_flat_verification_and_full_acceptance_draft_to_the_cap() -> None:
    """Verification that costs a step at any size, a = 1: k = draft_max, (k + 1) x plain."""
    flat = VerifyCurve(((1, 1.0), (2, 1.0)), assumed=False)
    b = free_bound(_inputs(1.0, k_max=5, verify=flat))
    assert (b.k, b.speedup) == (5, pytest.approx(6.0))


def test_the_bound_caps_every_mode_of_the_plan() -> None:
    """No mode pays less than verification, so none beats the free drafter."""
    p = PlanInputs(target_tps=19.0, draft_tps=60.0, acceptance=0.87, rtt_s=0.002,
                   verify=STEEP, draft_max=8)
    result = plan(p)
    assert result.bound is not None
    for m in result.modes.values():
        assert m.tokens_per_s <= result.bound.tokens_per_s * (1 + 1e-9)


def test_plan_cli_shows_the_bound_and_each_share(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers())
    base = ["plan", "--target-tps", "19", "--draft-tps", "60", "--acceptance", "0.87",
            "--verify-cost", "1:1,2:1.25,9:3", "--draft-max", "8"]
    assert plan_cmd.run(parser.parse_args(base)) == 0
    text = capsys.readouterr().out
    row = next(line for line in text.splitlines() if line.startswith("bound"))
    expected = free_bound(_inputs(0.87))
    assert f"{expected.tokens_per_s * 19 / 20:.2f}" in row
    assert plan_cmd.run(parser.parse_args([*base, "--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bound"]["share"]["plain"] == pytest.approx(1 / out["bound"]["speedup"])


def test_bench_bound_fits_the_acceptance_and_reports_the_share() -> None:
    """10 drafting rounds of 4 tokens keeping 20: a with a + a^2 + a^3 + a^4 = 2 (0.6914);
    the share is the measured rate over the free drafter's."""
    rounds = Rounds(rounds=20, drafting_rounds=10, drafted=40, accepted=20)
    a = predict.fit_acceptance(2.0, 4)
    assert a + a**2 + a**3 + a**4 == pytest.approx(2.0)
    b = predict.bound(RunParams("ngram", 8), 20.0, rounds, STEEP, measured_tps=30.0)
    free = free_bound(_inputs(a))
    assert b["acceptance"] == pytest.approx(a)
    assert b["k"] == free.k and b["tokens_per_s"] == pytest.approx(free.tokens_per_s)
    assert b["share"] == pytest.approx(30.0 / free.tokens_per_s)
    # nothing to bound: plain, no drafting round, no verification curve
    assert predict.bound(RunParams("plain"), 20.0, rounds, STEEP, 20.0) is None
    assert predict.bound(RunParams("ngram", 8), 20.0, Rounds(5, 0, 0, 0), STEEP, 20.0) is None
    assert predict.bound(RunParams("ngram", 8), 20.0, rounds, None, 30.0) is None


def test_bench_bound_takes_the_acceptance_by_maximum_likelihood_when_rejections_are_counted(
) -> None:
    """20 kept tokens and 5 rounds with a refused token: a = 20 / 25, whatever the draft
    lengths; two runs of the same drafter with short and long drafts get the same a, while
    the fit at the mean length moves with the mix."""
    short = Rounds(rounds=20, drafting_rounds=10, drafted=30, accepted=20, rejected=5)
    long = Rounds(rounds=20, drafting_rounds=10, drafted=60, accepted=20, rejected=5)
    b_short = predict.bound(RunParams("remote-pipelined", 8), 20.0, short, STEEP, 30.0)
    b_long = predict.bound(RunParams("remote-pipelined", 8), 20.0, long, STEEP, 30.0)
    assert b_short["acceptance"] == pytest.approx(0.8) == b_long["acceptance"]
    assert b_short["tokens_per_s"] == pytest.approx(free_bound(_inputs(0.8)).tokens_per_s)
    assert b_short["acceptance_fit"] != pytest.approx(b_long["acceptance_fit"], abs=0.02)
    fit_free = free_bound(_inputs(b_long["acceptance_fit"])).tokens_per_s
    assert b_long["share_fit"] == pytest.approx(30.0 / fit_free)


def test_the_bench_table_has_the_bound_columns() -> None:
    run = PromptRun("a", "code", 5, 10, 30.0, 1.0, 333.0, "limit", "x", {})
    rec = report.aggregate(RunParams("ngram", 8), [run], None, False)
    rec["bound"] = {"tokens_per_s": 50.0, "share": 0.6}
    table = report.render_table([rec])
    head, row = table.splitlines()[0], table.splitlines()[2]
    assert "bound" in head and "of%" in head
    assert "50.00" in row and " 60 " in row
