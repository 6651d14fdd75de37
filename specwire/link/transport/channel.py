"""One --draft-url: its channel, handshake, health and reconnection backoff.

The handshake runs before any sequence uses the node, so a node with another
vocabulary, protocol version or a wrong token fails at connect with a message
naming it, never as garbage tokens later. Hello and every Session stream share
one blocking channel, so a target's sessions (all slots of `serve -np N`, see
link/transport/channels.py) reach the node's main port on one HTTP/2 connection, a
stream each. A failure of one session backs the link off for new sessions but
leaves the connection, and the other sessions on it, alone; only a failure of
the connection itself (UNAVAILABLE, or a failed Hello) drops it.
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

import grpc

from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport import specwire_pb2_grpc as pbg
from specwire.link.transport.h2.connection import Connection, H2Error
from specwire.link.transport.peertext import peer_text

log = logging.getLogger("specwire.remote")


#: gRPC keepalive on the link: a ping after this long without frames, answered within the
#: timeout or the connection is closed.
KEEPALIVE_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 10_000
#: Session streams per link when the node did not say how many sessions it admits.
MAX_STREAMS = 64


class LinkError(Exception):
    """A draft node could not be used; the message says why."""


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
    """A channel to one draft node, with exponential backoff after failures."""

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
        self._session_channel: grpc.Channel | None = None
        self._lock = threading.Lock()
        self.up = False
        self.hello: pb.HelloReply | None = None
        self.rtt_s = float("inf")
        self.failures = 0
        self.violations = 0  # protocol violations seen (see failed)
        self.retry_at = 0.0
        self.last_error = ""
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

    def session_stub(self) -> pbg.DraftNodeStub:
        """A stub on the link's blocking channel, for Hello and Session streams.

        Sessions use grpcio's blocking API rather than grpc.aio: its threads
        move a message between the caller and the wire with fewer wake-ups (a cheaper
        synchronous round in benchmarks/link_overhead.py). The channel is dropped when
        the link fails, so that a restarted node is reached
        on a fresh connection rather than after grpc's own reconnection backoff.
        """
        return pbg.DraftNodeStub(self._sessions())

    def connect_sessions(self, timeout_s: float) -> bool:
        """Open the session channel's connection now (a TLS handshake of its own), so that
        the first session does not wait for it; False if it is not ready in time."""
        try:
            grpc.channel_ready_future(self._sessions()).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            return False
        return True

    def sync_port(self) -> int:
        """The node's synchronous port (link/transport/h2/server.py), 0 if it has none."""
        return self.hello.sync_port if self.hello is not None else 0

    def sync_address(self) -> tuple[str, int]:
        """(host, port) of the synchronous port: the URL's host, the port Hello gave."""
        return self.url.rsplit(":", 1)[0].strip("[]"), self.sync_port()

    def connect_sync(self) -> Connection:
        """A connection to the node's synchronous port: TCP, TLS as configured, HTTP/2.

        Raises LinkError with the reason; the caller then uses the main port.
        """
        (host, port), s = self.sync_address(), self.settings
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
        except (OSError, H2Error) as e:
            raise LinkError(f"sync port {host}:{port}: {e}") from None
        return conn

    def _sessions(self) -> grpc.Channel:
        """The blocking channel for sessions, made when first needed."""
        with self._lock:
            if self._session_channel is None:
                self._session_channel = self._make_channel()
            return self._session_channel

    def _drop_session_channel(self) -> None:
        with self._lock:
            channel, self._session_channel = self._session_channel, None
        if channel is not None:
            channel.close()

    def _make_channel(self) -> grpc.Channel:
        """The blocking channel: one connection of its own, no retries."""
        opts = [
            ("grpc.max_receive_message_length", protocol.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", protocol.MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
            # A connection of its own: grpc would otherwise share one TCP connection among
            # channels to the same address, and a failure of one Link would hit the others.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            # A frozen node (or a link that drops packets) is found within
            # KEEPALIVE_MS + KEEPALIVE_TIMEOUT_MS while a session is open; the node permits
            # pings this often (node/server.py).
            ("grpc.keepalive_time_ms", KEEPALIVE_MS),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),
        ]
        s = self.settings
        if not s.tls_ca:
            return grpc.insecure_channel(self.url, options=opts)
        ca = _read(s.tls_ca)
        cert = _read(s.tls_cert) if s.tls_cert else None
        key = _read(s.tls_key) if s.tls_key else None
        creds = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )
        return grpc.secure_channel(self.url, creds, options=opts)

    async def connect(self) -> None:
        """Handshake (again if needed); raises LinkError with the reason. Hello goes over
        the sessions' blocking channel (on an executor thread), so that it adds no
        connection of its own."""
        if self.up:
            return
        req = pb.HelloRequest(
            protocol_version=protocol.PROTOCOL_VERSION,
            vocab_fingerprint=self.fingerprint,
            n_vocab=self.n_vocab,
            target_model=self.target_name,
        )
        stub = self.session_stub()
        t0 = time.perf_counter()
        try:
            reply = await asyncio.get_running_loop().run_in_executor(None, lambda: stub.Hello(
                req, timeout=self.settings.connect_timeout_s, metadata=self.metadata()))
        except grpc.RpcError as e:
            self.failed(_reason(e))
            raise LinkError(self.last_error) from None
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
        """Close the channel (its connection goes with it)."""
        self.up = False
        self._drop_session_channel()

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
            self._drop_session_channel()
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


def _reason(e: grpc.RpcError) -> str:
    if isinstance(e, grpc.Call):
        return f"{e.code().name}: {peer_text(e.details())}"
    return peer_text(e)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()
