"""A node that accepts sessions and never answers, and a node's own shutdown (slow).

* The target (bundled model) against a fake node whose sessions take the Open and then
  say nothing, not even after the Close: each request's session was a thread and a
  stream held for ever (30 requests, 30 threads); now the call is cancelled
  (RST_STREAM) right after the Close, and the threads go back to what they were.
* An in-process node (bundled draft) told to drain: a new session is refused
  (UNAVAILABLE), the open one is ended within the grace period, and the drain returns.
"""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time

import grpc
import pytest
import specwire_pb2_grpc as pbg
from wire_helpers import (
    CODE,
    GREEDY,
    FakeNode,
    draft_model_path,
    ref,
    request,
    run_to_end,
    wait_for,
)

from specwire.config import ModelParams
from specwire.engine.engine import Engine
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.node import server as node_mod
from specwire.node.server import NodeSettings

pytestmark = pytest.mark.slow


class SilentNode(FakeNode):
    """Sessions read everything the target sends and answer nothing, even after Close."""

    async def Session(self, request_iterator, context):  # noqa: N802
        record = {"script": 0, "sent": 0, "ended": False, "verdicts": 0}
        self.sessions.append(record)
        try:
            async for _ in request_iterator:
                pass
            await asyncio.Event().wait()      # never ends by itself
            yield pb.DraftMessage()           # (a generator: unreachable)
        finally:
            record["ended"] = True


def _session_threads() -> int:
    return sum(t.name == "draft-session" and t.is_alive() for t in threading.enumerate())


def test_sessions_on_a_silent_node_are_cancelled_after_close(target) -> None:
    prompt, n = target.tokens(CODE), 6
    want = ref(target, GREEDY, n)
    before = _session_threads()
    with SilentNode(target.fingerprint, target.n_vocab) as fake:
        rd = target.drafter(fake.url, pipelined=True)
        try:
            for _ in range(8):
                g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
                assert run_to_end(g) == want
            wait_for(lambda: len(fake.sessions) >= 8, 10, "eight sessions")
            wait_for(lambda: all(s["ended"] for s in fake.sessions), 10,
                     "every silent session cancelled by the target")
            wait_for(lambda: _session_threads() <= before, 10, "the session threads' end")
        finally:
            rd.close()


def test_keepalive_and_stream_cap_are_set_on_the_link(target) -> None:
    with SilentNode(target.fingerprint, target.n_vocab) as fake:
        link = target.link(fake.url)
        asyncio.run(link.connect())
        assert link.max_streams() == 2 * 8 + 4          # the fake node admits 8 sessions
        taken = [link.take_stream() for _ in range(link.max_streams() + 3)]
        assert taken.count(True) == link.max_streams() and not taken[-1]
        link.give_stream()
        assert link.take_stream()
        asyncio.run(link.close())


def _refused(port: int) -> bool:
    """A TCP connect to the port is refused."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def test_a_draining_node_refuses_new_sessions_and_ends_open_ones() -> None:
    settings = NodeSettings(model=ModelParams(draft_model_path(), n_ctx=512), port=0,
                            sync_port=None)
    node = node_mod.start(settings)
    channel = grpc.insecure_channel(f"127.0.0.1:{node.port}")
    stub = pbg.DraftNodeStub(channel)
    try:
        history = node.service.model.tokenize(CODE)
        q: queue.Queue = queue.Queue()
        call = stub.Session(iter(q.get, None), timeout=60)
        q.put(pb.TargetMessage(open=pb.Open(history=history,
                                            sampling=protocol.sampling_to_pb(GREEDY),
                                            pipelined=False, want=2, lookahead=4,
                                            mode=pb.VERIFY_GREEDY)))
        assert next(call).chunk.tokens
        # the drain's first step, alone: a session opened on a live connection is refused
        node.service.draining = True
        fresh = stub.Session(iter([pb.TargetMessage(open=pb.Open(history=history))]),
                             timeout=10)
        with pytest.raises(grpc.RpcError) as refused:
            next(fresh)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        done = threading.Event()
        t0 = time.monotonic()
        threading.Thread(target=lambda: (node.drain(1.0), done.set()), daemon=True).start()
        wait_for(lambda: node.service.draining, 5, "the drain")
        # no new connection is accepted: a connect is refused at once, not left in a backlog
        wait_for(lambda: _refused(node.port), 5, "the node's port refusing connections")
        assert done.wait(15), "the drain did not return"
        with pytest.raises(grpc.RpcError):      # the open session was ended by the stop
            for _ in call:
                pass
        assert time.monotonic() - t0 < 15
    finally:
        q.put(None)
        channel.close()
