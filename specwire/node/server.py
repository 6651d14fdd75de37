"""The draft node: a gRPC server holding one small model for many targets.

Each Session stream gets a sequence of its own in the node's one llama.cpp context
(node/steps.py), so sequences from several targets are isolated from each other while
one loop decodes every drafting session's next tokens together. Sequences and the KV
caches of finished sessions are kept (node/kv_cache.py, --cache-ram and
--cache-sessions), so a chat's next turn evaluates only its new tokens. Every call
is served by link/transport/h2/server.py, a thread per connection: a synchronous
round (read verdict, draft, write chunk) happens on that thread, a pipelined
session drafts on a thread of its own. The calls here are its handlers
(link/transport/h2/mux.py's Handler), one object per call.
"""

from __future__ import annotations

import hmac
import logging
import signal
import ssl
import threading
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from specwire.backend.llama import LlamaBackend, Model, load_model, max_sequences
from specwire.config import ModelParams
from specwire.emulate.hold import HoldCounters, Regime, emulate
from specwire.link.messages import Chunk, DraftMessage, Failure, Verdict
from specwire.link.session import DraftSession, error_message
from specwire.link.transport import protocol, roundcodec
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.h2.grpcframe import Status
from specwire.link.transport.h2.server import H2Server, tls_context
from specwire.link.transport.protocol import ProtocolError
from specwire.node.calibrations import Calibrations, target_key
from specwire.node.kv_cache import KvCache
from specwire.node.metrics import NodeMetrics
from specwire.node.steps import StepLoop
from specwire.node.tenants import Quotas, certificate_subject, identity, token_name

log = logging.getLogger("specwire.node")


@dataclass(slots=True)
class NodeSettings:
    model: ModelParams
    host: str = "127.0.0.1"
    port: int = 7070
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # mutual TLS: require client certificates from this CA
    max_sessions: int = 8
    sync_port: int | None = None  # a second port serving the same calls (0: any free; None: none)
    seed: int | None = None  # overrides each target's sampling seed for this node's drafts
    cache_ram_mib: int = 8192  # finished sessions' KV caches kept in RAM (0: none kept)
    cache_sessions: int = 32  # and at most this many of them
    cache_ram_per_identity_mib: int = 0  # of which one identity holds at most (0: all)
    cache_sessions_per_identity: int = 0  # ... and at most this many (0: all)
    tokens: dict[str, str] | None = None  # --token-file: token -> its target's name
    sessions_per_identity: int = 0  # most sessions one identity holds at once (0: no limit)
    metrics_port: int | None = None  # Prometheus figures (node/metrics.py; None: off)
    idle_s: float = 120.0  # a connection with no call this long is closed (both ports)
    per_address: int = 8  # connections one peer address holds on a port (0: no cap)
    shutdown_s: float = 10.0  # on SIGTERM: open sessions get this long, then are closed
    cache_ttl_s: float = 900.0  # cached sessions unused this long are forgotten (0: never)
    #: --emulate: every draft context is held to this regime (emulate/hold.py)
    emulation: Regime | None = None


#: A call must send its first message (a Session's Open, a ping) this soon, and a Ping
#: stream each next ping: a silent peer would otherwise hold an admission slot for ever.
HANDSHAKE_S = 10.0
#: An open session whose target sends nothing for this long is ended, so that a target gone
#: without a word does not hold a slot. Generous: the target evaluates its prompt after the
#: Open, before its first verdict, and a long prompt on a large CPU model takes minutes.
SESSION_IDLE_S = 900.0
#: ...and once it has sent its first verdict, for this long: a started session's target
#: sends a verdict each round, so a longer silence means it is gone (or holds the slot).
ACTIVE_IDLE_S = 120.0
#: The longest one ping may hold a node thread busy (bench/link_overhead holds each as
#: long as a drafting round took, which on a loaded machine can pass 100 ms). What bounds
#: the spinning is admission: a Ping stream holds one of --max-sessions slots, as a
#: drafting session does, so pings can keep no more cores busy than sessions could.
MAX_PING_HOLD_US = 1_000_000
#: Targets whose calibration the node keeps; the least recently seen is forgotten first.
MAX_CALIBRATIONS = 64


class DraftNodeService:
    """The node's calls (Hello, Ping, Session), admission and memory, for every port."""

    def __init__(self, settings: NodeSettings, model: Model, steps: StepLoop,
                 holds: HoldCounters) -> None:
        """steps: the loop over the node's draft context (draft_context), whose --emulate
        holds count into `holds`."""
        self.settings, self.model, self.steps, self.holds = settings, model, steps, holds
        # What verdicts taught about the draft's confidence, kept across sessions, per target.
        self.calibrations = Calibrations(MAX_CALIBRATIONS)
        self.quotas = Quotas(settings.sessions_per_identity)
        self._slots = threading.BoundedSemaphore(settings.max_sessions)
        self._in_use = 0  # admitted calls open now (for /metrics)
        self.draining = False  # shutting down: no new sessions
        self._in_use_lock = threading.Lock()
        self.sync_port = 0  # advertised in Hello once the second port listens
        self.memory = KvCache(settings.model, model, settings.cache_ram_mib,
                              settings.cache_sessions, settings.max_sessions,
                              ttl_s=settings.cache_ttl_s,
                              identity_mib=settings.cache_ram_per_identity_mib,
                              identity_sessions=settings.cache_sessions_per_identity,
                              new_backend=self.steps.take)
        self.metrics = NodeMetrics(lambda: self._in_use, self.steps.taken,
                                   lambda: len(self.calibrations), self.memory.pooled,
                                   steps=self.steps.snapshot)

    def identity(self, context) -> str:
        """The peer's authenticated identity (node/tenants.py): its token's name in the
        --token-file, its client certificate's subject; "" for neither."""
        name = None
        if self.settings.tokens:
            got = dict(context.invocation_metadata() or ()).get(protocol.AUTH_HEADER, "")
            name = token_name(self.settings.tokens, got)
        return identity(name, certificate_subject(context))

    def purge_for(self, header: str) -> tuple[int, dict] | None:
        """POST /purge on the metrics port (node/exporter.py) with this Authorization
        header: the node's --token purges every finished conversation, a --token-file
        token its identity's; (status, answer), or None for a token neither."""
        want, tokens = self.settings.token, self.settings.tokens
        if not want and not tokens:
            return 403, {"error": "this node has no token: anyone could purge its memory; "
                         "send it SIGHUP instead"}
        if want and hmac.compare_digest(header.encode(), f"Bearer {want}".encode()):
            n = self.memory.purge()
            log.info("POST /purge: %d cached entries purged", n)
            return 200, {"purged": n, "identity": "all"}
        name = token_name(tokens, header) if tokens else None
        if name is None:
            return None
        n = self.memory.purge(f"token:{name}")
        log.info("POST /purge: %d cached entries of token:%s purged", n, name)
        return 200, {"purged": n, "identity": f"token:{name}"}

    def _authorize(self, context) -> None:
        want, tokens = self.settings.token, self.settings.tokens
        if not want and not tokens:
            return
        meta = dict(context.invocation_metadata() or ())
        got = meta.get(protocol.AUTH_HEADER, "")
        named = bool(tokens) and token_name(tokens, got) is not None
        if not named and not (want and hmac.compare_digest(got.encode(),
                                                           f"Bearer {want}".encode())):
            log.warning(
                "refused connection from %s: %s",
                context.peer(),
                "missing token" if not got else "wrong token",
            )
            self.metrics.refuse("token")
            context.abort(Status.UNAUTHENTICATED, "draft node: bad or missing token")

    def call(self, path: str, send, context, port: str = "main"):
        """The handler of a new call on `port` (link/transport/h2/mux.py's Handler), or
        context.abort if it may not start: the token checked first, and a Session or Ping
        admitted (one of --max-sessions slots). send(bytes, last) writes its messages."""
        if path == protocol.SESSION_PATH:
            return SessionCall(self, send, context, port)
        if path == protocol.PING_PATH:
            return PingCall(self, send, context, port)
        if path == protocol.HELLO_PATH:
            self._authorize(context)
            self.metrics.peer(port, context.peer())
            return HelloCall(self, send)
        context.abort(Status.UNIMPLEMENTED, f"draft node: no method {path[:80]!r}")

    def hello(self, request: pb.HelloRequest) -> pb.HelloReply:
        """The node's answer to a Hello; ProtocolError for another protocol version."""
        if request.protocol_version != protocol.PROTOCOL_VERSION:
            raise ProtocolError(
                f"protocol version {request.protocol_version} not supported "
                f"(this node speaks {protocol.PROTOCOL_VERSION})")
        return pb.HelloReply(
            protocol_version=protocol.PROTOCOL_VERSION,
            vocab_fingerprint=self.model.fingerprint(),
            n_vocab=self.model.n_vocab,
            draft_model=self.model.name,
            # "tree": verdicts may follow link/rule.py's tree rule (take_tree_alternate)
            modes=["greedy", "coupled", "rejection", "tree"],
            n_ctx=self.settings.model.n_ctx,
            max_sessions=self.settings.max_sessions,
            sync_port=self.sync_port,
        )

    def _admit(self, context, method: str, port: str = "main") -> str:
        """The token checked, and one of --max-sessions slots taken (context.abort if not),
        within the identity's quota; the identity."""
        self._authorize(context)
        self.metrics.peer(port, context.peer())
        if self.draining:
            self.metrics.refuse("draining")
            context.abort(Status.UNAVAILABLE, "draft node shutting down")
        if not self._slots.acquire(blocking=False):
            self.metrics.refuse("busy")
            context.abort(
                Status.RESOURCE_EXHAUSTED,
                f"draft node busy: {self.settings.max_sessions} sessions open",
            )
        who = self.identity(context)
        if not self.quotas.enter(who):
            self._slots.release()
            self.metrics.refuse("quota")
            context.abort(Status.RESOURCE_EXHAUSTED,
                          f"draft node: {self.quotas.per_identity} sessions open for this "
                          "identity (--sessions-per-identity)")
        with self._in_use_lock:
            self._in_use += 1
        self.metrics.call(method)
        return who

    def in_use(self) -> int:
        with self._in_use_lock:
            return self._in_use

    def _release(self) -> None:
        """A slot freed (the caller leaves the identity's quota, quotas.leave)."""
        with self._in_use_lock:
            self._in_use -= 1
        self._slots.release()

    def _open(self, m: pb.Open, send, context) -> DraftSession:
        """Check everything the Open says, then take a llama.cpp context (from memory).
        The session's messages (link/messages.py) go to `send`."""
        try:
            open_msg = protocol.open_from_pb(m)
            open_msg.check(self.model.n_vocab, self.settings.model.n_ctx)
        except ProtocolError:
            self.metrics.refuse("bad_open")
            raise
        who = self.identity(context)
        calibration = self.calibrations.get(target_key(context, who, open_msg.cache_scope)) \
            if open_msg.calibrated else None
        backend = self.memory.acquire(open_msg.history, (who, open_msg.cache_scope),
                                      store=not open_msg.no_store)
        try:
            session = DraftSession(backend, open_msg, send, seed=self.settings.seed,
                                   calibration=calibration)
        except Exception:
            self.memory.release(backend)
            raise
        self.memory.account(session.cache_n, session.prompt_n)
        log.info("session opens: %d history tokens, %d of them cached; kv cache: %s",
                 len(open_msg.history), session.cache_n, self.memory.describe())
        return session

    def _close(self, session: DraftSession | None) -> None:
        if session is not None:
            session.finish()
            self.memory.release(session.backend, session.committed)
            if self.memory.enabled:
                log.info("session closes: %d tokens kept", session.backend.n_past)
            steps = self.steps.snapshot()
            branches, alternates = steps.per_decode()
            log.info("node steps: %.2f sessions and %.2f alternates per decode (%d alternate "
                     "parts beside their branch's)", branches, alternates, steps.beside)
            if self.settings.emulation is not None:
                h = self.holds
                log.info("emulation: %d draft decodes, %d over their emulated time; "
                         "%d prompt chunks, %d over", h.decodes, h.over, h.prompt_chunks,
                         h.prompt_over)


def draft_context(settings: NodeSettings, model: Model, holds: HoldCounters):  # noqa: ANN201
    """The node's one llama.cpp context: a sequence for every session it admits and one
    for every finished session its memory keeps warm (node/kv_cache.py), each with a fork
    for its alternates (link/fork.py), held to the --emulate regime where given (one
    decode of n sequences charged as a batch of n)."""
    n_seq = 2 * settings.max_sessions
    forks = 2 * n_seq <= max_sequences()
    if not forks:
        log.warning("--max-sessions %d leaves no llama.cpp sequence ids for forks (at most %d "
                    "in a context): alternates are drafted between their branch's tokens",
                    settings.max_sessions, max_sequences())
    shared = LlamaBackend(settings.model, model, n_seq=n_seq, forks=forks)
    regime = settings.emulation
    return shared if regime is None else emulate(shared, regime, holds)


def _encode(msg: DraftMessage) -> bytes:
    """A session's message as bytes: a plain chunk written directly (roundcodec.py),
    anything else by protobuf."""
    data = roundcodec.chunk_bytes(msg) if isinstance(msg, Chunk) else None
    return data if data is not None else protocol.draft_to_pb(msg).SerializeToString()


class HelloCall:
    """A Hello: one request, one reply."""

    __slots__ = ("service", "send", "status")
    idle_s = None

    def __init__(self, service: DraftNodeService, send) -> None:
        self.service, self.send, self.status = service, send, (Status.OK, "")

    def take(self, data: bytes | ProtocolError) -> bool:
        try:
            if isinstance(data, ProtocolError):
                raise data
            self.send(self.service.hello(pb.HelloRequest.FromString(data)).SerializeToString())
        except DecodeError:
            self.status = (Status.INTERNAL, "undecodable HelloRequest")
        except ProtocolError as e:
            self.status = (Status.FAILED_PRECONDITION, str(e))
        return False

    def end(self) -> None:
        pass


class PingCall:
    """A Ping stream: each PingMessage answered by a Pong after hold_us of busy work, as a
    drafting round keeps the node busy.

    The time a message exchange takes depends on what the CPUs did meanwhile (an idle
    core wakes up slower), so the hold spins rather than sleeps. A Ping stream is
    admitted like a session (it holds one of --max-sessions slots and spins a core like
    one), each hold is at most MAX_PING_HOLD_US, and a stream silent for HANDSHAKE_S is
    ended.
    """

    __slots__ = ("service", "send", "status", "_who", "_ended")
    idle_s = HANDSHAKE_S

    def __init__(self, service: DraftNodeService, send, context, port: str) -> None:
        self._who = service._admit(context, "Ping", port)
        self.service, self.send, self.status = service, send, (Status.OK, "")
        self._ended = False

    def take(self, data: bytes | ProtocolError) -> bool:
        if isinstance(data, ProtocolError):
            self.service.metrics.refuse("silent")
            self.status = (Status.DEADLINE_EXCEEDED, f"ping: {data}")
            return False
        try:
            ping = pb.PingMessage.FromString(data)
        except DecodeError:
            self.status = (Status.INTERNAL, "undecodable PingMessage")
            return False
        if ping.hold_us > MAX_PING_HOLD_US:
            self.status = (Status.INVALID_ARGUMENT, f"ping: hold_us above {MAX_PING_HOLD_US}")
            return False
        until = time.perf_counter() + ping.hold_us / 1e6
        while time.perf_counter() < until:
            pass
        self.send(pb.Pong(seq=ping.seq).SerializeToString())
        return True

    def end(self) -> None:
        if not self._ended:
            self._ended = True
            self.service._release()
            self.service.quotas.leave(self._who)


class SessionCall:
    """One Session, fed one message at a time: the Open, then verdicts until a Close.
    Synchronous, each verdict is applied and drafted on at once (on the connection's
    thread, or a worker of it); pipelined, the session drafts on its own thread and its
    chunks go out as they are drafted. Holds an admission slot from its creation to
    end(). An error of this session is sent to its target as a DraftError and ends it
    alone."""

    __slots__ = ("service", "send", "context", "session", "status", "_ended", "_who")
    idle_s = None

    def __init__(self, service: DraftNodeService, send, context, port: str = "main") -> None:
        self._who = service._admit(context, "Session", port)
        self.service, self.send, self.context = service, send, context
        self.session: DraftSession | None = None
        self.status = (Status.OK, "")
        self._ended = False

    def _out(self, msg: DraftMessage) -> None:
        """A message of the session; a pipelined session's error is its last."""
        last = isinstance(msg, Failure) and self.session is not None and self.session.pipelined
        self.send(_encode(msg), last)

    def take(self, data: bytes | ProtocolError) -> bool:
        """One message of the call (or why none came in time); False once it is over. A
        verdict in its common encoding is decoded directly (link/transport/roundcodec.py)."""
        try:
            if isinstance(data, ProtocolError):   # silent past its deadline
                self.service.metrics.refuse("silent")
                if self.session is None:          # nothing to tell a peer that never spoke
                    log.info("session from %s ended: %s", self.context.peer(), data)
                    self.status = (Status.DEADLINE_EXCEEDED, str(data))
                    return False
                raise data
            msg = _decode(data)
            if isinstance(msg, Verdict):
                if self.session is None:
                    raise ProtocolError("unexpected verdict message")
                self._verdict(msg)
                return True
            kind = msg.WhichOneof("kind")
            if self.session is None:
                if kind != "open":
                    raise ProtocolError(f"unexpected {kind} message")
                self.session = self.service._open(msg.open, self._out, self.context)
                if self.session.pipelined:
                    self.session.start()
                else:
                    self.session.announce()
                    self.session.step(None)
                return True
            if kind == "close":
                return False
            if kind != "verdict":
                raise ProtocolError(f"unexpected {kind} message")
            self._verdict(protocol.verdict_from_pb(msg.verdict))
            return True
        except Exception as e:  # noqa: BLE001 - the node must survive any one session
            log.info("session from %s ends: %s", self.context.peer(), e)
            self.send(_encode(error_message(e)))
            return False

    def _verdict(self, v: Verdict) -> None:
        if self.session.pipelined:
            self.session.push(v)
        else:
            self.session.step(v)

    def end(self) -> None:
        """The call is over (however it ended): its context kept, its slot freed. Once."""
        if self._ended:
            return
        self._ended = True
        try:
            self.service._close(self.session)
        finally:
            self.service._release()
            self.service.quotas.leave(self._who)


def _decode(data: bytes) -> pb.TargetMessage | Verdict:
    """A target's message: a verdict in its common encoding decoded directly, anything
    else by protobuf; ProtocolError for bytes that are neither."""
    verdict = roundcodec.verdict_from_bytes(data)
    if verdict is not None:
        return verdict
    try:
        return pb.TargetMessage.FromString(data)
    except DecodeError:
        raise ProtocolError("undecodable frame: not a TargetMessage") from None


@dataclass(slots=True)
class RunningNode:
    """A started node: its gRPC server, its service, its other ports."""

    server: H2Server
    service: DraftNodeService
    port: int
    sync: H2Server | None
    metrics_port: int | None

    def _servers(self) -> list[H2Server]:
        return [self.server] + ([self.sync] if self.sync is not None else [])

    def drain(self, grace_s: float) -> None:
        """No new sessions (refused UNAVAILABLE; every connection gets a GOAWAY and no new
        one is accepted); those open get grace_s to end, then the node stops (what is left
        is ended)."""
        self.service.draining = True
        for server in self._servers():
            server.drain()
        open_ = self.service.in_use()
        log.info("draft node shutting down: %d session%s open get up to %.0f s",
                 open_, "" if open_ == 1 else "s", grace_s)
        deadline = time.monotonic() + grace_s
        while self.service.in_use() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop(grace_s=max(0.0, min(1.0, deadline - time.monotonic())))

    def stop(self, grace_s: float = 1.0) -> None:
        """Every call ended and every connection closed (waiting up to grace_s + 2 s for
        their threads), then the metrics port and the memory."""
        for server in self._servers():
            server.stop(grace_s + 2.0)
        self.service.metrics.close()
        self.service.memory.close()
        self.service.steps.close()


def start(settings: NodeSettings) -> RunningNode:
    """Load the model and start serving on every configured port (returns at once)."""
    model = load_model(settings.model)
    model.fingerprint()  # computed once, before the first Hello
    holds = HoldCounters()   # what --emulate's holds saw, logged per session
    service = DraftNodeService(settings, model,
                               StepLoop(draft_context(settings, model, holds)), holds)
    server = _server(settings, service, settings.port, "main")
    sync = None
    if settings.sync_port is not None:
        sync = _server(settings, service, settings.sync_port, "sync")
        service.sync_port = sync.port
    metrics_port = None
    if settings.metrics_port is not None:
        metrics_port = service.metrics.serve(settings.host, settings.metrics_port,
                                             settings.token, purge=service.purge_for,
                                             **metrics_options(settings))
    server.start()
    if sync is not None:
        sync.start()
    log.info(
        "draft node serving %s on %s:%d (%s, token %s)",
        model.name,
        settings.host,
        server.port,
        "TLS" if settings.tls_cert else "plain text",
        "required" if settings.token or settings.tokens else "off",
    )
    return RunningNode(server, service, server.port, sync, metrics_port)


def metrics_options(settings: NodeSettings) -> dict:
    """What the metrics port gets beside the --token (node/exporter.py): the --token-file's
    tokens, which read /metrics as the --token does, and TLS when the node has it."""
    return {"tokens": settings.tokens, "tls": _metrics_tls(settings)}


def _metrics_tls(settings: NodeSettings) -> ssl.SSLContext | None:
    """The metrics port's TLS (HTTP/1.1): the node's certificate, and its client CA when it
    wants client certificates; None for a node without --tls-cert (plain HTTP)."""
    if not settings.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(settings.tls_cert, settings.tls_key or settings.tls_cert)
    if settings.tls_client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(settings.tls_client_ca)
    return ctx


def _server(settings: NodeSettings, service: DraftNodeService, port: int,
            name: str) -> H2Server:
    """A listening port serving every call of the service (not yet accepting)."""
    tls = None
    if settings.tls_cert:
        tls = tls_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    n = settings.max_sessions
    try:
        return H2Server(
            lambda path, send, context: service.call(path, send, context, name),
            settings.host, port, tls,
            # Every admitted session and ping holds a call, plus short Hellos.
            max_connections=4 * n + 16, idle_s=settings.idle_s,
            session_idle_s=SESSION_IDLE_S, max_streams=2 * n + 8,
            active_idle_s=ACTIVE_IDLE_S, per_address=settings.per_address, name=name)
    except OSError as e:
        raise OSError(f"cannot listen on {settings.host}:{port}: {e}") from e


def serve(settings: NodeSettings, ready: threading.Event | None = None) -> None:
    """Run a draft node until interrupted."""
    node = start(settings)
    host = settings.host
    if node.metrics_port is not None:
        scheme = "https" if settings.tls_cert else "http"
        print(f"specwire draft node: metrics on {scheme}://{host}:{node.metrics_port}/metrics",
              flush=True)
    if node.sync is not None:
        print(f"specwire draft node: synchronous sessions on {host}:{node.sync.port}",
              flush=True)
    print(f"specwire draft node listening on {host}:{node.port}", flush=True)
    _purge_on_sighup(node.service)
    if ready is not None:
        ready.set()
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    node.drain(settings.shutdown_s)


def _purge_on_sighup(service: DraftNodeService) -> None:
    """SIGHUP drops every finished conversation the node keeps (contexts and saved states;
    open sessions go on), e.g. when a tenant leaves. Only from the main thread."""
    if threading.current_thread() is not threading.main_thread() or \
            not hasattr(signal, "SIGHUP"):
        return

    def purge(signum, frame) -> None:
        log.info("SIGHUP: %d cached entries purged", service.memory.purge())

    signal.signal(signal.SIGHUP, purge)
