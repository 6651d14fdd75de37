"""specwire's n-gram drafter against llama.cpp's n-gram types, side by side, one command.

    python -m benchmarks.versus_llama --llama-bin DIR [--prompts code] [--limit 6]

Per prompt, each llama.cpp type (`llama-speculative-simple --spec-type T`) and
each specwire configuration (`specwire generate --draft-ngram ...`) runs as a
fresh process on the same target, greedy, one thread, interleaved (the order
rotates per prompt and repetition, so that a drift in the machine's load falls
on every configuration alike). Each tool's own decoding tokens/s is read from
its output: llama.cpp's "decoded N tokens in S seconds", specwire's
`timings.predicted_*`. Prompt evaluation and model loading are left out of
both.

llama-speculative-simple does not stop at -n (it ran 128 -> 177 tokens here),
and the later tokens of a greedy run are often a repetition that is cheap to
draft; so specwire is asked for as many tokens as llama.cpp produced for the
same prompt (the most of its types), and both decode the same text. A fresh
process per prompt means specwire's learning starts from its priors each time,
as llama.cpp's tables do.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specwire.bench.prompts import resolve

TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ACCEPT = re.compile(r"n_drafted\s*=\s*(\d+).*?n_accept\s*=\s*(\d+)", re.S)
DEFAULT_SPECWIRE = ("ngram=--draft-ngram --draft-max 16 --draft-policy adaptive",)


@dataclass(slots=True)
class Run:
    tokens: int
    seconds: float
    drafted: int = 0
    accepted: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Tally:
    """One configuration's runs, per prompt."""

    runs: dict[str, list[Run]] = field(default_factory=dict)

    def add(self, prompt: str, run: Run) -> None:
        self.runs.setdefault(prompt, []).append(run)

    def rate(self, prompt: str) -> float:
        """Median tokens/s over the repetitions of one prompt."""
        return statistics.median(r.rate for r in self.runs[prompt])

    def set_rate(self) -> float:
        """All tokens over all decoding time."""
        runs = [r for rs in self.runs.values() for r in rs]
        return sum(r.tokens for r in runs) / max(sum(r.seconds for r in runs), 1e-9)

    def kept(self) -> str:
        drafted = sum(r.drafted for rs in self.runs.values() for r in rs)
        accepted = sum(r.accepted for rs in self.runs.values() for r in rs)
        return f"{accepted}/{drafted}" if drafted else "-"


def run_llama(binary: Path, model: str, prompt_file: str, spec_type: str, a) -> Run:
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    argv = [str(binary), "-m", model, "-f", prompt_file, "-n", str(a.n_predict), "--temp", "0",
            "-t", str(a.threads), "-c", str(a.ctx_size), "--spec-type", spec_type,
            "--spec-draft-n-max", str(a.draft_max), *a.llama_args.split()]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=a.timeout_s)
    text = out.stdout + out.stderr
    m = _DECODED.search(text)
    if out.returncode != 0 or m is None:
        raise SystemExit(f"{spec_type}: llama-speculative-simple failed (status "
                         f"{out.returncode}):\n{text[-2000:]}")
    acc = _ACCEPT.search(text)
    return Run(int(m.group(1)), float(m.group(2)),
               int(acc.group(1)) if acc else 0, int(acc.group(2)) if acc else 0)


def run_specwire(model: str, prompt: str, n: int, args: str, a) -> Run:
    argv = [sys.executable, "-m", "specwire", "generate", prompt, "-m", model, "-n", str(n),
            "--temp", "0", "-t", str(a.threads), "-c", str(a.ctx_size), "--json", *args.split()]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=a.timeout_s)
    if out.returncode != 0:
        raise SystemExit(f"specwire generate {args}: failed (status {out.returncode}):\n"
                         f"{out.stderr[-2000:]}")
    t = json.loads(out.stdout)["timings"]
    return Run(int(t["predicted_n"]), float(t["predicted_ms"]) / 1000.0,
               int(t.get("draft_n", 0)), int(t.get("draft_n_accepted", 0)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.versus_llama",
                                description="specwire n-gram vs llama.cpp n-gram types")
    p.add_argument("--llama-bin", required=True,
                   help="directory holding llama-speculative-simple (and its libraries)")
    p.add_argument("-m", "--model", default=None, help="target GGUF (default: bundled target)")
    p.add_argument("--prompts", default="code")
    p.add_argument("--limit", type=int, default=6)
    p.add_argument("--reps", type=int, default=1, help="runs of each configuration per prompt")
    p.add_argument("-n", "--n-predict", type=int, default=128)
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-c", "--ctx-size", type=int, default=1024)
    p.add_argument("--types", default=",".join(TYPES), help="llama.cpp --spec-type values")
    p.add_argument("--llama-args", default="", help="extra llama-speculative-simple flags")
    p.add_argument("--specwire", action="append", default=None, metavar="NAME=FLAGS",
                   help="a specwire configuration: name and generate flags (repeatable; "
                        f"default {DEFAULT_SPECWIRE[0]!r})")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None, help="write every run here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    binary = Path(a.llama_bin) / "llama-speculative-simple"
    if not binary.is_file():
        print(f"--llama-bin: no llama-speculative-simple in {a.llama_bin}", file=sys.stderr)
        return 2
    if a.model is None:
        from specwire.assets.models import bundled_path
        a.model = str(bundled_path("target"))
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    ours: dict[str, str] = {}
    for item in a.specwire or DEFAULT_SPECWIRE:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            print(f"--specwire: expected NAME=FLAGS, got {item!r}", file=sys.stderr)
            return 2
        ours[f"specwire {name}"] = flags
    names = [f"llama {t}" for t in types] + list(ours)
    tallies = {name: Tally() for name in names}
    prompts = resolve(a.prompts, a.limit)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for pi, prompt in enumerate(prompts):
            text = prompt.text or ""
            pfile = Path(tmp) / f"{prompt.id}.txt"
            pfile.write_text(text, encoding="utf-8")
            for rep in range(a.reps):
                shift = (pi + rep) % len(types)
                lengths: list[int] = []
                for t in types[shift:] + types[:shift]:
                    run = run_llama(binary, a.model, str(pfile), t, a)
                    tallies[f"llama {t}"].add(prompt.id, run)
                    lengths.append(run.tokens)
                n = max(lengths)
                for name, flags in ours.items():
                    tallies[name].add(prompt.id, run_specwire(a.model, text, n, flags, a))
                line = "  ".join(f"{k.split()[-1]} {tallies[k].runs[prompt.id][-1].rate:.2f}"
                                 for k in names)
                print(f"[{time.perf_counter() - t0:6.0f}s] {prompt.id} rep {rep} n={n}: {line}",
                      file=sys.stderr, flush=True)
    report(tallies, [p.id for p in prompts], list(ours))
    if a.json:
        Path(a.json).write_text(json.dumps(
            {k: {p: [asdict(r) for r in rs] for p, rs in v.runs.items()}
             for k, v in tallies.items()}, indent=1))
    return 0


def report(tallies: dict[str, Tally], prompts: list[str], ours: list[str]) -> None:
    llama = [k for k in tallies if k.startswith("llama ")]
    best = max(llama, key=lambda k: statistics.median(tallies[k].rate(p) for p in prompts))
    print(f"{'configuration':28s} {'median tok/s':>12s} {'set tok/s':>10s} {'kept':>11s}")
    for k, t in tallies.items():
        med = statistics.median(t.rate(p) for p in prompts)
        print(f"{k:28s} {med:12.2f} {t.set_rate():10.2f} {t.kept():>11s}")
    for k in ours:
        per_best = [tallies[k].rate(p) / max(tallies[q].rate(p) for q in llama) for p in prompts]
        by_median = (statistics.median(tallies[k].rate(p) for p in prompts)
                     / statistics.median(tallies[best].rate(p) for p in prompts))
        wins = sum(r >= 1.0 for r in per_best)
        print(f"{k}: {by_median:.2f}x llama's best type by median ({best.split()[-1]}), "
              f"{tallies[k].set_rate() / tallies[best].set_rate():.2f}x by set rate; "
              f"per prompt against the fastest type there: median "
              f"{statistics.median(per_best):.2f}x, won {wins} of {len(prompts)}")


if __name__ == "__main__":
    sys.exit(main())
