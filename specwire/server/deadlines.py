"""What one client may hold on `serve`: connections, time to send headers, a body, bytes.

uvicorn times out only keep-alive connections between requests, so a connection that sends
nothing, half its headers or a body a byte a second is held for ever, and so are the bytes
of every body being read. `protocol(...)` is uvicorn's h11 protocol with a deadline on a
request's headers (from the connection's accept, TLS handshake included, and again from
the end of each response: the next request's headers must be in by then), a cap on open
connections (handshakes in progress counted) and a smaller one per client address, and a
deadline on a response that its client stopped reading (an endless stream would hold its
slot for ever: the connection is cut, which cancels the job); `BodyBudget` caps the
bytes of all bodies being read (503 with Retry-After) and gives each body a deadline
(408), applied by limits.read_body.

With TLS the handshake is done by asyncio's own TLS layer, as loop.create_server(ssl=...)
would, but put under the protocol here (`_CountedTLS`): the loop's way runs the handshake
before the protocol sees the connection, uncounted, for up to 60 s.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from asyncio import sslproto
from collections.abc import Callable

from uvicorn.protocols.http.h11_impl import H11Protocol

from specwire.server.errors import ApiError

log = logging.getLogger("specwire.serve")

#: serve's defaults: --header-timeout, --body-timeout, --max-connections, --max-reading,
#: --keep-alive (llama-server's HTTP library and uvicorn keep an idle connection 5 s).
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256
MAX_READING_BYTES = 64 << 20
KEEP_ALIVE_S = 5.0
#: serve's default --conn-per-address: this share of --max-connections.
PER_ADDRESS_SHARE = 4


def per_address_default(max_connections: int) -> int:
    """--conn-per-address when not given: a quarter of --max-connections (at least 1)."""
    return max(1, max_connections // PER_ADDRESS_SHARE)


class _Deadlined(H11Protocol):
    """h11 with a header deadline and connection caps (set by `protocol`)."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    per_address = 0                       # 0: no cap but max_connections
    write_timeout_s = BODY_TIMEOUT_S      # a response's writes may stall this long
    handshaking: set[_Deadlined] = set()  # TLS handshakes in progress (one set per class)

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003 - uvicorn's
        super().__init__(*args, **kwargs)  # at the accept, before any TLS handshake
        self._accepted = self.loop.time()
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._host: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        counted = self in self.handshaking     # TLS: counted at its accept (_CountedTLS)
        self.handshaking.discard(self)
        super().connection_made(transport)
        if not counted:
            self._host = _host(self.client)
            if self._refuse():
                transport.close()
                return
        self._arm(self._accepted + self.header_timeout_s - self.loop.time())

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and not self._in_request():
            self._arm(self.header_timeout_s)   # the next request on a kept connection begins
        super().data_received(data)
        if self._deadline is not None and self._in_request():
            self._deadline.cancel()
            self._deadline = None

    def on_response_complete(self) -> None:
        super().on_response_complete()      # (may start a pipelined request)
        if self._deadline is None and not self._in_request() and \
                not self.transport.is_closing():
            self._arm(self.header_timeout_s)   # the next request's headers: due by then

    def pause_writing(self) -> None:
        """The transport's buffer is full: the client reads nothing; past the write
        deadline the connection is cut (uvicorn then tells the app: its job is cancelled)."""
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.write_timeout_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._deadline, self._stall):
            if timer is not None:
                timer.cancel()
        self._deadline = self._stall = None
        super().connection_lost(exc)

    def _stalled(self) -> None:
        self._stall = None      # (resume_writing would have cancelled it: still paused)
        if self.transport is not None:
            log.info("connection from %s cut: it read nothing of its response for %g s "
                     "(--body-timeout)", self._host, self.write_timeout_s)
            self.transport.abort()     # close() would wait for the unread bytes

    def _refuse(self) -> bool:
        """Whether this connection, counted already, passes --max-connections or its
        address's --conn-per-address (handshakes in progress count too)."""
        held = (*self.connections, *self.handshaking)
        if len(held) > self.max_connections:
            log.debug("connection from %s refused: %d open (--max-connections)", self._host,
                      len(held) - 1)
            return True
        if self.per_address and self._host is not None:
            mine = sum(getattr(c, "_host", None) == self._host for c in held)
            if mine > self.per_address:
                log.debug("connection from %s refused: %d open from it (--conn-per-address)",
                          self._host, mine - 1)
                return True
        return False

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self, seconds: float) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(max(0.0, seconds), self._expire)

    def _expire(self) -> None:
        self._deadline = None
        if not self._in_request() and not self.transport.is_closing():
            log.debug("connection from %s closed: no request headers within %.0f s",
                      self.client, self.header_timeout_s)
            self.transport.close()


class _CountedTLS(sslproto.SSLProtocol):
    """asyncio's TLS layer over a `_Deadlined` connection: the handshake counted against
    the caps from the accept, and cut at the header deadline; a closing connection's TLS
    shutdown too (asyncio's default would hold it 30 s for a peer that never answers)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        app: _Deadlined = self._app_protocol
        app._host = _host(transport.get_extra_info("peername"))
        app.handshaking.add(app)
        if app._refuse():
            app.handshaking.discard(app)
            transport.abort()
            return
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        app = self._app_protocol
        if app is not None:
            app.handshaking.discard(app)
        super().connection_lost(exc)


def _host(peer: object) -> str | None:
    return peer[0] if isinstance(peer, tuple) and peer else None


def protocol(header_timeout_s: float = HEADER_TIMEOUT_S,
             max_connections: int = MAX_CONNECTIONS, per_address: int = 0,
             tls: ssl.SSLContext | None = None,
             write_timeout_s: float = BODY_TIMEOUT_S) -> Callable[..., asyncio.Protocol]:
    """What to give uvicorn.Config(http=...): the protocol class, or with `tls` (and no
    ssl_* to uvicorn) a factory putting each connection under a counted TLS layer."""
    cls = type("DeadlinedH11", (_Deadlined,), {"header_timeout_s": header_timeout_s,
                                                "max_connections": max_connections,
                                                "per_address": per_address,
                                                "write_timeout_s": write_timeout_s,
                                                "handshaking": set()})
    if tls is None:
        return cls

    def counted_tls(*args, **kwargs) -> asyncio.Protocol:  # noqa: ANN002, ANN003 - uvicorn's
        app = cls(*args, **kwargs)
        # The close's TLS shutdown waits for the peer's close_notify: as long at most.
        return _CountedTLS(app.loop, app, tls, None, server_side=True,
                           ssl_handshake_timeout=header_timeout_s,
                           ssl_shutdown_timeout=header_timeout_s)

    return counted_tls


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
