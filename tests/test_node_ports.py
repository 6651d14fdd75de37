"""The node's metrics port (node/exporter.py) and the sync port's accept loop, without a
model: a token when the node has one, a cap on connections (threads stay bounded), a
deadline per connection, and an accept loop that outlives EMFILE."""

from __future__ import annotations

import errno
import socket
import threading
import time

import httpx

from specwire.link.transport.h2 import server as sync_server
from specwire.link.transport.h2.connection import Connection
from specwire.node import exporter
from specwire.node.metrics import NodeMetrics


def _metrics() -> NodeMetrics:
    return NodeMetrics(lambda: 0, lambda: 0, lambda: 0)


def test_metrics_port_wants_the_token_when_the_node_has_one() -> None:
    m = _metrics()
    port = m.serve("127.0.0.1", 0, token="s3cret")
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = httpx.get(url, headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200 and "specwire:node_slots_in_use" in r.text
        assert httpx.get(f"http://127.0.0.1:{port}/elsewhere",
                         headers={"Authorization": "Bearer s3cret"}).status_code == 404
    finally:
        m.close()
    m = _metrics()
    port = m.serve("127.0.0.1", 0)
    try:
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    finally:
        m.close()


def test_idle_connections_cannot_multiply_threads(monkeypatch) -> None:
    """300 idle connections (prometheus_client's server: a thread each, for ever): at most
    MAX_CONNECTIONS threads, the rest closed at once, and the held ones closed at the
    deadline; the port answers throughout once a slot frees."""
    monkeypatch.setattr(exporter, "DEADLINE_S", 1.0)
    monkeypatch.setattr(exporter._Handler, "timeout", 0.5)
    m = _metrics()
    port = m.serve("127.0.0.1", 0)
    try:
        before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(300)]
        time.sleep(0.3)
        during = threading.active_count()
        assert during - before <= exporter.MAX_CONNECTIONS
        closed = 0
        for c in idle:
            c.settimeout(3)
            try:
                closed += c.recv(1) == b""
            except (ConnectionResetError, TimeoutError):
                closed += 1
            c.close()
        assert closed == 300
        deadline = time.monotonic() + 5
        while threading.active_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert threading.active_count() <= before
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200
    finally:
        m.close()


class _Flaky:
    """A listening socket whose first accepts fail as when out of descriptors."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self.sock, self.failures = sock, failures

    def accept(self):
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def close(self) -> None:
        self.sock.close()

    def getsockname(self):
        return self.sock.getsockname()


def test_sync_accept_loop_outlives_emfile(monkeypatch) -> None:
    monkeypatch.setattr(sync_server, "ACCEPT_PAUSE_S", 0.01)
    srv = sync_server.SyncServer(None, "127.0.0.1", 0, None, max_connections=4, idle_s=5,
                                 session_idle_s=5)
    srv._sock = _Flaky(srv._sock, failures=5)
    srv.start()
    try:
        a = socket.create_connection(("127.0.0.1", srv.port))
        client = Connection(a, client=True, max_message=1 << 20)
        client.handshake(5)           # served: the loop went on after five EMFILEs
        client.close()
        assert srv._thread.is_alive()
    finally:
        srv.close()
    srv._thread.join(5)
    assert not srv._thread.is_alive()    # closing still ends it
