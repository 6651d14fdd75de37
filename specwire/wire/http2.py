"""Just enough HTTP/2 to carry gRPC streams, one thread and one blocking socket per connection.

Why specwire speaks gRPC's wire format itself on the synchronous link: a
synchronous round is one small message each way, and grpcio passes each one
between several threads (completion queue, poller, the caller). After the idle
wait of a round every hand-off is a wake-up of a sleeping thread, and on the
machine this was built on those wake-ups cost more than the network: a grpcio
echo took 1.0-1.2 ms where a raw TCP ping-pong took 0.32 ms, and a pure-Python
HTTP/2 library (h2) still 1.0 ms. Here the thread that needs a message reads
the frames itself, so a round costs the round trip plus the parsing.

What is implemented: the connection preface, SETTINGS, HEADERS/CONTINUATION
through HPACK (the hpack package), DATA with flow control both ways, PING,
WINDOW_UPDATE, RST_STREAM and GOAWAY, and gRPC's length-prefixed messages with
status trailers. Not implemented, and refused by what we advertise: server
push, compression. Everything read is bounded (frame size, header list,
message size), and a violation raises H2Error naming it.
"""

from __future__ import annotations

import os
import socket
import ssl
import time
from collections import deque
from dataclasses import dataclass, field
from typing import NoReturn
from urllib.parse import unquote

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
SETTINGS_ENABLE_PUSH, SETTINGS_MAX_CONCURRENT_STREAMS = 2, 3
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 4, 5
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL = \
    0x0, 0x1, 0x3, 0x6, 0x7, 0x8

RESPONSE_HEADERS = [(":status", "200"), ("content-type", "application/grpc")]
MAX_FRAME = 16384  # the largest frame we accept (HTTP/2's default, never raised)
MAX_HEADER_BLOCK = 65536
WINDOW = 1 << 30  # what we let the peer send before it hears from us
SEND_TIMEOUT_S = 10.0
DEFAULT_WINDOW = 65535


class H2Error(Exception):
    """The peer broke HTTP/2 or gRPC framing, or the connection ended; the message says how."""


class GrpcStatus(Exception):
    """A stream ended with a gRPC status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"gRPC status {code}: {message}")
        self.code, self.message = code, message


@dataclass(slots=True)
class Stream:
    sid: int
    send_window: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    messages: deque[bytes] = field(default_factory=deque)
    partial: bytearray = field(default_factory=bytearray)  # an incomplete gRPC message
    received: int = 0  # DATA bytes since our last WINDOW_UPDATE for this stream
    ended: bool = False  # the peer sent END_STREAM (or reset the stream)
    trailers: list[tuple[str, str]] = field(default_factory=list)
    reset: int | None = None


class Connection:
    """gRPC streams over one HTTP/2 connection; client or server side.

    Only one thread uses a connection at a time. Every read waits with a deadline
    and keeps what it read, so a timeout never loses part of a frame.
    """

    def __init__(self, sock: socket.socket, client: bool, max_message: int,
                 max_streams: int = 100) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock, self.client, self.max_message = sock, client, max_message
        self.max_streams = max_streams
        self._buf = bytearray()
        self._encoder, self._decoder = hpack.Encoder(), hpack.Decoder(MAX_HEADER_BLOCK)
        self.streams: dict[int, Stream] = {}
        self._next_sid = 1
        self._last_peer_sid = 0
        self._send_window = DEFAULT_WINDOW  # connection-level, granted by the peer
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_max_frame = MAX_FRAME
        self._received = 0  # connection-level DATA bytes since our last WINDOW_UPDATE
        self._header_block: tuple[int, int, bytearray] | None = None  # (sid, flags, block)
        self._new_requests: deque[int] = deque()
        self.goaway: int | None = None  # the error code of the peer's GOAWAY
        self.closed = False

    # -- setup ------------------------------------------------------------------------

    def handshake(self, timeout_s: float) -> None:
        """Client: send the preface; server: expect it. Both: exchange SETTINGS."""
        deadline = time.monotonic() + timeout_s
        settings = _settings({SETTINGS_ENABLE_PUSH: 0, SETTINGS_INITIAL_WINDOW_SIZE: WINDOW,
                              SETTINGS_MAX_CONCURRENT_STREAMS: self.max_streams})
        grow = _frame(WINDOW_UPDATE, 0, 0, (WINDOW - DEFAULT_WINDOW).to_bytes(4, "big"))
        if self.client:
            self._send(PREFACE + settings + grow)
            return
        while len(self._buf) < len(PREFACE):
            self._fill(deadline)
        if bytes(self._buf[: len(PREFACE)]) != PREFACE:
            raise H2Error("not an HTTP/2 connection preface (plain text against TLS?)")
        del self._buf[: len(PREFACE)]
        self._send(settings + grow)

    # -- streams --------------------------------------------------------------------

    def request(self, path: str, authority: str, metadata: tuple[tuple[str, str], ...],
                scheme: str) -> int:
        """Client: open a gRPC call; returns its stream id."""
        sid, self._next_sid = self._next_sid, self._next_sid + 2
        self.streams[sid] = Stream(sid, self._peer_initial_window)
        headers = [(":method", "POST"), (":scheme", scheme), (":path", path),
                   (":authority", authority), ("content-type", "application/grpc"),
                   ("te", "trailers"), *metadata]
        self._send_headers(sid, headers, end_stream=False)
        return sid

    def next_request(self, timeout_s: float) -> Stream | None:
        """Server: the next stream a client opened, None once the client is gone."""
        deadline = time.monotonic() + timeout_s
        while not self._new_requests:
            if self.closed or self.goaway is not None:
                return None
            try:
                self._read_frame(deadline)
            except H2Error:
                if self.closed:
                    return None
                raise
        return self.streams[self._new_requests.popleft()]

    def respond(self, sid: int) -> None:
        """Server: the response headers that precede its messages."""
        self._send_headers(sid, RESPONSE_HEADERS, end_stream=False)

    def finish(self, sid: int, code: int = 0, message: str = "", headers_sent: bool = True) -> None:
        """Server: end a call with its status (trailers; trailers-only if nothing was sent)."""
        trailers = [*([] if headers_sent else RESPONSE_HEADERS), ("grpc-status", str(code))]
        if message:
            trailers.append(("grpc-message", _percent_encode(message)))
        self._send_headers(sid, trailers, end_stream=True)
        self._forget(sid)

    def send_message(self, sid: int, payload: bytes, end_stream: bool = False,
                     timeout_s: float = SEND_TIMEOUT_S) -> None:
        """One gRPC message; waits for flow-control credit if the peer has granted too little."""
        data = b"\0" + len(payload).to_bytes(4, "big") + payload
        deadline = time.monotonic() + timeout_s
        out = bytearray()
        while data:
            stream = self.streams.get(sid)
            if stream is None or stream.reset is not None:
                raise H2Error(f"stream {sid} was reset by the peer")
            n = min(len(data), self._send_window, stream.send_window, self._peer_max_frame)
            if n <= 0:  # flush, then wait for the peer's WINDOW_UPDATE
                self._send(out)
                out.clear()
                self._read_frame(deadline)
                continue
            self._send_window -= n
            stream.send_window -= n
            last = n == len(data)
            out += _frame(DATA, END_STREAM if last and end_stream else 0, sid, data[:n])
            data = data[n:]
        self._send(out)

    def end_stream(self, sid: int) -> None:
        """Client: no more messages on this call (half-close)."""
        if sid in self.streams:
            self._send(_frame(DATA, END_STREAM, sid, b""))

    def reset(self, sid: int, code: int = CANCEL) -> None:
        """Cancel a stream; what still arrives for it is dropped."""
        if self.streams.pop(sid, None) is not None and not self.closed:
            self._send(_frame(RST_STREAM, 0, sid, code.to_bytes(4, "big")))

    def abandon(self, sid: int) -> None:
        """Stop listening to a stream we ended: its remaining frames are dropped."""
        self._forget(sid)

    def recv_message(self, sid: int, timeout_s: float,
                     spin: tuple[float, float] | None = None) -> bytes | None:
        """The stream's next message; None when it ended cleanly (client: status OK).

        Raises TimeoutError after timeout_s with nothing lost, GrpcStatus for a failed
        call, H2Error for a broken connection or a reset stream. spin=(start, end), in
        time.monotonic() seconds: sleep until start, busy-poll until end (see _fill).
        """
        deadline = time.monotonic() + timeout_s
        stream = self.streams.get(sid)
        if stream is None:
            raise H2Error(f"no stream {sid}")
        while not stream.messages:
            if stream.reset is not None:
                self._forget(sid)
                raise H2Error(f"stream {sid} reset by the peer (code {stream.reset})")
            if stream.ended:
                self._forget(sid)
                if stream.partial:
                    raise H2Error(f"stream {sid} ended inside a message")
                if self.client:
                    _check_status(stream.trailers or stream.headers)
                return None
            self._read_frame(deadline, spin)
        return stream.messages.popleft()

    def close(self, code: int = NO_ERROR) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            last = self._last_peer_sid.to_bytes(4, "big")
            self.sock.sendall(_frame(GOAWAY, 0, 0, last + code.to_bytes(4, "big")))
        except OSError:
            pass
        finally:
            self.sock.close()

    # -- frames -----------------------------------------------------------------------

    def _send(self, data: bytes | bytearray) -> None:
        if self.closed:
            raise H2Error("connection closed")
        try:
            self.sock.settimeout(SEND_TIMEOUT_S)
            self.sock.sendall(data)
        except OSError as e:
            self.closed = True
            raise H2Error(f"connection lost: {e}") from None

    def _send_headers(self, sid: int, headers: list[tuple[str, str]], end_stream: bool) -> None:
        block = self._encoder.encode(headers)
        size = self._peer_max_frame
        first, rest = block[:size], block[size:]
        flags = (END_STREAM if end_stream else 0) | (0 if rest else END_HEADERS)
        out = bytearray(_frame(HEADERS, flags, sid, first))
        while rest:
            part, rest = rest[:size], rest[size:]
            out += _frame(CONTINUATION, 0 if rest else END_HEADERS, sid, part)
        self._send(out)

    def _fill(self, deadline: float, spin: tuple[float, float] | None = None) -> None:
        """Read what has arrived, waiting until deadline (past it: only what is there).

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
        self._buf += data

    def _recv(self, until: float | None) -> bytes | None:
        """What recv() gives by `until` (None: without waiting), or None if nothing came."""
        self.sock.settimeout(0.0 if until is None else max(0.0, until - time.monotonic()))
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError, ssl.SSLWantReadError):
            return None
        except OSError as e:
            self.closed = True
            raise H2Error(f"connection lost: {e}") from None
        if not data:
            self.closed = True
            raise H2Error("connection closed by the peer")
        return data

    def _read_frame(self, deadline: float, spin: tuple[float, float] | None = None) -> None:
        """Read and handle one frame, waiting until deadline for it."""
        buf = self._buf
        while len(buf) < 9:
            self._fill(deadline, spin)
        n = int.from_bytes(buf[:3], "big")
        if n > MAX_FRAME:
            self._fail(FRAME_SIZE_ERROR, f"frame of {n} bytes, above {MAX_FRAME}")
        while len(buf) < 9 + n:
            self._fill(deadline, spin)
        kind, flags, sid = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
        payload = bytes(buf[9 : 9 + n])
        del buf[: 9 + n]
        self._handle(kind, flags, sid, payload)

    def _handle(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self._header_block is not None and kind != CONTINUATION:
            self._fail(PROTOCOL_ERROR, "header block interrupted by another frame")
        if kind == DATA:
            self._on_data(flags, sid, payload)
        elif kind in (HEADERS, CONTINUATION):
            self._on_headers(kind, flags, sid, payload)
        elif kind == SETTINGS:
            self._on_settings(flags, sid, payload)
        elif kind == WINDOW_UPDATE:
            self._on_window_update(sid, payload)
        elif kind == PING:
            if len(payload) != 8 or sid:
                self._fail(FRAME_SIZE_ERROR, "malformed PING")
            if not flags & ACK:
                self._send(_frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if len(payload) != 4 or not sid:
                self._fail(FRAME_SIZE_ERROR, "malformed RST_STREAM")
            stream = self.streams.get(sid)
            if stream is not None:
                stream.reset, stream.ended = int.from_bytes(payload, "big"), True
        elif kind == GOAWAY:
            if len(payload) < 8:
                self._fail(FRAME_SIZE_ERROR, "malformed GOAWAY")
            self.goaway = int.from_bytes(payload[4:8], "big")
            last = int.from_bytes(payload[:4], "big") & 0x7FFFFFFF
            for stream in self.streams.values():
                if stream.sid > last and not stream.ended:
                    stream.reset, stream.ended = REFUSED_STREAM, True
        elif kind == PUSH_PROMISE:
            self._fail(PROTOCOL_ERROR, "server push is disabled")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 requires.

    def _on_data(self, flags: int, sid: int, payload: bytes) -> None:
        self._received += len(payload)
        if self._received > WINDOW:
            self._fail(FLOW_CONTROL_ERROR, "peer overran the connection window")
        if flags & PADDED:
            payload = _unpad(payload)
        stream = self.streams.get(sid)
        if stream is not None and not stream.ended:
            stream.received += len(payload)
            if stream.received > WINDOW:
                self._fail(FLOW_CONTROL_ERROR, f"peer overran stream {sid}'s window")
            self._take(stream, payload)
            if flags & END_STREAM:
                stream.ended = True
        updates = b""
        if self._received > WINDOW // 2:
            updates += _frame(WINDOW_UPDATE, 0, 0, self._received.to_bytes(4, "big"))
            self._received = 0
        if stream is not None and stream.received > WINDOW // 2 and not stream.ended:
            updates += _frame(WINDOW_UPDATE, 0, sid, stream.received.to_bytes(4, "big"))
            stream.received = 0
        if updates:
            self._send(updates)

    def _take(self, stream: Stream, payload: bytes) -> None:
        """Split DATA into gRPC messages (a 1-byte flag and a 4-byte length before each)."""
        part = stream.partial
        part += payload
        while len(part) >= 5:
            if part[0] != 0:
                self._fail(PROTOCOL_ERROR, "compressed gRPC message (no encoding was agreed)")
            size = int.from_bytes(part[1:5], "big")
            if size > self.max_message:
                self._fail(PROTOCOL_ERROR, f"gRPC message of {size} bytes, above the limit "
                                           f"of {self.max_message}")
            if len(part) < 5 + size:
                break
            stream.messages.append(bytes(part[5 : 5 + size]))
            del part[: 5 + size]

    def _on_headers(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == CONTINUATION:
            if self._header_block is None or self._header_block[0] != sid:
                self._fail(PROTOCOL_ERROR, "CONTINUATION without a header block")
            block = self._header_block[2]
            block += payload
            flags |= self._header_block[1] & END_STREAM
        else:
            if not sid:
                self._fail(PROTOCOL_ERROR, "HEADERS on stream 0")
            if flags & PADDED:
                payload = _unpad(payload)
            if flags & PRIORITY_FLAG:
                payload = payload[5:]
            block = bytearray(payload)
        if len(block) > MAX_HEADER_BLOCK:
            self._fail(PROTOCOL_ERROR, f"header block above {MAX_HEADER_BLOCK} bytes")
        if not flags & END_HEADERS:
            self._header_block = (sid, flags, block)
            return
        self._header_block = None
        try:
            headers = [(str(k), str(v)) for k, v in self._decoder.decode(bytes(block))]
        except hpack.HPACKError as e:
            self._fail(PROTOCOL_ERROR, f"undecodable header block: {e}")
        self._on_header_list(sid, headers, bool(flags & END_STREAM))

    def _on_header_list(self, sid: int, headers: list[tuple[str, str]], end: bool) -> None:
        stream = self.streams.get(sid)
        if stream is None:
            if self.client or sid % 2 == 0 or sid <= self._last_peer_sid:
                return  # a stream we already forgot (reset or finished)
            self._last_peer_sid = sid
            if len(self.streams) >= self.max_streams:
                self._send(_frame(RST_STREAM, 0, sid, REFUSED_STREAM.to_bytes(4, "big")))
                return
            self.streams[sid] = stream = Stream(sid, self._peer_initial_window, headers)
            self._new_requests.append(sid)
        elif not stream.headers:
            stream.headers = headers
        else:
            stream.trailers = headers
        if end:
            stream.ended = True

    def _on_settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid or len(payload) % 6 or (flags & ACK and payload):
            self._fail(FRAME_SIZE_ERROR, "malformed SETTINGS")
        if flags & ACK:
            return
        for i in range(0, len(payload), 6):
            key, value = int.from_bytes(payload[i : i + 2], "big"), int.from_bytes(
                payload[i + 2 : i + 6], "big")
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > 0x7FFFFFFF:
                    self._fail(FLOW_CONTROL_ERROR, "initial window above 2^31-1")
                for stream in self.streams.values():
                    stream.send_window += value - self._peer_initial_window
                self._peer_initial_window = value
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not MAX_FRAME <= value <= 0xFFFFFF:
                    self._fail(PROTOCOL_ERROR, f"max frame size {value}")
                self._peer_max_frame = value
        self._send(_frame(SETTINGS, ACK, 0, b""))

    def _on_window_update(self, sid: int, payload: bytes) -> None:
        if len(payload) != 4:
            self._fail(FRAME_SIZE_ERROR, "malformed WINDOW_UPDATE")
        grant = int.from_bytes(payload, "big") & 0x7FFFFFFF
        if not sid:
            self._send_window += grant
        elif (stream := self.streams.get(sid)) is not None:
            stream.send_window += grant
        if self._send_window > 0x7FFFFFFF:
            self._fail(FLOW_CONTROL_ERROR, "window above 2^31-1")

    def _forget(self, sid: int) -> None:
        self.streams.pop(sid, None)

    def _fail(self, code: int, why: str) -> NoReturn:
        self.close(code)
        raise H2Error(why)


def _frame(kind: int, flags: int, sid: int, payload: bytes | bytearray) -> bytes:
    return (len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big")
            + payload)


def _settings(values: dict[int, int]) -> bytes:
    body = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big") for k, v in values.items())
    return _frame(SETTINGS, 0, 0, body)


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise H2Error("bad padding")
    return payload[1 : len(payload) - payload[0]]


def _check_status(headers: list[tuple[str, str]]) -> None:
    h = dict(headers)
    if h.get(":status", "200") != "200":
        raise GrpcStatus(14, f"HTTP status {h[':status']}")
    code = h.get("grpc-status")
    if code is None:
        raise GrpcStatus(13, "the call ended without a gRPC status")
    if code != "0":
        raise GrpcStatus(int(code) if code.isdigit() else 2, unquote(h.get("grpc-message", "")))


def _percent_encode(text: str) -> str:
    return "".join(c if " " <= c <= "~" and c != "%" else "".join(
        f"%{b:02X}" for b in c.encode()) for c in text)

