"""Concurrent requests drafting on one draft node: aggregate tokens/s, and the connections.

For each source tree (--specwire-root LABEL=DIR, as bench.concurrency; default this
tree) starts a draft node (`specwire draft`, the bundled draft) and a `specwire serve
-np N --draft-url NODE` from that tree, and sends each concurrency level's burst of
greedy requests (shipped prompts, n_predict tokens, ignore_eos) to it; --warm-prompts
reads each burst's prompts first, so that the bursts measure decoding alone. Prints, per
tree and level, the aggregate tokens/s, its ratio to level 1, the drafted and accepted
tokens, the connections the server opened to the node per port (counted by the
node, specwire:node_connections; "?" for a node that does not count them), and the
node's sessions and alternates per decode over the level's bursts (node/steps.py;
"?" for a node that does not batch). --plain adds the same bursts to a server without
a draft (its level-1 rate is the ratios' base too, "x plain"). --emulate PRESET and
--emulate-scale hold both processes to a regime (docs/benchmarks.md), and the share of
the node's decodes over their emulated time is printed from its log. Trees run one
after the other, so compare ratios within one run.

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
from benchmarks.concurrency import UsageError, parse_levels, parse_roots, warm_prompts
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
    p.add_argument("--plain", action="store_true", help="also a server without a draft")
    p.add_argument("--warm-prompts", action="store_true",
                   help="read each burst's prompts first (1 token each): the bursts measure "
                        "decoding alone")
    p.add_argument("--emulate", metavar="PRESET", help="hold the server and the node to it")
    p.add_argument("--emulate-scale", type=float, default=1.0)
    try:
        a = p.parse_args(argv)
        levels = parse_levels(a.concurrency)
        roots = parse_roots(a.specwire_root)
    except UsageError as e:
        print(f"{p.prog}: {e}", file=sys.stderr)
        return 2
    prompts = [(x.id, x.text) for x in resolve("code,prose,qa") if x.text]
    logs = Path(tempfile.mkdtemp(prefix="remote-slots-"))
    print("| tree | level | tokens/s | x level 1 | x plain | drafted | accepted | connections "
          "| sessions per decode | alternates per decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, tree in roots:
        plain = run_plain(a, label, tree, levels, prompts, logs) if a.plain else {}
        if plain is None or not run_tree(a, label, tree, levels, prompts, logs, plain):
            return 1
    print(f"\nload average {os.getloadavg()[0]:.1f}; logs in {logs}")
    return 0


def _emulation(a: argparse.Namespace) -> list[str]:
    if not a.emulate:
        return []
    return ["--emulate", a.emulate, "--emulate-scale", f"{a.emulate_scale:g}"]


def _warm(a: argparse.Namespace, levels: list[int],
          prompts: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The warm-up's prompts, one per slot: none a burst reads (concurrency.warm_prompts),
    so that no level starts from a prompt the warm-up left cached (level 1 did: its
    prompt was the warm-up's, and 4 requests against 1 compared a read prompt with none)."""
    return warm_prompts(prompts, levels, a.repeats, a.parallel)


def _serve_command(a: argparse.Namespace, port: int, draft: list[str]) -> list[str]:
    from specwire.assets import models
    return [sys.executable, "-P", "-m", "specwire", "serve", "--host", "127.0.0.1",
            "--port", str(port), "-m", str(models.default_target()),
            "-c", str(a.ctx_size), "-t", str(a.threads), "-np", str(a.parallel),
            "--no-webui", *draft, *_emulation(a)]


def _bursts(a: argparse.Namespace, label: str, url: str, level: int,
            prompts: list[tuple[str, str]]) -> tuple[float, int, int] | None:
    """The level's bursts: the best aggregate tokens/s, drafted and accepted tokens."""
    burst_set = [prompts[i % len(prompts)] for i in range(level)]
    tps, drafted, accepted = [], 0, 0
    for _ in range(a.repeats):
        if a.warm_prompts and fire(url, "/completion", burst_set, 1, 900).errors:
            print(f"{label}: reading the burst's prompts failed", file=sys.stderr)
            return None
        b = fire(url, "/completion", burst_set, a.n_predict, 900)
        if b.errors:
            print(f"{label}: {b.errors[0]}", file=sys.stderr)
            return None
        tps.append(b.aggregate_tps)
        drafted += sum(r.draft_n or 0 for r in b.replies)
        accepted += sum(r.draft_accepted or 0 for r in b.replies)
    return max(tps), drafted, accepted


def run_plain(a: argparse.Namespace, label: str, tree: Path, levels: list[int],
              prompts: list[tuple[str, str]], logs: Path) -> dict[int, float] | None:
    """The same bursts on a server without a draft: tokens/s per level; None on an error."""
    sport = free_port()
    server = ServerProcess(f"{label}-plain", _serve_command(a, sport, ["--no-draft"]), sport,
                           logs / f"{label}-plain.log", env={"PYTHONPATH": str(tree)})
    out: dict[int, float] = {}
    try:
        server.start(300)
        fire(server.url, "/completion", _warm(a, levels, prompts), 8, 300)
        for level in levels:
            got = _bursts(a, f"{label}-plain", server.url, level, prompts)
            if got is None:
                return None
            out[level] = got[0]
            print(f"| {label} plain | {level} | {got[0]:.2f} | {got[0] / out[levels[0]]:.2f} "
                  f"| 1.00 | | | | | |", flush=True)
    finally:
        server.stop()
    return out


def node_steps(metrics_url: str) -> tuple[float, float, float] | None:
    """The node's (decodes, branch parts, alternate parts) so far; None if it does not
    count them (a node that does not batch)."""
    f: dict[str, float] = {}
    for line in httpx.get(metrics_url, timeout=10).text.splitlines():
        if line.startswith("specwire:node_decode"):
            name, value = line.rsplit(" ", 1)
            f[name] = float(value)
    if "specwire:node_decodes_total" not in f:
        return None
    return (f["specwire:node_decodes_total"],
            f.get('specwire:node_decode_parts_total{kind="branch"}', 0.0),
            f.get('specwire:node_decode_parts_total{kind="alternate"}', 0.0))


def run_tree(a: argparse.Namespace, label: str, tree: Path, levels: list[int],
             prompts: list[tuple[str, str]], logs: Path,
             plain: dict[int, float] | None = None) -> bool:
    """A node and a server from one source tree, each level's burst; False on an error."""
    from specwire.assets import models
    # -P: without it `python -m` puts the working directory before PYTHONPATH, and every
    # tree would run the one the benchmark was started in.
    env = {"PYTHONPATH": str(tree)}
    port, metrics, sport = free_port(), free_port(), free_port()
    node_log = logs / f"{label}-node.log"
    node = ServerProcess("node", [sys.executable, "-P", "-m", "specwire", "draft",
                                  "-m", str(models.default_draft()), "--host", "127.0.0.1",
                                  "--port", str(port), "--sync-port", str(free_port()),
                                  "--metrics-port", str(metrics), "-td", str(a.threads_draft),
                                  "-c", str(a.ctx_size), "--max-sessions", str(2 * a.parallel),
                                  "--idle-timeout", "3600", *_emulation(a)],
                         metrics, node_log, env=env, health="/metrics")
    metrics_url = f"http://127.0.0.1:{metrics}/metrics"
    cmd = _serve_command(a, sport, [
        "--draft-url", f"127.0.0.1:{port}", "--draft-mode", a.draft_mode,
        "--draft-max", str(a.draft_max), "--draft-policy", "fixed", "--draft-p-min", "0"])
    server = ServerProcess(label, cmd, sport, logs / f"{label}.log", env=env)
    try:
        node.start(300)
        server.start(300)
        fire(server.url, "/completion", _warm(a, levels, prompts), 8, 300)
        base = None
        for level in levels:
            before = node_steps(metrics_url)
            got = _bursts(a, label, server.url, level, prompts)
            if got is None:
                return False
            best, drafted, accepted = got
            base = base or best
            after = node_steps(metrics_url)
            steps = "? | ?"
            if before is not None and after is not None and after[0] > before[0]:
                n = after[0] - before[0]
                steps = f"{(after[1] - before[1]) / n:.2f} | {(after[2] - before[2]) / n:.2f}"
            conns = node_connections(metrics_url)
            shown = ", ".join(f"{k} {v:g}" for k, v in sorted(conns.items())) or "?"
            vs_plain = f"{best / plain[level]:.2f}" if plain and level in plain else ""
            print(f"| {label} | {level} | {best:.2f} | {best / base:.2f} | {vs_plain} "
                  f"| {drafted} | {accepted} | {shown} | {steps} |", flush=True)
    finally:
        server.stop()
        node.stop()
    over = [line.strip() for line in node_log.read_text(errors="replace").splitlines()
            if "over their emulated time" in line]
    if over:
        print(f"{label} node, last session: {over[-1].split('emulation: ', 1)[-1]}")
    return True


if __name__ == "__main__":
    sys.exit(main())
