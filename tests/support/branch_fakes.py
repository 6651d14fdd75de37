"""BranchDrafters with no network under them: a scripted one whose chunks come from a list, and
one joined to a real DraftSession by function calls (Joined, and Branching, which drafts
alternates); _wire passes a message through protobuf and back."""

from __future__ import annotations

from fakes import FakeBackend, Forward

from specwire.link.alternates import (
    AlternateParams,
)
from specwire.link.branch import BranchDrafter
from specwire.link.messages import (
    Chunk,
    Failure,
    TargetMessage,
    Verdict,
)
from specwire.link.session import DraftSession
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb

V = 100


PROMPT = [1, 2, 3, 4]


class ScriptedDrafter(BranchDrafter):
    """A live session whose chunks arrive, one per wait, from a script."""

    def __init__(self, pipelined: bool = False) -> None:
        super().__init__(Forward(), V, pipelined=pipelined, sync_timeout_s=0.5)
        self.sent: list[TargetMessage] = []
        self.script: list[Chunk] = []
        self.waits = 0

    def _live(self) -> bool:
        return True

    def _post(self, msg: TargetMessage) -> None:
        self.sent.append(msg)

    def _open(self, session: int, history: list[int]) -> None:
        """Nothing to start: the script answers each wait."""

    def _await(self, left_s: float) -> None:
        self.waits += 1
        if self.script:
            self.on_chunk(self.session, self.script.pop(0))


def _wire(m: TargetMessage | Chunk | Failure):
    """Through protobuf and bytes and back, as the other end reads it."""
    if isinstance(m, Chunk | Failure):
        data = protocol.draft_to_pb(m).SerializeToString()
        return protocol.draft_from_pb(pb.DraftMessage.FromString(data))
    data = protocol.target_to_pb(m).SerializeToString()
    return protocol.target_from_pb(pb.TargetMessage.FromString(data))


class Joined(BranchDrafter):
    """A BranchDrafter whose drafter is a DraftSession reached by function call: each
    message is handled, and answered, before the call returns."""

    def __init__(self, backend: FakeBackend, pipelined: bool = False,
                 lookahead: int = 6) -> None:
        super().__init__(Forward(), backend.n_vocab, pipelined=pipelined, lookahead=lookahead,
                         sync_timeout_s=0.05)
        self.backend = backend
        self.node: DraftSession | None = None
        self.outcomes = {"kept": 0, "dropped": 0}  # what the rule made of each verdict

    def _live(self) -> bool:
        return self.node is not None

    def _post(self, msg: TargetMessage) -> None:
        if isinstance(msg, Verdict):
            gen = self.node.gen
            self.node.step(msg) if not self.pipelined else self._pipelined_step(msg)
            self.outcomes["kept" if self.node.gen == gen else "dropped"] += 1
        else:
            self.node = None

    def _pipelined_step(self, v: Verdict) -> None:
        """The pipelined session's work for one verdict, on this thread: apply it, then
        draft what the lookahead allows (what its own thread would do next)."""
        self.node._apply(v)
        if not self.node.stalled and len(self.node.branch) < self.node._limit():
            self.node._draft_burst()

    def _open(self, session: int, history: list[int]) -> None:
        self.node = DraftSession(self.backend, self.open_message(history),
                                 lambda m: self.on_chunk(session, m))
        self.node.announce()
        if self.pipelined:
            self.node._draft_burst()
        else:
            self.node.step(None)

    def _await(self, left_s: float) -> None:
        """Nothing more is coming: everything was answered during the call."""


class Branching(Joined):
    """Joined, pipelined, asking for alternates; after each verdict the node drafts its
    branch and its alternates as its own thread would, until it would wait."""

    def __init__(self, backend: FakeBackend) -> None:
        super().__init__(backend, pipelined=True)
        self.alternates = AlternateParams(value_min=0.05, top_below=0.95)

    def _pipelined_step(self, v: Verdict) -> None:
        self.node._apply(v)
        self._work()

    def _open(self, session: int, history: list[int]) -> None:
        super()._open(session, history)
        self._work()

    def _work(self) -> None:
        _work(self.node)


def _work(node: DraftSession) -> None:
    """What the session's thread does until it would wait (DraftSession._next_work)."""
    while True:
        j = node._alternate_first()
        if j is not None:
            node._draft_late_alternate(j)
        elif not node.stalled and len(node.branch) < node._limit():
            node._draft_burst()
        else:
            return
