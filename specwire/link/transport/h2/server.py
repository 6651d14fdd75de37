"""The draft node's gRPC server: every call (Hello, Ping, Session) over h2, a thread per
connection.

The connection's thread reads a synchronous round's verdict, drafts and writes the chunk;
a pipelined session drafts on a thread of its own and hands its chunks to the
connection's thread (mux.py). It speaks standard gRPC, so any gRPC client can be a
target. One deadline from accept covers TLS, the preface and an admitted call's headers;
idle connections get a GOAWAY (`--idle-timeout`); connections are bounded in all and per
address (`--conn-per-address`); a drain (SIGTERM) sends GOAWAY and lets open calls finish
(docs/link-hardening.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable

from specwire.link.transport import protocol
from specwire.link.transport.h2.connection import Connection, H2Error
from specwire.link.transport.h2.mux import Calls

log = logging.getLogger("specwire.node")

HANDSHAKE_TIMEOUT_S = 10.0
#: After a transient accept() error (EMFILE...), the wait before the next accept.
ACCEPT_PAUSE_S = 0.1
#: a closing connection reads what its peer still sends for at most this long, so that a
#: refused call's status reaches the peer instead of a TCP reset (Connection.close)
LINGER_S = 0.5
#: accept() errors that pass: out of descriptors or buffers, a peer gone before accept.
TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                       errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


class H2Server:
    """Listens on one port; one thread per connection, connections bounded."""

    def __init__(self, start: Callable, host: str, port: int, tls: ssl.SSLContext | None,
                 max_connections: int, idle_s: float, session_idle_s: float,
                 max_streams: int = 1, active_idle_s: float | None = None,
                 per_address: int = 0, name: str = "node") -> None:
        """start(path, send, context): the service's handler of a new call (mux.Calls).
        max_streams: calls one connection may have open at once (a target's slots share
        one connection, link/transport/channels.py); admission bounds the sessions, not this.
        active_idle_s: a started session's longest silence (session_idle_s by default).
        per_address: connections one peer address may hold at once (0: up to the total).
        name: the port's name in logs."""
        self.start_call, self.tls, self.name = start, tls, name
        self.max_streams = max_streams
        self.idle_s, self.session_idle_s = idle_s, session_idle_s
        self.active_idle_s = active_idle_s
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        self.per_address = per_address
        self._by_address: dict[str, int] = {}   # open connections per peer address
        self._lock = threading.Lock()
        self._closed = False
        self._live: set[Calls] = set()  # the connections being served, for drain and stop
        self._thread = threading.Thread(target=self._accept, name="node-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """No new connections. The listening socket is shut down before it is closed, which
        wakes the accept() blocked on it, so the accept thread ends too."""
        self._closed = True
        with contextlib.suppress(OSError):  # never listened, or already shut down
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def drain(self) -> None:
        """No new connections, and a GOAWAY on each open one: its calls go on to their end,
        then it closes."""
        self.close()
        with self._lock:
            live = list(self._live)
        for calls in live:
            calls.draining = True
            calls.conn.wake()

    def stop(self, wait_s: float = 2.0) -> None:
        """Every call ended and every connection closed now, waiting up to wait_s for
        their threads to finish."""
        self.close()
        with self._lock:
            live = list(self._live)
        for calls in live:
            calls.stopping = True
            calls.conn.wake()
        deadline = time.monotonic() + wait_s
        while self._live and time.monotonic() < deadline:
            time.sleep(0.01)

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno not in TRANSIENT:
                    return  # closed
                log.warning("%s port: accept failed (%s); retrying", self.name,
                            e.strerror or e)
                time.sleep(ACCEPT_PAUSE_S)   # out of descriptors: some close meanwhile
                continue
            if self._closed:
                sock.close()
                return
            if not self._enter(addr[0]):
                sock.close()
                continue
            if not self._slots.acquire(blocking=False):
                self._leave(addr[0])
                log.warning("refused connection from %s:%d on the %s port: too many",
                            *addr[:2], self.name)
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, addr[0], addr[1]),
                             name="node-conn", daemon=True).start()

    def _enter(self, address: str) -> bool:
        """One more connection from this address, unless it holds per_address already."""
        with self._lock:
            n = self._by_address.get(address, 0)
            if self.per_address and n >= self.per_address:
                full = True
            else:
                self._by_address[address] = n + 1
                full = False
        if full:
            log.warning("refused connection from %s on the %s port: %d open from that "
                        "address (--conn-per-address)", address, self.name, n)
        return not full

    def _leave(self, address: str) -> None:
        with self._lock:
            n = self._by_address.pop(address, 1) - 1
            if n > 0:
                self._by_address[address] = n

    def connections(self, address: str) -> int:
        """Connections open now from this peer address."""
        with self._lock:
            return self._by_address.get(address, 0)

    def _serve(self, sock: socket.socket, address: str, port: int) -> None:
        conn, calls, peer = None, None, f"{address}:{port}"
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S   # for TLS, preface and a call
        try:
            if self.tls is not None:
                # CPython bounds a whole blocking handshake by the socket's timeout
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                sock = self.tls.wrap_socket(sock, server_side=True)
            conn = Connection(sock, client=False, max_message=protocol.MAX_MESSAGE_BYTES,
                              max_streams=self.max_streams)
            conn.handshake(max(0.0, deadline - time.monotonic()))
            calls = Calls(conn, peer, self.start_call, HANDSHAKE_TIMEOUT_S, self.idle_s,
                          self.session_idle_s, self.active_idle_s, _subject(sock),
                          first_call_by=deadline)
            with self._lock:
                self._live.add(calls)
            if self._closed:
                calls.draining = True
            calls.run()
        except TimeoutError:
            if calls is not None and calls.served:
                log.info("connection from %s closed: idle for %g s", peer, self.idle_s)
            else:
                log.warning("connection from %s closed: no call within %g s", peer,
                            HANDSHAKE_TIMEOUT_S)
        except (H2Error, OSError) as e:  # OSError covers TLS errors
            log.warning("connection from %s closed: %s", peer, e)
        finally:
            if calls is not None:
                with self._lock:
                    self._live.discard(calls)
            if conn is not None:
                conn.close(linger_s=LINGER_S)
            else:
                sock.close()
            self._slots.release()
            self._leave(address)


def _subject(sock: socket.socket) -> str:
    """A mutual-TLS peer's certificate subject, as grpcio writes it ("CN=a,O=b"); or ""."""
    if not isinstance(sock, ssl.SSLSocket):
        return ""
    cert = sock.getpeercert() or {}
    rdns = [f"{_SHORT.get(k, k)}={v}" for rdn in reversed(cert.get("subject", ()))
            for k, v in rdn]
    return ",".join(rdns)


#: OpenSSL's short names of the usual subject attributes (Python's ssl spells them out).
_SHORT = {"commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
          "countryName": "C", "stateOrProvinceName": "ST", "localityName": "L"}


def tls_context(cert: str, key: str | None, client_ca: str | None) -> ssl.SSLContext:
    """TLS for the node's ports, with HTTP/2 negotiated by ALPN as gRPC requires."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key or cert)
    ctx.set_alpn_protocols(["h2"])
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx
