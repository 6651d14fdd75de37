"""One sequence of the engine's batch: a request's state from joining to leaving.

Data: the history, how far the prompt is in the target's cache, the verifier, the
policy, the round in progress (Round) and the stop state. The engine wires it up when
it joins (Engine.start), round.py moves it through its rounds, and `finish` undoes
the wiring when it leaves.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specwire.drafters.base import Draft
from specwire.engine.stats import Stats, counter_delta
from specwire.policy.adaptive import AdaptivePolicy, FixedPolicy, Policy
from specwire.sample.logprobs import TokenProb

if TYPE_CHECKING:
    from specwire.backend.base import Backend
    from specwire.backend.batch import BatchBackend
    from specwire.drafters.base import NoDrafter
    from specwire.drafters.guard import DraftGuard
    from specwire.engine.request import Request
    from specwire.policy.costs import VerifyCost
    from specwire.policy.tree import TreeYield
    from specwire.sample.constraints.grammar import Grammar
    from specwire.sample.tree import Tree
    from specwire.sample.verify import Verifier


def adapter_scales(target: Backend) -> tuple[float, ...]:
    """The target's own LoRA scales (--lora, POST /lora-adapters); () without adapters."""
    return tuple(getattr(target, "lora_scales", ()))


@dataclass(slots=True)
class Round:
    """One speculative round between its part being planned and its rows arriving."""

    draft: Draft
    k: int            # the draft length the policy asked for
    started: float    # perf_counter before the drafter was asked
    drafted: float    # ... and after its draft was in (with the others', in lockstep)
    #: what drafting cost this sequence, as if alone (drafters/lockstep.py); None: the
    #: time between started and drafted, all of it its own
    own_s: float | None = None
    #: ... and had the drafter been caught up (Drafting.steady_s); None: not measured
    steady_s: float | None = None
    #: the round's part is this tree of the draft (engine/tree_round.py); None: the chain
    tree: Tree | None = None

    @property
    def draft_s(self) -> float:
        """The drafting cost the policy learns from."""
        return self.drafted - self.started if self.own_s is None else self.own_s


class SequenceState:
    """Sequence `seq` of the batch, running request `req`.

    stop_type is llama-server's: "eos", "limit" (n_predict or context), or "word" when
    the caller stops it on a stop string. `done`: it left the batch, or will at the end
    of this step (finished, stopped, failed or closed).
    """

    def __init__(self, req: Request, seq: int, target: Backend,
                 drafter: DraftGuard | NoDrafter) -> None:
        self.req, self.seq, self.target, self.drafter = req, seq, target, drafter
        self.stats = Stats()
        self.tokens: list[int] = []     # generated so far
        self.probs: list[TokenProb] = []
        self.stop_type = "none"
        self.truncated = False          # the context's end stopped it, or it was shifted
        self.shifts = 0                 # context shifts done (round.shift_context)
        self.context_shift = False      # --context-shift: a full context shifts (start sets it)
        self.error: Exception | None = None
        self.done = False
        self.stopped = False            # no more tokens (the next plan ends it)
        self.out: list[int] = []        # tokens not yet handed to the caller
        self.round: Round | None = None  # the round planned this step; None: a prompt chunk
        self.started = self.begun = False   # joined; the drafter's sequence began
        self.drafter0: dict[str, float] = {}  # the drafter's counters as this request began
        self.t0 = self.t1 = 0.0         # perf_counter at joining, and at the first token
        self.prefilled = 0              # prompt tokens in the target's cache
        self.history: list[int] = []    # prompt and generated tokens, once the prompt is in
        self.decode_s = 0.0             # the target's decode time in this request's steps
        self.grammar: Grammar | None = None
        self.verifier: Verifier | None = None
        self.policy: Policy = FixedPolicy(0)
        #: the engine's batch and what its trees yielded, for rounds that verify a tree
        #: (engine/tree_round.py); set as the sequence joins
        self.batch: BatchBackend | None = None
        self.costs: VerifyCost | None = None   # the target's verification curve
        self.tree_yield: TreeYield | None = None

    @property
    def decoding(self) -> bool:
        """Past its prompt: its parts are a round (last token and draft), not a chunk."""
        return self.started and self.prefilled == len(self.req.prompt)

    @property
    def lora(self) -> tuple[float, ...]:
        """The adapter scales its target decodes run with: the request's own, else the
        target's (the scheduler decodes together only sequences with equal ones)."""
        if self.req.lora is not None:
            return self.req.lora
        return adapter_scales(self.target)

    @property
    def k(self) -> int:
        """The draft length this step's round asks for (0: none, or not a round)."""
        return self.round.k if self.round is not None else 0

    def stop(self, stop_type: str) -> None:
        self.stop_type, self.stopped = stop_type, True

    def pending(self) -> list[int]:
        """The tokens produced since the last call."""
        out, self.out = self.out, []
        return out

    def emit(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens to the output up to end-of-generation or n_predict."""
        out = []
        for t in tokens:
            if not self.req.ignore_eos and self.target.is_eog(t):
                self.stop("eos")
                break
            out.append(t)
            if len(self.tokens) + len(out) >= self.req.n_predict:
                self.stop("limit")
                break
        self.tokens.extend(out)
        if self.stopped:
            self.done = True
        return out

    def finish(self) -> None:
        """Leaving the batch: final figures, and the drafter's sequence ended."""
        st = self.stats
        if self.t1:
            st.predicted_n = len(self.tokens)
            st.predicted_ms = 1000 * (time.perf_counter() - self.t1)
            st.target_decode_ms = 1000 * self.decode_s
        try:
            if self.begun:
                st.drafter = counter_delta(self.drafter0, self.drafter.stats())
                if (got := self.drafter.cache_use()) is not None:
                    st.draft_cache_n, st.draft_prompt_n = got
                self.drafter.end()
        finally:
            if isinstance(self.policy, AdaptivePolicy):
                self.policy.drafter_stops = False  # set from the drafter's declaration by start
            if self.grammar is not None:
                self.grammar.close()
