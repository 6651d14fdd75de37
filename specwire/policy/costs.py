"""What verification costs on one target: seconds for a batch of n tokens.

The cost is the target's, not a sequence's nor a drafter's, so an engine keeps one
VerifyCost for its target, feeds it once per decode of rounds (Engine.decode), and
hands it to the adaptive policies, the drafters that weigh their own rounds (n-gram,
hybrid) and the bubble rule, which read it. Two views of the same times: a line
(the policies' and the drafters' pricing) and the means per batch size (the bubble
rule's, which waits only for sizes it has seen).

A part built alone, outside an engine (a test, a research script), is given a
VerifyCost of its own, which its own observations feed (`own_costs`) in the engine's place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.policy.throughput import LineFit, VerifyTimes, verify_line


@dataclass(slots=True)
class VerifyCost:
    """t_v(n), the target decoding n tokens of rounds, measured online."""

    #: seconds against n - 1 (the tokens drafted, for a round alone)
    line: LineFit = field(default_factory=verify_line)
    #: seconds per batch size, exponentially weighted per size
    times: VerifyTimes = field(default_factory=VerifyTimes)

    def observe(self, n: int, seconds: float) -> None:
        """A decode of n tokens, every one of them in a round, took `seconds`."""
        self.line.add(n - 1, seconds)
        self.times.add(n, seconds)

    def seconds(self, n: float) -> float | None:
        """The line's t_v(n); None before any decode."""
        if self.line.w == 0.0:
            return None
        return max(self.line(n - 1), 1e-6)

    def per_token(self) -> float:
        """Seconds each further token adds to a batch (the line's slope)."""
        return self.line.coefficients()[1]
