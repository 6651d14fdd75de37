"""A draft node's gRPC calls driven by hand: an Open message, a Session (or Ping) stream."""

from __future__ import annotations

import queue

from wire_helpers import GREEDY

from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb


def _open(history: list[int], want: int = 3, **kw) -> pb.TargetMessage:
    kw = {"mode": pb.VERIFY_GREEDY, "lookahead": 8, **kw}
    return pb.TargetMessage(open=pb.Open(
        history=history, sampling=protocol.sampling_to_pb(GREEDY), pipelined=False, want=want,
        **kw))


class Stream:
    """A Session (or Ping) call driven by hand."""

    def __init__(self, method, metadata=()) -> None:
        self.q: queue.Queue = queue.Queue()
        self.call = method(iter(self.q.get, None), metadata=metadata, timeout=30)

    def send(self, msg) -> None:
        self.q.put(msg)

    def next(self):
        return next(self.call)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()
