"""A fake service for the H2Server (each call echoes a chunk per verdict) and one round
of a call driven by hand over a client Connection."""

from __future__ import annotations

import threading

from specwire.link.messages import Chunk, Failure, Verdict
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.h2.connection import Connection
from specwire.link.transport.h2.grpcframe import Status
from specwire.link.transport.protocol import ProtocolError
from specwire.node.server import _decode, _encode


class EchoCall:
    """Answers every verdict with a chunk whose start counts the call's messages."""

    status, idle_s = (Status.OK, ""), None

    def __init__(self, service: FakeService, send, context) -> None:
        if service.hold is not None:         # holds the connection's thread
            service.entered.set()
            service.hold.wait(10)
        if len([c for c in service.calls if not c.ended]) >= service.max_calls:
            context.abort(Status.RESOURCE_EXHAUSTED, "busy")
        service.calls.append(self)
        service.peers.add(context.peer())
        self.service = service
        self.send = lambda m: send(_encode(m))
        self.taken, self.ended, self.error = 0, False, ""

    def take(self, data) -> bool:
        try:
            msg = data if isinstance(data, ProtocolError) else _decode(data)
        except ProtocolError as e:
            msg = e
        if self.service.barrier is not None and not isinstance(msg, ProtocolError):
            self.service.barrier.wait()      # passes only when two calls draft at once
        if isinstance(msg, ProtocolError):
            self.error = str(msg)
            self.send(Failure(str(msg)))
            return False
        if not isinstance(msg, Verdict) and msg.WhichOneof("kind") == "close":
            return False                     # (a verdict comes decoded: roundcodec.py)
        self.taken += 1
        self.send(Chunk(gen=0, start=self.taken, tokens=[]))
        return True

    def end(self) -> None:
        assert not self.ended, "a call ends once"
        self.ended = True


class FakeService:
    def __init__(self, max_calls: int = 8) -> None:
        self.calls: list[EchoCall] = []
        self.peers: set[str] = set()
        self.max_calls = max_calls
        self.barrier: threading.Barrier | None = None
        self.hold: threading.Event | None = None
        self.entered = threading.Event()

    def call(self, path, send, context) -> EchoCall:
        return EchoCall(self, send, context)


def _open(conn: Connection) -> int:
    return conn.request(protocol.SESSION_PATH, "node", (), "http")


def _verdict() -> bytes:
    return pb.TargetMessage(verdict=pb.Verdict(position=1)).SerializeToString()


def _round(conn: Connection, sid: int) -> int:
    conn.send_message(sid, _verdict())
    data = conn.recv_message(sid, 5)
    assert data is not None
    return pb.DraftMessage.FromString(data).chunk.start
