"""The draft node: a gRPC server holding one small model for many targets.

Each Session stream gets its own llama.cpp context over the shared weights, so
sequences from several targets are isolated from each other. Contexts and the
KV caches of finished sessions are kept (node/kv_cache.py, --cache-ram and
--cache-sessions), so a chat's next turn evaluates only its new tokens. The node runs
grpcio's threaded server rather than grpc.aio: a session is compute, and on a
thread per RPC a synchronous round (read verdict, draft, write chunk) happens
on one thread. Handing each message between an event loop and a drafting
thread cost about a millisecond per round here (benchmarks/link_overhead.py).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc

from specwire.backend.llama import Model, load_model, open_contexts
from specwire.config import ModelParams
from specwire.emulate.hold import HoldCounters, Regime, emulate
from specwire.link.messages import Verdict
from specwire.link.session import DraftSession, error_message
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport import specwire_pb2_grpc as pbg
from specwire.link.transport.channel import KEEPALIVE_MS
from specwire.link.transport.h2.server import SyncServer, tls_context
from specwire.link.transport.protocol import ProtocolError
from specwire.node.calibrations import Calibrations, target_key
from specwire.node.kv_cache import KvCache
from specwire.node.metrics import NodeMetrics
from specwire.node.tenants import Quotas, certificate_subject, identity, token_name
from specwire.node.watchdog import Lease, Watchdog

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
    sync_port: int | None = None  # the synchronous port (0: any free one; None: none)
    seed: int | None = None  # overrides each target's sampling seed for this node's drafts
    cache_ram_mib: int = 8192  # finished sessions' KV caches kept in RAM (0: none kept)
    cache_sessions: int = 32  # and at most this many of them
    cache_ram_per_identity_mib: int = 0  # of which one identity holds at most (0: all)
    cache_sessions_per_identity: int = 0  # ... and at most this many (0: all)
    tokens: dict[str, str] | None = None  # --token-file: token -> its target's name
    sessions_per_identity: int = 0  # most sessions one identity holds at once (0: no limit)
    metrics_port: int | None = None  # Prometheus figures (node/metrics.py; None: off)
    idle_s: float = 120.0  # a connection with no call this long is closed (both ports)
    sync_per_address: int = 8  # sync-port connections one peer address holds (0: no cap)
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


class DraftNodeService(pbg.DraftNodeServicer):
    def __init__(self, settings: NodeSettings, model: Model) -> None:
        self.settings, self.model = settings, model
        # What verdicts taught about the draft's confidence, kept across sessions, per target.
        self.calibrations = Calibrations(MAX_CALIBRATIONS)
        self.quotas = Quotas(settings.sessions_per_identity)
        self._slots = threading.BoundedSemaphore(settings.max_sessions)
        self._in_use = 0  # admitted calls open now (for /metrics)
        self.draining = False  # shutting down: no new sessions
        self._in_use_lock = threading.Lock()
        self.watchdog = Watchdog()
        self.sync_port = 0  # advertised in Hello once the sync server listens
        self.holds = HoldCounters()   # what --emulate's holds saw, logged per session
        regime = settings.emulation
        self.memory = KvCache(settings.model, model, settings.cache_ram_mib,
                              settings.cache_sessions, settings.max_sessions,
                              ttl_s=settings.cache_ttl_s,
                              identity_mib=settings.cache_ram_per_identity_mib,
                              identity_sessions=settings.cache_sessions_per_identity,
                              wrap=None if regime is None
                              else lambda b: emulate(b, regime, self.holds))
        self.metrics = NodeMetrics(lambda: self._in_use, open_contexts,
                                   lambda: len(self.calibrations), self.memory.pooled)

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

    def _authorize(self, context: grpc.ServicerContext) -> None:
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
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "draft node: bad or missing token")

    def Hello(self, request: pb.HelloRequest, context) -> pb.HelloReply:  # noqa: N802
        self._authorize(context)
        self.metrics.peer("main", context.peer())
        if request.protocol_version != protocol.PROTOCOL_VERSION:
            context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} not supported "
                f"(this node speaks {protocol.PROTOCOL_VERSION})",
            )
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

    def Ping(self, request_iterator, context):  # noqa: N802
        """Echo each ping after hold_us of busy work, as a drafting round keeps the node busy.

        The time a message exchange takes depends on what the CPUs did meanwhile
        (an idle core wakes up slower), so the hold spins rather than sleeps. A Ping
        stream is admitted like a session (it holds one of --max-sessions slots and
        spins a core like one), each hold is at most MAX_PING_HOLD_US, and a stream
        silent for HANDSHAKE_S is ended.
        """
        with self._admitted(context, "Ping"), \
                self.watchdog.watch(HANDSHAKE_S, context.cancel) as lease:
            for ping in request_iterator:
                lease.feed()
                if ping.hold_us > MAX_PING_HOLD_US:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"ping: hold_us above {MAX_PING_HOLD_US}")
                until = time.perf_counter() + ping.hold_us / 1e6
                while time.perf_counter() < until:
                    pass
                yield pb.Pong(seq=ping.seq)
                lease.feed()

    def Session(self, request_iterator, context):  # noqa: N802
        with self._admitted(context, "Session"):
            yield from self._serve(request_iterator, context)

    def sync_call(self, send, context) -> SyncCall:
        """A synchronous Session for a transport that writes from the calling thread (the
        sync port, link/transport/h2/server.py), admitted now (context.abort if it may not be):
        the transport hands it each message as it arrives (a Verdict it decoded itself, or
        protobuf), and each message goes to `send` as it is drafted, as a domain message
        (link/messages.py; the transport encodes it), with no generator or thread
        between the session and the socket.
        Several such calls may share one connection, a stream each."""
        return SyncCall(self, send, context)

    @contextlib.contextmanager
    def _admitted(self, context, method: str):
        """The token checked, and one of --max-sessions slots held for the block."""
        who = self._admit(context, method)
        try:
            yield
        finally:
            self._release()
            self.quotas.leave(who)

    def _admit(self, context, method: str, port: str = "main") -> str:
        """The token checked, and one of --max-sessions slots taken (context.abort if not),
        within the identity's quota; the identity."""
        self._authorize(context)
        self.metrics.peer(port, context.peer())
        if self.draining:
            self.metrics.refuse("draining")
            context.abort(grpc.StatusCode.UNAVAILABLE, "draft node shutting down")
        if not self._slots.acquire(blocking=False):
            self.metrics.refuse("busy")
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"draft node busy: {self.settings.max_sessions} sessions open",
            )
        who = self.identity(context)
        if not self.quotas.enter(who):
            self._slots.release()
            self.metrics.refuse("quota")
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
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

    def _serve(self, requests, context):
        """Open, then drafts out and verdicts in until Close; a broken peer gets a DraftError."""
        session: DraftSession | None = None
        out: list[pb.DraftMessage] = []
        lease = self.watchdog.watch(HANDSHAKE_S, context.cancel)
        try:
            first = _first_open(requests)
            if first is None:   # the stream ended, or the watchdog ended it
                if lease.expired:
                    self.metrics.refuse("silent")
                return
            lease.timeout_s = SESSION_IDLE_S
            lease.feed()
            if first.pipelined:
                outbox: queue.SimpleQueue[pb.DraftMessage | None] = queue.SimpleQueue()
                session = self._open(first, lambda m: outbox.put(protocol.draft_to_pb(m)),
                                     context)
                yield from _pipelined(session, outbox, _verdicts(requests, lease), context)
                return
            session = self._open(first, lambda m: out.append(protocol.draft_to_pb(m)), context)
            session.announce()
            yield from _drain(out)
            session.step(None)
            yield from _drain(out)
            for verdict in _verdicts(requests, lease):
                session.step(verdict)
                yield from _drain(out)
        except grpc.RpcError:
            if lease.expired:
                self.metrics.refuse("silent")
                log.info("session from %s ended: silent past its deadline (%s)", context.peer(),
                         "no Open" if session is None else "no verdict")
        except Exception as e:  # noqa: BLE001 - the node must survive any one session
            log.info("session from %s ends: %s", context.peer(), e)
            yield from _drain(out)
            yield protocol.draft_to_pb(error_message(e))
        finally:
            lease.release()
            self._close(session)

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
        calibration = self.calibrations.get(target_key(context, who)) \
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
            if self.settings.emulation is not None:
                h = self.holds
                log.info("emulation: %d draft decodes, %d over their emulated time; "
                         "%d prompt chunks, %d over", h.decodes, h.over, h.prompt_chunks,
                         h.prompt_over)


class SyncCall:
    """One synchronous Session on the sync port, fed one message at a time: the Open, then
    verdicts until a Close. Holds an admission slot from its creation to end(). An error
    of this session is sent to its target as a DraftError and ends it alone."""

    __slots__ = ("service", "send", "context", "session", "_ended", "_who")

    def __init__(self, service: DraftNodeService, send, context) -> None:
        self._who = service._admit(context, "Session", "sync")
        self.service, self.send, self.context = service, send, context
        self.session: DraftSession | None = None
        self._ended = False

    def take(self, msg: pb.TargetMessage | Verdict | ProtocolError) -> bool:
        """One message of the call (or why none could be read); False once it is over. A
        verdict in its common encoding comes decoded by the transport
        (link/transport/roundcodec.py)."""
        try:
            if isinstance(msg, ProtocolError):
                raise msg
            if isinstance(msg, Verdict):
                if self.session is None:
                    raise ProtocolError("unexpected verdict message")
                self.session.step(msg)
                return True
            kind = msg.WhichOneof("kind")
            if self.session is None:
                if kind != "open":
                    raise ProtocolError(f"unexpected {kind} message")
                if msg.open.pipelined:
                    raise ProtocolError("pipelined sessions are served on the node's main port")
                self.session = self.service._open(msg.open, self.send, self.context)
                self.session.announce()
                self.session.step(None)
                return True
            if kind == "close":
                return False
            if kind != "verdict":
                raise ProtocolError(f"unexpected {kind} message")
            self.session.step(protocol.verdict_from_pb(msg.verdict))
            return True
        except Exception as e:  # noqa: BLE001 - the node must survive any one session
            log.info("session from %s ends: %s", self.context.peer(), e)
            self.send(error_message(e))
            return False

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


def _first_open(requests) -> pb.Open | None:
    """The session's Open, which must come first; None if the stream ended before it."""
    first = next(requests, None)
    if first is None:
        return None
    if isinstance(first, Verdict):
        raise ProtocolError("unexpected verdict message")
    if first.WhichOneof("kind") != "open":
        raise ProtocolError(f"unexpected {first.WhichOneof('kind')} message")
    return first.open


def _drain(out: list[pb.DraftMessage]):
    yield from out
    out.clear()


def _verdicts(requests, lease: Lease | None = None):
    """The verdicts after the Open, until Close; anything else is a ProtocolError. Each
    message moves the lease's deadline on, ACTIVE_IDLE_S once the first has come."""
    for m in requests:
        if lease is not None:
            lease.timeout_s = min(lease.timeout_s, ACTIVE_IDLE_S)
            lease.feed()
        if isinstance(m, Verdict):  # decoded by the sync port (link/transport/roundcodec.py)
            yield m
            continue
        kind = m.WhichOneof("kind")
        if kind == "close":
            return
        if kind != "verdict":
            raise ProtocolError(f"unexpected {kind} message")
        yield protocol.verdict_from_pb(m.verdict)


def _pipelined(session: DraftSession, outbox: queue.SimpleQueue, verdicts, context):
    """The session drafts on its own thread into outbox; a reader thread feeds it verdicts."""
    context.add_callback(lambda: outbox.put(None))  # the RPC ended: stop yielding

    def read() -> None:
        try:
            for verdict in verdicts:
                session.push(verdict)
        except grpc.RpcError:
            pass
        except Exception as e:  # noqa: BLE001 - reported to the peer, the node stays up
            outbox.put(protocol.draft_to_pb(error_message(e)))
        finally:
            outbox.put(None)

    session.start()
    threading.Thread(target=read, name="session-reader", daemon=True).start()
    while (msg := outbox.get()) is not None:
        yield msg
        if msg.WhichOneof("kind") == "error":
            break


def _credentials(s: NodeSettings) -> grpc.ServerCredentials | None:
    if not s.tls_cert:
        return None
    with open(s.tls_cert, "rb") as f:
        cert = f.read()
    with open(s.tls_key or s.tls_cert, "rb") as f:
        key = f.read()
    ca = None
    if s.tls_client_ca:
        with open(s.tls_client_ca, "rb") as f:
            ca = f.read()
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


@dataclass(slots=True)
class RunningNode:
    """A started node: its gRPC server, its service, its other ports."""

    server: grpc.Server
    service: DraftNodeService
    port: int
    sync: SyncServer | None
    metrics_port: int | None

    def drain(self, grace_s: float) -> None:
        """No new sessions (both ports refuse them, UNAVAILABLE); those open get grace_s to
        end, then the node stops (what is left is cancelled, a GOAWAY on the main port)."""
        self.service.draining = True
        if self.sync is not None:
            self.sync.close()
        open_ = self.service.in_use()
        log.info("draft node shutting down: %d session%s open get up to %.0f s",
                 open_, "" if open_ == 1 else "s", grace_s)
        deadline = time.monotonic() + grace_s
        while self.service.in_use() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.stop(grace_s=max(0.0, min(1.0, deadline - time.monotonic())))

    def stop(self, grace_s: float = 1.0) -> None:
        if self.sync is not None:
            self.sync.close()
        self.service.metrics.close()
        self.server.stop(grace=grace_s).wait()
        self.service.memory.close()


def start(settings: NodeSettings) -> RunningNode:
    """Load the model and start serving on every configured port (returns at once)."""
    model = load_model(settings.model)
    model.fingerprint()  # computed once, before the first Hello
    server = grpc.server(
        ThreadPoolExecutor(settings.max_sessions + 4, thread_name_prefix="node-rpc"),
        options=[
            ("grpc.max_receive_message_length", protocol.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", protocol.MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
            # A connection with no call for this long is closed (one refused for its token
            # has none); targets reconnect on their next call without noticing.
            ("grpc.max_connection_idle_ms", int(settings.idle_s * 1000)),
            # Targets ping every KEEPALIVE_MS while a session is open
            # (link/transport/channel.py): allow it, rather than answering GOAWAY too_many_pings.
            ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_MS // 2),
            ("grpc.keepalive_permit_without_calls", 1),
        ],
        # Every admitted session and ping holds a call, plus short Hellos; more are refused
        # by grpcio (RESOURCE_EXHAUSTED) before they take a thread.
        maximum_concurrent_rpcs=2 * settings.max_sessions + 8,
    )
    service = DraftNodeService(settings, model)
    pbg.add_DraftNodeServicer_to_server(service, server)
    address = f"{settings.host}:{settings.port}"
    creds = _credentials(settings)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    sync = _sync_server(settings, service)
    metrics_port = None
    if settings.metrics_port is not None:
        metrics_port = service.metrics.serve(settings.host, settings.metrics_port,
                                             settings.token, purge=service.purge_for)
    server.start()
    log.info(
        "draft node serving %s on %s:%d (%s, token %s)",
        model.name,
        settings.host,
        port,
        "TLS" if creds else "plain text",
        "required" if settings.token else "off",
    )
    return RunningNode(server, service, port, sync, metrics_port)


def serve(settings: NodeSettings, ready: threading.Event | None = None) -> None:
    """Run a draft node until interrupted."""
    node = start(settings)
    host = settings.host
    if node.metrics_port is not None:
        print(f"specwire draft node: metrics on http://{host}:{node.metrics_port}/metrics",
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


def _sync_server(settings: NodeSettings, service: DraftNodeService) -> SyncServer | None:
    if settings.sync_port is None:
        return None
    tls = None
    if settings.tls_cert:
        tls = tls_context(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
    sync = SyncServer(service, settings.host, settings.sync_port, tls,
                      max_connections=4 * settings.max_sessions, idle_s=settings.idle_s,
                      session_idle_s=SESSION_IDLE_S, max_streams=settings.max_sessions + 4,
                      active_idle_s=ACTIVE_IDLE_S, per_address=settings.sync_per_address)
    service.sync_port = sync.port
    sync.start()
    return sync
