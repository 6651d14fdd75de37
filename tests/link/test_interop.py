"""Interoperability with another gRPC implementation, both ways: grpcio's client against
specwire's node (Hello, a synchronous and a pipelined session, a bad token), and
specwire's target against a node on grpcio's server (tests/support/grpc_node.py) with
its synchronous and pipelined sessions lossless. specwire itself speaks gRPC through
link/transport/h2/ only; grpcio is a test dependency."""

from __future__ import annotations

import queue

import grpc
import pytest
import specwire_pb2_grpc as pbg
from grpc_node import GrpcDraftNode
from wire_helpers import (
    CODE,
    GREEDY,
    N_CTX,
    draft_model_path,
    node_fixture,
    node_proc_fixture,
    node_process,
    request,
    run_to_end,
    target_fixture,
)

from specwire.config import ModelParams
from specwire.engine.engine import Engine
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb

__all__ = ["node_fixture", "node_proc_fixture", "target_fixture"]
pytestmark = pytest.mark.slow


def _hello(target) -> pb.HelloRequest:
    return pb.HelloRequest(protocol_version=protocol.PROTOCOL_VERSION,
                           vocab_fingerprint=target.fingerprint, n_vocab=target.n_vocab,
                           target_model="test")


def _open(history: list[int], pipelined: bool) -> pb.TargetMessage:
    return pb.TargetMessage(open=pb.Open(
        history=history, sampling=protocol.sampling_to_pb(GREEDY), mode=pb.VERIFY_GREEDY,
        pipelined=pipelined, want=3, lookahead=6))


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_grpcio_client_drafts_on_our_node(target, node, pipelined) -> None:
    with grpc.insecure_channel(node.url) as channel:
        stub = pbg.DraftNodeStub(channel)
        reply = stub.Hello(_hello(target), timeout=10)
        assert reply.vocab_fingerprint == target.fingerprint and "tree" in reply.modes
        history = target.tokens(CODE)
        sent: queue.SimpleQueue = queue.SimpleQueue()
        sent.put(_open(history, pipelined))
        chunks = stub.Session(iter(sent.get, None), timeout=30)
        first = next(chunks).chunk
        while not first.tokens:           # an empty chunk may announce the cache figures
            first = next(chunks).chunk
        assert first.gen == 0 and first.start == len(history)
        # A verdict rejecting the draft's first token: the node drafts a new branch after it.
        other = (first.tokens[0] + 1) % target.n_vocab
        sent.put(pb.TargetMessage(verdict=pb.Verdict(position=len(history), accepted=0,
                                                     tokens=[other], gen=0, want=3)))
        nxt = next(chunks).chunk
        while nxt.gen == 0:               # pipelined: what was drafted before the verdict
            nxt = next(chunks).chunk
        assert nxt.gen == 1 and nxt.start == len(history) + 1 and nxt.tokens
        sent.put(pb.TargetMessage(close=pb.Close()))
        sent.put(None)
        for _ in chunks:                  # the node ends the call after the Close
            pass


def test_grpcio_client_with_a_bad_token_is_refused(target, tmp_path) -> None:
    """Refused UNAUTHENTICATED (and the connection closed: only a peer that was let in may
    keep one); the right token on a new connection is answered."""
    with node_process(tmp_path, ["--token", "right"]) as n:
        with grpc.insecure_channel(n.url) as channel, pytest.raises(grpc.RpcError) as e:
            pbg.DraftNodeStub(channel).Hello(
                _hello(target), metadata=((protocol.AUTH_HEADER, "Bearer wrong"),), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with grpc.insecure_channel(n.url) as channel:
            ok = pbg.DraftNodeStub(channel).Hello(
                _hello(target), metadata=((protocol.AUTH_HEADER, "Bearer right"),), timeout=10)
        assert ok.n_vocab == target.n_vocab


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_our_target_drafts_losslessly_on_a_grpcio_node(target, pipelined) -> None:
    with GrpcDraftNode(ModelParams(draft_model_path(), n_ctx=N_CTX, n_threads=1)) as node:
        rd = target.drafter(f"127.0.0.1:{node.port}", pipelined=pipelined)
        try:
            prompt = target.tokens(CODE)
            g = Engine(target.backend, rd).generate(request(prompt, 24, GREEDY, 4))
            assert run_to_end(g) == target.plain(prompt, GREEDY, 24)
            assert g.stats.draft_n_accepted > 0, rd.counters
            assert node.sessions >= 1 and node.pipelined == (node.sessions if pipelined else 0)
        finally:
            rd.close()
