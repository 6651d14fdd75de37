"""The draft node's synchronous port: Session calls served on the connection's own thread.

A synchronous round is one verdict in and one chunk out, and its cost is the
target's wait. grpcio's server hands each message between its poller and a
handler thread; here the thread that owns a connection reads the verdict,
drafts and writes the chunk (link/transport/h2/connection.py says why that matters). It speaks
the same gRPC as the main port, so any gRPC client can use it, and it serves
only synchronous Session calls (DraftNodeService.sync_call): the sessions of
one target's slots as streams of one connection, served in turn by its thread
(link/transport/h2/mux.py), each with its own deadlines and admission slot. Pipelined
sessions, Hello and Ping stay on the main port.

Its deadlines are the main port's: a connection must start a call within
HANDSHAKE_TIMEOUT_S, a call must send its Open as soon, a connection with no
call open for `idle_s` is closed with a GOAWAY (the main port's
grpc.max_connection_idle_ms; `specwire draft --idle-timeout`), and a session
whose target sends nothing for `session_idle_s` ends. A target that finds its
connection closed opens a new one for its next session without failing it.
"""

from __future__ import annotations

import errno
import logging
import socket
import ssl
import threading
import time

from specwire.link.transport import protocol
from specwire.link.transport.h2.connection import Connection, H2Error
from specwire.link.transport.h2.mux import Calls

log = logging.getLogger("specwire.node")

HANDSHAKE_TIMEOUT_S = 10.0
#: After a transient accept() error (EMFILE...), the wait before the next accept.
ACCEPT_PAUSE_S = 0.1
#: accept() errors that pass: out of descriptors or buffers, a peer gone before accept.
TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                       errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


class SyncServer:
    """Listens on its own port; one thread per connection, connections bounded."""

    def __init__(self, service, host: str, port: int, tls: ssl.SSLContext | None,
                 max_connections: int, idle_s: float, session_idle_s: float,
                 max_streams: int = 1, active_idle_s: float | None = None) -> None:
        """max_streams: calls one connection may have open at once (a target's slots share
        one connection, link/transport/channels.py); admission bounds the sessions, not this.
        active_idle_s: a started session's longest silence (session_idle_s by default)."""
        self.service, self.tls = service, tls
        self.max_streams = max_streams
        self.idle_s, self.session_idle_s = idle_s, session_idle_s
        self.active_idle_s = active_idle_s
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="sync-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno not in TRANSIENT:
                    return  # closed
                log.warning("sync port: accept failed (%s); retrying", e.strerror or e)
                time.sleep(ACCEPT_PAUSE_S)   # out of descriptors: some close meanwhile
                continue
            if not self._slots.acquire(blocking=False):
                log.warning("refused connection from %s:%d on the sync port: too many", *addr[:2])
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name="sync-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn, calls = None, None
        try:
            if self.tls is not None:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                sock = self.tls.wrap_socket(sock, server_side=True)
            conn = Connection(sock, client=False, max_message=protocol.MAX_MESSAGE_BYTES,
                              max_streams=self.max_streams)
            conn.handshake(HANDSHAKE_TIMEOUT_S)
            calls = Calls(conn, peer, self.service.sync_call, HANDSHAKE_TIMEOUT_S, self.idle_s,
                          self.session_idle_s, self.active_idle_s, _subject(sock))
            calls.run()
        except TimeoutError:
            if calls is not None and calls.served:
                log.info("sync connection from %s closed: idle for %g s", peer, self.idle_s)
            else:
                log.warning("sync connection from %s closed: no call within %g s", peer,
                            HANDSHAKE_TIMEOUT_S)
        except (H2Error, OSError) as e:  # OSError covers TLS errors
            log.warning("sync connection from %s closed: %s", peer, e)
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()
            self._slots.release()


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
    """TLS as the main port serves it, with HTTP/2 negotiated by ALPN as gRPC requires."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key or cert)
    ctx.set_alpn_protocols(["h2"])
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx
