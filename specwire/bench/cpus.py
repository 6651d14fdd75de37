"""Two machines on one box: the target and the draft node on disjoint CPUs.

On a LAN the target and the draft node each have their own CPUs; on one box the scheduler
moves every thread freely, so a gRPC thread of one wakes on the core where the other
computes, and a wake-up across busy cores costs more (a gRPC round makes several;
benchmarks/link_overhead.py measures both ways, --shared-cpus). Remote benchmark modes
therefore pin the target to the first half of the CPUs and the draft node to the second;
in-process modes keep all. Linux only (sched_setaffinity); elsewhere, or with one CPU,
nothing is pinned.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


def halves() -> tuple[set[int], set[int]] | None:
    """(target's CPUs, draft node's CPUs), or None where they cannot be split."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def pin_process(cpus: set[int], pid: int | None = None) -> None:
    """Every thread of a process (this one by default) onto cpus.

    sched_setaffinity acts on one thread; threads started later inherit the
    mask of the thread that starts them, so pinning all current ones is enough.
    """
    tasks = f"/proc/{pid or 'self'}/task"
    for tid in os.listdir(tasks):
        with contextlib.suppress(ProcessLookupError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This process on cpus for the block, then back where it was; None: no change."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    pin_process(cpus)
    try:
        yield
    finally:
        pin_process(before)
