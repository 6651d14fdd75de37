"""Two machines on one box: bench/cpus.py pins whole processes to disjoint CPU halves."""

from __future__ import annotations

import os
import threading

import pytest

from specwire.bench import cpus

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux and at least two CPUs",
)


def test_halves_split_the_cpus_in_two_disjoint_sets() -> None:
    mine, node = cpus.halves()
    assert mine and node and not mine & node
    assert mine | node == os.sched_getaffinity(0)


def test_pinned_moves_every_thread_and_puts_them_back() -> None:
    """Threads that already run are pinned too, and the old mask comes back after."""
    before = os.sched_getaffinity(0)
    started, stop = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def worker() -> None:
        seen["tid"] = {threading.get_native_id()}
        started.set()
        stop.wait()

    t = threading.Thread(target=worker)
    t.start()
    started.wait()
    tid = next(iter(seen["tid"]))
    mine, _ = cpus.halves()
    try:
        with cpus.pinned(mine):
            assert os.sched_getaffinity(0) == mine
            assert os.sched_getaffinity(tid) == mine
        assert os.sched_getaffinity(0) == before
        assert os.sched_getaffinity(tid) == before
    finally:
        stop.set()
        t.join()


def test_pinned_none_changes_nothing() -> None:
    before = os.sched_getaffinity(0)
    with cpus.pinned(None):
        assert os.sched_getaffinity(0) == before
