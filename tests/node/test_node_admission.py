"""The draft node's admission: deadlines for silent peers, Ping under the session limit,
the Open checked before a context is allocated, a calibration per target, its /metrics.

An in-process node (node.server.start) on the bundled draft model, reached over real
sockets by grpcio's client and by raw TCP; the handshake deadlines are shortened
so that a silent peer is dropped within a second.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
import specwire_pb2_grpc as pbg
from node_calls import Stream, _open
from wire_helpers import CODE, GREEDY, Target, draft_model_path, request, run_to_end, wait_for

from specwire.config import ModelParams
from specwire.engine.engine import Engine
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.h2 import server as sync_server
from specwire.node import server as node_mod
from specwire.node.calibrations import Calibrations
from specwire.node.server import NodeSettings, RunningNode
from specwire.server.metrics import parse_figures

pytestmark = pytest.mark.slow
DEADLINE_S = 0.5
TOKEN = "node-secret"


@pytest.fixture
def start_node(monkeypatch) -> Iterator:
    """start_node(**settings) -> a running in-process node, stopped after the test."""
    monkeypatch.setattr(node_mod, "HANDSHAKE_S", DEADLINE_S)
    monkeypatch.setattr(sync_server, "HANDSHAKE_TIMEOUT_S", DEADLINE_S)
    started: list[RunningNode] = []

    def start(**kw) -> RunningNode:
        kw = {"sync_port": 0, "metrics_port": 0, **kw}
        settings = NodeSettings(model=ModelParams(draft_model_path(), n_ctx=512), port=0, **kw)
        started.append(node_mod.start(settings))
        return started[-1]

    yield start
    for n in started:
        n.stop()


def _figures(node: RunningNode) -> dict[str, float]:
    token = node.service.settings.token
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return parse_figures(httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics",
                                   headers=headers).text)


def _history(node: RunningNode) -> list[int]:
    return node.service.model.tokenize(CODE)


def test_silent_session_is_ended_and_its_slot_freed(start_node) -> None:
    node = start_node(max_sessions=1)
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pbg.DraftNodeStub(ch)
        silent = Stream(stub.Session)
        t0 = time.monotonic()
        with pytest.raises((grpc.RpcError, StopIteration)):
            silent.next()                      # never sends its Open
        assert time.monotonic() - t0 < DEADLINE_S + 2
        wait_for(lambda: _figures(node).get('specwire:node_refused_total{reason="silent"}') == 1,
                 5, "the silent session counted")
        s = Stream(stub.Session)              # the only slot is free again
        s.send(_open(_history(node)))
        assert len(s.next().chunk.tokens) == 3
        s.close()


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def test_silent_sync_connections_are_closed(start_node) -> None:
    """A TCP connection that never speaks, and one that says the HTTP/2 preface and then
    nothing, are both closed by the sync port within its handshake deadline."""
    node = start_node()
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
    for greeting in (b"", preface):
        with socket.create_connection(("127.0.0.1", node.sync.port)) as sock:
            sock.sendall(greeting)
            assert _closed_within(sock, 3 * DEADLINE_S + 2), greeting


def test_refused_token_closes_the_sync_connection(start_node) -> None:
    node = start_node(token=TOKEN)
    free = node.sync._slots._value
    with grpc.insecure_channel(f"127.0.0.1:{node.sync.port}") as ch:
        call = pbg.DraftNodeStub(ch).Session(
            iter([_open(_history(node))]), metadata=((protocol.AUTH_HEADER, "Bearer nope"),),
            timeout=10)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the node let the connection go at once, not after an hour of idling
        wait_for(lambda: node.sync._slots._value == free, 3, "the connection closed")
    assert _figures(node)['specwire:node_refused_total{reason="token"}'] == 1


def test_ping_is_admitted_like_a_session(start_node) -> None:
    node = start_node(max_sessions=1)
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pbg.DraftNodeStub(ch)
        session = Stream(stub.Session)
        session.send(_open(_history(node)))
        session.next()                          # the session holds the only slot
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Ping(iter([pb.PingMessage(seq=1)]), timeout=10))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        session.close()
        wait_for(lambda: node.service._in_use == 0, 5, "the session's slot released")
        pongs = list(stub.Ping(iter([pb.PingMessage(seq=i, hold_us=1000) for i in (4, 5)])))
        assert [p.seq for p in pongs] == [4, 5]
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Ping(iter([pb.PingMessage(seq=1, hold_us=node_mod.MAX_PING_HOLD_US + 1)])))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        silent = Stream(stub.Ping)              # admitted, then never pings
        with pytest.raises((grpc.RpcError, StopIteration)):
            silent.next()
        wait_for(lambda: node.service._in_use == 0, 5, "the silent ping's slot released")


def test_open_is_checked_before_a_sequence_is_allocated(start_node, monkeypatch) -> None:
    node = start_node()
    allocated: list[int] = []
    memory = node.service.memory   # the node takes its sequences from its memory
    real = memory._new

    def counting():
        allocated.append(1)
        return real()

    monkeypatch.setattr(memory, "_new", counting)
    history = _history(node)
    bad = [_open([]), _open([2, node.service.model.n_vocab]), _open(history, want=10**6),
           _open(history, mode=9), _open(history * 100),
           pb.TargetMessage(open=pb.Open(history=history, sampling=pb.Sampling(top_p=0)))]
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pbg.DraftNodeStub(ch)
        for msg in bad:
            s = Stream(stub.Session)
            s.send(msg)
            assert s.next().WhichOneof("kind") == "error"
            s.close()
        assert allocated == []
        assert _figures(node)['specwire:node_refused_total{reason="bad_open"}'] == len(bad)
        # The gauge counts this process's contexts: other tests' models may hold some.
        gauge = 'specwire:contexts_open{side="node"}'
        before = _figures(node)[gauge]
        s = Stream(stub.Session)
        s.send(_open(history))
        assert s.next().chunk.tokens and allocated == [1]
        assert _figures(node)[gauge] == before + 1
        s.close()
    wait_for(lambda: _figures(node)[gauge] == before, 5, "the session's context freed")


def test_calibration_is_kept_per_target(start_node) -> None:
    """Two targets (two ids in the call metadata) each get their own calibration: what
    one target's verdicts teach does not move the other's."""
    node = start_node()
    history = _history(node)
    cal = node.service.calibrations
    with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
        stub = pbg.DraftNodeStub(ch)
        for who in ("target-a", "target-b"):
            s = Stream(stub.Session, metadata=((protocol.TARGET_HEADER, who),))
            s.send(_open(history, want=4, calibrated=True, keep_min=1e-6))
            sent = list(s.next().chunk.tokens)
            if who == "target-a":   # A rejects the first draft token: a lesson for A only
                other = (sent[0] + 1) % node.service.model.n_vocab
                s.send(pb.TargetMessage(verdict=pb.Verdict(position=len(history), accepted=0,
                                                           tokens=[other], want=2)))
                s.next()
            s.close()
    assert len(cal) == 2
    a, b = cal.get(("127.0.0.1", "target-a", "")), cal.get(("127.0.0.1", "target-b", ""))
    assert a is not b
    prior = Calibrations(1).get(("x", "y", ""))
    assert a.seen != prior.seen and b.seen == prior.seen


def test_calibrations_are_bounded_least_recent_first() -> None:
    cal = Calibrations(2)
    first = cal.get(("h", "1"))
    cal.get(("h", "2"))
    assert cal.get(("h", "1")) is first       # used again: now the most recent
    cal.get(("h", "3"))                         # forgets ("h", "2")
    assert len(cal) == 2 and cal.get(("h", "1")) is first


def test_metrics_port_flag_is_checked() -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import draft

    parser = argparse.ArgumentParser()
    draft.register(parser.add_subparsers())
    args = parser.parse_args(["draft", "--metrics-port", "70000"])
    with pytest.raises(CliError, match="--metrics-port"):
        args.func(args)


@pytest.mark.parametrize("sync_port", [None, 0], ids=["main-port", "sync-port"])
def test_idle_connections_close_and_targets_carry_on(start_node, sync_port) -> None:
    """Either port closes a connection with no call for --idle-timeout (the main port by
    grpc.max_connection_idle_ms, the sync port with a GOAWAY): a target's next request
    reconnects by itself, without counting a failure, and still gets its drafts accepted."""
    node = start_node(sync_port=sync_port, idle_s=0.5)
    target = Target()
    rd = target.drafter(f"127.0.0.1:{node.port}", pipelined=False)
    try:
        engine = Engine(target.backend, rd)
        prompt = target.tokens(CODE)
        for _ in range(2):
            g = engine.generate(request(prompt, 16, GREEDY))
            assert run_to_end(g) == target.plain(prompt, GREEDY, 16)
            assert g.stats.draft_n_accepted > 0
            if node.sync is not None:       # the node drops the idle connection meanwhile
                wait_for(lambda: node.sync._slots._value == 4 * 8 + 16, 5, "the idle close")
            else:
                time.sleep(2.0)
        assert rd.counters.reconnects == 0
        assert rd.counters.sync_port_sessions == (2 if sync_port == 0 else 0)
    finally:
        rd.close()


@pytest.mark.parametrize("crossing", ["under-open", "after-open"])
def test_a_session_crossing_the_idle_close_opens_on_a_new_connection(
        start_node, monkeypatch, caplog, crossing) -> None:
    """The node closes an idle sync connection as the target opens a session on it (under
    load the two cross): either just after the target found the line alive, so that the
    Open itself fails, or once the Open has left, unread, so that the node's GOAWAY or
    reset ends the call before any answer. The session opens again on a new connection,
    no failure is counted, nothing is logged as down, and the request drafts."""
    from specwire.link.transport import channels as linkset
    from specwire.link.transport.h2 import connection as http2

    crossed: list[bool] = []
    if crossing == "under-open":
        alive = linkset.Line.alive

        def alive_then_closed(line) -> bool:
            ok = alive(line)
            if not crossed:  # the first check only: the close lands right after it
                crossed.append(ok)
                wait_for(lambda: node.sync._slots._value == 4 * 8 + 16, 5, "the idle close")
            return ok

        monkeypatch.setattr(linkset.Line, "alive", alive_then_closed)
    else:
        opened, open_, wait = threading.Event(), linkset.Line.open, http2.Connection.wait

        def open_and_tell(line, first, timeout_s: float, on_message=None) -> int | None:
            sid = open_(line, first, timeout_s, on_message)
            opened.set()
            return sid

        def idle_as_it_opens(conn, timeout_s: float) -> None:  # the node's sync port
            if not crossed and not conn.client and \
                    conn.sock.getsockname()[1] == node.sync.port:
                # its first idle deadline passes with the Open in, unread
                crossed.append(opened.wait(5))
                raise TimeoutError
            wait(conn, timeout_s)

        monkeypatch.setattr(linkset.Line, "open", open_and_tell)
        monkeypatch.setattr(http2.Connection, "wait", idle_as_it_opens)
    node = start_node(idle_s=0.5)
    target = Target()
    rd = target.drafter(f"127.0.0.1:{node.port}", pipelined=False)
    try:
        prompt = target.tokens(CODE)
        settled: list[bool] = []

        def once_reopened(_) -> None:
            # The session opens on its own thread, and under-open it waits there for the
            # node's idle close: a loaded machine can decode all 16 tokens plainly
            # meanwhile. The first step waits for the session to be up again.
            if not settled:
                wait_for(lambda: bool(crossed) and rd.transport.live(), 10, "the reopen")
                settled.append(True)

        g = Engine(target.backend, rd).generate(request(prompt, 16, GREEDY))
        assert run_to_end(g, on_step=once_reopened) == target.plain(prompt, GREEDY, 16)
        assert crossed == [True]                # the crossing did happen
        assert g.stats.draft_n_accepted > 0, rd.counters
        assert rd.counters.reconnects == 0 and rd.links[0].failures == 0
        assert rd.counters.sync_port_sessions == 1
        assert not [r for r in caplog.records if "down" in r.getMessage()]
    finally:
        rd.close()


def test_a_cancelled_sync_session_ends_alone(start_node, caplog) -> None:
    """A target that cancels a synchronous session (RST_STREAM, as when its request is cut)
    while the node drafts for it: the session ends as after a Close, without an error
    logged, and the same connection carries the next session."""
    from specwire.link.transport.h2.connection import Connection

    node = start_node()
    history = _history(node)
    conn = Connection(socket.create_connection(("127.0.0.1", node.sync.port)), client=True,
                      max_message=protocol.MAX_MESSAGE_BYTES)
    try:
        conn.handshake(5)
        for cancel in (True, True, False):
            sid = conn.request(protocol.SESSION_PATH, "node", (), "http")
            conn.send_message(sid, _open(history, want=8).SerializeToString())
            if cancel:     # at once: the node is drafting its first chunk meanwhile
                conn.reset(sid)
                continue
            chunk = pb.DraftMessage.FromString(conn.recv_message(sid, 30))
            assert chunk.WhichOneof("kind") == "chunk" and chunk.chunk.tokens
            conn.send_message(sid, pb.TargetMessage(close=pb.Close()).SerializeToString(),
                              end_stream=True)
        wait_for(lambda: _figures(node)["specwire:node_slots_in_use"] == 0, 10,
                 "the sessions to end")
        assert conn.alive()
    finally:
        conn.close()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert "reset by the peer" not in caplog.text
