"""specwire/link/transport/h2/connection.py against grpcio, both ways, and against broken peers.

The synchronous port's HTTP/2 is ours, so these check that it is gRPC as grpcio
speaks it: messages larger than grpcio's flow-control window, status and
messages in trailers, many messages on one stream; and that bytes which are
not HTTP/2 end in H2Error rather than a hang or a crash.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import hpack
import pytest

from specwire.link.transport.h2.connection import (
    MAX_FRAME,
    Connection,
    CreditTimeout,
    GrpcStatus,
    H2Error,
)
from specwire.link.transport.h2.grpcframe import MAX_QUEUED

ECHO = "/test.Echo/Echo"
CHAT = "/test.Echo/Chat"
FAIL = "/test.Echo/Fail"
LIMIT = 1 << 20


def _same(b: bytes) -> bytes:
    return b


@pytest.fixture(scope="module", name="grpcio_server")
def grpcio_server_fixture():
    """A grpcio server: unary echo, a bidi echo, and a call that fails with a status."""
    def fail(request, context):
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "nope: 100% refusé")

    handlers = {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda r, c: r, _same, _same),
        "Chat": grpc.stream_stream_rpc_method_handler(lambda it, c: (m for m in it),
                                                      _same, _same),
        "Fail": grpc.unary_unary_rpc_method_handler(fail, _same, _same),
    }
    server = grpc.server(ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo",
                                                                           handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield port
    server.stop(0)


def _client(port: int) -> Connection:
    conn = Connection(socket.create_connection(("127.0.0.1", port)), client=True,
                      max_message=LIMIT)
    conn.handshake(5)
    return conn


def test_our_client_against_grpcio(grpcio_server) -> None:
    """Unary calls beyond grpcio's 64 KiB window (both ways), a stream of 50 round trips,
    and a failed call's status and percent-encoded message, all on one connection."""
    conn = _client(grpcio_server)
    try:
        for size in (0, 10, 300_000):
            payload = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
            sid = conn.request(ECHO, "localhost", (), "http")
            conn.send_message(sid, payload, end_stream=True)
            assert conn.recv_message(sid, 5) == payload
            assert conn.recv_message(sid, 5) is None
        sid = conn.request(CHAT, "localhost", (), "http")
        for i in range(50):
            conn.send_message(sid, b"round %d" % i)
            assert conn.recv_message(sid, 5) == b"round %d" % i
        conn.end_stream(sid)
        assert conn.recv_message(sid, 5) is None
        sid = conn.request(FAIL, "localhost", (), "http")
        conn.send_message(sid, b"", end_stream=True)
        with pytest.raises(GrpcStatus) as e:
            conn.recv_message(sid, 5)
        assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert e.value.message == "nope: 100% refusé"
    finally:
        conn.close()


def test_a_timeout_loses_nothing(grpcio_server) -> None:
    """recv_message past its deadline raises TimeoutError; the message still arrives."""
    conn = _client(grpcio_server)
    try:
        sid = conn.request(CHAT, "localhost", (), "http")
        with pytest.raises(TimeoutError):
            conn.recv_message(sid, 0.05)
        conn.send_message(sid, b"late")
        assert conn.recv_message(sid, 5) == b"late"
        with pytest.raises(TimeoutError):
            conn.recv_message(sid, 0.0)
    finally:
        conn.close()


def _serve_echo(sock: socket.socket, served: list) -> None:
    """Our server side: answer each message of each call with itself, then status OK."""
    conn = Connection(sock, client=False, max_message=LIMIT, max_streams=1)
    try:
        conn.handshake(5)
        while (stream := conn.next_request(5)) is not None:
            served.append(dict(stream.headers)[":path"])
            conn.respond(stream.sid)
            while (m := conn.recv_message(stream.sid, 5)) is not None:
                conn.send_message(stream.sid, m)
            conn.finish(stream.sid, 0)
    except (H2Error, TimeoutError):
        pass
    finally:
        conn.close()


def test_grpcio_client_against_our_server() -> None:
    """A grpcio channel calls our server: a unary call of 300 kB (our window is 1 GiB, its
    own is 64 KiB: flow control both ways) and a stream of 50 messages."""
    listener = socket.create_server(("127.0.0.1", 0))
    port, served = listener.getsockname()[1], []

    def accept() -> None:
        sock, _ = listener.accept()
        _serve_echo(sock, served)

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        echo = channel.unary_unary(ECHO, _same, _same)
        big = b"z" * 300_000
        assert echo(big, timeout=10) == big
        chat = channel.stream_stream(CHAT, _same, _same)
        replies = list(chat(iter([b"m%d" % i for i in range(50)]), timeout=10))
        assert replies == [b"m%d" % i for i in range(50)]
    t.join(5)
    listener.close()
    assert served == [ECHO, CHAT]


def _pair() -> tuple[Connection, socket.socket]:
    """Our client on one end of a socket pair, the raw other end for a test to write."""
    a, b = socket.socketpair()
    return Connection(a, client=True, max_message=LIMIT), b


def _frame(kind: int, flags: int, sid: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") \
        + payload


def _block(headers: list[tuple[str, str]]) -> bytes:
    """A header block that leaves HPACK's dynamic table alone (never-indexed literals)."""
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])


def _message(payload: bytes) -> bytes:
    return b"\0" + len(payload).to_bytes(4, "big") + payload


RESPONSE = _frame(1, 4, 1, _block([(":status", "200"), ("content-type", "application/grpc")]))
SETTINGS_ACK = _frame(4, 1, 0, b"")


@pytest.mark.parametrize("garbage, why", [
    (_frame(0, 0, 1, b"\0" * (MAX_FRAME + 1)), "overlong frame"),
    (RESPONSE + _frame(0, 0, 1, b"\1\0\0\0\1x"), "compressed"),
    (RESPONSE + _frame(0, 0, 1, b"\0" + (LIMIT + 1).to_bytes(4, "big")), "above the limit"),
    (_frame(4, 0, 0, b"\0\4\xff\xff\xff\xff"), "Setting 4 has invalid value"),
    (_frame(9, 4, 1, b""), "CONTINUATION"),
    (_frame(1, 4, 1, b"\xff\xff\xff\xff"), "decoding header block"),
    (_frame(5, 4, 1, b"\0\0\0\2"), "push"),
    (_frame(8, 0, 0, b"\0\0\0\0"), "non-compliant"),  # a zero WINDOW_UPDATE
    (_frame(8, 0, 0, (2**31 - 1).to_bytes(4, "big")), "past 2147483647"),  # past 2^31-1
    (_frame(1, 0, 1, b"") + _frame(9, 0, 1, b"") * 100, "continuation"),
    (_frame(6, 0, 0, b"12345678") * 101, "more than 100 PING"),
    (_frame(4, 0, 0, b"") * 51, "more than 50 SETTINGS"),
    (_frame(3, 0, 1, b"\0\0\0\x08") + _frame(3, 0, 7, b"\0\0\0\x08") * 100,
     "more than 100 RST_STREAM"),
    (_frame(2, 0, 1, b"\0\0\0\3\x10") * 501, "more than 500 ignored"),
    (b"", "closed by the peer"),
    (_frame(1, 4, 1, hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(b":status", b"200"),
                                             hpack.NeverIndexedHeaderTuple(b"x", b"\xff")])),
     "not UTF-8"),
], ids=["oversized", "compressed", "message-limit", "window", "continuation", "hpack",
        "push", "zero-window-update", "window-overflow", "continuation-flood", "ping-flood",
        "settings-flood", "rst-flood", "priority-flood", "hang-up", "not-utf8-header"])
def test_broken_frames_raise_h2error(garbage: bytes, why: str) -> None:
    """Frames outside HTTP/2 or gRPC framing, floods of frames that carry no data, and a peer
    that hangs up raise H2Error naming the problem; unknown frame types before them are
    ignored as HTTP/2 says."""
    conn, raw = _pair()
    try:
        conn.handshake(5)
        sid = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(_frame(0xEE, 0, 0, b"unknown type") + garbage)
        if not garbage:
            raw.shutdown(socket.SHUT_WR)
        with pytest.raises(H2Error, match=why):
            conn.recv_message(sid, 5)
    finally:
        conn.close()
        raw.close()


def _feed_forever(raw: socket.socket, frame: bytes, stop: threading.Event) -> threading.Thread:
    """Write `frame` to raw over and over (a few per millisecond) until stop is set."""
    def run() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                raw.sendall(frame)
                time.sleep(0.002)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("frame", [
    _frame(0xEE, 0, 0, b"unknown"), _frame(2, 0, 1, b"\0\0\0\3\x10"), SETTINGS_ACK,
    _frame(6, 1, 0, b"12345678"), _frame(0, 0, 1, _message(b"stale"))],
    ids=["unknown-type", "priority", "settings-ack", "ping-ack", "endless-messages"])
@pytest.mark.slow   # times real waits: wall-clock bounds
def test_frames_that_keep_coming_cannot_hold_a_wait_past_its_deadline(frame: bytes) -> None:
    """A peer that streams frames under the flood limits (ignored ones, or messages nobody
    reads as an answer): a wait for a message on another stream ends at its deadline."""
    conn, raw = _pair()
    stop = threading.Event()
    try:
        conn.handshake(5)
        conn.request(CHAT, "localhost", (), "http")
        other = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(RESPONSE)
        feeder = _feed_forever(raw, frame, stop)
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, H2Error)):
            conn.recv_message(other, 0.3)
        assert time.monotonic() - t0 < 0.6
    finally:
        stop.set()
        conn.close()
        raw.close()
    feeder.join(5)


def test_grpc_status_is_parsed_strictly() -> None:
    """A status that is not a clean decimal gRPC code ("²" passes str.isdigit, 99 is no
    code) ends the call with GrpcStatus naming it; a good one keeps its code and message."""
    for code, want, text in (("\u00b2", 13, "malformed"), ("99", 13, "malformed"),
                             ("-1", 13, "malformed"), ("9", 9, "nope")):
        conn, raw = _pair()
        try:
            conn.handshake(5)
            sid = conn.request(CHAT, "localhost", (), "http")
            trailers = [(":status", "200"), ("grpc-status", code), ("grpc-message", "nope")]
            raw.sendall(_frame(1, 5, sid, _block(trailers)))
            with pytest.raises(GrpcStatus, match=text) as e:
                conn.recv_message(sid, 5)
            assert e.value.code == want
        finally:
            conn.close()
            raw.close()


def test_a_reset_ends_only_its_stream() -> None:
    """RST_STREAM on one call: that call raises H2Error, the connection and the other call
    go on."""
    conn, raw = _pair()
    try:
        conn.handshake(5)
        a = conn.request(CHAT, "localhost", (), "http")
        b = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(_frame(3, 0, a, b"\0\0\0\x08"))
        with pytest.raises(H2Error, match="reset"):
            conn.recv_message(a, 5)
        raw.sendall(_frame(1, 4, b, _block([(":status", "200")]))
                    + _frame(0, 0, b, _message(b"ok")))
        assert conn.recv_message(b, 5) == b"ok" and not conn.closed
    finally:
        conn.close()
        raw.close()


def _read_frames(raw: socket.socket, seconds: float) -> list[tuple[int, int, int]]:
    """(type, flags, stream) of every frame the peer wrote within `seconds`, preface
    skipped."""
    raw.settimeout(seconds)
    data = b""
    with contextlib.suppress(TimeoutError):
        while chunk := raw.recv(65536):
            data += chunk
    data = data.removeprefix(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
    out = []
    while len(data) >= 9:
        n = int.from_bytes(data[:3], "big")
        out.append((data[3], data[4], int.from_bytes(data[5:9], "big")))
        data = data[9 + n:]
    return out


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_no_credit_ends_a_send_at_its_deadline() -> None:
    """A peer granting a window of 0 (and never a WINDOW_UPDATE): a send waits for credit
    only until its deadline, then fails with CreditTimeout and resets its stream."""
    conn, raw = _pair()
    try:
        conn.handshake(5)
        sid = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(_frame(4, 0, 0, b"\0\4\0\0\0\0"))  # SETTINGS_INITIAL_WINDOW_SIZE = 0
        with pytest.raises(TimeoutError):  # reads the SETTINGS
            conn.recv_message(sid, 0.1)
        t0 = time.monotonic()
        with pytest.raises(CreditTimeout):
            conn.send_message(sid, b"verdict", timeout_s=0.3)
        assert 0.25 < time.monotonic() - t0 < 1.0
        assert (3, 0, sid) in _read_frames(raw, 0.3)  # RST_STREAM
    finally:
        conn.close()
        raw.close()


def test_memory_is_bounded_while_waiting_for_credit() -> None:
    """While our send waits for credit, the peer floods messages: what it may send is
    bounded by the window we granted (one largest message) and the unread-message cap, so
    the wait ends in H2Error, never in memory growing without bound."""
    conn, raw = _pair()
    stop = threading.Event()
    try:
        conn.handshake(5)
        sid = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(_frame(4, 0, 0, b"\0\4\0\0\0\0") + RESPONSE)
        with pytest.raises(TimeoutError):  # reads both
            conn.recv_message(sid, 0.1)
        flood = _frame(0, 0, sid, _message(b"x" * 64) * 200)
        feeder = _feed_forever(raw, flood, stop)
        with pytest.raises(H2Error, match="unread messages|overran|flow control|Flow control"):
            conn.send_message(sid, b"verdict", timeout_s=10)
        stream = conn.streams.get(sid)
        assert stream is None or len(stream.messages) <= MAX_QUEUED
    finally:
        stop.set()
        conn.close()
        raw.close()
    feeder.join(5)


def test_server_refuses_what_is_not_http2() -> None:
    """Bytes that are not the HTTP/2 preface (a TLS hello, or HTTP/1) end the connection."""
    a, b = socket.socketpair()
    conn = Connection(a, client=False, max_message=LIMIT)
    b.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(H2Error, match="preface"):
        conn.handshake(5)
    conn.close()
    b.close()


def test_ping_is_answered() -> None:
    """A PING from the peer gets its ACK with the same 8 bytes."""
    conn, raw = _pair()
    try:
        conn.handshake(5)
        sid = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(_frame(6, 0, 0, b"12345678"))
        with pytest.raises(TimeoutError):
            conn.recv_message(sid, 0.2)
        raw.settimeout(5)
        seen = b""
        while _frame(6, 1, 0, b"12345678") not in seen:
            seen += raw.recv(4096)
    finally:
        conn.close()
        raw.close()


def test_arrival_forecast_brackets_the_answers_it_learned() -> None:
    """ArrivalForecast learns a per-token wait and its deviation; its polling window holds
    the mean wait for the tokens asked, starts after the request was sent, and is absent
    before anything was learned or when nothing is asked."""
    from specwire.link.transport.grpc_client import ArrivalForecast

    f = ArrivalForecast()
    assert f.window(100.0, 2) is None
    for waited in (0.020, 0.022, 0.018, 0.021, 0.019) * 4:
        f.learn(waited, 2)
    start, end = f.window(100.0, 2)
    assert 100.0 < start < 100.020 < end < 100.040
    assert f.window(100.0, 0) is None
    assert abs(f.per_token_s - 0.010) < 0.001


def _h2_pair(short_path: bool) -> tuple[Connection, Connection, int]:
    """Our client and our server on a socket pair, one call open and answered."""
    a, b = socket.socketpair()
    client = Connection(a, client=True, max_message=LIMIT)
    server = Connection(b, client=False, max_message=LIMIT)
    for c in (client, server):
        c._fast.enabled = short_path
    t = threading.Thread(target=server.handshake, args=(5,))
    t.start()
    client.handshake(5)
    t.join()
    sid = client.request(CHAT, "localhost", (), "http")
    assert server.next_request(5).sid == sid
    server.respond(sid)
    return client, server, sid


def _windows(c: Connection, sid: int) -> tuple[int, ...]:
    h = c._h2
    return (h.local_flow_control_window(sid), h.remote_flow_control_window(sid),
            h.outbound_flow_control_window, h.inbound_flow_control_window)


def test_plain_data_takes_the_short_path_and_keeps_h2s_accounts() -> None:
    """A round's DATA frames skip h2's frame objects (datapath.py) both ways, and leave
    h2's flow-control windows exactly where h2 itself would have: the same exchange with
    the short path off ends with the same windows on both ends."""
    ends = {}
    for short in (True, False):
        client, server, sid = _h2_pair(short)
        try:
            for i in range(300):  # 600 kB down, past half the 1 MiB window: WINDOW_UPDATEs
                client.send_message(sid, b"v" * (i % 50 + 1))
                msg = server.recv_message(sid, 5)
                server.send_message(sid, msg * 80)
                assert client.recv_message(sid, 5) == msg * 80
            ends[short] = (_windows(client, sid), _windows(server, sid))
            used = client._fast.sent + client._fast.received + server._fast.received
            # all but the first few: headers and the first DATA may share a read (h2's then)
            assert (used >= 890) if short else used == 0
        finally:
            client.close()
            server.close()
    assert ends[True] == ends[False]


def _write_meanwhile(raw: socket.socket, data: bytes) -> None:
    def run() -> None:
        with contextlib.suppress(OSError):
            raw.sendall(data)

    threading.Thread(target=run, daemon=True).start()


@pytest.mark.parametrize("garbage, why", [
    (_frame(0, 0, 1, b"\1\0\0\0\1x"), "compressed"),
    (_frame(0, 0, 1, b"\0" + (LIMIT + 1).to_bytes(4, "big")), "above the limit"),
    (_frame(0, 0, 5, b"\0\0\0\0\1x"), "broke HTTP/2"),  # a stream never opened
    (_frame(0, 0, 1, _message(b"x" * (MAX_FRAME - 5))) * 65, "low control|flow control"),
], ids=["compressed", "message-limit", "unknown-stream", "over-window"])
def test_plain_data_breaking_a_rule_ends_as_through_h2(garbage: bytes, why: str) -> None:
    """DATA frames that arrive at the start of a read (the short path's case) and break a
    rule end the connection with H2Error as h2 would: the short path takes only frames it
    may, and h2 judges the rest."""
    conn, raw = _pair()
    try:
        conn.handshake(5)
        sid = conn.request(CHAT, "localhost", (), "http")
        other = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(SETTINGS_ACK + RESPONSE + _frame(1, 4, other, _block([(":status", "200")])))
        with pytest.raises(TimeoutError):
            conn.recv_message(other, 0.1)
        assert sid == 1
        _write_meanwhile(raw, garbage)  # more than a socket buffer: written while we read
        with pytest.raises(H2Error, match=why):
            for _ in range(3):  # reads what the first pass left; the stream's answer aside
                with contextlib.suppress(TimeoutError):
                    conn.recv_message(other, 0.3)
    finally:
        conn.close()
        raw.close()


def test_data_after_end_stream_is_left_to_h2() -> None:
    """A DATA frame on a stream the peer already ended, alone at the start of a read: the
    short path leaves it to h2, which answers it as a stream error (RST_STREAM)."""
    conn, raw = _pair()
    try:
        conn.handshake(5)
        sid = conn.request(CHAT, "localhost", (), "http")
        other = conn.request(CHAT, "localhost", (), "http")
        raw.sendall(SETTINGS_ACK + RESPONSE + _frame(0, 1, sid, _message(b"end")))
        with pytest.raises(TimeoutError):
            conn.recv_message(other, 0.1)
        taken = conn._fast.received
        raw.sendall(_frame(0, 0, sid, _message(b"after")))
        with pytest.raises(TimeoutError):
            conn.recv_message(other, 0.2)
        assert conn._fast.received == taken
        assert (3, 0, sid) in _read_frames(raw, 0.3)
        assert conn.recv_message(sid, 1) == b"end"
    finally:
        conn.close()
        raw.close()
