"""User-space network link emulator: a TCP relay that adds latency and a bandwidth cap.

Benchmarks and tests need a link with a controlled round trip and bandwidth between the
target and its draft node, and `tc netem` needs root and a kernel module this environment
lacks, so the relay emulates it: each direction is a FIFO wire of `bandwidth_bps` followed
by a delay line of `one_way_s` (each chunk gets its own delivery deadline, so a burst
arrives spread as it was sent; a sleep per chunk would serialize the latency and make
pipelined protocols such as HTTP/2 look slower). It runs an asyncio loop on a daemon thread,
driven by `start()` / `stop()` or `with`; `one_way_s`, `bandwidth_bps` and `blackhole`
may change while it runs and apply to chunks read from then on.
"""

import asyncio
import re
import socket
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

__all__ = ["LinkEmulator", "parse_bandwidth", "parse_duration"]

_READ_SIZE = 64 * 1024
# Chunks buffered per direction before we stop reading: bounds memory and lets TCP
# backpressure reach the sender, as a real router queue would.
_QUEUE_CHUNKS = 1024
_BLACKHOLE_POLL_S = 0.005
_THREAD_TIMEOUT_S = 5.0

_NUMBER = r"(?P<num>[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_DURATION_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zµ]*)\s*$", re.IGNORECASE)
_BANDWIDTH_RE = re.compile(rf"^\s*{_NUMBER}\s*(?P<unit>[a-zA-Z/]*)\s*$")

_DURATION_UNITS = {"": 1e-3, "ms": 1e-3, "s": 1.0, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
# Bit-rate suffixes follow tc's decimal convention (kbit = 1000 bit/s); matched
# case-insensitively. Byte rates need an explicit "B/s" so "m" can never mean megabytes.
_BIT_UNITS = {
    "": 1.0,
    "bit": 1.0,
    "k": 1e3,
    "kbit": 1e3,
    "m": 1e6,
    "mbit": 1e6,
    "g": 1e9,
    "gbit": 1e9,
}
_BYTE_UNITS = {"B/s": 8.0, "kB/s": 8e3, "KB/s": 8e3, "MB/s": 8e6, "GB/s": 8e9}


def parse_duration(text: str) -> float:
    """Parse a duration such as ``"2ms"``, ``"0.2ms"``, ``"1s"`` or ``"500us"`` to seconds.

    A bare number means milliseconds, because latencies on the command line are almost
    always given in ms and ``--rtt 20`` reading as 20 seconds would be a nasty surprise.
    """
    match = _DURATION_RE.match(str(text))
    unit = match.group("unit").lower() if match else None
    if match is None or unit not in _DURATION_UNITS:
        raise ValueError(
            f"invalid duration {text!r}: expected a number with an optional unit "
            "(ns, us, ms, s; bare number = ms), e.g. '20ms' or '0.5s'"
        )
    return float(match.group("num")) * _DURATION_UNITS[unit]


def parse_bandwidth(text: str) -> float:
    """Parse a bandwidth such as ``"1gbit"``, ``"100mbit"``, ``"10k"`` or ``"125MB/s"``.

    Returns bits per second. Suffixes g/m/k (alone or with ``bit``) are bit rates, like
    tc; byte rates must be spelled with ``B/s``. A bare number is bits/s. Zero and
    negative rates are rejected: "no cap" is expressed by not setting a bandwidth at all.
    """
    match = _BANDWIDTH_RE.match(str(text))
    factor = _bandwidth_factor(match.group("unit")) if match else None
    if match is None or factor is None:
        raise ValueError(
            f"invalid bandwidth {text!r}: expected e.g. '1gbit', '100mbit', '10kbit', "
            "'1g', '500k' (bits/s) or '125MB/s' (bytes/s)"
        )
    value = float(match.group("num")) * factor
    if value <= 0:
        raise ValueError(f"invalid bandwidth {text!r}: must be greater than zero")
    return value


def _bandwidth_factor(unit: str) -> float | None:
    """Bits/s per unit of ``unit``, or None if the suffix is unknown."""
    if unit in _BYTE_UNITS:
        return _BYTE_UNITS[unit]
    return _BIT_UNITS.get(unit.lower())


class _Wire:
    """The FIFO wire of one direction: remembers when it finishes serializing."""

    def __init__(self) -> None:
        self._free_at = 0.0

    def deadline(self, now: float, nbytes: int, one_way_s: float, bw: float | None) -> float:
        """Schedule ``nbytes`` read at ``now``; return when they reach the far end.

        The chunk waits for earlier chunks still on the wire (FIFO), takes its own
        serialization time, then propagates for ``one_way_s``. Deadlines therefore never
        depend on how long the relay itself slept, which is what keeps latency from
        accumulating across pipelined chunks.
        """
        start = max(now, self._free_at)
        self._free_at = start + (nbytes * 8.0 / bw if bw else 0.0)
        return self._free_at + one_way_s


class _Connection:
    """One relayed client connection and its upstream twin, pumped in both directions."""

    def __init__(
        self,
        emu: "LinkEmulator",
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self._emu = emu
        self._client = client
        self._upstream = upstream
        self._tasks: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        """Relay until both directions reach EOF, or abort everything on the first error."""
        self._tasks = self._direction(self._client[0], self._upstream[1], self._emu._add_up)
        self._tasks += self._direction(self._upstream[0], self._client[1], self._emu._add_down)
        try:
            done, _ = await asyncio.wait(self._tasks, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled by stop(): leave nothing half-open
            self.abort()
            raise
        if all(t.done() and not t.cancelled() and t.exception() is None for t in self._tasks):
            self._close_gracefully()
        else:
            self.abort()

    def abort(self) -> None:
        """Reset both sockets and stop the pumps (what a cut cable looks like to TCP)."""
        for task in self._tasks:
            task.cancel()
        for _, writer in (self._client, self._upstream):
            writer.transport.abort()

    def _close_gracefully(self) -> None:
        """Close both sockets after a clean EOF in both directions, flushing buffers."""
        for _, writer in (self._client, self._upstream):
            writer.close()

    def _direction(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        count: Callable[[int], None],
    ) -> list[asyncio.Task[None]]:
        """Start the read and write halves of one direction, joined by a delay queue.

        Reading and writing are separate tasks so reading never waits on delivery: the
        queue of (deadline, chunk) pairs *is* the delay line.
        """
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue(_QUEUE_CHUNKS)
        return [
            asyncio.create_task(self._ingress(reader, queue, _Wire())),
            asyncio.create_task(self._egress(queue, writer, count)),
        ]

    async def _ingress(
        self, reader: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes]], wire: _Wire
    ) -> None:
        """Read chunks as fast as they come and stamp each with its delivery deadline."""
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(_READ_SIZE)
            deadline = wire.deadline(
                loop.time(), len(data), self._emu.one_way_s, self._emu.bandwidth_bps
            )
            await queue.put((deadline, data))
            if not data:  # EOF travels the wire too, behind the data sent before it
                return

    async def _egress(
        self,
        queue: asyncio.Queue[tuple[float, bytes]],
        writer: asyncio.StreamWriter,
        count: Callable[[int], None],
    ) -> None:
        """Deliver each chunk at its deadline (held while blackholed); forward EOF."""
        loop = asyncio.get_running_loop()
        while True:
            deadline, data = await queue.get()
            delay = deadline - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            while self._emu.blackhole:
                await asyncio.sleep(_BLACKHOLE_POLL_S)
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            count(len(data))  # before write(): it may reach the peer synchronously
            writer.write(data)
            await writer.drain()


def _set_nodelay(writer: asyncio.StreamWriter) -> None:
    """Disable Nagle: coalescing would add latency we did not ask the emulator for."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class LinkEmulator:
    """TCP relay from ``listen_host:port`` to ``upstream_host:upstream_port`` over an
    emulated link with ``one_way_s`` latency and an optional ``bandwidth_bps`` cap.

    Use as ``with LinkEmulator("127.0.0.1", 50051, one_way_s=0.01) as link:`` and point
    the client at ``link.port``. ``bytes_up`` / ``bytes_down`` count payload bytes
    delivered client->server and server->client, which is what benchmarks report as
    bytes on the wire. ``cut()`` resets all live connections; setting ``blackhole``
    stalls delivery in both directions (bytes are still read and held, and flow again,
    in order, once it is cleared) to emulate a hung peer or a partition.

    ``extra_ports`` are relayed over the same emulated link, each listened on at its
    own number (a draft node's synchronous port, which the node advertises by number):
    give a ``listen_host`` other than the upstream's then, such as 127.0.0.2.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        one_way_s: float = 0.0,
        bandwidth_bps: float | None = None,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        extra_ports: tuple[int, ...] = (),
    ) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.one_way_s = one_way_s
        self.bandwidth_bps = bandwidth_bps
        self.listen_host = listen_host
        self.blackhole = False
        self.bytes_up = 0
        self.bytes_down = 0
        self._listen_port = listen_port
        self.extra_ports = extra_ports
        self._port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._servers: list[asyncio.Server] = []
        self._conns: set[_Connection] = set()

    # -- live-settable link parameters -------------------------------------------------

    @property
    def one_way_s(self) -> float:
        """One-way propagation delay in seconds (half the RTT)."""
        return self._one_way_s

    @one_way_s.setter
    def one_way_s(self, value: float) -> None:
        if value < 0:
            raise ValueError(f"one_way_s must be >= 0, got {value!r}")
        self._one_way_s = float(value)

    @property
    def bandwidth_bps(self) -> float | None:
        """Link rate in bits/s per direction; None means unlimited."""
        return self._bandwidth_bps

    @bandwidth_bps.setter
    def bandwidth_bps(self, value: float | None) -> None:
        if value is not None and value <= 0:
            raise ValueError(f"bandwidth_bps must be > 0 or None, got {value!r}")
        self._bandwidth_bps = None if value is None else float(value)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The port actually listened on (resolved after ``start()`` when 0 was asked)."""
        if self._port is None:
            raise RuntimeError("LinkEmulator is not started")
        return self._port

    @property
    def connections(self) -> int:
        """Number of connections currently being relayed."""
        return len(self._conns)

    def start(self) -> "LinkEmulator":
        """Start the loop thread and begin listening; returns self for chaining."""
        if self._thread is not None:
            raise RuntimeError("LinkEmulator already started")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="netemu", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            self._call(self._listen())
        except BaseException:
            self._shutdown_loop()
            raise
        return self

    def stop(self) -> None:
        """Stop listening, reset live connections and join the loop thread. Idempotent."""
        if self._thread is None:
            return
        try:
            self._call(self._close())
        finally:
            self._shutdown_loop()

    def cut(self) -> None:
        """Abort every current connection (RST to both ends); keep accepting new ones."""
        if self._thread is not None:
            self._call(self._cut())

    def reset_counters(self) -> None:
        """Zero ``bytes_up`` / ``bytes_down``, e.g. between benchmark phases."""
        self.bytes_up = 0
        self.bytes_down = 0

    def __enter__(self) -> "LinkEmulator":
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- loop-thread internals ---------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run a coroutine on the loop thread and wait for it from the caller's thread."""
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.result(timeout=_THREAD_TIMEOUT_S)

    def _shutdown_loop(self) -> None:
        """Stop and close the loop, join its thread, and forget both."""
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        self._port = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_THREAD_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    async def _listen(self) -> None:
        for listen, upstream in ((self._listen_port, self.upstream_port),
                                 *((p, p) for p in self.extra_ports)):
            server = await asyncio.start_server(
                lambda r, w, port=upstream: self._handle(r, w, port), self.listen_host, listen)
            self._servers.append(server)
        self._port = self._servers[0].sockets[0].getsockname()[1]

    async def _close(self) -> None:
        """Close the listeners and every connection, then let cancelled tasks unwind."""
        for server in self._servers:
            server.close()
            await server.wait_closed()
        self._servers.clear()
        await self._cut()
        current = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not current]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _cut(self) -> None:
        for conn in list(self._conns):
            conn.abort()
        await asyncio.sleep(0)  # let the aborted pumps observe their cancellation

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      port: int) -> None:
        """Per accepted client: dial upstream, then relay until done or aborted."""
        _set_nodelay(writer)
        try:
            upstream = await asyncio.open_connection(self.upstream_host, port)
        except OSError:
            writer.transport.abort()  # refuse like an unreachable server would
            return
        _set_nodelay(upstream[1])
        conn = _Connection(self, (reader, writer), upstream)
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)

    def _add_up(self, n: int) -> None:
        self.bytes_up += n

    def _add_down(self, n: int) -> None:
        self.bytes_down += n
