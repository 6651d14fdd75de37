"""The draft node: a gRPC (asyncio) server holding one small model for many targets.

Each Session stream gets its own llama.cpp context over the shared weights and
its own drafting thread (see session.py), so sequences from several targets
are isolated from each other. The event loop only moves messages.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass

import grpc

from specwire.backend.llama import LlamaBackend, Model, load_model
from specwire.config import ModelParams
from specwire.wire import protocol
from specwire.wire import specwire_pb2 as pb
from specwire.wire import specwire_pb2_grpc as pbg
from specwire.wire.protocol import ProtocolError
from specwire.wire.session import DraftSession

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
    seed: int | None = None  # overrides each target's sampling seed for this node's drafts


class DraftNodeService(pbg.DraftNodeServicer):
    def __init__(self, settings: NodeSettings, model: Model) -> None:
        self.settings, self.model = settings, model
        self.sessions_open = 0
        self.sessions_total = 0
        self._sem = asyncio.Semaphore(settings.max_sessions)

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        want = self.settings.token
        if not want:
            return
        meta = dict(context.invocation_metadata() or ())
        got = meta.get(protocol.AUTH_HEADER, "")
        if not hmac.compare_digest(got.encode(), f"Bearer {want}".encode()):
            log.warning(
                "refused connection from %s: %s",
                context.peer(),
                "missing token" if not got else "wrong token",
            )
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "draft node: bad or missing token")

    async def Hello(self, request: pb.HelloRequest, context) -> pb.HelloReply:  # noqa: N802
        await self._authorize(context)
        if request.protocol_version != protocol.PROTOCOL_VERSION:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version {request.protocol_version} not supported "
                f"(this node speaks {protocol.PROTOCOL_VERSION})",
            )
        return pb.HelloReply(
            protocol_version=protocol.PROTOCOL_VERSION,
            vocab_fingerprint=self.model.fingerprint(),
            n_vocab=self.model.n_vocab,
            draft_model=self.model.name,
            modes=["greedy", "coupled", "rejection"],
            n_ctx=self.settings.model.n_ctx,
            max_sessions=self.settings.max_sessions,
        )

    async def Session(self, request_iterator, context):  # noqa: N802
        await self._authorize(context)
        if self._sem.locked():
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"draft node busy: {self.settings.max_sessions} sessions open",
            )
        async with self._sem:
            self.sessions_open += 1
            self.sessions_total += 1
            try:
                async for msg in self._serve(request_iterator, context):
                    yield msg
            finally:
                self.sessions_open -= 1

    async def _serve(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        out: asyncio.Queue[pb.DraftMessage | None] = asyncio.Queue()
        session: DraftSession | None = None

        def send(msg: pb.DraftMessage) -> None:
            loop.call_soon_threadsafe(out.put_nowait, msg)

        async def read() -> None:
            nonlocal session
            try:
                async for m in request_iterator:
                    kind = m.WhichOneof("kind")
                    if kind == "open" and session is None:
                        session = await loop.run_in_executor(None, self._open, m.open, send)
                        session.start()
                    elif kind == "verdict" and session is not None:
                        session.push(m.verdict)
                    elif kind == "close":
                        break
                    else:
                        raise ProtocolError(f"unexpected {kind} message")
            except ProtocolError as e:
                log.warning("session from %s: %s", context.peer(), e)
                out.put_nowait(pb.DraftMessage(error=pb.DraftError(message=str(e))))
            except (asyncio.CancelledError, grpc.aio.AioRpcError):
                pass
            finally:
                out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (msg := await out.get()) is not None:
                yield msg
                if msg.WhichOneof("kind") == "error":
                    break
        finally:
            reader.cancel()
            if session is not None:
                session.close()
                await loop.run_in_executor(None, session.thread.join)
                session.backend.close()

    def _open(self, open_msg: pb.Open, send) -> DraftSession:
        backend = LlamaBackend(self.settings.model, self.model)
        try:
            return DraftSession(backend, open_msg, send, seed=self.settings.seed)
        except Exception:
            backend.close()
            raise


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


async def serve(settings: NodeSettings, ready: asyncio.Event | None = None) -> None:
    """Run a draft node until cancelled."""
    model = load_model(settings.model)
    model.fingerprint()  # computed once, before the first Hello
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", protocol.MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", protocol.MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ]
    )
    service = DraftNodeService(settings, model)
    pbg.add_DraftNodeServicer_to_server(service, server)
    address = f"{settings.host}:{settings.port}"
    creds = _credentials(settings)
    port = server.add_secure_port(address, creds) if creds else server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    await server.start()
    log.info(
        "draft node serving %s on %s:%d (%s, token %s)",
        model.name,
        settings.host,
        port,
        "TLS" if creds else "plain text",
        "required" if settings.token else "off",
    )
    print(f"specwire draft node listening on {settings.host}:{port}", flush=True)
    if ready is not None:
        ready.set()
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(grace=1.0)
