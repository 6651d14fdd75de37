"""A draft node on grpcio's threaded server, for interoperability tests only.

specwire's own node serves gRPC on link/transport/h2/; this one serves the same
DraftNode service through grpcio and the generated stubs, wrapping the same
DraftSession, so that the tests can show a target of ours drafting against
another gRPC implementation of a node (Hello, synchronous and pipelined sessions).
It has no admission, quotas or deadlines: it is a peer, not a product.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import specwire_pb2_grpc as pbg

from specwire.backend.llama import LlamaBackend, Model, load_model
from specwire.config import ModelParams
from specwire.link.session import DraftSession, error_message
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb


class GrpcDraftNode(pbg.DraftNodeServicer):
    """Hello and Session over grpcio, each session a DraftSession on a fresh context."""

    def __init__(self, params: ModelParams) -> None:
        self.params = params
        self.model: Model = load_model(params)
        self.sessions = 0  # Session calls opened
        self.pipelined = 0  # of which pipelined
        self._server: grpc.Server | None = None
        self.port = 0

    def start(self) -> GrpcDraftNode:
        self._server = grpc.server(ThreadPoolExecutor(8))
        pbg.add_DraftNodeServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0.5).wait()

    def __enter__(self) -> GrpcDraftNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def Hello(self, request, context):  # noqa: N802 - gRPC's method name
        if request.protocol_version != protocol.PROTOCOL_VERSION:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "protocol version")
        return pb.HelloReply(
            protocol_version=protocol.PROTOCOL_VERSION,
            vocab_fingerprint=self.model.fingerprint(), n_vocab=self.model.n_vocab,
            draft_model=self.model.name, modes=["greedy", "coupled", "rejection", "tree"],
            n_ctx=self.params.n_ctx, max_sessions=8)

    def Session(self, request_iterator, context):  # noqa: N802 - gRPC's method name
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("kind") != "open":
            return
        self.sessions += 1
        out: queue.SimpleQueue = queue.SimpleQueue()
        open_msg = protocol.open_from_pb(first.open)
        backend = LlamaBackend(self.params, self.model)
        session = DraftSession(backend, open_msg, lambda m: out.put(protocol.draft_to_pb(m)))
        try:
            if open_msg.pipelined:
                self.pipelined += 1
                yield from self._pipelined(session, request_iterator, out, context)
                return
            session.announce()
            session.step(None)
            yield from _drain(out)
            for m in request_iterator:
                kind = m.WhichOneof("kind")
                if kind == "close":
                    return
                session.step(protocol.verdict_from_pb(m.verdict))
                yield from _drain(out)
        except Exception as e:  # noqa: BLE001 - told to the target, as a node does
            yield protocol.draft_to_pb(error_message(e))
        finally:
            session.finish()
            backend.close()

    @staticmethod
    def _pipelined(session: DraftSession, requests, out: queue.SimpleQueue, context):
        """The session drafts on its thread; a reader thread hands it the verdicts."""
        context.add_callback(lambda: out.put(None))

        def read() -> None:
            try:
                for m in requests:
                    if m.WhichOneof("kind") != "verdict":
                        break
                    session.push(protocol.verdict_from_pb(m.verdict))
            except grpc.RpcError:
                pass
            finally:
                out.put(None)

        session.start()
        threading.Thread(target=read, daemon=True).start()
        while (msg := out.get()) is not None:
            yield msg


def _drain(out: queue.SimpleQueue):
    while True:
        try:
            yield out.get_nowait()
        except queue.Empty:
            return
