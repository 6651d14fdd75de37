"""The synchronous port serving several calls on one connection (link/transport/h2/mux.py), and
the link's failure accounting shared by them (Link.failed's epoch).

A real H2Server on a real socket, driven by link/transport/h2/connection.py's client
Connection; the service is a fake whose calls answer each message with a chunk numbering it, so the
tests see the multiplexing alone: calls served side by side, and one call's end (a
cancel, bad bytes, silence past its deadline) leaving the others going.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from sync_calls import FakeService, _open, _round, _verdict

from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import Link, LinkSettings
from specwire.link.transport.h2.connection import Connection, H2Error
from specwire.link.transport.h2.server import H2Server


@pytest.fixture(name="served")
def served_fixture():
    """An H2Server of the fake service (1 s per call's Open) and a client connection."""
    service = FakeService(max_calls=3)
    server = H2Server(service.call, "127.0.0.1", 0, None, max_connections=4, idle_s=30,
                      session_idle_s=1.0, max_streams=8)
    server.start()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    conn = Connection(sock, client=True, max_message=protocol.MAX_MESSAGE_BYTES)
    conn.handshake(5)
    try:
        yield service, conn
    finally:
        conn.close()
        server.close()


def test_calls_on_one_connection_are_served_side_by_side(served) -> None:
    service, conn = served
    a, b = _open(conn), _open(conn)
    # both verdicts out before either answer is read: the node answers each on its stream
    conn.send_message(a, _verdict())
    conn.send_message(b, _verdict())
    conn.send_message(b, _verdict())
    got_b = [pb.DraftMessage.FromString(conn.recv_message(b, 5)).chunk.start for _ in "xy"]
    got_a = pb.DraftMessage.FromString(conn.recv_message(a, 5)).chunk.start
    assert (got_a, got_b) == (1, [1, 2])
    assert _round(conn, a) == 2
    assert len(service.calls) == 2 and len(service.peers) == 1, "one connection, two calls"
    conn.end_stream(a)                       # a Close of the HTTP/2 kind ends a alone
    assert conn.recv_message(a, 5) is None
    assert _round(conn, b) == 3
    assert service.calls[0].ended and not service.calls[1].ended


def test_calls_with_verdicts_waiting_draft_side_by_side(served) -> None:
    """Two calls' verdicts waiting at once: their sessions draft at the same time (each
    waits for the other at a barrier, which a one-at-a-time server never passes)."""
    service, conn = served
    a, b = _open(conn), _open(conn)
    assert _round(conn, a) == 1 and _round(conn, b) == 1
    service.barrier = threading.Barrier(2, timeout=10)
    service.hold = threading.Event()         # a third call's admission holds the node's
    _open(conn)                              # thread while both verdicts go out, so it
    assert service.entered.wait(10)          # finds them waiting together
    conn.send_message(a, _verdict())
    conn.send_message(b, _verdict())
    hold, service.hold = service.hold, None
    hold.set()
    got = {sid: pb.DraftMessage.FromString(conn.recv_message(sid, 15)) for sid in (a, b)}
    assert [m.chunk.start for m in got.values()] == [2, 2], got
    assert not service.barrier.broken


def test_a_cancelled_call_ends_alone(served) -> None:
    service, conn = served
    a, b = _open(conn), _open(conn)
    assert _round(conn, a) == 1 and _round(conn, b) == 1
    conn.reset(a)                            # the target's request ended: RST_STREAM
    assert _round(conn, b) == 2
    deadline = time.monotonic() + 5
    while not service.calls[0].ended and time.monotonic() < deadline:
        time.sleep(0.01)
    assert service.calls[0].ended and not service.calls[1].ended
    c = _open(conn)                          # its admission slot is free again
    assert _round(conn, c) == 1


def test_bad_bytes_end_their_call_alone(served) -> None:
    service, conn = served
    a, b = _open(conn), _open(conn)
    assert _round(conn, a) == 1
    conn.send_message(b, b"\xff\xff not a TargetMessage")
    error = pb.DraftMessage.FromString(conn.recv_message(b, 5))
    assert "undecodable" in error.error.message
    with pytest.raises(H2Error, match="reset by the peer .code 0"):  # then the call ends
        conn.recv_message(b, 5)              # (trailers, and RST_STREAM NO_ERROR)
    assert _round(conn, a) == 2 and service.calls[1].ended and not service.calls[0].ended


def test_a_silent_call_ends_at_its_deadline_and_the_others_go_on(served) -> None:
    service, conn = served
    a, b = _open(conn), _open(conn)
    assert _round(conn, a) == 1 and _round(conn, b) == 1
    for _ in range(4):                       # a keeps talking, b says nothing for 1.2 s
        time.sleep(0.3)
        _round(conn, a)
    error = pb.DraftMessage.FromString(conn.recv_message(b, 5))
    assert "the target sent nothing for 1 s" in error.error.message
    assert service.calls[1].ended and not service.calls[0].ended


def test_admission_refuses_a_call_and_keeps_the_connection(served) -> None:
    service, conn = served
    sids = [_open(conn) for _ in range(4)]
    for sid in sids[:3]:
        assert _round(conn, sid) == 1
    with pytest.raises(H2Error):             # finished at once (RESOURCE_EXHAUSTED) and reset
        conn.send_message(sids[3], _verdict())
        conn.recv_message(sids[3], 5)
    assert len(service.calls) == 3
    assert _round(conn, sids[0]) == 2       # the others go on


@pytest.mark.slow   # times real waits: wall-clock bounds
def test_one_failure_of_a_shared_link_backs_it_off_once() -> None:
    """Sessions that opened in the same epoch and all fail with their connection count as
    one failure; a failure after the link was up again counts anew."""
    link = Link("127.0.0.1:9", LinkSettings(backoff_min_s=0.25), "f", 10, "t")
    epoch = link.epoch
    for _ in range(4):
        link.failed("connection lost", epoch=epoch)
    assert link.failures == 1 and link.retry_at - time.monotonic() <= 0.25
    link.failed("again", epoch=link.epoch, reconnect=False)
    assert link.failures == 2


def test_a_node_serving_one_call_at_a_time_sends_the_next_session_elsewhere() -> None:
    """A node that allows one stream per connection: a second session's open gives None
    (the drafter then counts the cap and decodes plainly) instead of breaking the
    connection the first one uses; once the first ends, the next opens there again."""
    service = FakeService()
    server = H2Server(service.call, "127.0.0.1", 0, None, max_connections=4, idle_s=30,
                      session_idle_s=5.0, max_streams=1)
    server.start()
    link = Link(f"127.0.0.1:{server.port}", LinkSettings(), "f", 10, "t")
    line = link.line()
    try:
        opened = []
        first = line.open(lambda: opened.append(1) or _verdict(), 5)
        assert first is not None and line.conn.recv_message(first, 5) is not None
        assert line.open(lambda: opened.append(2) or _verdict(), 5) is None
        assert opened == [1], "the Open of a session that cannot start is never made"
        line.release(first, closed=False)
        deadline = time.monotonic() + 5
        while (sid := line.open(_verdict, 5)) is None:   # the node saw the reset
            assert time.monotonic() < deadline
            line.alive()
            time.sleep(0.05)
        assert line.conn.recv_message(sid, 5) is not None and not line.broken()
    finally:
        line.close()
        server.close()
