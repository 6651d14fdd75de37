"""The draft links of one target, shared by all its drafters: one connection per node, a
stream per call.

The slots of `serve -np N` share one LinkSet, so a node sees one target on one HTTP/2
connection (a Line) whatever N: Hello, every session and pings are streams of it, and
what ends one stream leaves the others alone. A synchronous caller writes its verdict
and reads the chunk itself under the line's lock; pipelined chunks are read by the
line's reader thread, which also pings a connection that has gone quiet (KEEPALIVE_S).
A drafter built alone (tests, `generate`) has a LinkSet of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import threading
import time
from collections.abc import Callable

from specwire.link.transport import protocol
from specwire.link.transport.h2.connection import Connection, GrpcStatus, H2Error

log = logging.getLogger("specwire.remote")

#: Keepalive while pipelined streams are open: a PING after this long without a frame,
#: answered within the timeout or the connection is given up.
KEEPALIVE_S = 20.0
KEEPALIVE_TIMEOUT_S = 10.0
#: The reader's longest wait between checks of its keepalive and of messages a caller
#: of another stream read for it.
READER_TICK_S = 0.5

class LinkError(Exception):
    """A draft node could not be used; the message says why."""


#: What a pipelined stream's callback gets: a message's bytes, None when the node ended
#: the call with status OK, or the exception that ended it (GrpcStatus, H2Error).
Delivery = bytes | None | Exception
#: A pipelined stream's callback: deliver(stream id, what came).
Deliver = Callable[[int, Delivery], None]


class Line:
    """One connection to a node, shared by the calls of every drafter of a target; each
    call on it holds its lock (a wait for one stream's answer reads, and keeps, what
    arrives for the others meanwhile)."""

    def __init__(self, conn: Connection, link, port: int) -> None:
        self.conn, self.link, self.port = conn, link, port
        self.authority = f"{link.address()[0]}:{port}"
        self.lock = threading.RLock()
        self._piped: dict[int, Deliver] = {}  # pipelined streams' callbacks
        self._reader: threading.Thread | None = None
        self._kick_r, self._kick_w = socket.socketpair()
        self._kick_r.setblocking(False)
        self._kick_w.setblocking(False)

    def broken(self) -> bool:
        """The connection is gone (lost, closed, or the node sent GOAWAY): every session
        on it has failed, not just the one that noticed."""
        return self.conn.closed or self.conn.goaway is not None

    def _authority(self) -> tuple[str, str]:
        return self.authority, "https" if self.link.settings.tls_ca else "http"

    def open(self, first: Callable[[], bytes], timeout_s: float,
             on_message: Deliver | None = None) -> int | None:
        """A Session call whose first message (the Open, made by `first` once the call is
        sure to start) is sent; its stream id, or None if the node takes no more calls on
        this connection now (its MAX_CONCURRENT_STREAMS). on_message: a pipelined
        stream's callback (on the reader thread, deliver(sid, what came)); without it the
        caller reads."""
        authority, scheme = self._authority()
        with self.lock:
            if not self.conn.room():
                return None
            sid = self.conn.request(protocol.SESSION_PATH, authority, self.link.metadata(),
                                    scheme)
            if on_message is not None:
                self._piped[sid] = on_message
                self._start_reader()
            self.conn.send_message(sid, first(), timeout_s=timeout_s)
            return sid

    def unary(self, path: str, request: bytes, timeout_s: float) -> bytes:
        """One request, one reply (Hello); GrpcStatus for a call that failed, H2Error or
        TimeoutError for the connection."""
        authority, scheme = self._authority()
        with self.lock:
            if not self.conn.room():
                raise H2Error("the node takes no more calls on this connection")
            sid = self.conn.request(path, authority, self.link.metadata(), scheme)
            try:
                self.conn.send_message(sid, request, end_stream=True, timeout_s=timeout_s)
                deadline = time.monotonic() + timeout_s
                reply = self.conn.recv_message(sid, timeout_s)
                if reply is None:
                    raise GrpcStatus(13, "the node ended the call without a reply")
                if self.conn.recv_message(sid, max(0.0, deadline - time.monotonic())) \
                        is not None:
                    raise GrpcStatus(13, "more than one reply")
                return reply
            finally:
                if sid in self.conn.streams:
                    self.conn.reset(sid)

    def send(self, sid: int, data: bytes, end_stream: bool, timeout_s: float) -> None:
        with self.lock:
            self.conn.send_message(sid, data, end_stream=end_stream, timeout_s=timeout_s)

    def recv(self, sid: int, timeout_s: float,
             spin: tuple[float, float] | None = None) -> bytes | None:
        with self.lock:
            try:
                return self.conn.recv_message(sid, timeout_s, spin)
            finally:
                if self._piped:
                    self._kick()   # what arrived for a pipelined stream meanwhile

    def release(self, sid: int, closed: bool) -> None:
        """Done with a stream: stop listening if we ended it (Close sent), else cancel it."""
        with self.lock:
            self._piped.pop(sid, None)
            if closed:
                self.conn.abandon(sid)
            else:
                self.conn.reset(sid)

    def alive(self) -> bool:
        with self.lock:
            try:
                return self.conn.alive()
            finally:
                if self._piped:
                    self._kick()   # what it read for a pipelined stream

    def close(self) -> None:
        with self.lock:
            self.conn.close()
        self._kick()

    # -- the reader of pipelined streams -------------------------------------------

    def _kick(self) -> None:
        with contextlib.suppress(OSError):
            self._kick_w.send(b"\0")

    def _start_reader(self) -> None:
        if self._reader is None or not self._reader.is_alive():
            self._reader = threading.Thread(target=self._read, name="draft-line", daemon=True)
            self._reader.start()

    def _read(self) -> None:
        """Until the connection is gone and every pipelined stream has heard so: wait for
        bytes without the lock, read them with it, deliver without it."""
        poll = select.poll()
        poll.register(self._kick_r, select.POLLIN)
        sock_fd = -1
        while True:
            with self.lock:
                if not self._piped:
                    self._reader = None
                    return
                conn = self.conn
                if not conn.closed and conn.sock.fileno() != sock_fd:
                    sock_fd = conn.sock.fileno()
                    poll.register(sock_fd, select.POLLIN)
                pending = conn._tls and not conn.closed and conn.sock.pending()
            if not pending:
                with contextlib.suppress(OSError):
                    poll.poll(READER_TICK_S * 1000)
                with contextlib.suppress(OSError):
                    self._kick_r.recv(4096)
            for deliver, sid, item in self._take():
                deliver(sid, item)

    def _take(self) -> list[tuple[Deliver, int, Delivery]]:
        """Under the lock: read what has arrived (without waiting), keep the connection
        alive, and collect each pipelined stream's messages and ends."""
        out: list[tuple[Deliver, int, Delivery]] = []
        with self.lock:
            conn = self.conn
            failure: Exception | None = None
            try:
                if not conn.closed:
                    with contextlib.suppress(TimeoutError):
                        conn.wait(0.0)
                    self._keepalive()
            except H2Error as e:
                failure = e
            if conn.closed and failure is None:
                failure = H2Error("connection closed")
            for sid, deliver in list(self._piped.items()):
                stream = conn.streams.get(sid)
                try:
                    while stream is not None and stream.messages:
                        out.append((deliver, sid, conn.recv_message(sid, 0.0)))
                    if stream is None or stream.ended:
                        if failure is not None and stream is None:
                            raise failure
                        out.append((deliver, sid, conn.recv_message(sid, 0.0)))
                        del self._piped[sid]
                    elif failure is not None:
                        raise failure
                except (H2Error, GrpcStatus, TimeoutError) as e:
                    out.append((deliver, sid, e if not isinstance(e, TimeoutError)
                                else H2Error(str(e))))
                    self._piped.pop(sid, None)
        return out

    def _keepalive(self) -> None:
        conn, now = self.conn, time.monotonic()
        if conn.ping_sent is not None:
            if now - conn.ping_sent > KEEPALIVE_TIMEOUT_S:
                conn.close()
                raise H2Error(f"the node did not answer a keepalive PING within "
                              f"{KEEPALIVE_TIMEOUT_S:g} s")
        elif now - conn.heard_at > KEEPALIVE_S:
            conn.ping()


class LinkSet:
    """The links to a target's draft nodes and the event loop their handshakes run on;
    closed when its last drafter closes."""

    def __init__(self, links: list) -> None:
        if not links:
            raise ValueError("a LinkSet needs at least one link")
        self.links = links
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="draft-link",
                                        daemon=True)
        self._thread.start()
        self._lock = threading.Lock()  # guards _users
        self._users = 0

    def attach(self) -> None:
        """A drafter uses the set (each drafter attaches once and closes once)."""
        with self._lock:
            self._users += 1

    def handshake(self, sync: bool, timeout_s: float = 30.0) -> list[str | None]:
        """Connect every link now (its connection and Hello, and the connection to the
        port a node advertises for synchronous sessions if `sync`), so that the first
        request already drafts. Per link, None or why it could not connect."""
        fut = asyncio.run_coroutine_threadsafe(_handshake_all(self.links), self.loop)
        errors = fut.result(timeout=timeout_s)
        for link, error in zip(self.links, errors, strict=True):
            if error is None and sync and link.sync_port():
                try:
                    link.line(link.sync_port())
                except LinkError as e:
                    log.warning("draft node %s: %s; synchronous sessions use its main port",
                                link.url, e)
        return errors

    def close(self) -> None:
        """One drafter is done; the last one closes the connections and stops the loop."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
        closing = asyncio.run_coroutine_threadsafe(_close_all(self.links), self.loop)
        try:
            closing.result(timeout=2)
        except (TimeoutError, OSError) as e:
            log.debug("closing draft links: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=2)


async def _close_all(links: list) -> None:
    for link in links:
        await link.close()


async def _handshake_all(links: list) -> list[str | None]:
    out = []
    for link in links:
        try:
            await link.connect()
            out.append(None)
        except LinkError as e:
            out.append(str(e))
    return out
