"""A started session's shorter idle deadline (node/server.py ACTIVE_IDLE_S): once its target
has sent a verdict, a silence of ACTIVE_IDLE_S ends it; before that (the target still
evaluating its prompt) it may wait SESSION_IDLE_S. On the main port (an in-process node on
the bundled draft model, grpcio's client) and on the synchronous port (link/transport/h2/mux.py
with test_sync_mux's fake service). Real waits: slow.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest
import specwire_pb2_grpc as pbg
from node_calls import Stream, _open
from sync_calls import FakeService, _round
from sync_calls import _open as _sync_open
from wire_helpers import N_CTX, draft_model_path, wait_for

from specwire.config import ModelParams
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.h2.connection import Connection
from specwire.link.transport.h2.server import H2Server
from specwire.node import server as node_mod
from specwire.node.server import NodeSettings

pytestmark = pytest.mark.slow
ACTIVE_S = 2.0  # long enough for a round on a loaded machine, far below SESSION_IDLE_S


def test_a_started_session_silent_past_its_deadline_is_ended(monkeypatch) -> None:
    monkeypatch.setattr(node_mod, "ACTIVE_IDLE_S", ACTIVE_S)
    node = node_mod.start(NodeSettings(model=ModelParams(draft_model_path(), n_ctx=N_CTX),
                                       port=0))
    try:
        history = node.service.model.tokenize("def total(xs):\n    return sum(xs)\n")
        with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            stub = pbg.DraftNodeStub(ch)
            waiting, started = Stream(stub.Session), Stream(stub.Session)
            for s in (waiting, started):
                s.send(_open(history))
                sent = list(s.next().chunk.tokens)
            other = (sent[0] + 1) % node.service.model.n_vocab   # rejects the draft: a new one
            started.send(pb.TargetMessage(verdict=pb.Verdict(
                position=len(history), accepted=0, tokens=[other], want=2)))
            started.next()
            wait_for(lambda: node.service._in_use == 1, 10, "the started session's end")
            time.sleep(3 * ACTIVE_S)
            assert node.service._in_use == 1   # the one before its first verdict goes on
            waiting.close()
    finally:
        node.stop()


def test_the_sync_port_gives_a_started_call_the_shorter_deadline() -> None:
    service = FakeService(max_calls=3)
    server = H2Server(service.call, "127.0.0.1", 0, None, max_connections=4, idle_s=30,
                        session_idle_s=30.0, max_streams=8, active_idle_s=ACTIVE_S)
    server.start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    conn = Connection(sock, client=True, max_message=protocol.MAX_MESSAGE_BYTES)
    conn.handshake(5)
    try:
        waiting, started = _sync_open(conn), _sync_open(conn)
        assert _round(conn, waiting) == 1 and _round(conn, started) == 1   # their "Opens"
        assert _round(conn, started) == 2                                  # a verdict
        error = pb.DraftMessage.FromString(conn.recv_message(started, 5))
        assert f"the target sent nothing for {ACTIVE_S:g} s" in error.error.message
        time.sleep(3 * ACTIVE_S)
        assert not service.calls[0].ended and service.calls[1].ended
    finally:
        conn.close()
        server.close()
