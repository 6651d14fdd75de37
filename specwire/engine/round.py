"""One round of a decoding sequence in the step in progress: its draft, and when."""

from __future__ import annotations

from dataclasses import dataclass

from specwire.drafters.base import Draft
from specwire.sample.tree import Tree


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
