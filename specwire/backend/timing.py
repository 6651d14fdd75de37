"""Timing a backend's batches: what verification costs per batch size, on the real model."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any


def batch_tries(backend: Any, prompt: Sequence[int], sizes: Sequence[int], reps: int,
                clock: Any = time, logits: str = "all") -> dict[int, list[float]]:
    """Seconds each of reps evaluations of a batch of n tokens took after the prompt (logits:
    the rows asked for), the cache truncated back after each; a first pass warms up.

    The sizes take turns, rep after rep, so that a shared machine's drift in speed lands on
    every size alike and the ratios between them stay honest.
    """
    sizes = sorted({n for n in sizes if 0 < n <= backend.n_ctx - len(prompt) - 1})
    backend.truncate(0)
    backend.eval(list(prompt), logits="last")
    base = backend.n_past
    filler = list(prompt) or [0]
    tries: dict[int, list[float]] = {n: [] for n in sizes}
    for rep in range(reps + 1):
        for n in sizes:
            batch = [filler[i % len(filler)] for i in range(n)]
            t0 = clock.perf_counter()
            backend.eval(batch, logits=logits)
            if rep:
                tries[n].append(clock.perf_counter() - t0)
            backend.truncate(base)
    backend.truncate(0)
    return tries
