"""Concurrent requests drafting on one draft node: aggregate tokens/s, and the connections.

For each source tree (--specwire-root LABEL=DIR, as bench.concurrency; default this
tree) starts a draft node (`specwire draft`, the bundled draft) and a `specwire serve
-np N --draft-url NODE` from that tree, and sends each concurrency level's burst of
greedy requests (shipped prompts, n_predict tokens, ignore_eos) to it. Prints, per
tree and level, the aggregate tokens/s, its ratio to level 1, the drafted and accepted
tokens, and the connections the server opened to the node per port (counted by the
node, specwire:node_connections; "?" for a node that does not count them). Trees run
one after the other, so compare ratios within one run.

    python -m benchmarks.remote_slots --concurrency 1,4 -np 4 -n 32 --draft-mode sync \\
        --specwire-root before=/work/main --specwire-root after=.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import httpx

from benchmarks.burst import fire
from benchmarks.concurrency import UsageError, parse_levels, parse_roots
from benchmarks.server_process import ServerProcess, free_port
from specwire.bench.prompts import resolve


def node_connections(metrics_url: str) -> dict[str, float]:
    text = httpx.get(metrics_url, timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("specwire:node_connections_total{"):
            port = line.split('port="', 1)[1].split('"', 1)[0]
            out[port] = float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.remote_slots",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4", metavar="LEVELS")
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-td", "--threads-draft", type=int, default=1)
    p.add_argument("-c", "--ctx-size", type=int, default=512)
    p.add_argument("--draft-max", type=int, default=4)
    p.add_argument("--draft-mode", choices=["sync", "pipelined"], default="sync")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--specwire-root", action="append", metavar="LABEL=DIR")
    try:
        a = p.parse_args(argv)
        levels = parse_levels(a.concurrency)
        roots = parse_roots(a.specwire_root)
    except UsageError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    prompts = [(x.id, x.text) for x in resolve("code,prose,qa") if x.text]
    logs = Path(tempfile.mkdtemp(prefix="remote-slots-"))
    print("| tree | level | tokens/s | x level 1 | drafted | accepted | connections |")
    print("|---|---|---|---|---|---|---|")
    for label, tree in roots:
        if not run_tree(a, label, tree, levels, prompts, logs):
            return 1
    print(f"\nload average {os.getloadavg()[0]:.1f}; logs in {logs}")
    return 0


def run_tree(a: argparse.Namespace, label: str, tree: Path, levels: list[int],
             prompts: list[tuple[str, str]], logs: Path) -> bool:
    """A node and a server from one source tree, each level's burst; False on an error."""
    from specwire.assets import models
    # -P: without it `python -m` puts the working directory before PYTHONPATH, and every
    # tree would run the one the benchmark was started in.
    env = {"PYTHONPATH": str(tree)}
    port, metrics, sport = free_port(), free_port(), free_port()
    node = ServerProcess("node", [sys.executable, "-P", "-m", "specwire", "draft",
                                  "-m", str(models.default_draft()), "--host", "127.0.0.1",
                                  "--port", str(port), "--sync-port", str(free_port()),
                                  "--metrics-port", str(metrics), "-td", str(a.threads_draft),
                                  "-c", str(a.ctx_size), "--max-sessions", str(2 * a.parallel),
                                  "--idle-timeout", "3600"],
                         metrics, logs / f"{label}-node.log", env=env)  # healthy: metrics
    metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    cmd = [sys.executable, "-P", "-m", "specwire", "serve", "--host", "127.0.0.1",
           "--port", str(sport), "-m", str(models.default_target()),
           "-c", str(a.ctx_size), "-t", str(a.threads), "-np", str(a.parallel),
           "--no-webui", "--draft-url", f"127.0.0.1:{port}", "--draft-mode",
           a.draft_mode, "--draft-max", str(a.draft_max), "--draft-policy", "fixed",
           "--draft-p-min", "0"]
    server = ServerProcess(label, cmd, sport, logs / f"{label}.log", env=env)
    try:
        node.start(300)
        server.start(300)
        fire(server.url, "/completion", prompts[:1], 8, 300)  # warm-up
        base = None
        for level in levels:
            burst_set = [prompts[i % len(prompts)] for i in range(level)]
            tps, drafted, accepted = [], 0, 0
            for _ in range(a.repeats):
                b = fire(server.url, "/completion", burst_set, a.n_predict, 900)
                if b.errors:
                    print(f"{label}: {b.errors[0]}", file=sys.stderr)
                    return False
                tps.append(b.aggregate_tps)
                drafted += sum(r.draft_n or 0 for r in b.replies)
                accepted += sum(r.draft_accepted or 0 for r in b.replies)
            best = max(tps)
            base = base or best
            conns = node_connections(metrics_url)
            shown = ", ".join(f"{k} {v:g}" for k, v in sorted(conns.items())) or "?"
            print(f"| {label} | {level} | {best:.2f} | {best / base:.2f} | {drafted} "
                  f"| {accepted} | {shown} |", flush=True)
    finally:
        server.stop()
        node.stop()
    return True


if __name__ == "__main__":
    sys.exit(main())
