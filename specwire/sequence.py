"""What a decoding sequence put into the step in progress: its draft, and when."""

from __future__ import annotations

from dataclasses import dataclass

from specwire.drafters.base import Draft


@dataclass(slots=True)
class Round:
    """One speculative round between its part being planned and its rows arriving."""

    draft: Draft
    k: int            # the draft length the policy asked for
    started: float    # perf_counter before the drafter was asked
    drafted: float    # ... and after its draft was in (with the others', in lockstep)
