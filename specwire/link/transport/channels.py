"""The draft links of one target, shared by all its drafters: one connection per node and
port, a stream per session.

`serve -np N` gives each slot a drafter of its own; they share one LinkSet, so the
node sees one target on one connection per port (the main port's gRPC channel,
see Link, and the synchronous port's SyncLine here) however many slots draft.
HTTP/2 gives each session a stream with its own flow control; what ends one
stream (a Close, a cancel, the node's error for that session) leaves the others
alone, and only the connection failing ends them all, each drafter then decoding
plainly and reconnecting after the link's backoff, as one drafter alone does.
A drafter built alone (tests, `generate`) has a LinkSet of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from specwire.link.transport import protocol
from specwire.link.transport.channel import Link, LinkError
from specwire.link.transport.h2.connection import Connection

log = logging.getLogger("specwire.remote")


class SyncLine:
    """A connection to a node's synchronous port, shared by the sessions of every drafter
    of a target; each call on it holds its lock (a wait for one stream's answer reads,
    and keeps, what arrives for the others meanwhile)."""

    __slots__ = ("conn", "link", "lock")

    def __init__(self, conn: Connection, link: Link) -> None:
        self.conn, self.link = conn, link
        self.lock = threading.RLock()

    def broken(self) -> bool:
        """The connection is gone (lost, closed, or the node sent GOAWAY): every session
        on it has failed, not just the one that noticed."""
        return self.conn.closed or self.conn.goaway is not None

    def open(self, first: Callable[[], bytes], timeout_s: float) -> int | None:
        """A Session call whose first message (the Open, made by `first` once the call is
        sure to start) is sent; its stream id, or None if
        the node takes no more calls on this connection now (a node that serves one at a
        time: the session then uses the main port)."""
        link = self.link
        host, port = link.sync_address()
        with self.lock:
            if not self.conn.room():
                return None
            sid = self.conn.request(protocol.SESSION_PATH, f"{host}:{port}", link.metadata(),
                                    "https" if link.settings.tls_ca else "http")
            self.conn.send_message(sid, first(), timeout_s=timeout_s)
            return sid

    def send(self, sid: int, data: bytes, end_stream: bool, timeout_s: float) -> None:
        with self.lock:
            self.conn.send_message(sid, data, end_stream=end_stream, timeout_s=timeout_s)

    def recv(self, sid: int, timeout_s: float,
             spin: tuple[float, float] | None = None) -> bytes | None:
        with self.lock:
            return self.conn.recv_message(sid, timeout_s, spin)

    def release(self, sid: int, closed: bool) -> None:
        """Done with a stream: stop listening if we ended it (Close sent), else cancel it."""
        with self.lock:
            if closed:
                self.conn.abandon(sid)
            else:
                self.conn.reset(sid)

    def alive(self) -> bool:
        with self.lock:
            return self.conn.alive()

    def close(self) -> None:
        with self.lock:
            self.conn.close()


class LinkSet:
    """The links to a target's draft nodes, the connections to their synchronous ports, and
    the event loop their handshakes run on; closed when its last drafter closes."""

    def __init__(self, links: list[Link]) -> None:
        if not links:
            raise ValueError("a LinkSet needs at least one link")
        self.links = links
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="draft-link",
                                        daemon=True)
        self._thread.start()
        self._lines: dict[str, SyncLine] = {}  # per link URL, kept across sessions
        self._lock = threading.Lock()  # guards _lines and _users
        self._users = 0

    def attach(self) -> None:
        """A drafter uses the set (each drafter attaches once and closes once)."""
        with self._lock:
            self._users += 1

    def handshake(self, sync: bool, timeout_s: float = 30.0) -> list[str | None]:
        """Connect every link now (Hello, and the connection its sessions use: the
        synchronous port's if `sync` and the node has one), so that the first request
        already drafts. Per link, None or why it could not connect."""
        fut = asyncio.run_coroutine_threadsafe(_handshake_all(self.links), self.loop)
        errors = fut.result(timeout=timeout_s)
        for link, error in zip(self.links, errors, strict=True):
            if error is not None:
                continue
            if sync and link.sync_port():
                self.sync_line(link)
            elif not link.connect_sessions(link.settings.connect_timeout_s):
                log.warning("draft node %s: no session connection after %.1f s", link.url,
                            link.settings.connect_timeout_s)
        return errors

    def sync_line(self, link: Link) -> SyncLine | None:
        """The link's connection to the synchronous port, made if needed (also when the node
        closed the one it had, as it does after --idle-timeout); None if it cannot be made
        (sessions then use the main port)."""
        with self._lock:
            line = self._lines.get(link.url)
            if line is not None and not line.broken() and line.alive():
                return line
            if line is not None:
                line.close()
            try:
                line = self._lines[link.url] = SyncLine(link.connect_sync(), link)
            except LinkError as e:
                self._lines.pop(link.url, None)
                log.warning("draft node %s: %s; synchronous sessions use its main port",
                            link.url, e)
                return None
            return line

    def drop(self, line: SyncLine) -> None:
        """Close a broken line; the next session on its link makes a new one."""
        with self._lock:
            if self._lines.get(line.link.url) is line:
                del self._lines[line.link.url]
        line.close()

    def close(self) -> None:
        """One drafter is done; the last one closes the connections and stops the loop."""
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
            lines, self._lines = list(self._lines.values()), {}
        for line in lines:
            line.close()
        closing = asyncio.run_coroutine_threadsafe(_close_all(self.links), self.loop)
        try:
            closing.result(timeout=2)
        except (TimeoutError, OSError) as e:
            log.debug("closing draft links: %s", e)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=2)


async def _close_all(links: list[Link]) -> None:
    for link in links:
        await link.close()


async def _handshake_all(links: list[Link]) -> list[str | None]:
    out = []
    for link in links:
        try:
            await link.connect()
            out.append(None)
        except LinkError as e:
            out.append(str(e))
    return out
