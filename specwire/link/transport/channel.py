"""One --draft-url: its connection, handshake, health and reconnection backoff.

The handshake runs before any sequence uses the node, so a node with another
vocabulary, protocol version or a wrong token fails at connect with a message
naming it, never as garbage tokens later. Hello and every Session stream share
one HTTP/2 connection (a Line, link/transport/channels.py), so a target's sessions
(all slots of `serve -np N`) reach the node on one connection, a stream each. A
failure of one session backs the link off for new sessions but leaves the
connection, and the other sessions on it, alone; only a failure of the connection
itself (or a failed Hello) drops it, and the next call makes a new one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channels import Line, LinkError
from specwire.link.transport.h2.connection import Connection, GrpcStatus, H2Error
from specwire.link.transport.h2.grpcframe import Status
from specwire.link.transport.peertext import peer_text

__all__ = ["Link", "LinkError", "LinkSettings", "loopback"]

log = logging.getLogger("specwire.remote")

#: Session streams per link when the node did not say how many sessions it admits.
MAX_STREAMS = 64


@dataclass(slots=True, frozen=True)
class LinkSettings:
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    connect_timeout_s: float = 3.0
    backoff_min_s: float = 0.25
    backoff_max_s: float = 5.0


class Link:
    """A connection to one draft node, with exponential backoff after failures."""

    def __init__(
        self, url: str, settings: LinkSettings, fingerprint: str, n_vocab: int, target_name: str
    ) -> None:
        self.url = url.removeprefix("grpc://")
        if ":" not in self.url:
            raise LinkError(f"--draft-url {url}: expected HOST:PORT")
        self.settings = settings
        self.fingerprint, self.n_vocab, self.target_name = fingerprint, n_vocab, target_name
        if settings.token and not settings.tls_ca and not loopback(self.url):
            log.warning("draft node %s: the token goes to it in clear text over the network; "
                        "give --draft-tls-ca (and the node --tls-cert/--tls-key)", self.url)
        self._lines: dict[int, Line] = {}  # by port: the main one, the synchronous one
        self._lock = threading.Lock()
        self.up = False
        self.hello: pb.HelloReply | None = None
        self.rtt_s = float("inf")
        self.failures = 0
        self.violations = 0  # protocol violations seen (see failed)
        self.retry_at = 0.0
        self.last_error = ""
        #: what the node's last decode for this target held, as its last chunk that
        #: said so: (sessions' branches, alternates) (DraftChunk.step_sessions); None:
        #: not said (a node that does not batch, or no chunk yet)
        self.node_step: tuple[int, int] | None = None
        #: Bumps at every failure: a session remembers the epoch it opened in, and its own
        #: failure counts only if no other failure was counted since (the sessions on a
        #: connection that breaks all fail, and the backoff must grow once, not per session).
        self.epoch = 0
        self._streams = 0  # pipelined Session streams open on this link now

    def max_streams(self) -> int:
        """Session streams this target may have open on the link at once: what the node
        admits (its --max-sessions, from Hello) and a few closing, else MAX_STREAMS."""
        hello = self.hello
        return 2 * hello.max_sessions + 4 if hello and hello.max_sessions else MAX_STREAMS

    def take_stream(self) -> bool:
        """Count a stream about to open; False (nothing counted) if the link has its most."""
        with self._lock:
            if self._streams >= self.max_streams():
                return False
            self._streams += 1
            return True

    def give_stream(self) -> None:
        with self._lock:
            self._streams -= 1

    def metadata(self) -> tuple[tuple[str, str], ...]:
        tok = self.settings.token
        who = ((protocol.TARGET_HEADER, protocol.TARGET_ID),)
        return ((protocol.AUTH_HEADER, f"Bearer {tok}"), *who) if tok else who

    def sort_key(self) -> tuple[int, float]:
        """Healthy links first, then the one that answered its handshake fastest."""
        return (0 if self.up else 1, self.rtt_s)

    def ready_to_try(self) -> bool:
        return self.up or time.monotonic() >= self.retry_at

    def address(self) -> tuple[str, int]:
        """(host, port) of the node."""
        host, port = self.url.rsplit(":", 1)
        try:
            return host.strip("[]"), int(port)
        except ValueError:
            raise LinkError(f"--draft-url {self.url}: the port is not a number") from None

    def sync_port(self) -> int:
        """The port the node advertised for synchronous sessions (HelloReply.sync_port), 0
        for none: then they are streams of the main connection like the rest."""
        return self.hello.sync_port if self.hello is not None else 0

    def line(self, port: int = 0) -> Line:
        """The connection to the node's port (0: the URL's), made if needed (also when
        the node closed the one it had, as it does after --idle-timeout); LinkError if it
        cannot be made."""
        port = port or self.address()[1]
        with self._lock:
            line = self._lines.get(port)
            if line is not None and not line.broken() and line.alive():
                return line
            self._lines.pop(port, None)
        if line is not None:
            line.close()
        made = Line(self._connect(port), self, port)
        with self._lock:
            other = self._lines.get(port)
            if other is None:
                self._lines[port] = made
                return made
        made.close()   # another thread made one meanwhile: use it
        return other

    def drop_line(self, line: Line) -> None:
        """Close a broken line; the next call on its port makes a new one."""
        with self._lock:
            if self._lines.get(line.port) is line:
                del self._lines[line.port]
        line.close()

    def _drop(self) -> None:
        """Close the connections, ending every call on them."""
        with self._lock:
            lines, self._lines = list(self._lines.values()), {}
        for line in lines:
            line.close()

    def _connect(self, port: int) -> Connection:
        """A connection to the node's port: TCP, TLS as configured, HTTP/2. LinkError if
        it cannot be made."""
        host, s = self.address()[0], self.settings
        try:
            sock = socket.create_connection((host, port), timeout=s.connect_timeout_s)
            if s.tls_ca:
                ctx = ssl.create_default_context(cafile=s.tls_ca)
                if s.tls_cert:
                    ctx.load_cert_chain(s.tls_cert, s.tls_key)
                ctx.set_alpn_protocols(["h2"])
                sock = ctx.wrap_socket(sock, server_hostname=host)
            conn = Connection(sock, client=True, max_message=protocol.MAX_MESSAGE_BYTES)
            conn.handshake(s.connect_timeout_s)
        except (OSError, H2Error, TimeoutError) as e:
            raise LinkError(f"{host}:{port}: UNAVAILABLE: {e}") from None
        return conn

    def _hello(self, req: pb.HelloRequest) -> pb.HelloReply:
        """The Hello call over the link's connection; LinkError with the reason."""
        try:
            line = self.line()
        except LinkError as e:
            self.failed(str(e))
            raise
        try:
            data = line.unary(protocol.HELLO_PATH, req.SerializeToString(),
                              self.settings.connect_timeout_s)
            return pb.HelloReply.FromString(data)
        except GrpcStatus as e:
            self.failed(f"{_status_name(e.code)}: {peer_text(e.message)}")
        except (H2Error, TimeoutError, OSError) as e:
            self.failed(f"UNAVAILABLE: {e}")
        except Exception as e:  # noqa: BLE001 - a reply protobuf cannot parse
            self.failed(f"INTERNAL: undecodable HelloReply ({type(e).__name__})")
        raise LinkError(self.last_error)

    async def connect(self) -> None:
        """Handshake (again if needed); raises LinkError with the reason. Hello goes over
        the sessions' connection (on an executor thread), so that it adds no connection
        of its own."""
        if self.up:
            return
        req = pb.HelloRequest(
            protocol_version=protocol.PROTOCOL_VERSION,
            vocab_fingerprint=self.fingerprint,
            n_vocab=self.n_vocab,
            target_model=self.target_name,
        )
        t0 = time.perf_counter()
        reply = await asyncio.get_running_loop().run_in_executor(None, self._hello, req)
        self.rtt_s = time.perf_counter() - t0
        self._check(reply)
        # `failures` stays: it is reset by a session that drafts (worked()), so a node that
        # greets and then drops every session still backs off longer each time.
        self.hello, self.up = reply, True
        log.info(
            "draft node %s: %s, handshake %.1f ms", self.url, peer_text(reply.draft_model),
            1000 * self.rtt_s
        )

    async def close(self) -> None:
        """Close the connection."""
        self.up = False
        self._drop()

    def _check(self, r: pb.HelloReply) -> None:
        if r.protocol_version != protocol.PROTOCOL_VERSION:
            self._refuse(
                f"incompatible draft node {self.url}: protocol {r.protocol_version}, "
                f"this target speaks {protocol.PROTOCOL_VERSION}"
            )
        if r.vocab_fingerprint != self.fingerprint or r.n_vocab != self.n_vocab:
            self._refuse(
                f"incompatible models: the target {self.target_name} (vocabulary "
                f"{self.n_vocab} tokens, fingerprint {self.fingerprint}) and the draft "
                f"{peer_text(r.draft_model)} at {self.url} (vocabulary {r.n_vocab} tokens, "
                f"fingerprint {r.vocab_fingerprint}) do not share a tokenizer"
            )

    def _refuse(self, msg: str) -> None:
        self.failed(msg, backoff_s=3600.0)
        raise LinkError(msg)

    def worked(self) -> None:
        """A session on this link delivered a usable draft: the next failure starts a fresh
        backoff (but not below what the node's protocol violations earned it)."""
        self.failures = 0

    def failed(self, reason: str, backoff_s: float | None = None, hostile: bool = False,
               epoch: int | None = None, reconnect: bool = True) -> None:
        """Mark the link down; retry after an exponentially growing pause. hostile: the node
        broke the protocol, which doubles every later pause for good (a node that drafts a
        little and then misbehaves is not retried ever faster). epoch: the link's epoch
        when the failing session opened; if another failure was counted since, this one is
        part of it and changes nothing. reconnect: the connection itself failed and is
        dropped (the next session makes a fresh one); False for a failure of one session,
        which leaves the others on the connection alone."""
        if epoch is not None and epoch != self.epoch:
            return
        self.epoch += 1
        self.up = False
        self.failures += 1
        self.violations += hostile
        self.last_error = reason
        if reconnect:
            self._drop()
        s = self.settings
        n = self.failures + self.violations
        pause = backoff_s or min(s.backoff_max_s, s.backoff_min_s * 2 ** (n - 1))
        self.retry_at = time.monotonic() + pause
        log.warning("draft link %s down (%s); retry in %.2f s", self.url, reason, pause)


def loopback(url: str) -> bool:
    """Whether HOST:PORT names this machine (localhost or a loopback address)."""
    host = url.rsplit(":", 1)[0].strip("[]")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return f"status {code}"
