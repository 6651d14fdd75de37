"""The synchronous port's calls of one connection, served together on its thread.

A target with several slots (`serve -np N`) opens its synchronous sessions as
streams of one connection (link/transport/channels.py). The connection's thread reads
whatever arrives, for whichever stream, and hands each call its messages in
turn: a verdict in, the session drafts, its chunk out, on this thread as for a
single call (link/transport/h2/server.py says why). When verdicts of several calls are
waiting at once (a batch target sends all its slots' verdicts before it waits,
Capabilities.asks_ahead), their sessions draft side by side on worker threads, as they
would on connections of their own, while this thread alone reads and writes the
connection, sending each chunk as it is ready. Each call keeps its own deadlines
(its Open within the handshake deadline, each next message within the session's
idle time) and its own admission slot; what ends one call (a Close, a cancel, a
malformed message, a deadline, a stream without flow-control credit) ends it
alone. Only the connection failing, or HTTP/2 abuse on it (floods.py), ends
every call on it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from specwire.link.messages import Chunk, DraftMessage, Verdict
from specwire.link.transport import protocol, roundcodec
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.h2.connection import Connection, H2Error, Stream
from specwire.link.transport.protocol import ProtocolError

log = logging.getLogger("specwire.node")


class Abort(Exception):
    """What a service raises (through its context) to refuse or end a call with a status."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class Context:
    """What DraftNodeService asks of grpcio's ServicerContext."""

    def __init__(self, stream: Stream, peer: str, subject: str = "") -> None:
        self._metadata = tuple((k, v) for k, v in stream.headers if not k.startswith(":"))
        self._peer, self._subject = peer, subject

    def auth_context(self) -> dict[str, list[bytes]]:
        """As grpcio's: the mutual-TLS client certificate's subject, when there is one."""
        return {"x509_subject": [self._subject.encode()]} if self._subject else {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def abort(self, code: grpc.StatusCode, details: str):
        raise Abort(code, details)


@dataclass(slots=True)
class _Call:
    """A live call: the service's side of it, and when it must next hear from its target."""

    stream: Stream
    handler: object  # the service's call: take(message or ProtocolError) -> bool, end()
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
        """start(send, context): the service's call for a new stream (it may abort). A call
        waits session_idle_s for its first verdict, active_idle_s for each next one;
        subject: the peer's client certificate's (mutual TLS). first_call_by: the monotonic
        time by which a call must be admitted (default: handshake_s from now)."""
        self.conn, self.peer, self._start = conn, peer, start
        self.handshake_s, self.idle_s, self.session_idle_s = handshake_s, idle_s, session_idle_s
        self.active_idle_s = session_idle_s if active_idle_s is None else active_idle_s
        self.subject = subject
        self.first_call_by = first_call_by
        self.calls: dict[int, _Call] = {}
        self.served = 0  # calls admitted so far
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
            while not conn.closed and conn.goaway is None:
                if not self.calls and idle_until is not None and \
                        time.monotonic() >= idle_until:
                    raise TimeoutError("no call before the deadline")  # what came late waits
                while (stream := conn.take_request()) is not None:
                    if self._open(stream) == grpc.StatusCode.UNAUTHENTICATED and \
                            not self.calls:
                        return  # only a target that was let in may keep a connection idle
                self._serve_all()
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
                self._end(call)
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _open(self, stream: Stream) -> grpc.StatusCode | None:
        """Admit a new stream's call, or finish it at once with why not."""
        conn, headers = self.conn, dict(stream.headers)
        refusal = _refusal(headers)
        if refusal is not None:
            conn.finish(stream.sid, grpc.StatusCode.UNIMPLEMENTED.value[0], refusal,
                        headers_sent=False)
            return None
        call = _Call(stream, None, time.monotonic() + self.handshake_s, "no Open",
                     self.handshake_s)
        try:
            call.handler = self._start(lambda msg: self._send(call, msg),
                                       Context(stream, self.peer, self.subject))
        except Abort as e:
            self._finish(call, e.code.value[0], e.details)
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

    def _next(self, call: _Call) -> pb.TargetMessage | Verdict | ProtocolError:
        """The call's next message (there is one), its deadline moved on. A verdict in its
        common encoding comes decoded (roundcodec.py), anything else as protobuf."""
        data = self.conn.recv_message(call.stream.sid, 0.0)
        call.heard += 1
        wait = self.session_idle_s if call.heard == 1 else self.active_idle_s
        call.deadline = time.monotonic() + wait
        call.silent, call.timeout_s = "the target sent nothing", wait
        verdict = roundcodec.verdict_from_bytes(data)
        if verdict is not None:
            return verdict
        try:
            return pb.TargetMessage.FromString(data)
        except DecodeError:
            return ProtocolError("undecodable frame: not a TargetMessage")

    def _together(self, ready: list[_Call]) -> None:
        """One message to each of these calls, their sessions drafting on worker threads;
        each chunk goes out from this thread as soon as it is drafted. Waits for them all
        (a session's step is bounded by its own draft length), and only then raises what
        the connection did meanwhile: a session must not be closed while it drafts."""
        if self._pool is None:
            # a worker per core: sessions draft side by side as on connections of their own
            self._pool = ThreadPoolExecutor(min(os.cpu_count() or 1, 16),
                                            thread_name_prefix="sync-draft")
        events = self._events
        for call in ready:
            self._pool.submit(_work, call, self._next(call), events)
        over, failure, pending = [], None, len(ready)
        while pending:
            kind, call, value = events.get()
            if kind == "send":
                try:
                    if failure is None:
                        self._send(call, value)
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

    def _send(self, call: _Call, msg: DraftMessage) -> None:
        """A session's message out on the call's stream; a stream the target cancelled takes
        none. From a worker, the message goes to this connection's thread, which sends it.
        A plain chunk's bytes are written directly (roundcodec.py), anything else by
        protobuf."""
        if threading.get_ident() != self._owner:
            self._events.put(("send", call, msg))
            return
        sid = call.stream.sid
        if call.stream.reset is not None or sid not in self.conn.streams:
            return
        if not call.sent:
            self.conn.respond(sid)
            call.sent = True
        data = roundcodec.chunk_bytes(msg) if isinstance(msg, Chunk) else None
        if data is None:
            data = protocol.draft_to_pb(msg).SerializeToString()
        try:
            self.conn.send_message(sid, data)
        except H2Error:
            if self.conn.closed:
                raise
            # This stream alone (no credit from its target): it was reset, the rest go on.

    def _end(self, call: _Call) -> None:
        """The call is over: its slot freed, its status sent if its stream is still open."""
        self.calls.pop(call.stream.sid, None)
        try:
            call.handler.end()
        finally:
            self._finish(call, 0, "")

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


def _work(call: _Call, msg: pb.TargetMessage | Verdict | ProtocolError,
          events: queue.SimpleQueue) -> None:
    """A worker's turn: the call takes its message; ("done", call, result) when it did."""
    try:
        result: bool | BaseException = call.handler.take(msg)
    except BaseException as e:  # noqa: BLE001 - handed to the connection's thread
        result = e
    events.put(("done", call, result))


def _refusal(headers: dict[str, str]) -> str | None:
    """Why this port does not serve a stream with these headers, or None."""
    if headers.get(":path") != protocol.SESSION_PATH:
        return f"this port serves only synchronous {protocol.SESSION_PATH} calls"
    if not headers.get("content-type", "").startswith("application/grpc") or \
            headers.get("grpc-encoding", "identity") != "identity":
        return "expected content-type application/grpc without compression"
    return None
