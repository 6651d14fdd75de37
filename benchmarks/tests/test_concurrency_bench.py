"""`python -m benchmarks.concurrency`: the concurrency benchmark.

Fast tests cover what would silently skew its figures: flag parsing, the prompt
plan (every configuration gets the same bursts, bursts differ), answer parsing
for both endpoints, the aggregation and ratios, the servers' command lines, and
that a burst's requests really are in flight at once (a local HTTP server that
holds each answer 0.3 s). The slow test runs the harness on `specwire serve`
with the bundled pair at concurrency 1 and 2.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from benchmarks import concurrency as conc
from benchmarks import concurrency_table as table
from benchmarks.burst import Burst, Reply, fire, parse_reply, request_body
from benchmarks.server_process import (
    ServerFlags,
    ServerProcess,
    free_port,
    llama_server_command,
    specwire_command,
)

# --------------------------------------------------------------------------- flags


def test_levels_parse_keep_order_and_drop_duplicates() -> None:
    assert conc.parse_levels("1,2,4,8") == [1, 2, 4, 8]
    assert conc.parse_levels(" 4, 1,4 ,") == [4, 1]


@pytest.mark.parametrize("text", ["", "0", "1,x", "-1", "2.5"])
def test_bad_levels_are_refused(text: str) -> None:
    with pytest.raises(conc.UsageError, match="--concurrency"):
        conc.parse_levels(text)


def test_variants_and_roots(tmp_path: Path) -> None:
    assert conc.parse_variants("md,plain,md") == ["md", "plain"]
    with pytest.raises(conc.UsageError, match="--variants"):
        conc.parse_variants("plain,ngram")
    assert conc.parse_roots(None) == [("specwire", conc.this_tree())]
    with pytest.raises(conc.UsageError, match="LABEL=DIR"):
        conc.parse_roots([str(tmp_path)])
    with pytest.raises(conc.UsageError, match="no specwire package"):
        conc.parse_roots([f"x={tmp_path}"])
    tree = str(conc.this_tree())
    with pytest.raises(conc.UsageError, match="used twice"):
        conc.parse_roots([f"a={tree}", f"a={tree}"])


def test_bad_flag_is_one_line_and_exit_2(capsys: pytest.CaptureFixture) -> None:
    assert conc.main(["--concurrency", "1,zero"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--concurrency" in err and "Traceback" not in err
    assert conc.main(["--llama-server", "/nonexistent/llama-server"]) == 2
    assert "not an executable" in capsys.readouterr().err


def test_tuning_environment_is_part_of_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    monkeypatch.setenv("HOME_OF_SOMETHING_ELSE", "x")
    env = conc.tuning_env()
    assert env["OMP_WAIT_POLICY"] == "passive" and "HOME_OF_SOMETHING_ELSE" not in env


def test_configs_pair_each_row_with_its_plain_and_llama_server() -> None:
    roots = [("main", Path(".")), ("batch", Path("."))]
    confs = conc.configs(roots, ["plain", "md"], llama=True)
    assert [c.label for c in confs] == ["main plain", "main -md", "batch plain", "batch -md",
                                        "llama-server plain", "llama-server -md"]
    by = {c.label: c for c in confs}
    assert by["batch -md"].plain == "batch plain"
    assert by["batch -md"].rival == "llama-server -md"
    assert by["llama-server -md"].rival is None
    assert all(c.rival is None for c in conc.configs(roots, ["md"], llama=False))


def test_every_configuration_gets_the_same_distinct_bursts() -> None:
    prompts = [(f"p{i}", f"text {i}") for i in range(10)]
    plan = conc.assign_prompts(prompts, [1, 2, 4], repeats=2)
    assert [p for p, _ in plan[(0, 1)]] == ["p0"]
    assert [p for p, _ in plan[(0, 2)]] == ["p1", "p2"]
    assert [p for p, _ in plan[(1, 2)]] == ["p8", "p9"]
    assert [p for p, _ in plan[(1, 4)]] == ["p0", "p1", "p2", "p3"]    # wraps round
    assert all(len(plan[(r, lv)]) == lv for r in range(2) for lv in (1, 2, 4))


def test_the_warm_up_reads_none_of_the_bursts_prompts() -> None:
    """A warm-up on the bursts' first prompts left them in the slots' caches: one
    request's burst read none of its prompt and four requests' three of four."""
    prompts = [(f"p{i}", f"text {i}") for i in range(24)]
    plan = conc.assign_prompts(prompts, [1, 4], repeats=1)
    warm = conc.warm_prompts(prompts, [1, 4], repeats=1, parallel=4)
    assert [p for p, _ in warm] == ["p5", "p6", "p7", "p8"]
    assert not {p for p, _ in warm} & {p for b in plan.values() for p, _ in b}
    assert len(conc.warm_prompts(prompts, [1, 4], repeats=1, parallel=8)) == 4


def test_server_commands_use_llama_cpp_flags() -> None:
    f = ServerFlags("t.gguf", "d.gguf", parallel=4, threads=2, threads_draft=2, ctx=512,
                    draft_max=8)
    s = specwire_command(f, 8080, ["--verify", "greedy"])
    assert s[1:5] == ["-P", "-m", "specwire", "serve"]   # each root's code, not the cwd's
    assert _after(s, "-np") == "4" and _after(s, "-c") == "512" and _after(s, "-t") == "2"
    assert _after(s, "-md") == "d.gguf" and _after(s, "--draft-max") == "8"
    assert s[-2:] == ["--verify", "greedy"]
    ll = llama_server_command("/bin/llama-server", f, 8080, [])
    assert ll[0] == "/bin/llama-server" and _after(ll, "-c") == "2048"    # 512 per slot
    assert _after(ll, "-td") == "2" and _after(ll, "-md") == "d.gguf"
    assert _after(ll, "--spec-draft-n-max") == "8"
    assert _after(ll, "--spec-type") == "draft-simple"          # else -md loads but never drafts
    plain = ServerFlags("t.gguf", None, 4, 2, 2, 512, 8)
    assert "--no-draft" in specwire_command(plain, 1, [])
    assert "-md" not in llama_server_command("ls", plain, 1, [])


def _after(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# --------------------------------------------------------------------------- answers


def test_request_bodies_are_greedy_fixed_length() -> None:
    b = request_body("/completion", "hi", 32)
    assert b["n_predict"] == 32 and b["ignore_eos"] and b["temperature"] == 0.0
    assert request_body("/v1/completions", "hi", 32)["max_tokens"] == 32


def test_parse_reply_reads_both_endpoints_and_timings() -> None:
    timings = {"predicted_per_second": 20.5, "draft_n": 40, "draft_n_accepted": 30}
    r = parse_reply("a", "/completion", {"content": "xy", "tokens_predicted": 16,
                                         "timings": timings}, 2.0)
    assert (r.tokens, r.text, r.tps, r.decode_tps) == (16, "xy", 8.0, 20.5)
    assert (r.draft_n, r.draft_accepted, r.error) == (40, 30, None)
    o = parse_reply("b", "/v1/completions", {"choices": [{"text": "z"}],
                                             "usage": {"completion_tokens": 4}}, 1.0)
    assert (o.tokens, o.text, o.draft_n, o.decode_tps) == (4, "z", None, None)


@pytest.mark.parametrize("body", [[1], {"content": "x"}, {"choices": []},
                                  {"content": "x", "tokens_predicted": "many"}])
def test_unexpected_answers_are_errors_not_zero_figures(body: object) -> None:
    endpoint = "/v1/completions" if "choices" in str(body) else "/completion"
    r = parse_reply("a", endpoint, body, 1.0)
    assert r.error and r.tokens == 0


# --------------------------------------------------------------------------- aggregation


def _burst(level: int, wall: float, tokens: int, text: str = "t", draft: int | None = None,
           ids: str = "p") -> Burst:
    replies = tuple(Reply(f"{ids}{i}", tokens, wall, text=text, decode_tps=tokens / wall,
                          draft_n=draft, draft_accepted=None if draft is None else draft // 2)
                    for i in range(level))
    return Burst(level, wall, replies, load=1.5, cpu_s=wall / 2)


def test_summary_medians_ratios_and_text_check() -> None:
    runs = [("plain", _burst(1, 2.0, 10)), ("md", _burst(1, 1.0, 10, draft=8)),
            ("plain", _burst(2, 2.0, 10)), ("md", _burst(2, 1.0, 10, text="other", draft=8)),
            ("plain", _burst(2, 4.0, 10)), ("md", _burst(2, 0.5, 10, draft=8))]
    ref = table.reference_texts(runs, "plain")
    assert ref == {"p0": "t", "p1": "t"}
    cells = table.summarize(runs, n_predict=10, reference=ref)
    assert cells[("plain", 2)].aggregate == [10.0, 5.0]
    assert cells[("plain", 2)].median == 7.5
    md2 = cells[("md", 2)]
    assert md2.median == 30.0 and md2.acceptance == 0.5 and (md2.same, md2.compared) == (2, 4)
    confs = [table.Variant("plain", "plain"), table.Variant("md", "plain")]
    md = table.markdown(confs, [1, 2], cells)
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line
            for line in md.splitlines()[2:]}
    assert "| 3.00x |" in rows[("md", "2")]            # 30 / 10 at concurrency 1
    assert "| 4.00x |" in rows[("md", "2")]            # 30 / 7.5 of plain at 2
    assert "0.50 of 32" in rows[("md", "2")] and "2/4" in rows[("md", "2")]
    assert "x llama-server" not in md.splitlines()[0]
    # tokens per CPU second: the server used half the wall time's CPU in these bursts
    assert md2.cpu_tps == [40.0, 80.0] and "| 60.0 | 4.00x |" in rows[("md", "2")]


def test_errors_and_short_answers_are_counted() -> None:
    bad = Burst(2, 1.0, (Reply("p0", 0, 1.0, error="HTTP 500: x"), Reply("p1", 7, 1.0)))
    cells = table.summarize([("a", bad)], n_predict=8, reference={})
    assert cells[("a", 2)].errors == ["HTTP 500: x"] and cells[("a", 2)].short == 1
    assert bad.aggregate_tps == 7.0
    md = table.markdown([table.Variant("a", "a", "llama-server plain")], [2], cells)
    assert "x llama-server" in md and "| 2 |" in md.splitlines()[2]


# --------------------------------------------------------------------------- burst


class _SlowCompletion(BaseHTTPRequestHandler):
    """Answers /completion after 0.3 s with 5 tokens; counts requests in flight."""

    in_flight = 0
    most = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        cls = type(self)
        with cls.lock:
            cls.in_flight += 1
            cls.most = max(cls.most, cls.in_flight)
        time.sleep(0.3)
        with cls.lock:
            cls.in_flight -= 1
        out = json.dumps({"content": body["prompt"][::-1], "tokens_predicted": body["n_predict"],
                          "timings": {"draft_n": 0, "draft_n_accepted": 0}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args: object) -> None:
        pass


def test_a_burst_sends_every_request_at_once() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowCompletion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        b = fire(url, "/completion", [(f"p{i}", f"text {i}") for i in range(6)], 5, 10)
    finally:
        server.shutdown()
        server.server_close()
    assert _SlowCompletion.most == 6
    assert 0.3 <= b.wall_s < 1.2                     # one 0.3 s round, not six
    assert b.tokens == 30 and not b.errors
    assert [r.text for r in b.replies] == [f"{i} txet" for i in range(6)]


def test_a_refused_connection_is_an_error_in_the_burst() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]                   # bound, not listening: refused
        b = fire(f"http://127.0.0.1:{port}", "/completion", [("p", "x")], 4, 5)
    assert b.errors and "ConnectError" in b.errors[0] and b.tokens == 0


# --------------------------------------------------------------------------- real server


@pytest.mark.slow
def test_harness_on_specwire_serve(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "conc.json"
    rc = conc.main(["--concurrency", "1,2", "-n", "8", "--repeats", "1", "-np", "2",
                    "-t", "1", "-c", "512", "--prompts", "code", "--log-dir",
                    str(tmp_path / "logs"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    report = json.loads(out.read_text())
    cells = {(c["config"], c["concurrency"]): c for c in report["cells"]}
    assert set(cells) == {(f"specwire {v}", lv) for v in ("plain", "-md") for lv in (1, 2)}
    for c in cells.values():
        assert not c["errors"] and c["short"] == 0 and c["aggregate_tps_median"] > 0
        assert c["same_text"] == c["compared_text"] == c["concurrency"]   # lossless
    assert "| specwire -md | 2 |" in printed
    assert "python -m benchmarks.concurrency --concurrency 1,2" in printed
    for cmd in report["servers"].values():                # every server is gone
        port = int(cmd.split("--port ")[1].split()[0])
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_server_process_reports_its_cpu_seconds(tmp_path) -> None:
    """The CPU time of a server's process, read from /proc, grows while it computes."""
    code = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n" \
           "time.sleep(30)"
    proc = ServerProcess("spin", [sys.executable, "-c", code], free_port(),
                         tmp_path / "spin.log", {})
    assert proc.cpu_s() is None                      # not started
    proc.proc = subprocess.Popen(proc.cmd, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while (proc.cpu_s() or 0.0) < 0.25 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert 0.25 <= proc.cpu_s() < 5.0
    finally:
        proc.stop()
