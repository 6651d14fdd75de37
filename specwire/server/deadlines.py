"""What one client may hold on `serve`: connections, time to send headers, a body, bytes.

uvicorn times out only keep-alive connections between requests, so a connection that sends
nothing, half its headers or a body a byte a second is held for ever, and so are the bytes
of every body being read. `protocol(...)` is uvicorn's h11 protocol with a deadline on a
request's headers (from the connection's start, or the next request's first byte) and a cap
on open connections; `BodyBudget` caps the bytes of all bodies being read (503 with
Retry-After) and gives each body a deadline (408), applied by limits.read_body.
"""

from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

from specwire.server.errors import ApiError

log = logging.getLogger("specwire.serve")

#: serve's defaults: --header-timeout, --body-timeout, --max-connections, --max-reading.
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256
MAX_READING_BYTES = 64 << 20


class _Deadlined(H11Protocol):
    """h11 with a header deadline and a connection cap (set by `protocol`)."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._deadline: asyncio.TimerHandle | None = None
        if len(self.connections) > self.max_connections:
            log.debug("connection from %s refused: %d open (--max-connections)", self.client,
                      len(self.connections) - 1)
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and not self._in_request():
            self._arm()                # the next request on a kept connection begins
        super().data_received(data)
        if self._deadline is not None and self._in_request():
            self._deadline.cancel()
            self._deadline = None

    def connection_lost(self, exc: Exception | None) -> None:
        if getattr(self, "_deadline", None) is not None:
            self._deadline.cancel()
            self._deadline = None
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if not self._in_request() and not self.transport.is_closing():
            log.debug("connection from %s closed: no request headers within %.0f s",
                      self.client, self.header_timeout_s)
            self.transport.close()


def protocol(header_timeout_s: float = HEADER_TIMEOUT_S,
             max_connections: int = MAX_CONNECTIONS) -> type[H11Protocol]:
    """The protocol class to give uvicorn.Config(http=...)."""
    return type("DeadlinedH11", (_Deadlined,), {"header_timeout_s": header_timeout_s,
                                                 "max_connections": max_connections})


class BodyBudget:
    """Bytes of request bodies being read, all requests together (the event loop's alone)."""

    def __init__(self, total: int = MAX_READING_BYTES, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.total, self.timeout_s = total, timeout_s
        self.held = 0

    def take(self, n: int) -> None:
        """Hold n more bytes, or a 503 if that would pass the total."""
        if self.held + n > self.total:
            raise ApiError(503, f"the server is reading {self.held} bytes of request bodies "
                           f"already (--max-reading {self.total}); retry shortly",
                           "unavailable_error", retry_after=1)
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n

    def late(self) -> ApiError:
        return ApiError(408, f"request body: not received within {self.timeout_s:g} s "
                        "(--body-timeout)", "timeout_error")
