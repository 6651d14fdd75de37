"""Tests for the user-space link emulator: latency, bandwidth, pipelining, faults, parsing.

Everything runs over loopback against a tiny threaded echo server. Timing bounds are
one-sided-tight (the emulator must never deliver early) and generous on the slow side,
because this machine may be busy with other work.
"""

import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from specwire.bench.netemu import LinkEmulator, _Wire, parse_bandwidth, parse_duration

SLACK_S = 0.08  # scheduling noise allowed on top of the emulated delay (best of n pings)
# What a relay that serialized its latency (a sleep per chunk) would take beyond the right
# time is many times the emulated delay: a test of pipelining allows half of that as noise,
# on a machine so loaded that one pass through the relay's threads may take 100 ms or more.


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while data := self.request.recv(65536):
            self.request.sendall(data)


class _EchoServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture(scope="module")
def echo_port() -> Iterator[int]:
    server = _EchoServer(("127.0.0.1", 0), _EchoHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture
def link(echo_port: int) -> Iterator[LinkEmulator]:
    with LinkEmulator("127.0.0.1", echo_port) as emu:
        yield emu


def _connect(emu: LinkEmulator) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", emu.port), timeout=5)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def _min_rtt(sock: socket.socket, samples: int = 5) -> float:
    """Best-of-n ping time: the minimum filters out scheduler hiccups."""
    best = float("inf")
    for i in range(samples):
        payload = bytes([i]) * 8
        t0 = time.perf_counter()
        sock.sendall(payload)
        assert _recv_exact(sock, len(payload)) == payload
        best = min(best, time.perf_counter() - t0)
    return best


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_zero_latency_round_trip(link: LinkEmulator) -> None:
    with _connect(link) as sock:
        assert _min_rtt(sock) < 0.015


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_20ms_rtt_round_trip(link: LinkEmulator) -> None:
    link.one_way_s = parse_duration("20ms") / 2
    with _connect(link) as sock:
        rtt = _min_rtt(sock)
    assert 0.0199 <= rtt < 0.020 + SLACK_S


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_latency_is_live_settable(link: LinkEmulator) -> None:
    with _connect(link) as sock:
        fast = _min_rtt(sock, samples=3)
        link.one_way_s = 0.025
        slow = _min_rtt(sock, samples=3)
    assert fast < 0.015
    assert slow >= 0.0499


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_bandwidth_cap_serializes(link: LinkEmulator) -> None:
    link.bandwidth_bps = parse_bandwidth("8mbit")
    payload = bytes(range(256)) * 800  # 204,800 bytes -> 0.2048 s at 8 Mbit/s
    with _connect(link) as sock:
        t0 = time.perf_counter()
        sender = threading.Thread(target=sock.sendall, args=(payload,))
        sender.start()
        echoed = _recv_exact(sock, len(payload))
        elapsed = time.perf_counter() - t0
        sender.join()
    assert echoed == payload
    assert 0.2 <= elapsed < 2.0


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_latency_pipelines_instead_of_serializing(link: LinkEmulator) -> None:
    """20 messages 5 ms apart through 50 ms one-way: each sees ~100 ms RTT, not a queue."""
    link.one_way_s = 0.05
    count, size, gap = 20, 16, 0.005
    sent_at: list[float] = []

    def send_all(sock: socket.socket) -> None:
        for i in range(count):
            sent_at.append(time.perf_counter())
            sock.sendall(i.to_bytes(2, "big") * (size // 2))
            time.sleep(gap)

    with _connect(link) as sock:
        t0 = time.perf_counter()
        sender = threading.Thread(target=send_all, args=(sock,))
        sender.start()
        arrived_at = []
        for i in range(count):
            assert _recv_exact(sock, size) == i.to_bytes(2, "big") * (size // 2)
            arrived_at.append(time.perf_counter())
        total = time.perf_counter() - t0
        sender.join()
    # Serialized, the i-th message would wait for the i before it: 20 * 50 ms at least in
    # all, and from the 8th on 0.1 + i * 0.045 s > 0.4 s each.
    assert total < 0.1 + count * gap + 0.5
    latencies = [arrived - sent for sent, arrived in zip(sent_at, arrived_at, strict=True)]
    assert all(0.0999 <= lat < 0.4 for lat in latencies), latencies


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_back_to_back_burst_arrives_together(link: LinkEmulator) -> None:
    """20 chunks sent at once through 50 ms one-way arrive after one RTT (~100 ms), never
    before; the bound above is half what a relay sleeping per chunk read would take (the
    relay may read a burst in one chunk: test_a_burst_shares_one_delay checks the
    arithmetic itself on a fixed clock)."""
    link.one_way_s = 0.05
    count, serialized = 20, 20 * 0.05
    with _connect(link) as sock:
        t0 = time.perf_counter()
        for i in range(count):
            sock.sendall(bytes([i]) * 10)
        data = _recv_exact(sock, 10 * count)
        elapsed = time.perf_counter() - t0
    assert data == b"".join(bytes([i]) * 10 for i in range(count))
    assert 0.0999 <= elapsed < serialized / 2


def test_a_burst_shares_one_delay() -> None:
    """The delay line on a fixed clock: chunks read at the same instant get one deadline
    (latency is not paid per chunk); with a cap each waits for the bytes before it only,
    and a wire idle again starts afresh."""
    wire = _Wire()
    assert [wire.deadline(1.0, 10, 0.05, None) for _ in range(20)] == [1.05] * 20
    capped = _Wire()  # 1000 bytes at 8 Mbit/s: 1 ms on the wire each
    got = [capped.deadline(1.0, 1000, 0.05, 8e6) for _ in range(3)]
    assert got == pytest.approx([1.051, 1.052, 1.053])
    assert capped.deadline(2.0, 1000, 0.05, 8e6) == pytest.approx(2.051)


def test_byte_counters(link: LinkEmulator) -> None:
    with _connect(link) as sock:
        for n in (1, 1000, 50_000):
            sock.sendall(b"x" * n)
            _recv_exact(sock, n)
    assert link.bytes_up == link.bytes_down == 51_001
    link.reset_counters()
    assert link.bytes_up == link.bytes_down == 0


def test_cut_resets_connections_and_keeps_listening(link: LinkEmulator) -> None:
    with _connect(link) as sock:
        sock.sendall(b"ping")
        assert _recv_exact(sock, 4) == b"ping"
        assert link.connections == 1
        link.cut()
        with pytest.raises((ConnectionResetError, EOFError, BrokenPipeError)):
            sock.sendall(b"more")
            _recv_exact(sock, 4)
    _wait_for(lambda: link.connections == 0)
    with _connect(link) as sock:
        sock.sendall(b"again")
        assert _recv_exact(sock, 5) == b"again"


def test_blackhole_stalls_then_resumes(link: LinkEmulator) -> None:
    with _connect(link) as sock:
        link.blackhole = True
        sock.sendall(b"held")
        sock.settimeout(0.15)
        with pytest.raises(TimeoutError):
            sock.recv(4)
        assert link.bytes_up == 0
        link.blackhole = False
        sock.settimeout(5)
        assert _recv_exact(sock, 4) == b"held"


def test_stop_closes_listener(echo_port: int) -> None:
    emu = LinkEmulator("127.0.0.1", echo_port).start()
    port = emu.port
    emu.stop()
    emu.stop()  # idempotent
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    with pytest.raises(RuntimeError):
        _ = emu.port


def test_unreachable_upstream_drops_client() -> None:
    with socket.socket() as probe:  # grab a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    with (
        LinkEmulator("127.0.0.1", dead_port) as emu,
        _connect(emu) as sock,
        pytest.raises((ConnectionResetError, EOFError)),
    ):
        _recv_exact(sock, 1)


def test_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError):
        LinkEmulator("127.0.0.1", 1, one_way_s=-0.001)
    with pytest.raises(ValueError):
        LinkEmulator("127.0.0.1", 1, bandwidth_bps=0)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("2ms", 0.002),
        ("0.2ms", 0.0002),
        ("1s", 1.0),
        ("500us", 0.0005),
        ("20", 0.020),
        (" 1.5 MS ", 0.0015),
        ("0", 0.0),
    ],
)
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "ms", "fast", "2 hours", "-5ms", "1.2.3s", "5m"])
def test_parse_duration_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "bps"),
    [
        ("1gbit", 1e9),
        ("100mbit", 1e8),
        ("10kbit", 1e4),
        ("1g", 1e9),
        ("500k", 5e5),
        ("2.5M", 2.5e6),
        ("64bit", 64.0),
        ("1000", 1000.0),
        ("125MB/s", 1e9),
        ("1KB/s", 8000.0),
    ],
)
def test_parse_bandwidth(text: str, bps: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bps)


@pytest.mark.parametrize("text", ["", "fast", "10xbit", "-1mbit", "0mbit", "125mb/s", "1 tbit"])
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="invalid bandwidth") as info:
        parse_bandwidth(text)
    assert repr(text) in str(info.value)


def _wait_for(predicate: Callable[[], bool], timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)
