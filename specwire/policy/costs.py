"""What verification and drafting cost: seconds for n tokens, measured online.

The verification cost is the target's: an engine keeps one VerifyCost, feeds it once per
decode (Engine.decode) and hands it to the adaptive policies, the n-gram and hybrid
drafters and the bubble rule. It has two views of the same times: a line, starting from
throughput's prior (the policies' and drafters' pricing), and the means per batch size
(the bubble rule's, which waits only for sizes it has seen). The drafting cost is the
draft backend's: one DraftCost per draft model (shared by the sequences of one draft
context), holding a draft's own time and what catching up costs, fed by whoever times the
draft model. A part built outside an engine is given cost models of its own (`own_costs`).
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


@dataclass(slots=True)
class PerToken:
    """Seconds per token of work done now and then (catching up), exponentially weighted
    by the tokens of each sample."""

    seconds: float = 0.0
    tokens: float = 0.0
    alpha: float = 0.15  # the weight of the newest sample

    def add(self, tokens: float, seconds: float) -> None:
        w = 1.0 - self.alpha
        self.seconds = w * self.seconds + seconds
        self.tokens = w * self.tokens + tokens

    def __call__(self) -> float:
        """Seconds per token (0 before any sample: catching up is assumed free)."""
        return self.seconds / self.tokens if self.tokens else 0.0


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
    #: what a draft beyond its own time spends evaluating the tokens its backend lacks:
    #: those added while it was not asked (plain steps, an n-gram's rounds) ...
    catch_up: PerToken = field(default_factory=PerToken)
    #: ... and, in a request's first draft, its prompt (one batch: cheaper per token)
    prompt: PerToken = field(default_factory=PerToken)

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

    def adopt(self, other: DraftCost) -> None:
        """Start from what another sequence's draft backend learnt (the same model on the
        same machine), where this one has seen no draft yet."""
        if self.line.w == 0.0 and other.line.w > 0.0:
            self.line = replace(other.line)
        if self.catch_up.tokens == 0.0:
            self.catch_up = replace(other.catch_up)
        if self.prompt.tokens == 0.0:
            self.prompt = replace(other.prompt)
