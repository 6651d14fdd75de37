"""`specwire bench` and `specwire plan --measure`.

Fast tests cover the parts whose mistakes would silently skew a benchmark:
prompt loading (a bad line names FILE:LINE), the aggregation math (medians,
speedups paired by prompt id, the time split, bytes per token), the token
invariance check, the plan prediction and the plots. Tests marked slow run the
real bundled models: one small local end-to-end run (plain, local, ngram) and
one remote run through a draft node subprocess and the link emulator.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from specwire.bench import plots, predict, prompts, report
from specwire.bench.runner import PromptRun, RunParams, tokens_digest
from specwire.bench.sweep import SweepSettings, configurations
from specwire.cli.args import CliError
from specwire.cli.commands import bench as bench_cmd
from specwire.cli.commands import plan as plan_cmd
from specwire.config import ConfigError
from specwire.engine.stats import counter_delta
from specwire.policy.throughput import VerifyCurve, expected_tokens, local_rate


def _parse(cmd_module, argv: list[str]) -> argparse.Namespace:
    """Parse one sub-command without specwire.cli.main (which imports every command)."""
    p = argparse.ArgumentParser()
    cmd_module.register(p.add_subparsers(dest="command"))
    return p.parse_args(argv)


# --------------------------------------------------------------------------- prompts


def _write(tmp_path: Path, lines: list[str], name: str = "set.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_prompts_load_text_chat_and_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, [
        '{"id": "a", "category": "code", "prompt": "def f():", "max_tokens": 32}',
        "",
        "# a comment",
        '{"messages": [{"role": "user", "content": "Hi"}]}',
    ])
    ps = prompts.load_file(path)
    assert [p.id for p in ps] == ["a", "set-4"]
    assert ps[0].text == "def f():" and ps[0].max_tokens == 32 and not ps[0].is_chat
    assert ps[1].is_chat and ps[1].messages[0]["content"] == "Hi"
    assert ps[1].category == "set" and ps[1].max_tokens is None
    assert ps[1].source == f"{path}:4"


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"', "not valid JSON"),
    ('["prompt"]', "expected a JSON object"),
    ('{"id": "x"}', 'exactly one of "prompt" and "messages"'),
    ('{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}', "exactly one of"),
    ('{"prompt": ""}', "non-empty string"),
    ('{"prompt": "x", "max_tokens": 0}', "positive integer"),
    ('{"prompt": "x", "max_tokens": true}', "positive integer"),
    ('{"prompt": "x", "temperature": 1}', "unknown key(s) temperature"),
    ('{"messages": [{"role": "wizard", "content": "y"}]}', "messages[0].role"),
    ('{"prompt": "x", "category": 3}', '"category" must be a non-empty string'),
])
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, ['{"prompt": "fine"}', line])
    with pytest.raises(prompts.PromptError) as e:
        prompts.load_file(path)
    assert str(e.value).startswith(f"{path}:2: ")
    assert message in str(e.value)


def test_missing_empty_and_duplicate(tmp_path: Path) -> None:
    with pytest.raises(prompts.PromptError, match="no such prompt file.*shipped sets"):
        prompts.resolve("cod")
    empty = _write(tmp_path, ["", "# nothing"], "empty.jsonl")
    with pytest.raises(prompts.PromptError, match="no prompts"):
        prompts.load_file(empty)
    dup = _write(tmp_path, ['{"id": "a", "prompt": "x"}', '{"id": "a", "prompt": "y"}'])
    with pytest.raises(prompts.PromptError, match=r"set.jsonl:2: id 'a' already used at .*:1"):
        prompts.resolve(str(dup))


def test_shipped_sets_and_comma_lists_with_limit() -> None:
    ps = prompts.resolve("code, qa", limit=2)
    assert [p.category for p in ps] == ["code", "code", "qa", "qa"]
    assert len(prompts.resolve("prose")) == len(prompts.load_file(prompts.shipped_path("prose")))


# --------------------------------------------------------------------------- aggregation


def _run(pid: str, tps: float, *, cat: str = "code", sha: str = "s", gen: int = 10,
         drafted: int = 0, accepted: int = 0, hist: list[int] | None = None,
         by_pos: list[list[int]] | None = None, draft_ms: float = 0.0, verify_ms: float = 0.0,
         rounds: int = 0, link: tuple[int, int] = (0, 0), drafter: dict | None = None
         ) -> PromptRun:
    return PromptRun(
        id=pid, category=cat, prompt_tokens=5, generated=gen, tokens_per_s=tps, prompt_ms=1.0,
        predicted_ms=1000.0 * gen / tps, stop_type="limit", tokens_sha=sha,
        stats={"draft_n": drafted, "draft_n_accepted": accepted, "accepted_hist": hist or [],
               "by_position": by_pos or [], "draft_ms": draft_ms, "verify_ms": verify_ms,
               "rounds": rounds, "drafter": drafter or {}},
        link_bytes_up=link[0], link_bytes_down=link[1])


def test_spread_percentiles() -> None:
    s = report.spread([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
    assert s["median"] == 6 and s["p10"] == 2 and s["p90"] == 10
    assert s["q1"] == 3.5 and s["q3"] == 8.5 and s["iqr"] == 5
    assert report.spread([])["median"] is None


def test_speedup_pairs_prompts_by_id_not_by_order() -> None:
    plain = [_run("a", 10), _run("b", 20), _run("c", 40)]
    spec = [_run("c", 40), _run("a", 30), _run("b", 20)]       # shuffled
    assert sorted(report.paired_speedups(spec, plain)) == [1.0, 1.0, 3.0]
    s = report.speedup(spec, plain)
    assert s["paired_median"] == 1.0
    assert s["ratio_of_medians"] == pytest.approx(30 / 20)
    assert report.speedup(spec, None)["ratio_of_medians"] is None


def test_token_match_flags_a_mismatch() -> None:
    plain = [_run("a", 1, sha="x"), _run("b", 1, sha="y")]
    assert report.token_match([_run("a", 2, sha="x"), _run("b", 2, sha="y")], plain, True) == (
        True, [])
    assert report.token_match([_run("a", 2, sha="x"), _run("b", 2, sha="z")], plain, True) == (
        False, ["b"])
    assert report.token_match(plain, plain, lossless=False) == (None, [])


def test_aggregate_record() -> None:
    cfg = RunParams("remote-sync", 4, "fixed", rtt_s=0.010)
    plain = [_run("a", 10, sha="1"), _run("b", 10, sha="2", cat="qa")]
    runs = [
        _run("a", 20, sha="1", drafted=8, accepted=6, hist=[0, 1, 0, 1], rounds=4,
             by_pos=[[2, 2], [2, 2], [2, 1], [2, 1]], draft_ms=100.0, verify_ms=300.0,
             link=(300, 500), drafter={"bytes_up": 200.0, "bytes_down": 400.0,
                                        "bytes_open": 80.0, "tokens_received": 10.0}),
        _run("b", 15, sha="X", cat="qa", drafted=4, accepted=1, hist=[1, 1], rounds=3,
             by_pos=[[2, 1], [1, 0]], draft_ms=10.0, verify_ms=500.0, link=(100, 100)),
    ]
    r = report.aggregate(cfg, runs, plain, lossless=True)
    assert r["mode"] == "remote-sync" and r["rtt_ms"] == pytest.approx(10.0)
    assert r["acceptance"] == pytest.approx(7 / 12)
    assert r["accepted_hist"] == [1, 2, 0, 1]
    assert r["mean_accepted"] == pytest.approx((1 * 2 + 3 * 1) / 4)
    assert [p["drafted"] for p in r["by_position"]] == [4, 3, 2, 2]
    assert r["by_position"][1]["rate"] == pytest.approx(2 / 3)
    assert r["speedup"]["paired_median"] == pytest.approx(1.75)
    assert r["tokens_match_plain"] is False and r["mismatched_prompts"] == ["b"]
    # network: at most one round trip per round, never more than the wait itself
    t = r["time"]["ms"]
    assert t["network"] == pytest.approx(40.0 + 10.0)
    assert t["draft"] == pytest.approx(60.0)
    assert t["verify"] == pytest.approx(800.0)
    assert t["total"] == pytest.approx(500.0 + 1000.0 * 10 / 15)
    assert t["overhead"] == pytest.approx(t["total"] - 60.0 - 50.0 - 800.0)
    assert sum(r["time"]["fraction"].values()) == pytest.approx(1.0)
    assert r["bytes"]["link_per_token"] == pytest.approx(1000 / 20)
    assert r["bytes"]["drafter_per_token"] == pytest.approx(600 / 20)
    assert r["bytes"]["drafter_per_drafted_token"] == pytest.approx(600 / 10)
    assert r["bytes"]["drafter_per_drafted_token_after_open"] == pytest.approx(520 / 10)
    assert r["by_category"]["qa"]["speedup"]["paired_median"] == pytest.approx(1.5)
    assert report.warnings([r]) and "b" in report.warnings([r])[0]
    table = report.render_table([r])
    assert "remote-sync k=4 rtt=10ms" in table and "NO" in table
    # as llama-spec-bench prints it: 4 draft rounds kept 7 tokens, plus their own 4
    assert r["drafting_rounds"] == 4 and r["rounds"] == 7
    assert r["mean_accepted_length"] == pytest.approx((7 + 4) / 4)
    spec = report.render_speculation([r]).splitlines()
    assert spec[0].split()[:8] == ["configuration", "rounds", "drafts", "drafted", "accepted",
                                   "rate", "mean", "len"]
    assert spec[2].split()[-14:] == ["7", "4", "12", "7", "58.3%", "2.75",
                                     "75", "67", "50", "50", "-", "-", "-", "-"]


def test_adaptive_against_best_fixed() -> None:
    """Set rate = all tokens over all time (a long prompt weighs more than a median
    would give it); paired = median per-prompt ratio against that best fixed length."""
    plain = [_run("a", 10), _run("b", 10, gen=30)]

    def rec(k: int, policy: str, a: float, b: float) -> dict:
        runs = [_run("a", a), _run("b", b, gen=30)]
        return report.aggregate(RunParams("local", k, policy), runs, plain, True)

    recs = [rec(4, "fixed", 20, 10), rec(8, "fixed", 10, 15), rec(8, "adaptive", 12, 15)]
    [row] = report.adaptive_vs_fixed(recs)
    # set rates: k=4 40 tokens in 0.5 + 3 s; k=8 in 1 + 2 s; adaptive in 10/12 + 2 s
    assert row["best_fixed_k"] == 8 and row["best_fixed_tps"] == pytest.approx(40 / 3)
    assert row["ratio"] == pytest.approx((40 / (10 / 12 + 2)) / (40 / 3))
    assert row["paired"] == pytest.approx((12 / 10 + 15 / 15) / 2)
    # the bootstrap resamples prompts: here only {a}, {b} or {a, b} rates can come out
    lo, hi = row["interval"]
    only_a, only_b = 12 / 10, 15 / 15
    assert min(only_a, only_b) <= lo <= row["ratio"] <= hi <= max(only_a, only_b)


def test_ratio_interval_is_exact_when_every_prompt_agrees() -> None:
    """A record 10% faster on every prompt: every resample gives 1.1, so does the interval."""
    plain = [_run(x, 10) for x in "abcd"]
    fast = report.aggregate(RunParams("local", 8, "adaptive"),
                            [_run(x, 11) for x in "abcd"], plain, True)
    slow = report.aggregate(RunParams("local", 8), plain, plain, True)
    assert report.ratio_interval(fast, slow, "code") == pytest.approx([1.1, 1.1])
    assert report.ratio_interval(fast, slow, "prose") is None  # no prompt in that set


def test_counter_delta_and_digest() -> None:
    assert counter_delta({"bytes_up": 10.0}, {"bytes_up": 25.0, "wait_ms": 3.0}) == {
        "bytes_up": 15.0, "wait_ms": 3.0}
    assert tokens_digest([1, 2, 3]) == tokens_digest([1, 2, 3]) != tokens_digest([1, 23])


# --------------------------------------------------------------------------- prediction


def test_a_records_run_params_read_back_as_run() -> None:
    for cfg in (RunParams("plain"), RunParams("local", 8, "adaptive"),
                RunParams("remote-pipelined", 4, "fixed", 0.0025, 1e8)):
        assert RunParams.from_dict(cfg.to_dict()) == cfg


def test_fit_acceptance_inverts_expected_tokens() -> None:
    for a in (0.1, 0.5, 0.9):
        kept = expected_tokens(a, 5) - 1
        assert predict.fit_acceptance(kept, 5) == pytest.approx(a, abs=1e-9)
    assert predict.fit_acceptance(9.0, 4) == 1.0
    assert predict.fit_acceptance(0.0, 4) == 0.0


def test_prediction_plain_local_and_mixture() -> None:
    curve = VerifyCurve(((1, 1.0), (4, 1.3)), assumed=False)
    plain = predict.predict(RunParams("plain"), 10.0, None, predict.Rounds(0, 0, 0, 0), None, 12.5)
    assert plain["predicted_tps"] == 10.0 and plain["error_pct"] == pytest.approx(-20.0)
    # every round drafts 3 tokens and keeps all: the plan's local rate at k=3, a=1
    rounds = predict.Rounds(rounds=10, drafting_rounds=10, drafted=30, accepted=30)
    got = predict.predict(RunParams("local", 8), 10.0, 50.0, rounds, curve, 20.0)
    assert got["k"] == 3 and got["inputs"]["acceptance"] == 1.0
    from specwire.policy.throughput import PlanInputs
    expect = local_rate(PlanInputs(10.0, 50.0, 1.0, verify=curve), 3)
    assert got["predicted_tps"] == pytest.approx(expect)
    # half the rounds draft nothing: plain steps that still paid one draft step for asking
    half = predict.Rounds(rounds=20, drafting_rounds=10, drafted=30, accepted=30)
    mixed = predict.predict(RunParams("local", 8), 10.0, 50.0, half, curve, 20.0)
    empty_s = 0.1 + 0.02
    assert mixed["predicted_tps"] == pytest.approx((10 * 4 + 10) / (10 * 4 / expect + 10 * empty_s))
    assert mixed["drafting_share"] == 0.5


# --------------------------------------------------------------------------- plots, CLI


@pytest.mark.slow
def test_plots_are_written(tmp_path: Path) -> None:
    plain = [_run("a", 10)]
    recs = [report.aggregate(RunParams("plain"), plain, plain, True)]
    for k in (2, 4):
        for rtt in (0.001, 0.01):
            recs.append(report.aggregate(
                RunParams("remote-sync", k, rtt_s=rtt), [_run("a", 10 + k - 100 * rtt, drafted=4,
                                                          accepted=2, by_pos=[[2, 1], [2, 1]],
                                                          hist=[0, 2])], plain, True))
    recs.append(report.aggregate(RunParams("local", 4, "adaptive"), [_run("a", 13)], plain, True))
    paths = plots.write_all(recs, tmp_path / "p")
    assert [p.name for p in paths] == list(plots.FILES)
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no drafting at all: the files are still there (with a note)
    paths = plots.write_all(recs[:1], tmp_path / "q")
    assert all(p.stat().st_size > 1000 for p in paths)


def test_bench_flags_quick_lists_and_errors(tmp_path: Path) -> None:
    a = _parse(bench_cmd, ["bench", "--quick", "--out", str(tmp_path)])
    s = bench_cmd.settings_from_args(a)
    quick = ("code", 6, 64, ["plain", "local", "local-pipelined"])
    assert (s.prompts, s.limit, s.n_predict, s.modes) == quick
    assert a.temp == 0.0 and a.threads == 1 and a.threads_draft == 1
    a = _parse(bench_cmd, ["bench", "--quick", "-n", "16", "--modes", "ngram,remote-sync",
                           "--rtt", "0.2ms,2,20ms", "--bandwidth", "1gbit,inf",
                           "--draft-max", "4,8,4", "--draft-policy", "fixed,adaptive"])
    s = bench_cmd.settings_from_args(a)
    assert s.n_predict == 16 and s.modes == ["ngram", "remote-sync"]
    assert s.rtts == pytest.approx([0.0002, 0.002, 0.02]) and s.bandwidths == [1e9, None]
    assert s.draft_max == [4, 8] and s.policies == ["fixed", "adaptive"]
    for argv, msg in ((["--modes", "plain,warp"], "unknown mode 'warp'"),
                      (["--rtt", "2 parsecs"], "--rtt: invalid duration"),
                      (["--draft-max", "4,x"], "--draft-max: not an integer"),
                      (["--draft-policy", "greedy"], "--draft-policy: must be fixed"),
                      (["--modes", "llama-server"], "needs --llama-server URL"),
                      (["--limit", "0"], "--limit: must be >= 1"),
                      (["--draft-ngram"], "--draft-ngram: not a bench flag"),
                      (["--draft-mode", "sync"], "--draft-mode: not a bench flag")):
        with pytest.raises(ConfigError, match=msg):
            bench_cmd.settings_from_args(_parse(bench_cmd, ["bench", *argv]))


def test_bench_settings_from_flags() -> None:
    """What the sweep gets instead of the namespace: the draft model only for modes that
    run it, the node's flags from the draft's, remote options, and no secret in the record."""
    models = ["-m", "t.gguf", "-md", "d.gguf"]
    a = _parse(bench_cmd, ["bench", *models, "-c", "512", "-cd", "256", "-td", "3",
                           "--seed-draft", "7", "--draft-token", "hush", "--shared-cpus"])
    b = bench_cmd.bench_settings(a, ["plain", "remote-sync"])
    assert b.target.path == "t.gguf" and b.target.n_ctx == 512
    assert b.draft is not None and (b.draft.path, b.draft.n_ctx, b.draft.n_threads) == (
        "d.gguf", 256, 3)
    flags = " ".join(b.node_flags)
    assert "-c 256" in flags and "-td 3" in flags and flags.endswith("-s 7")
    assert b.remote.token == "hush" and b.shared_cpus and b.flags["draft_token"] == "***"
    assert "hush" not in json.dumps(dict(b.flags))
    b = bench_cmd.bench_settings(_parse(bench_cmd, ["bench", *models]), ["plain", "ngram"])
    assert b.draft is None and not b.shared_cpus and b.flags["draft_token"] is None


def test_configurations_sweep_links_only_for_remote() -> None:
    s = SweepSettings(prompts="code", modes=["local", "remote-pipelined"], out=Path("x"),
                 rtts=[0.001, 0.01], bandwidths=[None], draft_max=[4, 8],
                 policies=["fixed", "adaptive"])
    cfgs = configurations(s)
    assert cfgs[0] == RunParams("plain")
    # fixed at 4 and 8, adaptive once (capped at 8)
    local = [(c.draft_max, c.policy) for c in cfgs if c.mode == "local"]
    assert local == [(4, "fixed"), (8, "fixed"), (8, "adaptive")]
    remote = [c for c in cfgs if c.mode == "remote-pipelined"]
    assert len(remote) == 6 and {c.rtt_s for c in remote} == {0.001, 0.01}
    assert all(c.rtt_s is None for c in cfgs if c.mode == "local")
    assert len({c.label() for c in cfgs}) == len(cfgs)


def test_command_line_is_recorded_without_secrets(monkeypatch) -> None:
    from specwire.bench import sweep
    monkeypatch.setattr("sys.argv", ["/usr/bin/specwire", "bench", "--draft-token", "s3cret",
                                     "--draft-token=other", "--rtt", "2ms"])
    line = sweep._command_line()
    assert line == "specwire bench --draft-token '***' '--draft-token=***' --rtt 2ms"
    assert "s3cret" not in line and "other" not in line


def test_plan_without_measure_still_needs_its_figures() -> None:
    a = _parse(plan_cmd, ["plan", "--target-tps", "10"])
    with pytest.raises(CliError, match="missing --draft-tps, --acceptance .*--measure"):
        plan_cmd.run(a)


# --------------------------------------------------------------------------- real models


def _children() -> set[int]:
    """Live child processes of this one (Linux), to prove the draft node was stopped."""
    out: set[int] = set()
    for tid in os.listdir(f"/proc/{os.getpid()}/task"):
        try:
            text = Path(f"/proc/{os.getpid()}/task/{tid}/children").read_text()
        except OSError:
            continue
        out |= {int(x) for x in text.split()}
    return out


def _bench(tmp_path: Path, *argv: str) -> dict:
    a = _parse(bench_cmd, ["bench", "--prompts", "code", "--out", str(tmp_path), "-n", "16",
                           "--no-progress", *argv])
    assert bench_cmd.run(a) == 0
    return json.loads((tmp_path / "results.json").read_text())


@pytest.mark.slow
def test_end_to_end_plain_local_ngram(tmp_path: Path, capsys) -> None:
    r = _bench(tmp_path, "--limit", "2", "--modes", "plain,local,ngram")
    assert {"command", "args", "machine", "models", "settings", "calibration", "records",
            "adaptive_vs_fixed", "warnings", "elapsed_s"} <= set(r)
    assert r["machine"]["cpu_count"] and r["machine"]["llama_cpp_python"]
    assert r["settings"]["lossless_expected"] and r["calibration"]["draft_tps"] > 0
    assert [x["mode"] for x in r["records"]] == ["plain", "local", "ngram"]
    for rec in r["records"]:
        assert rec["n_prompts"] == 2 and rec["tokens_generated"] > 0
        assert rec["tokens_per_s"]["median"] > 0 and rec["speedup"]["paired_median"] > 0
        assert {"draft", "network", "verify", "overhead"} <= set(rec["time"]["ms"])
        assert rec["plan"] is not None and "error_pct" in rec["plan"]
        assert rec["tokens_match_plain"] is True, rec["mismatched_prompts"]
    plain, local, _ = r["records"]
    assert plain["speedup"]["paired_median"] == 1.0
    assert local["draft_n"] > 0 and local["accepted_hist"] and local["by_position"]
    shas = {m["mode"]: [p["tokens_sha"] for p in m["prompts"]] for m in r["records"]}
    assert shas["plain"] == shas["local"] == shas["ngram"]
    assert r["warnings"] == []
    assert all((tmp_path / f).exists() for f in plots.FILES)
    out = capsys.readouterr().out
    assert "local k=8" in out and "speedup" in out


@pytest.mark.slow
def test_end_to_end_remote_through_emulated_link(tmp_path: Path) -> None:
    before = _children()
    r = _bench(tmp_path, "--limit", "1", "--modes", "remote-sync,remote-pipelined",
               "--rtt", "2ms", "--no-plots")
    assert [x["mode"] for x in r["records"]] == ["plain", "remote-sync", "remote-pipelined"]
    for rec in r["records"][1:]:
        assert rec["rtt_ms"] == pytest.approx(2.0)
        assert rec["bytes"]["link_up"] > 0 and rec["bytes"]["link_down"] > 0
        assert rec["bytes"]["drafter_per_token"] > 0
        assert rec["tokens_match_plain"] is True
    assert "listening on" in (tmp_path / "draft-node.log").read_text()
    assert _children() <= before            # the node process is gone


@pytest.mark.slow
def test_plan_measure(capsys) -> None:
    a = _parse(plan_cmd, ["plan", "--measure", "--measure-limit", "1", "--measure-n", "12",
                          "--rtt", "2ms"])
    assert plan_cmd.run(a) == 0
    captured = capsys.readouterr()
    assert "measured: target" in captured.err
    assert "verify cost: t_v(n) through 1:1," in captured.out
    assert "pipelined" in captured.out


def test_an_emulated_bench_waits_for_a_synchronous_node_on_the_emulated_clock(
        tmp_path) -> None:
    """Drafters.hold: under --emulate every remote drafter bench builds waits its scale
    times the synchronous deadline (a node reading a prompt in emulated time is not late),
    and the node it starts gets the emulation's flags."""
    import contextlib

    from specwire.bench.modes import Drafters
    from specwire.config import ModelParams
    from specwire.settings import BenchSettings

    with contextlib.ExitStack() as stack:
        drafters = Drafters(BenchSettings(target=ModelParams(path="t.gguf")), None,
                            tmp_path, stack)
        drafters.hold(None, None, ("--emulate-scale", "3"), 3.0)
    assert drafters.bench.remote.sync_timeout_s == 3.0
    assert drafters.bench.node_flags[-2:] == ("--emulate-scale", "3")
