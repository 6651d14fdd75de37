"""The node's synchronous port (link/transport/h2/): grpcio clients served, the
fallback to the main port, and hostile sync ports that cannot change the output."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import grpc
import pytest
import specwire_pb2_grpc as pbg
from wire_helpers import CODE, GREEDY, FakeNode, RawSession, _sync_open, ref, request, run_to_end

from specwire.bench.netemu import LinkEmulator
from specwire.engine.engine import Engine
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import LinkSettings
from specwire.link.transport.h2.connection import Connection, H2Error

# ============================================================================ the sync port


@pytest.mark.slow
def test_sync_port_serves_grpcio_clients(target, node) -> None:
    """The node's synchronous port is gRPC as grpcio speaks it, and serves what the main
    port serves: an ordinary grpcio client runs a synchronous Session there (a chunk for
    the Open, one per verdict), a pipelined one (chunks drafted ahead), and a Hello."""
    history = target.tokens(CODE)
    with grpc.insecure_channel(f"127.0.0.1:{node.sync_port}") as channel:
        stub = pbg.DraftNodeStub(channel)
        s = RawSession(stub)
        s.send(open=_sync_open(history, want=3))
        [c] = s.answer()
        assert c.start == len(history) and len(c.tokens) == 3
        s.send(verdict=pb.Verdict(position=len(history), accepted=3, gen=c.gen,
                                  tokens=[c.tokens[0]], want=2))
        [c2] = s.answer()
        assert c2.start == len(history) + 4 and len(c2.tokens) == 2
        s.send(close=pb.Close())
        assert list(s.call) == [] and s.call.code() == grpc.StatusCode.OK
        p = RawSession(stub)
        p.send(open=pb.Open(history=history, sampling=protocol.sampling_to_pb(GREEDY),
                            pipelined=True, want=2, lookahead=8))
        drafted = 0
        while drafted < 8:                  # the lookahead, drafted without a verdict
            [c] = p.answer()
            drafted += len(c.tokens)
        p.close()
        reply = stub.Hello(pb.HelloRequest(protocol_version=protocol.PROTOCOL_VERSION),
                           timeout=10)
        assert reply.n_vocab == target.n_vocab


@pytest.mark.slow
def test_unreachable_sync_port_falls_back_to_the_main_port(target, node) -> None:
    """Behind a relay that forwards only the main port, the advertised synchronous port
    cannot be reached: synchronous sessions run on the main port and still draft."""
    prompt, n = target.tokens(CODE), 12
    with LinkEmulator("127.0.0.1", node.port, listen_host="127.0.0.2") as emu:
        rd = target.drafter(f"127.0.0.2:{emu.port}", pipelined=False)
        try:
            g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
            assert run_to_end(g) == ref(target, GREEDY, n)
            assert g.stats.draft_n_accepted > 0 and rd.counters.sync_port_sessions == 0
            assert emu.bytes_down > 0
        finally:
            rd.close()


def _hostile_sync_port(reply: Callable[[Connection, int, pb.Open], None]) -> tuple[int, Callable]:
    """A synchronous port answering every Session with reply(conn, stream, open)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            conn = Connection(sock, client=False, max_message=1 << 20)
            try:
                conn.handshake(5)
                while (stream := conn.next_request(30)) is not None:
                    first = conn.recv_message(stream.sid, 5)
                    reply(conn, stream.sid, pb.TargetMessage.FromString(first).open)
            except (H2Error, TimeoutError, OSError):
                pass
            finally:
                conn.close()

    threading.Thread(target=serve, daemon=True).start()
    return listener.getsockname()[1], listener.close


def _out_of_vocabulary(conn: Connection, sid: int, o: pb.Open) -> None:
    conn.respond(sid)
    chunk = pb.DraftChunk(gen=0, start=len(o.history), tokens=[10**7])
    conn.send_message(sid, pb.DraftMessage(chunk=chunk).SerializeToString())


def _not_a_draft_message(conn: Connection, sid: int, o: pb.Open) -> None:
    conn.respond(sid)
    conn.send_message(sid, b"\xff\xff\xff not protobuf")


def _not_http2(conn: Connection, sid: int, o: pb.Open) -> None:
    conn.sock.sendall(bytes(range(256)) * 4)


@pytest.mark.slow
@pytest.mark.parametrize("reply", [_out_of_vocabulary, _not_a_draft_message, _not_http2],
                         ids=["out-of-vocabulary", "undecodable", "not-http2"])
def test_hostile_sync_port_cannot_change_the_output(target, reply) -> None:
    """A node whose synchronous port answers with tokens outside the vocabulary, bytes
    that are not a DraftMessage, or bytes that are not HTTP/2: the target drops it
    (dropped_peers or a failed link), survives, and produces plain decoding's tokens."""
    port, stop = _hostile_sync_port(reply)
    try:
        with FakeNode(target.fingerprint, target.n_vocab, scripts=[lambda o, v, s: None],
                      sync_port=port) as fake:
            rd = target.drafter(fake.url, pipelined=False,
                                settings=LinkSettings(backoff_min_s=0.05, backoff_max_s=0.1))
            try:
                g = Engine(target.backend, rd).generate(
                    request(target.tokens(CODE), 12, GREEDY, 4))
                assert run_to_end(g) == ref(target, GREEDY, 12)
                assert rd.counters.sync_port_sessions >= 1
                assert rd.counters.dropped_peers + rd.counters.reconnects >= 1
                assert g.stats.draft_n_accepted == 0
            finally:
                rd.close()
    finally:
        stop()
