"""What a draft model drafting beside the target costs the target's verification.

    python -m benchmarks.colocation [--reps 8] [--sizes 1,5,9]

bench's free-drafter bound prices a round on the verification curve measured
with nothing else running; a pipelined node on the same machine (bench's
emulated link) drafts while the target verifies, and the two share memory
bandwidth and, on a machine that runs other work, cores. This times the
target's batches of n tokens (all logits, as verification asks) with the draft
model idle and drafting in another process, interleaved rep by rep so that a
shared machine's drift lands on both alike, and prints the ratio: how much of a
pipelined configuration's distance from the bound is co-location, which a node
on another machine does not pay.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + f"


def _backend(path: str):
    from specwire.backend.llama import LlamaBackend
    from specwire.config import ModelParams
    return LlamaBackend(ModelParams(path, n_ctx=512))


def _draft_loop(path: str, busy, stop, rate) -> None:
    """Greedy one-token steps, as a node drafts, while `busy` is set."""
    be = _backend(path)
    toks = be.tokenize(PROMPT)
    be.eval(toks, logits="last")
    base, tok, n, t0 = be.n_past, toks[-1], 0, time.perf_counter()
    while not stop.is_set():
        if not busy.is_set():
            time.sleep(0.002)
            n, t0 = 0, time.perf_counter()
            continue
        if be.n_past > 400:
            be.truncate(base)
        tok = int(np.argmax(be.eval([tok], logits="last")[-1]))
        n += 1
        rate.value = n / (time.perf_counter() - t0)


def measure(target: str, draft: str, sizes: Sequence[int], reps: int) -> dict:
    """{n: (idle ms, drafting ms)} medians, and the draft's tokens/s while drafting."""
    ctx = mp.get_context("spawn")
    busy, stop, rate = ctx.Event(), ctx.Event(), ctx.Value("d", 0.0)
    proc = ctx.Process(target=_draft_loop, args=(draft, busy, stop, rate), daemon=True)
    proc.start()
    try:
        be = _backend(target)
        toks = be.tokenize(PROMPT)
        be.eval(toks, logits="last")
        base = be.n_past
        batch = [toks[i % len(toks)] for i in range(max(sizes))]
        times: dict[tuple[bool, int], list[float]] = {(b, n): [] for b in (False, True)
                                                      for n in sizes}
        rates = []
        time.sleep(2.0)  # the draft model loads meanwhile
        for rep in range(reps + 1):  # the first pass warms up
            for drafting in (False, True):
                (busy.set if drafting else busy.clear)()
                time.sleep(0.05)
                for n in sizes:
                    t0 = time.perf_counter()
                    be.eval(batch[:n], logits="all")
                    if rep:
                        times[(drafting, n)].append(time.perf_counter() - t0)
                    be.truncate(base)
                if drafting and rep:
                    rates.append(rate.value)
    finally:
        stop.set()
        proc.join(timeout=10)
    return {"ms": {n: (1000 * statistics.median(times[(False, n)]),
                       1000 * statistics.median(times[(True, n)])) for n in sizes},
            "draft_tps": statistics.median(rates) if rates else None}


def main(argv: Sequence[str] | None = None) -> int:
    from specwire.assets import models
    ap = argparse.ArgumentParser(prog="python -m benchmarks.colocation",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--sizes", default="1,5,9", help="batch sizes, comma-separated")
    args = ap.parse_args(argv)
    try:
        sizes = sorted({int(s) for s in args.sizes.split(",") if s.strip()})
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or max(sizes) > 64 or not 1 <= args.reps <= 100:
        print("colocation: --sizes are batch sizes in 1..64, --reps in 1..100", file=sys.stderr)
        return 2
    out = measure(str(models.default_target()), str(models.default_draft()), sizes, args.reps)
    for n, (idle, drafting) in out["ms"].items():
        print(f"t_v({n}): {idle:.1f} ms with the draft idle, {drafting:.1f} ms while it "
              f"drafts: x{drafting / idle:.2f}")
    if out["draft_tps"]:
        print(f"the draft model meanwhile: {out['draft_tps']:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
