"""Shutdown that loses nothing: `serve --shutdown-timeout`.

On SIGTERM (or Ctrl-C) uvicorn stops accepting connections and waits for the open
requests, then cancels what is left, which cuts a stream without a word. Here the
scheduler is told first: requests still waiting for a slot are answered 503 with
Retry-After at once, new ones the same; running generations have the drain's
seconds to finish; then they end with a 503 (an SSE error event on a stream) and
uvicorn gets a few more seconds to write those before it cancels anything.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from specwire.server.slots import SlotPool

log = logging.getLogger("specwire.serve")

#: serve's default --shutdown-timeout: a typical generation on a CPU finishes within it.
SHUTDOWN_TIMEOUT_S = 30.0
#: After the cut, the time left for the 503s and error events to be written.
FLUSH_S = 3.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining the scheduler's jobs before its own shutdown steps."""

    def __init__(self, config: uvicorn.Config, scheduler: SlotPool,
                 timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
        config.timeout_graceful_shutdown = int(timeout_s + FLUSH_S + 1)
        super().__init__(config)
        self.scheduler, self.timeout_s = scheduler, timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        running = self.scheduler.running()
        log.info("shutting down: %d generation%s running get up to %.0f s (--shutdown-timeout)",
                 running, "" if running == 1 else "s", self.timeout_s)
        self.scheduler.drain()
        cut = asyncio.get_running_loop().call_later(self.timeout_s, self._cut)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _cut(self) -> None:
        left = self.scheduler.running()
        if left:
            log.warning("shutting down: ending %d generation%s still running after %.0f s",
                        left, "" if left == 1 else "s", self.timeout_s)
        self.scheduler.cut()
