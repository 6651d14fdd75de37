"""plan's second box: a target split over two boxes by llama.cpp's RPC backend against a
draft node, priced by the link model of specwire/policy/rpc.py (worked by hand here)."""

from __future__ import annotations

import json

import pytest

from specwire.cli.args import CliError
from specwire.cli.commands import plan as plan_cmd
from specwire.cli.main import build_parser
from specwire.policy import rpc
from specwire.policy.throughput import PlanInputs, VerifyCurve

P = PlanInputs(target_tps=20.0, draft_tps=200.0, acceptance=0.7, rtt_s=0.5e-3,
               bandwidth_bps=1e9, verify=VerifyCurve(((1, 1.0), (8, 1.35)), assumed=False))


def test_the_link_per_decode_by_hand() -> None:
    link = rpc.RpcLink(n_embd=4096, round_trips=2, act_bytes=4, graph_bytes=1000)
    assert link.bytes(1) == 2 * 4096 * 4 + 1000
    assert link.bytes(8) == 2 * 8 * 4096 * 4 + 1000
    assert link.link_s(P, 1) == pytest.approx(2 * 0.5e-3 + 8 * 33768 / 1e9)
    # a decode of 8: 1.35 plain steps of compute plus the link
    assert rpc.split_step_s(P, link, 8) == pytest.approx(1.35 / 20 + 1e-3 + 8 * 263144 / 1e9)


def test_a_free_link_splits_for_nothing() -> None:
    """No RTT, no bytes cost: the split target is the target (layers run one box after
    the other, so a split buys memory, not speed)."""
    free = PlanInputs(target_tps=20.0, draft_tps=200.0, acceptance=0.7, verify=P.verify)
    split = rpc.split_inputs(free, rpc.RpcLink(n_embd=8192))
    assert split.target_tps == pytest.approx(20.0)
    for n in (1, 2, 8, 17):
        assert split.verify.cost(n) == pytest.approx(free.verify.cost(n))


def test_the_split_is_slower_by_its_link() -> None:
    link = rpc.RpcLink(n_embd=8192)
    split = rpc.split_inputs(P, link)
    assert 1 / split.target_tps == pytest.approx(1 / 20 + link.link_s(P, 1))
    s = rpc.compare(P, link)
    assert s.split_tps == pytest.approx(split.target_tps)
    assert s.split_tps < s.one_box_tps == 20.0
    assert s.draft_node[2] > 20.0 > s.split_tps        # a good draft pays, a split never
    assert "a split never speeds one stream up" in s.verdict()


def test_a_batch_shares_the_waits_but_not_the_activations() -> None:
    waits = PlanInputs(target_tps=20.0, draft_tps=200.0, acceptance=0.7, rtt_s=1e-3,
                       verify=P.verify)               # no bandwidth cost: waits only
    assert rpc.split_inputs(waits, rpc.RpcLink(8192)).verify.cost(8) < P.verify.cost(8)
    wide = PlanInputs(target_tps=20.0, draft_tps=200.0, acceptance=0.7, rtt_s=0.0,
                      bandwidth_bps=1e8, verify=P.verify)   # 100 Mbit/s, no waits
    assert rpc.split_inputs(wide, rpc.RpcLink(8192)).verify.cost(8) > P.verify.cost(8)


def test_a_useless_draft_gives_the_second_box_nothing() -> None:
    """Acceptance 0: the draft node leaves the target at its plain speed (it never pays
    less: a pipelined draft is not waited for), the split below it."""
    p = PlanInputs(target_tps=20.0, draft_tps=50.0, acceptance=0.0, rtt_s=2e-3,
                   bandwidth_bps=1e9)
    s = rpc.compare(p, rpc.RpcLink(n_embd=1024))
    assert s.draft_node[2] == pytest.approx(20.0) and s.split_tps < 20.0


def _args(*argv: str):
    return build_parser().parse_args(["plan", "--target-tps", "20", "--draft-tps", "200",
                                      "--acceptance", "0.7", "--rtt", "0.5", *argv])


def test_plan_prints_the_second_box_with_its_figures(capsys) -> None:
    a = _args("--rpc-embd", "6144", "--json")
    assert plan_cmd.run(a) == 0
    out = json.loads(capsys.readouterr().out)["second_box"]
    assert out["n_embd"] == 6144 and out["split_bytes"] == 2 * 6144 * 4
    assert out["split_tps"] < 20 and out["verdict"]
    assert plan_cmd.run(_args("--rpc-embd", "6144")) == 0
    text = capsys.readouterr().out
    assert "split target (llama.cpp --rpc), alone" in text and "not a measurement" in text
    assert plan_cmd.run(_args()) == 0 and "second box" not in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "needle"), [
    (["--rpc-embd", "0"], "--rpc-embd: must be >= 1"),
    (["--rpc-embd", "x"], "--rpc-embd: not an integer"),
    (["--rpc-embd", "64", "--rpc-round-trips", "-1"], "--rpc-round-trips: must be >= 0"),
    (["--rpc-embd", "64", "--rpc-round-trips", "inf"], "--rpc-round-trips: must be >= 0"),
    (["--rpc-embd", "64", "--rpc-act-bytes", "0"], "--rpc-act-bytes: must be >= 1"),
    (["--rpc-embd", "64", "--rpc-graph-bytes", "-5"], "--rpc-graph-bytes: must be >= 0"),
])
def test_bad_rpc_flags_name_themselves(argv, needle: str) -> None:
    with pytest.raises(CliError, match=needle):
        plan_cmd.run(_args(*argv))
