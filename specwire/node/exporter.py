"""The node's metrics port: Prometheus text over HTTP, bounded like the other ports.

prometheus_client's own server gives every connection a thread with no deadline and no
cap, and asks for no token. Here: at most MAX_CONNECTIONS at once, each with a socket
timeout and a total DEADLINE_S (its TLS handshake included), the node's tokens when it has
any (its --token or one of its --token-file's), TLS when the node has a certificate (its
client CA too), and an accept loop that waits out transient errors (EMFILE). `POST /purge`
drops finished conversations, as SIGHUP does, from another machine (docs/memory.md says
whose, by token).
"""

from __future__ import annotations

import contextlib
import errno
import hmac
import json
import logging
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from specwire.node.tenants import token_name

log = logging.getLogger("specwire.node")

MAX_CONNECTIONS = 8
#: Seconds a connection may take, from accept to the end of its answer.
DEADLINE_S = 10.0
#: accept() errors that pass: out of descriptors or buffers, a peer gone before accept.
TRANSIENT = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM,
                       errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN})


class _Handler(BaseHTTPRequestHandler):
    timeout = DEADLINE_S / 2    # per socket operation

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        server: Exporter = self.server  # type: ignore[assignment]
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self._answer(404, b"not found\n", "text/plain")
            return
        if not server.authorized(self.headers.get("Authorization", "")):
            self._answer(401, b"bad or missing token\n", "text/plain")
            return
        self._answer(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        server: Exporter = self.server  # type: ignore[assignment]
        if self.path.split("?", 1)[0] != "/purge" or server.purge is None:
            self._answer(404, b"not found\n", "text/plain")
            return
        got = server.purge(self.headers.get("Authorization", ""))
        if got is None:
            self._answer(401, b"bad or missing token\n", "text/plain")
            return
        status, answer = got
        self._answer(status, json.dumps(answer).encode() + b"\n", "application/json")

    def _answer(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - its name
        pass


class Exporter(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, host: str, port: int, registry: CollectorRegistry,
                 token: str | None = None, max_connections: int = MAX_CONNECTIONS,
                 purge: Callable[[str], tuple[int, dict] | None] | None = None,
                 tokens: dict[str, str] | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """token, tokens (a --token-file's, token -> name): GET /metrics wants one of them
        when there is any. purge(authorization header): POST /purge's (status, JSON
        answer), None for a token it does not know (401); None: no /purge. tls: serve
        HTTPS (the handshake is the connection's thread's, within its deadline)."""
        self.registry, self.token, self.purge = registry, token, purge
        self.tokens, self.tls = tokens or {}, tls
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), _Handler)
        self._thread = threading.Thread(target=self.serve_forever, name="node-metrics",
                                        daemon=True)
        self._thread.start()
        threading.Thread(target=self._reap, name="node-metrics-deadlines", daemon=True).start()

    def _reap(self) -> None:
        """One thread for every connection's deadline: past it, its socket is shut down,
        which ends the handler's blocked read or write."""
        while self.socket.fileno() >= 0:
            now = time.monotonic()
            with self._lock:
                late = [s for s, t in self._deadlines.items() if t < now]
            for s in late:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            time.sleep(min(0.25, DEADLINE_S / 4))

    @property
    def port(self) -> int:
        return self.server_address[1]

    def authorized(self, header: str) -> bool:
        """Whether an Authorization header may read the figures: anyone when the node has
        no token, else the node's --token or any of its --token-file's."""
        if not self.token and not self.tokens:
            return True
        named = bool(self.tokens) and token_name(self.tokens, header) is not None
        wanted = bool(self.token) and hmac.compare_digest(header.encode(),
                                                          f"Bearer {self.token}".encode())
        return named or wanted

    def get_request(self) -> tuple[socket.socket, object]:
        try:
            request, address = super().get_request()
        except OSError as e:
            if e.errno in TRANSIENT:
                time.sleep(0.05)    # serve_forever ignores the error and tries again
            raise
        if self.tls is not None:    # no handshake here: it is the connection thread's
            request = self.tls.wrap_socket(request, server_side=True,
                                           do_handshake_on_connect=False)
        return request, address

    def finish_request(self, request, client_address) -> None:  # noqa: ANN001
        if isinstance(request, ssl.SSLSocket):   # under the deadline, on this thread
            request.settimeout(_Handler.timeout)
            request.do_handshake()
        super().finish_request(request, client_address)

    def handle_error(self, request, client_address) -> None:  # noqa: ANN001
        """A failed handshake, a peer gone, a deadline's shutdown: a debug line, no
        traceback on stderr."""
        log.debug("metrics port: connection from %s ended: %s", client_address,
                  sys.exc_info()[1])

    def process_request(self, request, client_address) -> None:  # noqa: ANN001
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:  # noqa: ANN001
        with self._lock:
            self._deadlines[request] = time.monotonic() + DEADLINE_S
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._deadlines.pop(request, None)
            self._slots.release()

    def close(self) -> None:
        self.shutdown()
        self.server_close()
