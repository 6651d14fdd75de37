"""One box or two: `plan`'s comparison of speculation in the target's process with a draft
node, its verdict, the acceptance's range, and the CLI that prints them side by side."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest

from specwire.cli.commands import plan as plan_cmd
from specwire.policy import boxes
from specwire.policy.plan import best_k
from specwire.policy.throughput import PlanInputs, VerifyCurve, local_rate, pipelined_rate

MOE = VerifyCurve.parse("1:1,8:3")
SEED = PlanInputs(target_tps=6.6, draft_tps=30.0, acceptance=0.74, verify=MOE, rtt_s=0.001)


def test_each_side_is_its_best_mode_and_the_gain_their_ratio() -> None:
    node = replace(SEED, draft_tps=100.0)
    got = boxes.compare(SEED, node)
    k, rate = best_k(local_rate, SEED)
    assert (got.one.mode, got.one.k, got.one.tokens_per_s) == ("local", k, rate)
    k2, rate2 = best_k(pipelined_rate, node)
    assert (got.two.mode, got.two.k) == ("pipelined", k2)
    assert got.two.tokens_per_s == pytest.approx(rate2)
    assert got.gain[1] == pytest.approx(rate2 / rate - 1)
    assert got.verdict().startswith("a draft node pays, by +")


def test_a_long_prompt_read_makes_one_box_plain() -> None:
    """A 300-token prompt, read by a draft that shares the target's box, costs more than
    a 64-token reply wins back: one box runs plainly (the adaptive policy does so too)."""
    req = replace(SEED, prompt_tokens=300, reply_tokens=64, target_prompt_tps=270.0)
    assert boxes.one_box(SEED).mode == "local"
    assert boxes.one_box(req) == boxes.Side("plain", 0, 6.6)


def test_a_node_no_faster_than_the_box_over_a_slow_link_does_not_pay() -> None:
    slow = replace(SEED, acceptance=0.3, rtt_s=0.5)
    got = boxes.compare(slow, slow)
    assert got.two.mode == "plain" and got.gain[1] <= 0
    assert "does not pay" in got.verdict()


def test_the_range_comes_from_the_counts_and_can_hold_both_answers() -> None:
    lo, hi = boxes.acceptance_range(810, 1093)
    assert lo < 810 / 1093 < hi and hi - lo < 0.05
    lo2, hi2 = boxes.acceptance_range(8, 11)
    assert hi2 - lo2 > 3 * (hi - lo)                     # fewer tokens, wider
    assert boxes.acceptance_range(0, 0) == (0.0, 1.0)
    node = replace(SEED, draft_tps=100.0)
    sure = boxes.compare(SEED, node, (lo, hi), (lo, hi))
    assert sure.gain[0] < sure.gain[1] < sure.gain[2]   # more acceptance, more gain
    assert "range holds both" not in sure.verdict()
    # a node a little slower than the box's draft (pipelining makes up for it): the
    # estimate says even, the top of a wide range says it pays
    unsure = boxes.compare(SEED, replace(SEED, draft_tps=12.0), (0.6, 0.88), (0.6, 0.88))
    assert "even" in unsure.verdict() and "range holds both" in unsure.verdict(), unsure


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    plan_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


def test_cli_prints_both_sides_and_the_verdict(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--target-tps", "6.6", "--draft-tps", "30", "--node-draft-tps", "100",
            "--acceptance", "810/1093", "--verify-cost", "1:1,8:3", "--prompt-tokens", "285",
            "--reply-tokens", "64", "--target-prompt-tps", "270"]
    assert plan_cmd.run(_args(*argv)) == 0
    text = capsys.readouterr().out
    for words in ("one box    plain", "two boxes  pipelined", "verdict: a draft node pays",
                  "90% range", "285 prompt + 64 reply"):
        assert words in text, text
    assert plan_cmd.run(_args(*argv, "--json")) == 0
    out = json.loads(capsys.readouterr().out)["boxes"]
    assert out["one_box"]["mode"] == "plain" and out["two_boxes"]["mode"] == "pipelined"
    assert out["gain"][0] < out["gain"][1] < out["gain"][2]


def test_cli_takes_the_figures_from_a_bench_run(tmp_path, capsys) -> None:
    results = {"calibration": {"plain_tps_overall": 6.6, "draft_tps": 30.0,
                               "verify_cost": [[1, 1.0], [8, 3.0]]},
               "records": [{"mode": "plain", "draft_n": 0, "prompts": [
                               {"prompt_tokens": 300, "prompt_ms": 1000.0, "generated": 64}]},
                           {"mode": "remote-pipelined", "draft_n": 10, "rtt_ms": 2.0,
                            "draft_n_accepted": 5, "prompts": []},
                           {"mode": "local", "draft_n": 1100, "draft_n_accepted": 750,
                            "rejected_rounds": 250,
                            "prompts": [{"prompt_tokens": 100, "generated": 64},
                                        {"prompt_tokens": 200, "generated": 64}]}]}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert plan_cmd.run(_args("--bench", str(path), "--node-draft-tps", "100",
                              "--json")) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["inputs"]["target_tps"] == 6.6 and out["inputs"]["acceptance"] == 0.75
    assert out["inputs"]["verify_cost"] == [[1, 1.0], [8, 3.0]]
    assert out["inputs"]["rtt_s"] == pytest.approx(0.002)
    assert out["boxes"]["acceptance"][0] < 0.75 < out["boxes"]["acceptance"][2]
    # the node's own acceptance (a pipelined run's, 5 kept of 10 judged) prices two boxes
    node = PlanInputs(6.6, 100.0, 0.5, rtt_s=0.002, bandwidth_bps=1e9, verify=MOE,
                      prompt_tokens=150, reply_tokens=64, target_prompt_tps=300.0)
    assert out["boxes"]["two_boxes"]["tokens_per_s"] == pytest.approx(
        boxes.two_boxes(node).tokens_per_s)
    assert plan_cmd.run(_args("--bench", str(path), "--acceptance", "0.5", "--json")) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["acceptance"] == 0.5
    with pytest.raises(plan_cmd.CliError, match="--bench"):
        plan_cmd.run(_args("--bench", str(tmp_path / "missing.json")))
