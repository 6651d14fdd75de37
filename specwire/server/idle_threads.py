"""The request threads' pool shrinks back once the server is idle.

Parsing, tokenizing and templating run on anyio's worker threads (run_in_threadpool).
anyio starts a worker when none is idle and retires the workers idle for 10 s, but only
when it hands out the next piece of work: after a burst, the pool keeps its busiest size
until a request comes. A no-op handed to the pool every few seconds lets it retire them,
so that an idle server holds one worker whatever its busiest moment was (threads and
descriptors are then back to their idle values, which the soak checks).
"""

from __future__ import annotations

import anyio
import anyio.to_thread

#: Seconds between the no-ops: a worker idle for 10 s goes within this much more.
EVERY_S = 5.0


def _nothing() -> None:
    return None


async def retire_idle_workers(every_s: float = EVERY_S) -> None:
    """Hand the pool a no-op every `every_s` seconds, for ever (cancel it to stop)."""
    while True:
        await anyio.sleep(every_s)
        await anyio.to_thread.run_sync(_nothing)
