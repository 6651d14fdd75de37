"""The branch buffer of a drafter that answers over a transport, with the transport scripted.

A script of chunks arrives while a synchronous round waits, in the order a slow
link delivers them: what the engine gets must be the draft that answers its
latest verdict, never an empty draft taken from a stale branch's `done`.
"""

from __future__ import annotations

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.branch import BranchDrafter
from specwire.wire import specwire_pb2 as pb

V = 100
PROMPT = [1, 2, 3, 4]


class ScriptedDrafter(BranchDrafter):
    """A live session whose chunks arrive, one per wait, from a script."""

    def __init__(self, pipelined: bool = False) -> None:
        super().__init__(V, pipelined=pipelined, sync_timeout_s=0.5)
        self.sent: list[pb.TargetMessage] = []
        self.script: list[pb.DraftChunk] = []
        self.waits = 0

    def _live(self) -> bool:
        return True

    def _post(self, msg: pb.TargetMessage) -> None:
        self.sent.append(msg)

    def _open(self, session: int, history: list[int]) -> None:
        self.session = session

    def _await(self, left_s: float) -> None:
        self.waits += 1
        if self.script:
            self._on_chunk(self.session, self.script.pop(0))


def _chunk(gen: int, start: int, tokens: list[int], done: bool = True) -> pb.DraftChunk:
    return pb.DraftChunk(gen=gen, start=start, tokens=tokens, done=done)


def test_a_stale_branch_does_not_end_the_wait_for_the_answer_to_the_verdict() -> None:
    """The target stepped past the node's first branch, which lands after the verdict, done."""
    d = ScriptedDrafter()
    d.begin(PROMPT, SamplingParams(temperature=0.0), DraftParams(n_max=3, p_min=0.0))
    history = [*PROMPT, 50, 51, 52]             # plain steps the node has not heard of
    d.script = [_chunk(0, 4, [50, 51]),         # the answer to Open: right, but behind
                _chunk(1, 7, [60, 61, 62])]     # the answer to the verdict below
    draft = d.propose(history, 3)
    assert d.sent[-1].verdict.position == 4 and list(d.sent[-1].verdict.tokens) == [50, 51, 52]
    assert draft.tokens == [60, 61, 62]
    assert d.waits == 2


def test_a_branch_that_disagrees_with_the_history_is_not_used() -> None:
    """A branch whose tokens contradict what the target committed is dead, whatever it says."""
    d = ScriptedDrafter()
    d.begin(PROMPT, SamplingParams(temperature=0.0), DraftParams(n_max=2, p_min=0.0))
    d.script = [_chunk(0, 4, [7, 8])]
    assert d.propose(PROMPT, 2).tokens == [7, 8]
    d.script = [_chunk(0, 6, [9, 10]), _chunk(1, 6, [11, 12])]
    history = [*PROMPT, 7, 30]                  # 7 kept, then the target's own 30
    d.waits = 0
    assert d.propose(history, 2).tokens == [11, 12]   # gen 0 said 8 where 30 stands: dead
    assert d.waits == 2
