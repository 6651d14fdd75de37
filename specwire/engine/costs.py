"""What the target's decodes cost: one model per target, timed by its engine.

The cost of verifying a batch of n tokens is the target's, not a sequence's or a
drafter's: the engine times every decode of rounds and fits one line to them,
which the policies read (Engine.policy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from specwire.backend.batch import Part
from specwire.policy.throughput import LineFit, verify_line


@dataclass(slots=True)
class TargetCosts:
    """The target's verification curve, fed once per decode."""

    #: seconds of a decode of rounds only against its tokens - 1
    verify: LineFit = field(default_factory=verify_line)

    def observe_decode(self, parts: Sequence[Part], seconds: float) -> None:
        """A decode of these parts took `seconds`. A step that reads a prompt chunk is off
        the curve: its chunk's tokens cost far less each than rounds' (one logits row,
        not one per token), and a long one would set the line's slope alone."""
        if all(p.logits == "all" for p in parts):
            self.verify.add(sum(len(p.tokens) for p in parts) - 1, seconds)
