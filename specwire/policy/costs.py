"""What verification and drafting cost: seconds for n tokens, measured online.

The verification cost is the target's, not a sequence's nor a drafter's, so an engine
keeps one VerifyCost for its target, feeds it once per decode of rounds (Engine.decode),
and hands it to the adaptive policies, the drafters that weigh their own rounds (n-gram,
hybrid) and the bubble rule, which read it. Two views of the same times: a line (the
policies' and the drafters' pricing) and the means per batch size (the bubble rule's,
which waits only for sizes it has seen).

The drafting cost is the draft backend's: one DraftCost per draft model (or per
sequence's drafter where there is none), kept by whoever owns it (the engine, beside
what its policies learned; the sequences of one shared draft context share one) and
handed to the policies, the hybrid and the lockstep drafts. Whoever times the draft
model feeds it: the policy from its rounds, the hybrid (which alone knows which rounds
were its model's) and the shared draft context's decodes.

A part built alone, outside an engine (a test, a research script), is given cost models
of its own, which its own observations feed (`own_costs`) in the engine's place.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specwire.policy.throughput import LineFit, VerifyTimes, draft_line, verify_line

#: A shared draft decode's assumed cost per token, relative to its fixed part (the prior
#: of the line fitted to its decodes).
DECODE_SLOPE = 0.1


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


def _decode_line() -> LineFit:
    return LineFit(0.05, guess=DECODE_SLOPE)


@dataclass(slots=True)
class DraftCost:
    """t_d(k), a draft backend drafting k tokens for a round, measured online; and, for a
    draft context that several sequences share, what one of its decodes costs."""

    #: seconds of a caught-up round's draft against the tokens drafted; a prior of one
    #: evaluation per round and one per token
    line: LineFit = field(default_factory=draft_line)
    #: seconds of one decode of the shared draft context against its tokens (lockstep)
    decode: LineFit = field(default_factory=_decode_line)
    #: drafts of the shared context in the lockstep decode just made (drafters/lockstep.py
    #: sets it before they choose their next tokens; 1 alone)
    live: int = 1

    def observe(self, drafted: int, seconds: float) -> None:
        """A caught-up draft of `drafted` tokens took `seconds`."""
        self.line.add(drafted, seconds)

    def seconds(self, drafted: float) -> float:
        """The line's t_d(drafted) (0 before any draft)."""
        return self.line(drafted)

    def per_token(self) -> float:
        """Seconds each further drafted token adds (the line's slope)."""
        return self.line.coefficients()[1]

    def observe_decode(self, tokens: int, seconds: float) -> None:
        """A decode of the shared draft context, `tokens` in all, took `seconds`."""
        self.decode.add(tokens, seconds)

    def share(self, tokens: int, total: int, seconds: float) -> float:
        """What `tokens` of a shared decode of `total` tokens that took `seconds` would
        have cost in a decode of their own: the decode's fixed part, reading the weights,
        and their part per token."""
        whole = self.decode(total)
        return seconds * min(1.0, self.decode(tokens) / whole) if whole > 0 else seconds

    def lockstep(self, n: int) -> float:
        """A shared decode of n sequences' draft tokens against one sequence's alone
        (1 before any shared decode was timed)."""
        one = self.decode(1)
        return max(1.0, self.decode(n) / one) if self.decode.w > 0.0 and one > 0 else 1.0

    def adopt(self, other: DraftCost) -> None:
        """Start from what another sequence's draft backend learnt (the same model on the
        same machine), where this one has seen no draft yet."""
        if self.line.w == 0.0 and other.line.w > 0.0:
            self.line = replace(other.line)
