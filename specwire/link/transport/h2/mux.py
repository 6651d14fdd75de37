"""The gRPC calls of one server connection, served together on its thread.

A target's Hello, pings and sessions (every slot of `serve -np N`) are streams of one
connection. Its thread reads whatever arrives and hands each call its messages; a
synchronous round happens on this thread. Messages of several calls waiting at once (a
batch target's verdicts, Capabilities.asks_ahead) are taken side by side on worker
threads, while this thread alone reads and writes the socket. Each call keeps its own
deadlines and admission slot, and what ends one call ends it alone; only the connection
failing, or HTTP/2 abuse on it (floods.py), ends every call on it.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from specwire.link.transport.h2.connection import Connection, H2Error, Stream
from specwire.link.transport.h2.grpcframe import Status
from specwire.link.transport.protocol import ProtocolError

log = logging.getLogger("specwire.node")

#: Calls of one connection whose messages are taken side by side (serve -np N's slots).
SYNC_WORKERS = 16


class Abort(Exception):
    """What a service raises (through its context) to refuse or end a call with a status."""

    def __init__(self, code: Status, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Handler(Protocol):
    """A service's side of one call. `take` gets each message's bytes (or why none could
    be read) and says whether the call goes on; `end` is called once, however it ended;
    `status` is the (code, details) the call ends with; `idle_s`, if not None, replaces
    the session's idle time between messages (a Ping stream's)."""

    status: tuple[int, str]
    idle_s: float | None

    def take(self, data: bytes | ProtocolError) -> bool: ...

    def end(self) -> None: ...


class Context:
    """The call's metadata, peer and client certificate, as a service asks for them (the
    names of grpcio's ServicerContext)."""

    def __init__(self, stream: Stream, peer: str, subject: str = "", port: int = 0) -> None:
        self._metadata = tuple((k, v) for k, v in stream.headers if not k.startswith(":"))
        self._peer, self._subject = peer, subject
        self.port = port  # the node's port the call came to

    def auth_context(self) -> dict[str, list[bytes]]:
        """As grpcio's: the mutual-TLS client certificate's subject, when there is one."""
        return {"x509_subject": [self._subject.encode()]} if self._subject else {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def abort(self, code: Status, details: str):
        raise Abort(code, details)


@dataclass(slots=True)
class _Call:
    """A live call: the service's side of it, and when it must next hear from its target."""

    stream: Stream
    handler: Handler | None
    deadline: float
    silent: str  # what its deadline's expiry means, for the error
    timeout_s: float
    sent: bool = False  # response headers out
    heard: int = 0  # messages received


class Calls:
    """The calls of one server connection, served until it closes or stays idle too long."""

    def __init__(self, conn: Connection, peer: str, start: Callable, handshake_s: float,
                 idle_s: float, session_idle_s: float, active_idle_s: float | None = None,
                 subject: str = "", first_call_by: float | None = None) -> None:
        """start(path, send, context): the service's Handler for a new stream (it may
        abort); send(message, last=False) writes a message of the call, from any thread
        (last: the call ends after it). A call waits session_idle_s for its second
        message, active_idle_s for each next one (or its handler's idle_s);
        subject: the peer's client certificate's (mutual TLS). first_call_by: the monotonic
        time by which a call must be admitted (default: handshake_s from now)."""
        self.conn, self.peer, self._start = conn, peer, start
        self.handshake_s, self.idle_s, self.session_idle_s = handshake_s, idle_s, session_idle_s
        self.active_idle_s = session_idle_s if active_idle_s is None else active_idle_s
        self.subject = subject
        self.port = conn.sock.getsockname()[1] if conn.sock.family != socket.AF_UNIX else 0
        self.first_call_by = first_call_by
        self.calls: dict[int, _Call] = {}
        self.served = 0  # calls admitted so far
        self.draining = False  # set from another thread (then conn.wake()): GOAWAY, finish
        self.stopping = False  # likewise: end every call and the connection now
        self._owner = threading.get_ident()  # the thread that reads and writes conn
        self._pool: ThreadPoolExecutor | None = None  # made when two calls first draft at once
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # from the workers

    def run(self) -> None:
        """Until the target goes (returns) or stays idle (TimeoutError); H2Error for a
        connection that failed. Every admitted call is ended on the way out."""
        conn = self.conn
        # The first admitted call comes by the connection's deadline or the connection
        # closes (a refused call does not move it); later, one without calls for idle_s
        # closes.
        idle_until: float | None = (self.first_call_by if self.first_call_by is not None
                                    else time.monotonic() + self.handshake_s)
        try:
            while not conn.closed and conn.goaway is None and not self.stopping:
                if self.draining:
                    conn.announce_goaway()
                if not self.calls and idle_until is not None and \
                        time.monotonic() >= idle_until:
                    raise TimeoutError("no call before the deadline")  # what came late waits
                while (stream := conn.take_request()) is not None:
                    if self._open(stream) == Status.UNAUTHENTICATED and \
                            not self.calls:
                        return  # only a target that was let in may keep a connection idle
                self._serve_all()
                self._pass_events()
                if self.draining and not self.calls:
                    return
                if self.calls:
                    idle_until = None
                    until = min(c.deadline for c in self.calls.values())
                else:
                    if idle_until is None:
                        idle_until = time.monotonic() + self.idle_s
                    until = idle_until
                try:
                    conn.wait(until - time.monotonic())
                except TimeoutError:
                    if not self.calls:
                        raise
                    self._expire()
        finally:
            for call in list(self.calls.values()):
                if self.stopping:
                    call.handler.status = (Status.UNAVAILABLE, "draft node shutting down")
                self._end(call)
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _open(self, stream: Stream) -> Status | None:
        """Admit a new stream's call, or finish it at once with why not."""
        conn, headers = self.conn, dict(stream.headers)
        refusal = _refusal(headers)
        if refusal is not None:
            conn.finish(stream.sid, Status.UNIMPLEMENTED, refusal, headers_sent=False)
            return None
        call = _Call(stream, None, time.monotonic() + self.handshake_s, "no Open",
                     self.handshake_s)
        try:
            call.handler = self._start(headers.get(":path", ""),
                                       lambda msg, last=False: self._send(call, msg, last),
                                       Context(stream, self.peer, self.subject, self.port))
        except Abort as e:
            self._finish(call, int(e.code), e.details)
            return e.code
        self.calls[stream.sid] = call
        self.served += 1
        return None

    def _serve_all(self) -> None:
        """Hand every call what its stream holds, a message per call at a time (side by side
        when several have one); end the calls that are over."""
        while ready := [c for c in self.calls.values() if c.stream.messages]:
            if len(ready) == 1:
                call = ready[0]
                if not call.handler.take(self._next(call)):
                    self._end(call)
            else:
                self._together(ready)
        conn = self.conn
        for call in [c for c in self.calls.values()
                     if c.stream.ended or c.stream.sid not in conn.streams]:
            self._end(call)  # the target half-closed or cancelled it (a Close), or we reset
            #                  it (no flow-control credit for a chunk)

    def _next(self, call: _Call) -> bytes:
        """The call's next message (there is one), its deadline moved on."""
        data = self.conn.recv_message(call.stream.sid, 0.0)
        call.heard += 1
        wait = call.handler.idle_s
        if wait is None:
            wait = self.session_idle_s if call.heard == 1 else self.active_idle_s
        call.deadline = time.monotonic() + wait
        call.silent, call.timeout_s = "the target sent nothing", wait
        return data

    def _together(self, ready: list[_Call]) -> None:
        """One message to each of these calls, their sessions drafting on worker threads;
        each chunk goes out from this thread as soon as it is drafted. Waits for them all
        (a session's step is bounded by its own draft length), and only then raises what
        the connection did meanwhile: a session must not be closed while it drafts."""
        if self._pool is None:
            # a worker per call: their sessions' tokens share the node's decodes
            # (node/steps.py), as on connections of their own
            self._pool = ThreadPoolExecutor(SYNC_WORKERS, thread_name_prefix="sync-draft")
        events = self._events
        for call in ready:
            self._pool.submit(_work, call, self._next(call), events)
        over, failure, pending = [], None, len(ready)
        while pending:
            kind, call, value = events.get()
            if kind == "send":
                try:
                    if failure is None and self._send(call, *value):
                        over.append(call)
                except H2Error as e:
                    failure = e
                continue
            pending -= 1
            if isinstance(value, BaseException):
                failure = failure or value
            elif not value:
                over.append(call)
        if failure is not None:
            raise failure
        for call in over:
            self._end(call)

    def _expire(self) -> None:
        """Calls past their deadline end with an error to their target."""
        now = time.monotonic()
        for call in [c for c in self.calls.values() if c.deadline <= now]:
            call.handler.take(ProtocolError(f"{call.silent} for {call.timeout_s:g} s"))
            self._end(call)

    def _pass_events(self) -> None:
        """Send what other threads handed over (a pipelined session's drafts), ending the
        calls whose last message that was."""
        events = self._events
        while True:
            try:
                kind, call, value = events.get_nowait()
            except queue.Empty:
                return
            if kind == "send" and self._send(call, *value) and \
                    self.calls.get(call.stream.sid) is call:
                self._end(call)

    def _send(self, call: _Call, data: bytes, last: bool = False) -> bool:
        """A call's message out on its stream; a stream the target cancelled takes none.
        From another thread, the message goes to this connection's thread, which sends it
        (and is woken for it). Returns `last` (the call is to end) on this thread."""
        if threading.get_ident() != self._owner:
            self._events.put(("send", call, (data, last)))
            self.conn.wake()
            return False
        sid = call.stream.sid
        if call.stream.reset is not None or sid not in self.conn.streams:
            return last
        if not call.sent:
            self.conn.respond(sid)
            call.sent = True
        try:
            self.conn.send_message(sid, data)
        except H2Error:
            if self.conn.closed:
                raise
            # This stream alone (no credit from its target): it was reset, the rest go on.
        return last

    def _end(self, call: _Call) -> None:
        """The call is over: its slot freed, its status sent if its stream is still open."""
        self.calls.pop(call.stream.sid, None)
        try:
            call.handler.end()
        finally:
            self._finish(call, *call.handler.status)

    def _finish(self, call: _Call, code: int, details: str) -> None:
        sid = call.stream.sid
        if call.stream.reset is not None or sid not in self.conn.streams or self.conn.closed:
            with contextlib.suppress(H2Error):
                self.conn.reset(sid)
            return
        try:
            self.conn.finish(sid, code, details, headers_sent=call.sent)
        except H2Error:
            if self.conn.closed:
                raise


def _work(call: _Call, msg: bytes, events: queue.SimpleQueue) -> None:
    """A worker's turn: the call takes its message; ("done", call, result) when it did."""
    try:
        result: bool | BaseException = call.handler.take(msg)
    except BaseException as e:  # noqa: BLE001 - handed to the connection's thread
        result = e
    events.put(("done", call, result))


def _refusal(headers: dict[str, str]) -> str | None:
    """Why no call is served on a stream with these headers (the service refuses an
    unknown method itself), or None."""
    if not headers.get("content-type", "").startswith("application/grpc") or \
            headers.get("grpc-encoding", "identity") != "identity":
        return "expected content-type application/grpc without compression"
    return None
