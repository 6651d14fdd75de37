"""The node's metrics port (node/exporter.py) and the sync port's accept loop, without a
model: a token when the node has one, a cap on connections (threads stay bounded), a
deadline per connection, and an accept loop that outlives EMFILE; on the sync port, a cap
per peer address and one deadline from connect to an admitted call."""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time
from types import SimpleNamespace

import httpx

from specwire.link.transport import protocol
from specwire.link.transport.h2 import server as sync_server
from specwire.link.transport.h2.connection import Connection, H2Error
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

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def close(self) -> None:
        self.sock.close()

    def getsockname(self):
        return self.sock.getsockname()


def test_sync_accept_loop_outlives_emfile(monkeypatch) -> None:
    monkeypatch.setattr(sync_server, "ACCEPT_PAUSE_S", 0.01)
    srv = sync_server.H2Server(None, "127.0.0.1", 0, None, max_connections=4, idle_s=5,
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


class _Recording:
    """A sync-port service that admits every call and records it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, path, send, context):
        self.calls.append(context.peer())
        return _Held()


class _Held:
    status, idle_s = (0, ""), None

    def take(self, msg) -> bool:
        return True

    def end(self) -> None:
        pass


def _closed(sock: socket.socket, within_s: float = 5.0) -> bool:
    """Whether the server closed this connection (EOF or reset) within the wait."""
    sock.settimeout(within_s)
    try:
        while data := sock.recv(65536):
            del data                     # the server's SETTINGS: read past them
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def _until(conn: Connection, done, within_s: float = 5.0) -> None:
    """Read the connection until done() (or the wait is over)."""
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.wait(0.05)


def test_connections_per_address_are_capped() -> None:
    """Peers of one address hold at most per_address connections: the next is closed at
    once, whatever it sends; one closing lets the next in."""
    service = _Recording()
    srv = sync_server.H2Server(service.call, "127.0.0.1", 0, None, max_connections=16,
                                 idle_s=30, session_idle_s=30, per_address=2)
    srv.start()
    try:
        held = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(2)]
        deadline = time.monotonic() + 5
        while srv.connections("127.0.0.1") < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert srv.connections("127.0.0.1") == 2
        third = socket.create_connection(("127.0.0.1", srv.port))
        assert _closed(third)
        assert srv.connections("127.0.0.1") == 2
        held.pop().close()
        deadline = time.monotonic() + 5
        while srv.connections("127.0.0.1") > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        fourth = socket.create_connection(("127.0.0.1", srv.port))
        client = Connection(fourth, client=True, max_message=1 << 20)
        client.handshake(5)
        sid = client.request(protocol.SESSION_PATH, "node", (), "http")
        _until(client, lambda: service.calls)
        assert sid and len(service.calls) == 1     # served: the slot was freed
        client.close()
        for s in (*held, third):
            s.close()
    finally:
        srv.close()


def test_one_deadline_from_connect_to_an_admitted_call(monkeypatch) -> None:
    """A peer that spends most of the deadline on its HTTP/2 preface, then opens a call
    after the deadline, is closed at the deadline and its call never reaches the service
    (before: the preface and the first call had a deadline each, one after the other).
    A peer that opens its call in time is admitted."""
    monkeypatch.setattr(sync_server, "HANDSHAKE_TIMEOUT_S", 1.0)
    service = _Recording()
    srv = sync_server.H2Server(service.call, "127.0.0.1", 0, None, max_connections=8,
                                 idle_s=30, session_idle_s=30)
    srv.start()
    try:
        slow = socket.create_connection(("127.0.0.1", srv.port))
        time.sleep(0.6)
        late = Connection(slow, client=True, max_message=1 << 20)
        late.handshake(5)                     # the preface, within the deadline
        time.sleep(0.7)                       # past it: 1.3 s after connecting
        with contextlib.suppress(H2Error, OSError, TimeoutError):
            late.request(protocol.SESSION_PATH, "node", (), "http")
            late.wait(3.0)
        assert late.closed or _closed(slow)
        assert service.calls == []

        quick = Connection(socket.create_connection(("127.0.0.1", srv.port)), client=True,
                           max_message=1 << 20)
        quick.handshake(5)
        quick.request(protocol.SESSION_PATH, "node", (), "http")
        _until(quick, lambda: service.calls)
        assert len(service.calls) == 1
        quick.close()
    finally:
        srv.close()


class _Memory:
    def __init__(self) -> None:
        self.purged: list[str | None] = []

    def purge(self, identity: str | None = None) -> int:
        self.purged.append(identity)
        return 3


def _purger(token: str | None, tokens: dict[str, str] | None):
    from specwire.node.server import DraftNodeService
    node = SimpleNamespace(settings=SimpleNamespace(token=token, tokens=tokens),
                           memory=_Memory())
    return node, lambda header: DraftNodeService.purge_for(node, header)


def test_purge_on_the_metrics_port_wants_a_token_and_purges_its_identity() -> None:
    """POST /purge: the node's --token purges every conversation, a --token-file token its
    own identity's only, anything else 401; a node without tokens refuses (403)."""
    alice = "alice-token-0123456789"
    node, purge = _purger("admin-token-0123456789", {alice: "alice"})
    m = _metrics()
    port = m.serve("127.0.0.1", 0, "admin-token-0123456789", purge=purge)
    try:
        url = f"http://127.0.0.1:{port}/purge"
        assert httpx.post(url).status_code == 401
        assert httpx.post(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
        r = httpx.post(url, headers={"Authorization": f"Bearer {alice}"})
        assert r.status_code == 200 and r.json() == {"purged": 3, "identity": "token:alice"}
        r = httpx.post(url, headers={"Authorization": "Bearer admin-token-0123456789"})
        assert r.status_code == 200 and r.json()["identity"] == "all"
        assert node.memory.purged == ["token:alice", None]
    finally:
        m.close()
    open_node, purge = _purger(None, None)
    assert purge("")[0] == 403 and open_node.memory.purged == []


def test_a_purge_by_identity_matches_its_token_beside_a_certificate() -> None:
    """An identity of a token and a client certificate is purged by its token's name."""
    from specwire.node.kv_cache import KvCache
    mem = KvCache.__new__(KvCache)
    dropped: list[bool] = []
    mem._drop_where = lambda doomed: dropped.extend(
        doomed(scope, 0.0) for scope in [("token:alice cert:CN=a", ""), ("token:bob", ""),
                                         ("token:alicex", "")]) or 0
    mem.purge("token:alice")
    assert dropped == [True, False, False]
