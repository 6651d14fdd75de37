"""specwire/wire/http2.py against grpcio, both ways, and against broken peers.

The synchronous port's HTTP/2 is ours, so these check that it is gRPC as grpcio
speaks it: messages larger than grpcio's flow-control window, status and
messages in trailers, many messages on one stream; and that bytes which are
not HTTP/2 end in H2Error rather than a hang or a crash.
"""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from specwire.wire.http2 import MAX_FRAME, Connection, GrpcStatus, H2Error

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


@pytest.mark.parametrize("garbage, why", [
    (_frame(0, 0, 1, b"\0" * (MAX_FRAME + 1)), "frame of"),
    (_frame(0, 0, 1, b"\1\0\0\0\1x"), "compressed"),
    (_frame(0, 0, 1, b"\0" + (LIMIT + 1).to_bytes(4, "big")), "above the limit"),
    (_frame(4, 0, 0, b"\0\4\xff\xff\xff\xff"), "initial window"),
    (_frame(9, 4, 1, b""), "CONTINUATION without"),
    (_frame(1, 4, 1, b"\xff\xff\xff\xff"), "undecodable header block"),
    (_frame(5, 4, 1, b"\0\0\0\2"), "server push"),
    (b"", "closed by the peer"),
], ids=["oversized", "compressed", "message-limit", "window", "continuation", "hpack",
        "push", "hang-up"])
def test_broken_frames_raise_h2error(garbage: bytes, why: str) -> None:
    """Frames outside HTTP/2 or gRPC framing, and a peer that hangs up, raise H2Error
    naming the problem; unknown frame types before them are ignored as HTTP/2 says."""
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


def test_server_refuses_what_is_not_http2() -> None:
    """Bytes that are not the HTTP/2 preface (a TLS hello, or HTTP/1) end the connection."""
    a, b = socket.socketpair()
    conn = Connection(a, client=False, max_message=LIMIT)
    b.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    with pytest.raises(H2Error, match="preface"):
        conn.handshake(5)
    conn.close()
    b.close()


def test_ping_is_answered(grpcio_server) -> None:
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
    from specwire.wire.client import ArrivalForecast

    f = ArrivalForecast()
    assert f.window(100.0, 2) is None
    for waited in (0.020, 0.022, 0.018, 0.021, 0.019) * 4:
        f.learn(waited, 2)
    start, end = f.window(100.0, 2)
    assert 100.0 < start < 100.020 < end < 100.040
    assert f.window(100.0, 0) is None
    assert abs(f.per_token_s - 0.010) < 0.001
