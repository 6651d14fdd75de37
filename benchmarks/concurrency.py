"""Concurrency benchmark: aggregate tokens/s with 1, 2, 4, 8... greedy requests in flight.

Starts each server configuration as its own process (`specwire serve`, plain and
with -md, from one or more source trees; `llama-server` from --llama-server PATH,
plain and with -md, given the same -m, -md, -np, -t, -td, --draft-max and per-slot
context), waits for /health, warms every slot, then for each repeat and
concurrency level sends the same burst of shipped prompts (n_predict tokens each,
ignore_eos, temperature 0) to every configuration in turn, rotating their order
each repeat so that the machine's drift hits all alike. It prints a markdown table
(ratios to concurrency 1, to plain, to llama-server) and the command, and writes the
raw figures as JSON with --out.

    python -m benchmarks.concurrency --concurrency 1,2,4,8 -np 4 -t 2 -n 64 \\
        --llama-server /path/to/llama-server --out conc.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks import concurrency_table as table
from benchmarks.burst import ENDPOINTS, Burst, fire
from benchmarks.server_process import (
    ServerFlags,
    ServerProcess,
    ServerStartError,
    free_port,
    llama_server_command,
    specwire_command,
)

PROG = "python -m benchmarks.concurrency"
LLAMA = "llama-server"
VARIANTS = ("plain", "md")


class UsageError(ValueError):
    """A bad flag: printed as one line, exit status 2."""


class WarmUpError(RuntimeError):
    """A server answered its warm-up request with an error: nothing would be measured."""


@dataclass(frozen=True, slots=True)
class Server:
    """A configuration and the process that serves it."""

    config: table.Variant
    process: ServerProcess


def this_tree() -> Path:
    """The source tree this specwire is imported from (what `specwire serve` runs by default)."""
    return Path(__file__).resolve().parents[1]


def tuning_env() -> dict[str, str]:
    """Environment variables that change how the servers compute (OpenMP's wait policy...):
    part of the command that reproduces a figure."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("OMP_", "GOMP_", "GGML_", "LLAMA_ARG_"))}


def parse_levels(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8]: positive, no duplicates, order kept."""
    out: list[int] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if not item.isdigit() or int(item) < 1:
            raise UsageError(f"--concurrency: expected positive integers, got {item!r}")
        if int(item) not in out:
            out.append(int(item))
    if not out:
        raise UsageError("--concurrency: no level given")
    return out


def parse_variants(text: str) -> list[str]:
    out = [s.strip() for s in text.split(",") if s.strip()]
    bad = [v for v in out if v not in VARIANTS]
    if bad or not out:
        raise UsageError(f"--variants: expected a comma list of plain, md; got {text!r}")
    return list(dict.fromkeys(out))


def parse_roots(items: list[str] | None) -> list[tuple[str, Path]]:
    """--specwire-root LABEL=DIR items -> (label, tree); none given: ('specwire', this tree)."""
    if not items:
        return [("specwire", this_tree())]
    out: list[tuple[str, Path]] = []
    for item in items:
        label, sep, folder = item.partition("=")
        if not sep or not label or not folder:
            raise UsageError(f"--specwire-root: expected LABEL=DIR, got {item!r}")
        tree = Path(folder).expanduser().resolve()
        if not (tree / "specwire" / "__init__.py").is_file():
            raise UsageError(f"--specwire-root: {tree} holds no specwire package")
        if label == LLAMA or label in (x for x, _ in out):
            raise UsageError(f"--specwire-root: label {label!r} used twice")
        out.append((label, tree))
    return out


def configs(roots: list[tuple[str, Path]], variants: list[str],
            llama: bool) -> list[table.Variant]:
    """Every tree's variants, then llama-server's; specwire rows are compared with it."""
    def label(server: str, v: str) -> str:
        return f"{server} {'plain' if v == 'plain' else '-md'}"

    out = [table.Variant(label(name, v), label(name, "plain"),
                        label(LLAMA, v) if llama else None)
           for name, _ in roots for v in variants]
    if llama:
        out += [table.Variant(label(LLAMA, v), label(LLAMA, "plain")) for v in variants]
    return out


def assign_prompts(prompts: list[tuple[str, str]], levels: list[int],
                   repeats: int) -> dict[tuple[int, int], list[tuple[str, str]]]:
    """(repeat, level) -> the burst's prompts: consecutive ones, wrapping round, so bursts
    differ from each other (no prompt cache helps a later burst) and every configuration
    gets the same burst."""
    out, i = {}, 0
    for r in range(repeats):
        for level in levels:
            out[(r, level)] = [prompts[(i + k) % len(prompts)] for k in range(level)]
            i += level
    return out


def load_prompts(spec: str) -> list[tuple[str, str]]:
    from specwire.bench.prompts import PromptError, resolve
    try:
        prompts = resolve(spec)
    except PromptError as e:
        raise UsageError(str(e)) from None
    text = [(p.id, p.text) for p in prompts if p.text is not None]
    if not text:
        raise UsageError(f"--prompts: {spec} has no text prompts (chat prompts are not sent "
                         "to /completion)")
    return text


def build_servers(a: argparse.Namespace, flags: ServerFlags, confs: list[table.Variant],
                  roots: dict[str, Path], log_dir: Path) -> list[Server]:
    out = []
    for conf in confs:
        server, _, variant = conf.label.rpartition(" ")
        f = flags if variant == "-md" else _without_draft(flags)
        port = free_port()
        name = conf.label.replace(" ", "_")
        if server == LLAMA:
            cmd = llama_server_command(a.llama_server, f, port, shlex.split(a.llama_args))
            env = {"LD_LIBRARY_PATH": ":".join(
                x for x in (str(Path(a.llama_server).resolve().parent),
                            os.environ.get("LD_LIBRARY_PATH", "")) if x)}
        else:
            cmd = specwire_command(f, port, shlex.split(a.specwire_args))
            env = {"PYTHONPATH": str(roots[server])}
        out.append(Server(conf, ServerProcess(conf.label, cmd, port, log_dir / f"{name}.log",
                                              env)))
    return out


def _without_draft(f: ServerFlags) -> ServerFlags:
    return ServerFlags(f.target, None, f.parallel, f.threads, f.threads_draft, f.ctx,
                       f.draft_max)


def warm_prompts(prompts: list[tuple[str, str]], levels: list[int], repeats: int,
                 parallel: int) -> list[tuple[str, str]]:
    """The warm-up's prompts: those after the bursts' (wrapping round), so that the
    warm-up leaves none of a burst's prompts in a slot's cache (where the set is larger
    than the bursts need), and every burst reads its prompts alike."""
    start = sum(levels) * repeats
    return [prompts[(start + k) % len(prompts)] for k in range(max(1, min(parallel,
                                                                         max(levels))))]


def measure(servers: list[Server], a: argparse.Namespace, levels: list[int],
            prompts: list[tuple[str, str]]) -> list[tuple[str, Burst]]:
    """Warm every slot of every server, then the interleaved bursts, in run order. With
    --warm-prompts each burst's prompts are read first (1 token each), so that the
    burst decodes from cached prompts and measures decoding alone."""
    warm = warm_prompts(prompts, levels, a.repeats, a.parallel)
    for s in servers:
        b = fire(s.process.url, a.endpoint, warm, 8, a.timeout)
        if b.errors:
            raise WarmUpError(f"{s.config.label}: warm-up failed: {b.errors[0]}")
    plan = assign_prompts(prompts, levels, a.repeats)
    runs: list[tuple[str, Burst]] = []
    for r in range(a.repeats):
        order = servers[r % len(servers):] + servers[:r % len(servers)]
        for level in levels:
            for s in order:
                if a.warm_prompts:
                    b = fire(s.process.url, a.endpoint, plan[(r, level)], 1, a.timeout)
                    if b.errors:
                        raise WarmUpError(f"{s.config.label}: reading the burst's prompts "
                                          f"failed: {b.errors[0]}")
                cpu0 = s.process.cpu_s()
                b = fire(s.process.url, a.endpoint, plan[(r, level)], a.n_predict, a.timeout)
                cpu1 = s.process.cpu_s()
                if cpu0 is not None and cpu1 is not None:
                    b = replace(b, cpu_s=cpu1 - cpu0)
                runs.append((s.config.label, b))
                note = f", {len(b.errors)} errors: {b.errors[0][:120]}" if b.errors else ""
                print(f"[concurrency] repeat {r + 1}/{a.repeats} conc {level} "
                      f"{s.config.label}: {b.aggregate_tps:.1f} tok/s in {b.wall_s:.1f} s "
                      f"(load {b.load or 0:.1f}){note}", file=sys.stderr, flush=True)
    return runs


def run(a: argparse.Namespace) -> dict:
    from specwire.assets import models

    levels = parse_levels(a.concurrency)
    variants = parse_variants(a.variants)
    roots = parse_roots(a.specwire_root)
    for flag, value in (("-np", a.parallel), ("-n", a.n_predict), ("-t", a.threads),
                        ("--repeats", a.repeats), ("-c", a.ctx_size), ("--draft-max",
                                                                       a.draft_max)):
        if value < 1:
            raise UsageError(f"{flag}: must be >= 1, got {value}")
    if a.llama_server and not os.access(a.llama_server, os.X_OK):
        raise UsageError(f"--llama-server: {a.llama_server} is not an executable file")
    prompts = load_prompts(a.prompts)
    target = a.model or str(models.default_target())
    draft = a.model_draft or str(models.default_draft())
    for flag, path in (("-m", target), ("-md", draft)):
        if not Path(path).is_file():
            raise UsageError(f"{flag}: no such file: {path}")
    flags = ServerFlags(target, draft, a.parallel, a.threads, a.threads_draft or a.threads,
                        a.ctx_size, a.draft_max)
    confs = configs(roots, variants, bool(a.llama_server))
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="specwire-concurrency-"))
    servers = build_servers(a, flags, confs, dict(roots), log_dir)
    report: dict = {
        "command": " ".join([*(f"{k}={shlex.quote(v)}" for k, v in tuning_env().items()),
                             PROG, shlex.join(a.argv)]).strip(),
        "cpus": os.cpu_count(),
        "load_start": os.getloadavg(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "levels": levels, "n_predict": a.n_predict, "repeats": a.repeats,
        "endpoint": a.endpoint, "logs": str(log_dir),
        "roots": {k: str(v) for k, v in roots},
        "servers": {s.config.label: shlex.join(s.process.cmd) for s in servers}}
    try:
        for s in servers:
            print(f"[concurrency] starting {s.config.label}: {shlex.join(s.process.cmd)}",
                  file=sys.stderr, flush=True)
            s.process.start(a.start_timeout)
        runs = measure(servers, a, levels, prompts)
    finally:
        for s in servers:
            s.process.stop()
    reference = table.reference_texts(runs, confs[0].label)
    cells = table.summarize(runs, a.n_predict, reference)
    report |= {"load_end": os.getloadavg(), "ended": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
               "reference": confs[0].label,
               "cells": [cells[(c.label, lv)].to_dict() for c in confs for lv in levels
                         if (c.label, lv) in cells],
               "table": table.markdown(confs, levels, cells)}
    return report


def render(report: dict) -> str:
    load = ", ".join(f"{x:.2f}" for x in report["load_start"])
    load_end = ", ".join(f"{x:.2f}" for x in report["load_end"])
    servers = "\n".join(f"    {k}: {v}" for k, v in report["servers"].items())
    return (f"{report['table']}\n\n"
            f"n_predict {report['n_predict']} (ignore_eos, greedy), {report['repeats']} "
            f"repeat(s), median shown; same text: equal to {report['reference']} on the same "
            f"prompt.\nload average (1, 5, 15 min) at start {load}, at end {load_end}; "
            f"{report['cpus']} CPUs; {report['started']} .. {report['ended']}\n"
            f"command: {report['command']}\nservers:\n{servers}\nlogs: {report['logs']}")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default="1,2,4,8", metavar="LEVELS",
                   help="requests in flight, comma list (default 1,2,4,8)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="server slots (default 4)")
    p.add_argument("-n", "--n-predict", type=int, default=64,
                   help="tokens per request, EOS ignored (default 64)")
    p.add_argument("--repeats", type=int, default=2, help="bursts per level (default 2)")
    p.add_argument("-m", "--model", help="target GGUF (default: the bundled target)")
    p.add_argument("-md", "--model-draft", help="draft GGUF (default: the bundled draft)")
    p.add_argument("-t", "--threads", type=int, default=2, help="target threads (default 2)")
    p.add_argument("-td", "--threads-draft", type=int, default=0,
                   help="draft threads (default: = -t, as llama-server)")
    p.add_argument("-c", "--ctx-size", type=int, default=1024,
                   help="context per slot (llama-server gets -c CTX*NP; default 1024)")
    p.add_argument("--draft-max", type=int, default=8,
                   help="draft tokens per round for both servers (default 8)")
    p.add_argument("--variants", default="plain,md",
                   help="plain, md (with the draft model) or both (default)")
    p.add_argument("--specwire-root", action="append", metavar="LABEL=DIR",
                   help="run `specwire serve` from this source tree, labelled LABEL; "
                        "repeatable (default: specwire=this tree)")
    p.add_argument("--llama-server", metavar="PATH",
                   help="also measure this llama-server binary with the same flags")
    p.add_argument("--specwire-args", default="", metavar="ARGS",
                   help="extra flags for specwire serve (one string)")
    p.add_argument("--llama-args", default="", metavar="ARGS",
                   help="extra flags for llama-server (one string)")
    p.add_argument("--prompts", default="code,prose,qa",
                   help="prompt sets or JSONL files (default code,prose,qa)")
    p.add_argument("--warm-prompts", action="store_true",
                   help="read each burst's prompts (1 token each) just before it, so that "
                        "every burst decodes from cached prompts (default: every burst "
                        "reads its prompts, none of which the warm-up used)")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/completion")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one request may take (default 900)")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds a server may take to become healthy (default 300)")
    p.add_argument("--log-dir", help="the servers' logs (default: a new temporary folder)")
    p.add_argument("--out", help="write the figures as JSON here")
    return p


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")     # runs the finally that stops the servers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    a.argv = argv
    signal.signal(signal.SIGTERM, _terminate)
    try:
        report = run(a)
    except UsageError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (ServerStartError, WarmUpError) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    print(render(report))
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    failed = sum(len(c["errors"]) + c["short"] for c in report["cells"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
