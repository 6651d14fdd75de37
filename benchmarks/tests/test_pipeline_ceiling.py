"""The modelled pipeline of benchmarks/pipeline_ceiling.py: cases worked by hand, and the
limits it must meet (an instant drafter is the bound; a drafter slower than a plain
step is plain decoding; the oracle matches its closed form)."""

from __future__ import annotations

import random

import pytest

from benchmarks.pipeline_ceiling import (
    Pipeline,
    Schedule,
    Truth,
    free_bound,
    main,
    oracle_closed_form,
    simulate,
)
from specwire.policy.throughput import VerifyCurve, expected_tokens


def linear(slope: float):
    return lambda n: 1.0 + slope * (n - 1)


def truth(wrong: list[bool]) -> Truth:
    return Truth(wrong, [False] * len(wrong))


def test_instant_drafter_by_hand():
    # wrong guess at position 2 only; k = 2; t_v(n) = n. Round 1 keeps 0, 1 and the
    # target's 2 (3 steps); the verdict restarts the drafter at 3, which drafts 3, 4 at
    # once; round 2 keeps them and adds 5 (3 steps): 6 tokens in 6 steps.
    pipe = Pipeline(0.9, linear(1.0), draft=0.0)
    res = simulate(pipe, Schedule("today", k=2), truth([False, False, True, False, False, False]))
    assert (res.tokens, res.steps, res.rounds, res.plain_rounds) == (6, 6.0, 2, 0)


def test_waiting_for_a_token_by_hand():
    # Never wrong, a token every 0.5 steps, k = 1, t_v(2) = 1.5, waiting for 1 token:
    # the first round waits 0.5 and ends at 2.0 with 2 tokens; the drafter stays ahead,
    # so 4 more rounds of 1.5 steps: 10 tokens in 8 steps.
    pipe = Pipeline(1.0, linear(0.5), draft=0.5)
    res = simulate(pipe, Schedule("today", k=1, wait=1), truth([False] * 10))
    assert (res.tokens, res.steps, res.waited, res.plain_rounds) == (10, 8.0, 0.5, 0)
    # Without the wait, the first round is a plain step; the drafter is then ahead, and
    # the last round is plain too (one position left: nothing after it to verify).
    res = simulate(pipe, Schedule("today", k=1), truth([False] * 10))
    assert res.plain_rounds == 2 and res.steps == pytest.approx(1.0 + 4 * 1.5 + 1.0)


def test_a_drafter_slower_than_a_step_is_plain_decoding():
    pipe = Pipeline(0.9, linear(0.2), draft=1.5, rtt=0.04)
    t = Truth.sample(500, 0.9, 0.0, random.Random(1))
    res = simulate(pipe, Schedule("today", k=4, wait=2), t)
    assert res.rounds == res.plain_rounds == 500 and res.rate == 1.0


def test_an_instant_drafter_on_no_link_reaches_the_bound():
    curve = VerifyCurve.parse("1:1,2:1.52,4:1.69,8:2.55,16:3.13")
    pipe = Pipeline(0.85, curve.cost, draft=0.0)
    k, bound = free_bound(pipe, 8)
    assert bound == pytest.approx(expected_tokens(0.85, k) / curve.cost(k + 1))
    tok = steps = 0.0
    for seed in range(4):
        r = simulate(pipe, Schedule("today", k=k), Truth.sample(5000, 0.85, 0.0,
                                                                 random.Random(seed)))
        tok, steps = tok + r.tokens, steps + r.steps
    assert tok / steps / bound == pytest.approx(1.0, abs=0.03)


def test_the_oracle_matches_its_closed_form_and_beats_today():
    # a drafter that limits the oracle: k d exceeds t_v(k + 1) for long drafts
    pipe = Pipeline(0.8, linear(0.1), draft=0.4, rtt=0.0, lookahead=16)
    closed = oracle_closed_form(pipe, 8)
    best_k = max(range(1, 9), key=lambda k: expected_tokens(0.8, k) / max(pipe.verify(k + 1),
                                                                         k * pipe.draft))
    tok = steps = today_tok = today_steps = 0.0
    for seed in range(4):
        rng = random.Random(seed)
        oracle = simulate(pipe, Schedule("oracle", best_k, through=1.0, stops=True),
                          Truth.sample(5000, 0.8, 1.0, rng))
        tok, steps = tok + oracle.tokens, steps + oracle.steps
        today = simulate(pipe, Schedule("today", best_k),
                         Truth.sample(5000, 0.8, 0.0, random.Random(seed)))
        today_tok, today_steps = today_tok + today.tokens, today_steps + today.steps
    assert tok / steps == pytest.approx(closed, rel=0.04)
    assert today_tok / today_steps < 0.9 * tok / steps


def test_cli_rejects_bad_input_in_one_line(capsys):
    assert main(["--acceptance", "1.5"]) == 2
    assert main(["--verify-cost", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("pipeline_ceiling: ") for e in err)


def test_cli_table(capsys):
    assert main(["--draft-cost", "0.3", "-n", "300", "--seeds", "1", "--draft-max", "4"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[0] == "0.3"


def _rate(pipe: Pipeline, sched: Schedule, a: float, seeds: int = 2) -> float:
    tok = steps = 0.0
    for seed in range(seeds):
        r = simulate(pipe, sched, Truth.sample(3000, a, 0.0, random.Random(seed)))
        tok, steps = tok + r.tokens, steps + r.steps
    return tok / steps


def test_the_built_rule_waits_where_it_pays_and_not_where_it_does_not():
    # A GPU-like target (a batch of 9 at 1.2 steps) and a fast drafter: waiting for the
    # fresh branch beats a plain step after each rejection, and the rule finds it.
    gpu = Pipeline(0.85, linear(0.025), draft=0.02, rtt=0.04)
    plain_after = _rate(gpu, Schedule("today", k=8), 0.85)
    assert _rate(gpu, Schedule("today", k=8, rule=True), 0.85) > 1.15 * plain_after
    # A drafter a little faster than the target: what comes within a plain step is too
    # little to pay for waiting, and the rule costs nothing against never waiting.
    slow = Pipeline(0.85, linear(0.2), draft=0.6, rtt=0.04)
    never = _rate(slow, Schedule("today", k=4), 0.85)
    assert _rate(slow, Schedule("today", k=4, rule=True), 0.85) >= 0.98 * never


def test_from_a_bench_run(tmp_path, capsys):
    res = {"calibration": {"draft_tps": 100.0, "plain_tps_overall": 20.0,
                           "verify_cost": [[1, 1.0], [2, 1.5], [4, 1.7], [8, 2.5]]},
           "records": [{"mode": "plain", "label": "plain", "bound": None},
                       {"mode": "remote-pipelined", "label": "rp", "rtt_ms": 2.0,
                        "draft_max": 4, "bound": {"share": 0.7, "acceptance": 0.8}}]}
    (tmp_path / "results.json").write_text(__import__("json").dumps(res))
    assert main(["--from", str(tmp_path), "-n", "300", "--seeds", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split()[0] == "0.2"  # d = 20 / 100
    assert out[-1].startswith("measured (rp): 0.700 of its bound; a = 0.800, d = 0.200")
    (tmp_path / "results.json").write_text("{}")
    assert main(["--from", str(tmp_path)]) == 2
    assert "is not a bench results.json" in capsys.readouterr().err


def test_contention_slows_verification_only_while_the_drafter_drafts():
    t = Truth.sample(2000, 0.85, 0.0, random.Random(3))
    busy = Pipeline(0.85, linear(0.2), draft=0.2, rtt=0.04)
    alone = simulate(busy, Schedule("today", k=4), t).rate
    shared = simulate(Pipeline(0.85, linear(0.2), draft=0.2, rtt=0.04, contention=0.3),
                      Schedule("today", k=4), t).rate
    assert shared < 0.95 * alone
    # the busy share counts tokens drafted: a drafter that finishes none slows nothing
    idle = Pipeline(0.85, linear(0.2), draft=1e9, rtt=0.04, contention=0.3)
    assert simulate(idle, Schedule("today", k=4), t).rate == 1.0
