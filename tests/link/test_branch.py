"""The branch buffer of a drafter that answers over a transport, with the transport scripted.

A script of chunks arrives while a synchronous round waits, in the order a slow
link delivers them: what the engine gets must be the draft that answers its
latest verdict, never an empty draft taken from a stale branch's `done`.
"""

from __future__ import annotations

import pytest
from branch_fakes import PROMPT, ScriptedDrafter

from specwire.config import DraftParams, SamplingParams
from specwire.link.messages import Chunk, Verdict
from specwire.link.transport import protocol


def _chunk(gen: int, start: int, tokens: list[int], done: bool = True) -> Chunk:
    return Chunk(gen, start, tokens, done=done)


def test_a_stale_branch_does_not_end_the_wait_for_the_answer_to_the_verdict() -> None:
    """The target stepped past the node's first branch, which lands after the verdict, done."""
    d = ScriptedDrafter()
    d.begin(PROMPT, SamplingParams(temperature=0.0), DraftParams(n_max=3, p_min=0.0))
    history = [*PROMPT, 50, 51, 52]             # plain steps the node has not heard of
    d.script = [_chunk(0, 4, [50, 51]),         # the answer to Open: right, but behind
                _chunk(1, 7, [60, 61, 62])]     # the answer to the verdict below
    draft = d.propose(history, 3)
    assert d.sent[-1].position == 4 and d.sent[-1].tokens == [50, 51, 52]
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


class Steering:
    """What BranchDrafter reads of an adaptive policy: its stop threshold."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def stop_threshold(self) -> float:
        return self.threshold


def test_a_synchronous_verdict_waits_for_the_next_request_and_carries_its_k() -> None:
    """Rounds that skip the drafter post nothing; the next request for a draft sends one
    verdict for all of them (the kept branch tokens of the first, then the target's own)
    with that round's k as `want` when it changed. Under an adaptive policy the Open and the
    verdicts carry its threshold, a verdict only when it moved by more than 15%."""
    d = ScriptedDrafter()
    policy = Steering(0.3)
    d.begin(PROMPT, SamplingParams(temperature=0.0), DraftParams(n_max=8, p_min=0.75),
            policy=policy)
    opened = d.open_message(list(PROMPT))
    assert opened.calibrated and opened.keep_min == pytest.approx(0.3) and opened.k == 8
    d.script = [_chunk(0, 4, [7, 8, 9])]
    assert d.propose([*PROMPT, 7], 3).tokens == [8, 9]         # the answer to Open, behind
    d.learn([*PROMPT, 7, 8, 40], 1, 2)                        # 8 kept, then the target's 40
    d.learn([*PROMPT, 7, 8, 40, 41], 0, 1)                    # two plain steps, k = 0
    d.learn([*PROMPT, 7, 8, 40, 41, 42], 0, 1)
    assert [type(m) for m in d.sent] == [Verdict]   # only the first token's
    policy.threshold = 0.34                                   # within 15%: not sent
    d.script = [_chunk(1, 9, [50, 51])]
    assert d.propose([*PROMPT, 7, 8, 40, 41, 42], 2).tokens == [50, 51]
    v = d.sent[-1]
    assert (v.position, v.accepted, list(v.tokens), v.k) == (5, 1, [40, 41, 42], 2)
    assert v.keep_min == 0.0
    d.learn([*PROMPT, 7, 8, 40, 41, 42, 50, 60], 1, 2)
    policy.threshold = 0.5
    d.script = [_chunk(2, 11, [61])]
    assert d.propose([*PROMPT, 7, 8, 40, 41, 42, 50, 60], 1).tokens == [61]
    v = d.sent[-1]
    assert (v.position, v.accepted, list(v.tokens), v.k) == (9, 1, [60], 1)
    assert v.keep_min == pytest.approx(0.5)
    d.learn([*PROMPT, 7, 8, 40, 41, 42, 50, 60, 70], 0, 1)   # 61 rejected: the target's 70
    d.script = [_chunk(3, 12, [80])]
    assert d.propose([*PROMPT, 7, 8, 40, 41, 42, 50, 60, 70], 1).tokens == [80]
    v = d.sent[-1]        # nothing kept, k unchanged: neither gen nor want is sent
    assert (v.position, v.accepted, list(v.tokens)) == (11, 0, [70])
    assert v.keep_min == 0.0         # on the wire: position 2 bytes, tokens 3
    assert protocol.target_to_pb(v).verdict.ByteSize() == 5
    assert (v.gen, v.k) == (0, 0)
    d.end()                          # the policy goes with the sequence
    assert not d.open_message(list(PROMPT)).calibrated
