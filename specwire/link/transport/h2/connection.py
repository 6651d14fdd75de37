"""gRPC streams over HTTP/2 (the h2 package), driven by the thread that owns the socket.

The thread that needs a message reads the socket itself and feeds h2 (a state machine
without I/O), so a synchronous round costs the round trip plus the parsing, with no
hand-off between threads (docs/protocol.md, "One stack", has the measurements). What
this adds to h2: a deadline in every wait, a receive window of one message credited back
only once read, flood limits (floods.py), gRPC framing (grpcframe.py), a short path for a
round's DATA frames (datapath.py), and one write per round. Every failure surfaces as
H2Error, GrpcStatus or, from a wait, TimeoutError.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import ssl
import time
from typing import NoReturn

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings

from specwire.link.transport.h2.datapath import DataPath
from specwire.link.transport.h2.floods import FloodError, FloodLimits
from specwire.link.transport.h2.grpcframe import (
    GrpcStatus,
    H2Error,
    Stream,
    check_status,
    frame_message,
    percent_encode,
)

__all__ = ["Connection", "CreditTimeout", "GrpcStatus", "H2Error", "Stream", "MAX_FRAME",
           "SEND_TIMEOUT_S"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME = 16384  # the largest frame we accept (HTTP/2's default, never raised)
SEND_TIMEOUT_S = 10.0
#: the most a lingering close reads (Connection._linger) before it closes regardless
LINGER_BYTES = 1 << 20
#: A write that must happen even past its caller's deadline (a PING ACK, a window update)
#: may still take this long before the connection is given up.
MIN_SEND_S = 0.05
RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]
_E = h2.events


class CreditTimeout(H2Error):
    """The peer granted no flow-control credit for a message within its deadline."""


class Connection:
    """gRPC streams over one HTTP/2 connection; client or server side.

    Only one thread uses a connection at a time. Every wait has a deadline and
    keeps what it read, so a timeout never loses part of a frame.
    """

    def __init__(self, sock: socket.socket, client: bool, max_message: int,
                 max_streams: int = 100) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        self.sock, self.client, self.max_message = sock, client, max_message
        self._tls = isinstance(sock, ssl.SSLSocket)
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(sock, select.POLLIN)
        # Another thread's wake() ends this one's wait early (a message to send, a drain).
        self._waker, self._wakee = socket.socketpair()
        self._waker.setblocking(False)
        self._wakee.setblocking(False)
        self._readable.register(self._wakee, select.POLLIN)
        self._writable.register(sock, select.POLLOUT)
        self.window = min(max_message + 5, 2**31 - 1)
        config = h2.config.H2Configuration(client_side=client, header_encoding="utf-8")
        self._h2 = h2.connection.H2Connection(config)
        self._h2.local_settings = h2.settings.Settings(client=client, initial_values={
            h2.settings.SettingCodes.ENABLE_PUSH: 0,
            h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: self.window,
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: max_streams,
            h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16,
        })
        self.streams: dict[int, Stream] = {}
        self._credit: dict[int, int] = {}  # bytes read per stream, not yet credited back
        self._new_requests: list[int] = []
        self._floods = FloodLimits(skip=0 if client else len(PREFACE))
        self._fast = DataPath(self._h2)
        self._handlers = {
            _E.DataReceived: self._on_data,
            _E.RequestReceived: self._on_headers,
            _E.ResponseReceived: self._on_headers,
            _E.TrailersReceived: self._on_trailers,
            _E.StreamEnded: self._on_end,
            _E.StreamReset: self._on_reset,
            _E.ConnectionTerminated: self._on_goaway,
            _E.PingAckReceived: self._on_ping_ack,
        }
        self.goaway: int | None = None  # the error code of the peer's GOAWAY
        self.goaway_sent = False  # ours went out (drain): no new streams from the peer
        self.heard_at = time.monotonic()  # when bytes last came from the peer
        self.ping_sent: float | None = None  # when our unanswered PING went out
        self.closed = False

    # -- setup ------------------------------------------------------------------------

    def handshake(self, timeout_s: float) -> None:
        """Client: send the preface; server: expect it. Both: send SETTINGS and a connection
        window as large as the streams'."""
        deadline = time.monotonic() + timeout_s
        self._h2.initiate_connection()
        if self.window > 65535:  # HTTP/2's initial connection window
            self._h2.increment_flow_control_window(self.window - 65535)
        if not self.client:
            head = b""
            while len(head) < len(PREFACE):
                data = self._recv(deadline)
                if data is None:
                    raise TimeoutError("no HTTP/2 preface before the deadline")
                head += data
                if not PREFACE.startswith(head[: len(PREFACE)]):
                    raise H2Error("not an HTTP/2 connection preface (plain text against TLS?)")
            self._feed(head, deadline)
        self._flush(deadline)

    # -- streams --------------------------------------------------------------------

    def request(self, path: str, authority: str, metadata: tuple[tuple[str, str], ...],
                scheme: str) -> int:
        """Client: open a gRPC call; returns its stream id."""
        sid = self._h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", scheme), (":path", path),
                   (":authority", authority), ("content-type", "application/grpc"),
                   ("te", "trailers"), *metadata]
        self._call(self._h2.send_headers, sid, headers)
        self.streams[sid] = Stream(sid)
        self._flush(time.monotonic() + SEND_TIMEOUT_S)
        return sid

    def next_request(self, timeout_s: float) -> Stream | None:
        """Server: the next stream a client opened, None once the client is gone."""
        deadline = time.monotonic() + timeout_s
        while not self._new_requests:
            if self.closed or self.goaway is not None:
                return None
            try:
                self._pump(deadline)
            except H2Error:
                if self.closed:
                    return None
                raise
        return self.streams[self._new_requests.pop(0)]

    def room(self) -> bool:
        """Client: whether the peer's MAX_CONCURRENT_STREAMS allows another call now."""
        h = self._h2
        return h.open_outbound_streams < h.remote_settings.max_concurrent_streams

    def take_request(self) -> Stream | None:
        """Server: a stream the client opened that next_request has not returned, without
        waiting (None if there is none)."""
        return self.streams[self._new_requests.pop(0)] if self._new_requests else None

    def wait(self, timeout_s: float) -> None:
        """Read and handle what arrives within timeout_s, for whichever stream (a server
        serving several calls on one connection); TimeoutError if nothing did."""
        self._pump(time.monotonic() + max(timeout_s, 0.0))

    def respond(self, sid: int) -> None:
        """Server: the response headers that precede its messages."""
        self._call(self._h2.send_headers, sid, RESPONSE_HEADERS)
        self._flush(time.monotonic() + SEND_TIMEOUT_S)

    def finish(self, sid: int, code: int = 0, message: str = "", headers_sent: bool = True) -> None:
        """Server: end a call with its status (trailers; trailers-only if nothing was sent).
        A client still sending is then told to stop (RST_STREAM NO_ERROR, as gRPC servers do)."""
        trailers = [*([] if headers_sent else RESPONSE_HEADERS), ("grpc-status", str(code))]
        if message:
            trailers.append(("grpc-message", percent_encode(message)))
        self._call(self._h2.send_headers, sid, trailers, end_stream=True)
        stream = self.streams.get(sid)
        if stream is not None and not stream.ended:
            self._call(self._h2.reset_stream, sid, h2.errors.ErrorCodes.NO_ERROR)
        self._forget(sid)
        self._flush(time.monotonic() + SEND_TIMEOUT_S)

    def send_message(self, sid: int, payload: bytes, end_stream: bool = False,
                     timeout_s: float = SEND_TIMEOUT_S) -> None:
        """One gRPC message. Waits up to timeout_s for flow-control credit; past it the
        stream is reset (a message half sent is lost) and H2Error says why."""
        data = frame_message(payload)
        deadline = time.monotonic() + timeout_s
        self._check_open(sid)
        if not end_stream and (frame := self._fast.frame(sid, data)) is not None:
            self._write(self._h2.data_to_send() + frame, deadline)
            return
        off, h = 0, self._h2
        while True:
            self._check_open(sid)
            room = self._call(h.local_flow_control_window, sid)
            n = min(len(data) - off, room, h.max_outbound_frame_size)
            if n > 0:
                last = off + n == len(data)
                self._call(h.send_data, sid, data[off : off + n], end_stream=last and end_stream)
                off += n
                if last:
                    break
                continue
            self._flush(deadline)
            try:
                if time.monotonic() >= deadline:
                    raise TimeoutError
                self._pump(deadline)
            except TimeoutError:
                self.reset(sid)
                raise CreditTimeout(f"stream {sid}: no flow-control credit from the peer within "
                              f"{timeout_s:.2f} s") from None
        self._flush(deadline)

    def end_stream(self, sid: int) -> None:
        """Client: no more messages on this call (half-close)."""
        if sid in self.streams:
            self._call(self._h2.end_stream, sid)
            self._flush(time.monotonic() + SEND_TIMEOUT_S)

    def reset(self, sid: int, code: int = h2.errors.ErrorCodes.CANCEL) -> None:
        """Cancel a stream; what still arrives for it is dropped."""
        if self._forget(sid) and not self.closed:
            try:
                self._h2.reset_stream(sid, code)
            except h2.exceptions.H2Error:
                return  # already closed on the wire
            self._flush(time.monotonic() + SEND_TIMEOUT_S)

    def abandon(self, sid: int) -> None:
        """Stop listening to a stream we ended: its remaining frames are dropped. If the
        peer has not ended it yet it is reset, so that it no longer counts against the
        peer's MAX_CONCURRENT_STREAMS (the peer read our END_STREAM first)."""
        stream = self.streams.get(sid)
        if stream is not None and not stream.ended:
            self.reset(sid)
        else:
            self._forget(sid)

    def recv_message(self, sid: int, timeout_s: float,
                     spin: tuple[float, float] | None = None) -> bytes | None:
        """The stream's next message; None when it ended cleanly (client: status OK).

        Raises TimeoutError after timeout_s with nothing lost, GrpcStatus for a failed
        call, H2Error for a broken connection or a reset stream. The deadline holds
        whatever arrives meanwhile. spin=(start, end), in time.monotonic() seconds:
        sleep until start, busy-poll until end (see _read).
        """
        deadline = time.monotonic() + timeout_s
        stream = self.streams.get(sid)
        if stream is None:
            raise H2Error(f"no stream {sid}")
        read = False
        while not stream.messages:
            if stream.reset is not None:
                self._forget(sid)
                raise H2Error(f"stream {sid} reset by the peer (code {stream.reset})")
            if stream.ended:
                self._forget(sid)
                if stream.partial:
                    raise H2Error(f"stream {sid} ended inside a message")
                if self.client:
                    check_status(stream.trailers or stream.headers)
                return None
            if read and time.monotonic() >= deadline:
                raise TimeoutError("no message before the deadline")
            self._pump(deadline, spin)
            read = True
        msg = stream.messages.popleft()
        # Credited back before the next wait (_settle): the peer's window is what we hold
        # unread, and reading on needs no credit.
        credit = self._credit
        credit[sid] = credit.get(sid, 0) + len(msg) + 5
        return msg

    def alive(self) -> bool:
        """Whether a new call may start here: not closed, and no GOAWAY or end of stream
        among what has arrived meanwhile (read without waiting). A server closes idle
        connections; a client checks before reusing one, and makes a new one instead."""
        try:
            # Until nothing is left (a few reads at most): the end of the connection may
            # come after frames still unread (a reset after the last call's trailers).
            for _ in range(8):
                if self.closed or self.goaway is not None or not (data := self._recv(None)):
                    break
                self._feed(data, time.monotonic() + MIN_SEND_S)
        except H2Error:
            return False
        return not self.closed and self.goaway is None

    def wake(self) -> None:
        """From any thread: end the owner's current wait now (it returns as if a frame that
        carries nothing had arrived)."""
        with contextlib.suppress(OSError):   # already pending, or the connection is closed
            self._waker.send(b"\0")

    def announce_goaway(self) -> None:
        """Server: a GOAWAY (NO_ERROR) naming the last stream opened, so that the peer
        opens no new stream while those it has go on to their end (a drain). Written
        beside h2, which after a GOAWAY of its own would send no more frames."""
        if self.goaway_sent or self.closed:
            return
        self.goaway_sent = True
        last = max(self._h2.streams, default=0)
        frame = (8).to_bytes(3, "big") + b"\x07\0" + (0).to_bytes(4, "big") + \
            last.to_bytes(4, "big") + (0).to_bytes(4, "big")
        self._write(self._h2.data_to_send() + frame, time.monotonic() + SEND_TIMEOUT_S)

    def ping(self) -> None:
        """A PING (keepalive); its ACK clears ping_sent."""
        self._call(self._h2.ping, os.urandom(8))
        self.ping_sent = time.monotonic()
        self._flush(time.monotonic() + SEND_TIMEOUT_S)

    def close(self, code: int = h2.errors.ErrorCodes.NO_ERROR, linger_s: float = 0.0) -> None:
        """A GOAWAY, then the socket closed. linger_s: first half-close and read what the
        peer still sends, until it closes or linger_s pass: closing with its bytes unread
        would send a TCP reset, which can destroy our last frames (a refusal's status)
        before the peer reads them."""
        if self.closed:
            return
        try:
            # A GOAWAY, unless h2 already queued one for a protocol error; written while
            # the connection is still open (_write refuses a closed one: the GOAWAY and
            # any last frames were once dropped here).
            with contextlib.suppress(h2.exceptions.H2Error):
                self._h2.close_connection(error_code=code)
            self._write(self._h2.data_to_send(), 0.0)
            if linger_s > 0:
                self._linger(linger_s)
        except (OSError, H2Error):
            pass
        finally:
            self.closed = True
            self._waker.close()
            self._wakee.close()
            self.sock.close()

    def _linger(self, seconds: float) -> None:
        """Half-close, then discard what arrives until the peer closes, LINGER_BYTES
        arrive or `seconds` pass (a peer that keeps sending cannot hold us longer)."""
        self.sock.shutdown(socket.SHUT_WR)
        deadline, left = time.monotonic() + seconds, LINGER_BYTES
        while left > 0 and (wait := deadline - time.monotonic()) > 0:
            self.sock.settimeout(wait)
            try:
                chunk = self.sock.recv(min(left, 65536))
            except (TimeoutError, ssl.SSLError):
                return
            if not chunk:
                return
            left -= len(chunk)

    # -- reading and writing --------------------------------------------------------

    def _pump(self, deadline: float, spin: tuple[float, float] | None = None) -> None:
        """Send what is pending, then read what arrives by deadline and handle it;
        TimeoutError if nothing did."""
        if self._credit:
            self._settle()
        self._flush(deadline)
        data = self._read(deadline, spin)
        self._feed(data, deadline)

    def _settle(self) -> None:
        """Credit back what was read since the last wait. Before every wait, so that a peer
        waiting for credit always gets it before we wait for that peer."""
        credit, self._credit = self._credit, {}
        for sid, n in credit.items():
            self._h2.acknowledge_received_data(n, sid)

    def _feed(self, data: bytes, deadline: float) -> None:
        try:
            if self._floods.settled:
                taken = self._fast.parse(data, self._deliver)
                if taken == len(data):
                    return  # the short path queues nothing to send
                if taken:
                    data = data[taken:]
            if data:
                self._floods.scan(data)
                handlers = self._handlers
                for event in self._h2.receive_data(data):
                    handler = handlers.get(type(event))
                    if handler is not None:
                        handler(event)
        except h2.exceptions.ProtocolError as e:
            self._fail(f"the peer broke HTTP/2: {e}", getattr(e, "error_code", 1))
        except FloodError as e:
            self._fail(str(e), h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
        except H2Error as e:  # gRPC framing
            self._fail(str(e), h2.errors.ErrorCodes.PROTOCOL_ERROR)
        except UnicodeDecodeError:  # h2 decodes header blocks as UTF-8, unchecked
            self._fail("the peer sent a header that is not UTF-8",
                       h2.errors.ErrorCodes.PROTOCOL_ERROR)
        self._flush(deadline)

    def _read(self, deadline: float, spin: tuple[float, float] | None = None) -> bytes:
        """What has arrived, waiting until deadline (past it: only what is there).

        With spin=(start, end) the wait sleeps until start, busy-polls the socket until
        end, then sleeps again. A thread that sleeps when its bytes arrive pays a wake-up
        on the critical path, and on this machine runs the code after it with cold caches;
        one that polls does not, at the price of a core for the window.
        """
        data = None
        if spin is not None and time.monotonic() < spin[1]:
            data = self._recv(min(spin[0], deadline))
            while data is None and time.monotonic() < min(spin[1], deadline):
                os.sched_yield()  # lets this process's other threads have the GIL and the core
                data = self._recv(None)
        if data is None:
            data = self._recv(deadline)
            if data is None:
                raise TimeoutError("no frame before the deadline")
        return data

    def _recv(self, until: float | None) -> bytes | None:
        """What recv() gives by `until` (None: without waiting), or None if nothing came.
        Polls only when it has to wait: with nothing buffered (TLS keeps decrypted bytes
        the kernel no longer shows) and time left."""
        if self.closed:
            raise H2Error("connection closed")
        sock = self.sock
        while True:
            left = 0.0 if until is None else until - time.monotonic()
            if left > 0 and not (self._tls and sock.pending()):
                ready = self._readable.poll(left * 1000)
                if not ready:
                    return None
                if any(fd == self._wakee.fileno() for fd, _ in ready):
                    with contextlib.suppress(OSError):
                        self._wakee.recv(4096)
                    if len(ready) == 1:
                        return b""   # woken: nothing read
            try:
                data = sock.recv(65536)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                if left <= 0:
                    return None
                continue  # part of a TLS record: wait for the rest
            except OSError as e:
                self._lost(f"connection lost: {e}")
            if not data:
                self._lost("connection closed by the peer")
            self.heard_at = time.monotonic()
            return data

    def _flush(self, deadline: float) -> None:
        """Write what h2 has queued, giving up at deadline (or MIN_SEND_S from now)."""
        out = self._h2.data_to_send()
        if out:
            self._write(out, deadline)

    def _write(self, out: bytes, deadline: float) -> None:
        """All of out, by deadline (or MIN_SEND_S from now); a write half done cannot be
        resumed, so one that runs out of time loses the connection."""
        if self.closed:
            raise H2Error("connection closed")
        view, off, sock = memoryview(out), 0, self.sock
        give_up = max(deadline, time.monotonic() + MIN_SEND_S)
        while off < len(view):
            try:
                off += sock.send(view[off:])
                continue
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError):
                pass
            except OSError as e:
                self._lost(f"connection lost: {e}")
            left = give_up - time.monotonic()
            if left <= 0 or not self._writable.poll(left * 1000):
                self._lost("connection lost: the peer does not read")

    def _call(self, fn, *args, **kw):
        """An h2 call that raises H2Error instead of h2's own exceptions."""
        try:
            return fn(*args, **kw)
        except h2.exceptions.H2Error as e:
            raise H2Error(f"{type(e).__name__}: {e}") from None

    def _check_open(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is None or stream.reset is not None:
            raise H2Error(f"stream {sid} was reset by the peer")
        if self.closed:
            raise H2Error("connection closed")

    # -- events ---------------------------------------------------------------------

    def _on_headers(self, e) -> None:
        stream = self.streams.get(e.stream_id)
        if stream is None:
            if self.client:
                return  # a stream we already forgot
            self.streams[e.stream_id] = stream = Stream(e.stream_id)
            self._new_requests.append(e.stream_id)
        stream.headers = list(e.headers)

    def _on_trailers(self, e) -> None:
        stream = self.streams.get(e.stream_id)
        if stream is not None:
            stream.trailers = list(e.headers)

    def _deliver(self, sid: int, data: bytes) -> None:
        """A plain DATA frame's payload, from the short path (as _on_data, without h2)."""
        stream = self.streams.get(sid)
        if stream is None or stream.ended:
            self._h2.acknowledge_received_data(len(data), sid)
        else:
            stream.take(data, self.max_message)

    def _on_data(self, e) -> None:
        stream = self.streams.get(e.stream_id)
        data = e.data
        unread = e.flow_controlled_length - len(data)  # padding: never held, credit it now
        if stream is None or stream.ended:
            unread = e.flow_controlled_length
        elif data:
            stream.take(data, self.max_message)
        if unread:
            self._h2.acknowledge_received_data(unread, e.stream_id)

    def _on_end(self, e) -> None:
        stream = self.streams.get(e.stream_id)
        if stream is not None:
            stream.ended = True

    def _on_reset(self, e) -> None:
        stream = self.streams.get(e.stream_id)
        if stream is not None:
            stream.reset, stream.ended = int(e.error_code), True

    def _on_ping_ack(self, e) -> None:
        self.ping_sent = None

    def _on_goaway(self, e) -> None:
        self.goaway = int(e.error_code)
        last = e.last_stream_id if e.last_stream_id is not None else 0
        for stream in self.streams.values():
            if not stream.ended and (stream.sid > last or self.goaway):
                stream.reset, stream.ended = h2.errors.ErrorCodes.REFUSED_STREAM, True

    def _forget(self, sid: int) -> bool:
        """Drop a stream, crediting back what it held unread; False if it was gone."""
        stream = self.streams.pop(sid, None)
        if stream is None:
            return False
        held = sum(len(m) + 5 for m in stream.messages) + len(stream.partial) + \
            self._credit.pop(sid, 0)
        if held and not self.closed:
            self._h2.acknowledge_received_data(held, sid)
        return True

    def _lost(self, why: str) -> NoReturn:
        self.closed = True
        self._waker.close()
        self._wakee.close()
        with contextlib.suppress(OSError):
            self.sock.close()
        raise H2Error(why)

    def _fail(self, why: str, code: int) -> NoReturn:
        self.close(code)
        raise H2Error(why)
