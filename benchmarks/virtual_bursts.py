"""Bursts of concurrent requests in virtual time: the emulated regime without the machine's load.

Runs the engine `serve -np N -md --emulate PRESET` builds, in-process, with time.perf_counter
and time.sleep replaced by a virtual clock that only the emulation's holds advance: every
decode takes exactly its emulated time, the real models' compute and Python's own work take
none. So the figures are the regime's alone, the same on a quiet or a loaded machine (what a
wall-clock run loses against them is Python's unscaled work and decodes over their time).
Each level's burst runs plain and with the draft, interleaved, its prompts first read into
their sequences' caches (1 token each), as `benchmarks.concurrency --warm-prompts`; the
draft's policies keep what they learned from burst to burst, as a server's do.

    python -m benchmarks.virtual_bursts --concurrency 1,4 -np 4 --emulate cpu-membound
"""

from __future__ import annotations

import argparse
import time


class VirtualClock:
    """perf_counter and sleep of a clock that only sleeping advances."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(0.0, seconds)


def burst(engine, prompts: list[list[int]], n: int, drafted: bool, n_max: int) -> dict:
    """The requests' prompts read into sequences 0.., then all of them run together (the
    first a step ahead, as a server admits its first arrival); the burst's figures."""
    from specwire.config import DraftParams, SamplingParams
    from specwire.engine.engine import Request

    dp = DraftParams(n_max=n_max, policy="adaptive", enabled=drafted)
    greedy = SamplingParams(temperature=0.0)
    for i, p in enumerate(prompts):
        engine.generate(Request(p, 1, greedy, dp, ignore_eos=True), seq=i).run()
    t0 = time.perf_counter()
    gens = [engine.generate(Request(prompts[0], n, greedy, dp, ignore_eos=True), seq=0)]
    engine.step()
    gens += [engine.generate(Request(p, n, greedy, dp, ignore_eos=True), seq=i + 1)
             for i, p in enumerate(prompts[1:])]
    while any(not g.done for g in gens):
        engine.step()
    seconds = time.perf_counter() - t0
    tokens = sum(len(g.tokens) for g in gens)
    return {"tps": tokens / seconds, "drafted": sum(g.stats.draft_n for g in gens),
            "kept": sum(g.stats.draft_n_accepted for g in gens),
            "tokens": [g.tokens for g in gens]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.virtual_bursts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4")
    p.add_argument("-np", "--parallel", type=int, default=4)
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", default="code")
    p.add_argument("--emulate", default="cpu-membound")
    a = p.parse_args(argv)
    clock = VirtualClock()
    time.perf_counter, time.sleep = clock.perf_counter, clock.sleep   # type: ignore[assignment]

    from benchmarks.concurrency import load_prompts
    from specwire.build import build_engine
    from specwire.cli.main import build_parser
    from specwire.cli.settings import engine_settings

    levels = [int(x) for x in a.concurrency.split(",")]
    if max(levels) > a.parallel:
        p.error(f"--concurrency: {max(levels)} requests need -np {max(levels)}")
    serve = build_parser().parse_args(
        ["serve", "-np", str(a.parallel), "-t", "1", "-td", "1", "--draft-max",
         str(a.draft_max), "--emulate", a.emulate, "--emulate-scale", "1"])
    engine = build_engine(engine_settings(serve), n_seq=a.parallel)
    texts = [t for _, t in load_prompts(a.prompts)]
    prompts = [engine.target.tokenize(t) for t in texts]
    for drafted in (False, True):        # warm-up: prompts no burst uses
        burst(engine, prompts[-a.parallel:], 8, drafted, a.draft_max)
    rates: dict[tuple[int, bool], list[float]] = {}
    same, at = True, 0
    for _ in range(a.repeats):
        for level in levels:
            ps = [prompts[(at + i) % len(prompts)] for i in range(level)]
            at += level
            got = {d: burst(engine, ps, a.n_predict, d, a.draft_max) for d in (False, True)}
            same = same and got[False]["tokens"] == got[True]["tokens"]
            for d, b in got.items():
                rates.setdefault((level, d), []).append(b["tps"])
                print(f"{level} {'-md' if d else 'plain':5} {b['tps']:7.2f} emulated tok/s, "
                      f"drafted {b['drafted']}, kept {b['kept']}", flush=True)
    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    lo, hi = min(levels), max(levels)
    print(f"with the draft: {hi} requests {mean[(hi, True)] / mean[(lo, True)]:.2f}x {lo}, "
          f"{mean[(hi, True)] / mean[(hi, False)]:.2f}x plain at {hi}; same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
