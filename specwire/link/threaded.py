"""A draft model on its own thread in this process, working ahead like a draft node.

llama.cpp's own speculative decoding alternates: draft k tokens, then verify,
so on a machine with a spare core one core always waits. Here the draft node's
session logic (link/session.py) runs on a thread of this process, the
messages of link/messages.py pass by function call instead of gRPC, and the
engine takes the branch through the same BranchDrafter as a remote node: the
draft drafts while the target verifies (llama.cpp releases the GIL inside decode).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from specwire.backend.base import Backend
from specwire.config import DraftParams, SamplingParams
from specwire.drafters.bubble import BubbleWait
from specwire.link.alternates import AlternateParams
from specwire.link.branch import DEFAULT_ALTERNATES, BranchDrafter
from specwire.link.messages import (
    MAX_ALTERNATES,
    Chunk,
    DraftMessage,
    ProtocolError,
    TargetMessage,
    Verdict,
)
from specwire.link.session import DraftSession
from specwire.link.transport.base import Transport
from specwire.policy.adaptive import Calibration
from specwire.policy.scoped import Scoped
from specwire.sample.constraints.grammar import GrammarSpec

log = logging.getLogger("specwire.threaded")


class InProcessTransport(Transport):
    """A BranchDrafter's messages by function call to a DraftSession on its own thread."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.calibration = Calibration()  # for synchronous sessions of adaptive requests
        self.grammar: GrammarSpec | None = None
        self.grammar_start = 0  # where the request's grammar begins (the prompt's end)
        self._draft_session: DraftSession | None = None

    def live(self) -> bool:
        s = self._draft_session
        return s is not None and s.error is None

    def post(self, msg: TargetMessage) -> None:
        s = self._draft_session
        if s is None:
            return
        if isinstance(msg, Verdict):
            s.push(msg)
        else:
            s.close()

    def open(self, session: int, history: list[int]) -> None:
        branch = self.branch

        def deliver(m: DraftMessage) -> None:
            if isinstance(m, Chunk):
                try:
                    branch.on_chunk(session, m)
                except ProtocolError as e:   # a bug, not a peer: say so loudly
                    log.error("threaded drafter sent a bad chunk: %s", e)
            else:
                log.error("threaded drafter failed: %s", m.message)
                branch.wake()

        self._draft_session = DraftSession(self.backend, branch.open_message(history), deliver,
                                           calibration=self.calibration)
        self._draft_session.drafter.follow(self.grammar, self.grammar_start)
        self._draft_session.start()

    def trees(self) -> bool:
        return True   # the session in this process is this version's (link/session.py)

    def detach(self) -> None:
        s, self._draft_session = self._draft_session, None
        if s is not None:
            s.close()
            s.thread.join()


class ThreadedDrafter(BranchDrafter):
    """A local draft model that drafts concurrently with the target's verification."""

    transport: InProcessTransport

    def __init__(self, backend: Backend, pipelined: bool = True, lookahead: int = 0, *,
                 alternates: AlternateParams | None = DEFAULT_ALTERNATES,
                 tree: int = MAX_ALTERNATES,
                 bubbles: Scoped[BubbleWait] | None = None) -> None:
        """alternates, tree, bubbles: as BranchDrafter's."""
        super().__init__(InProcessTransport(backend), backend.n_vocab, pipelined, lookahead,
                         alternates=alternates, tree=tree, bubbles=bubbles)
        self.backend = backend
        self.name = f"threaded:{backend.name}"

    @property
    def calibration(self) -> Calibration:
        return self.transport.calibration

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar: GrammarSpec | None = None) -> None:
        """Draft under the request's grammar too (in process: no wire message needed)."""
        self.transport.grammar, self.transport.grammar_start = grammar, len(prompt)
        super().begin(prompt, sampling, params, policy=policy)
