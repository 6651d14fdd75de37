"""Bursts of concurrent requests in one process: where a draft gains or loses in a batch.

`benchmarks/concurrency.py` measures servers over HTTP; this runs the same bursts on
the engine `serve -np N -md` builds, without the server, so that a burst's time
can be split: the target's decodes, the draft model's lockstep decodes (catch-up
and drafts), and the rest. Every slot is first warmed with 8 tokens, then each
level's burst (distinct shipped prompts, `ignore_eos`, greedy) runs plain (the
request without a draft) and with the draft, interleaved, on the same engine; the
draft's policies keep what they learned from burst to burst, as a server's do.
Tokens per CPU second (the process's user + system time) are less disturbed by
other work on the machine than wall tokens/s.

    python -m benchmarks.batch_bursts --concurrency 1,4,8 -np 8 -t 2 -td 2 -n 48
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from benchmarks.concurrency import load_prompts


@dataclass(slots=True)
class Timers:
    """Seconds inside the target's decodes and the lockstep drafting, counted by wrapping
    the engine's scheduler (a benchmark's view; the engine itself is unchanged)."""

    target_s: float = 0.0
    draft_s: float = 0.0


def _wrap(obj: object, name: str, timers: Timers, field: str) -> None:
    fn = getattr(obj, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            setattr(timers, field, getattr(timers, field) + time.perf_counter() - t0)

    setattr(obj, name, timed)


def burst(engine, texts: list[str], n: int, drafted: bool, n_max: int, lead: int = 1) -> dict:
    """Run the requests to the end together, the first `lead` steps ahead of the others;
    the burst's figures."""
    from specwire.config import DraftParams, SamplingParams
    from specwire.engine.engine import Request

    target = engine.target
    dp = DraftParams(n_max=n_max, policy="adaptive", enabled=drafted)
    reqs = [Request(target.tokenize(t), n, SamplingParams(temperature=0.0), dp,
                    ignore_eos=True, cache_prompt=False) for t in texts]
    timers = Timers()
    sched = engine.scheduler
    _wrap(sched.batch, "decode", timers, "target_s")
    _wrap(sched, "draft", timers, "draft_s")
    try:
        c0, t0 = os.times(), time.perf_counter()
        gens = [engine.generate(reqs[0])]
        for _ in range(lead):       # the first request's prompt is read before the others
            engine.step()           # are admitted, as a server's first arrival is
        gens += [engine.generate(r) for r in reqs[1:]]
        while any(not g.done for g in gens):
            engine.step()
        wall = time.perf_counter() - t0
        c1 = os.times()
    finally:
        del sched.batch.decode, sched.draft
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    tokens = sum(len(g.tokens) for g in gens)
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "tps": tokens / wall,
            "cpu_tps": tokens / cpu if cpu else 0.0,
            "drafted": sum(g.stats.draft_n for g in gens),
            "kept": sum(g.stats.draft_n_accepted for g in gens),
            "asked_rounds": sum(g.stats.asked_rounds for g in gens),
            "rounds": sum(g.stats.rounds for g in gens),
            "target_s": timers.target_s, "draft_s": timers.draft_s}


def main(argv: list[str] | None = None) -> int:
    from specwire.build import build_engine
    from specwire.cli.main import build_parser
    from specwire.cli.settings import engine_settings

    p = argparse.ArgumentParser(prog="python -m benchmarks.batch_bursts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,4,8")
    p.add_argument("-np", "--parallel", type=int, default=8)
    p.add_argument("-t", "--threads", type=int, default=2)
    p.add_argument("-td", "--threads-draft", type=int, default=2)
    p.add_argument("-n", "--n-predict", type=int, default=48)
    p.add_argument("-c", "--ctx-size", type=int, default=1024)
    p.add_argument("--draft-max", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--prompts", default="code,prose,qa")
    p.add_argument("--lead", type=int, default=1,
                   help="steps the first request of a burst runs before the others join "
                        "(default 1: a server admits the first arrival at once)")
    a = p.parse_args(argv)
    levels = [int(x) for x in a.concurrency.split(",")]
    serve = build_parser().parse_args(
        ["serve", "-np", str(a.parallel), "-t", str(a.threads), "-td", str(a.threads_draft),
         "-c", str(a.ctx_size), "--draft-max", str(a.draft_max)])
    engine = build_engine(engine_settings(serve), n_seq=a.parallel)
    prompts = [text for _, text in load_prompts(a.prompts)]
    warm = prompts[:a.parallel]
    for drafted in (False, True):
        burst(engine, warm, 8, drafted, a.draft_max)
    at = a.parallel
    print(f"{'burst':>12} {'tok/s':>6} {'tok/CPU-s':>9} {'drafted':>7} {'kept':>5} "
          f"{'asked':>9} {'target s':>8} {'draft s':>7} {'wall s':>6}  load")
    for _ in range(a.repeats):
        for level in levels:
            texts = [prompts[(at + i) % len(prompts)] for i in range(level)]
            at += level
            for drafted in (False, True):
                b = burst(engine, texts, a.n_predict, drafted, a.draft_max, a.lead)
                name = f"{level} {'-md' if drafted else 'plain'}"
                print(f"{name:>12} {b['tps']:6.1f} {b['cpu_tps']:9.1f} {b['drafted']:7d} "
                      f"{b['kept']:5d} {b['asked_rounds']:4d}/{b['rounds']:<4d} "
                      f"{b['target_s']:8.2f} {b['draft_s']:7.2f} {b['wall_s']:6.2f}  "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
