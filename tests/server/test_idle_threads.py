"""serve's request threads (anyio's worker pool) shrink back once the server is idle.

anyio retires a worker idle for MAX_IDLE_TIME only when it hands out the next piece of
work, so after a burst the pool keeps its busiest size until the next request.
retire_idle_workers hands it a no-op now and then; here with the idle time made short,
on a real event loop.
"""

from __future__ import annotations

import threading
import time

import anyio
import anyio.to_thread
from anyio._backends import _asyncio as anyio_asyncio

from specwire.server import idle_threads


def _workers() -> int:
    return sum(isinstance(t, anyio_asyncio.WorkerThread) for t in threading.enumerate())


def _burst_then_idle(monkeypatch, retire: bool) -> tuple[int, int]:
    """Workers after a burst of 4 calls at once, and once idle (a second at most)."""
    monkeypatch.setattr(anyio_asyncio.WorkerThread, "MAX_IDLE_TIME", 0.05)
    gate = threading.Barrier(4)

    async def main() -> tuple[int, int]:
        async with anyio.create_task_group() as tg:
            for _ in range(4):
                tg.start_soon(anyio.to_thread.run_sync, gate.wait)
        busiest = _workers()
        async with anyio.create_task_group() as tg:
            if retire:
                tg.start_soon(idle_threads.retire_idle_workers, 0.02)
            deadline = time.monotonic() + 1.0
            while _workers() > 1 and time.monotonic() < deadline:
                await anyio.sleep(0.02)
            idle = _workers()
            tg.cancel_scope.cancel()
        return busiest, idle

    return anyio.run(main)


def test_idle_workers_are_retired(monkeypatch) -> None:
    busiest, idle = _burst_then_idle(monkeypatch, retire=True)
    assert busiest == 4 and idle == 1


def test_without_it_the_pool_keeps_its_busiest_size(monkeypatch) -> None:
    """The control: anyio alone keeps all four until the next call."""
    busiest, idle = _burst_then_idle(monkeypatch, retire=False)
    assert busiest == 4 and idle == 4
