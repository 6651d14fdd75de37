"""The bubble after a rejection: wait a moment for the fresh draft, or decode plainly.

A drafter that works ahead (a pipelined node, a draft thread) loses its lookahead with
every rejection, yet starts its fresh branch at once and drafts faster than the target
verifies. So the round may wait for m tokens: E(m) tokens in w(m) + t_v(m + 1) against a
plain step's one token in t_v(1), valued against the run's own rate r (the most E - r T),
with t_v the engine's VerifyCost means per batch size and w(m) measured online. It waits
when that beats not waiting by `margin` tokens, and only for batch sizes it has seen, so a
CPU target whose small batches cost several steps never waits. Waiting changes which tokens
are verified, never the output. docs/drafting.md section 6.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.policy.costs import VerifyCost
from specwire.policy.throughput import LineFit, expected_tokens

#: Rounds and arrivals seen before waiting is considered: the first estimates are guesses.
MIN_ROUNDS = 4
MIN_ARRIVALS = 3


@dataclass(slots=True)
class BubbleWait:
    """Decides how long a round without enough draft waits for the drafter; tokens that
    are late are not waited for past the deadline: the round verifies what came."""

    alpha: float = 0.1
    margin: float = 0.1  # tokens by which waiting must beat verifying what is there
    accepted: float = 3.0  # pseudo-counts: a = 0.75 before any verdict
    rejected: float = 1.0
    #: the target's verification cost, read per batch size (`costs.times`)
    costs: VerifyCost = field(default_factory=VerifyCost)
    #: no engine handed `costs`: the rounds' own times feed it
    own_costs: bool = True
    #: seconds from a verdict to the n-th token of the branch it started, against n
    arrival: LineFit = field(default_factory=lambda: LineFit(0.1, guess=1.0))
    arrivals: int = 0
    tokens: float = 0.0  # exponentially weighted tokens per round and seconds per round:
    seconds: float = 0.0  # the run's rate, against which a wait is priced
    #: a wait got nothing: no more waits until a fresh branch's token arrives again, so a
    #: stalled or dead drafter costs at most one wait, not one per round
    vain: bool = False

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe_round(self, drafted: int, accepted: int, verify_s: float,
                      waited_s: float = 0.0) -> None:
        """A round waited waited_s for its draft, verified `drafted` tokens (0: a plain
        step) in verify_s and kept `accepted` of them."""
        if self.own_costs:
            self.costs.observe(drafted + 1, verify_s)
        w = 1.0 - self.alpha
        self.tokens = w * self.tokens + accepted + 1
        self.seconds = w * self.seconds + waited_s + verify_s
        if drafted:
            self.accepted = w * self.accepted + accepted
            self.rejected = w * self.rejected + (1.0 if accepted < drafted else 0.0)

    @property
    def rate(self) -> float:
        """Tokens per second over recent rounds."""
        return self.tokens / self.seconds if self.seconds > 0.0 else 0.0

    def observe_arrival(self, n: int, seconds: float) -> None:
        """The n-th token of a fresh branch arrived `seconds` after the verdict."""
        self.arrival.add(n, seconds)
        self.arrivals += 1
        self.vain = False

    def missed(self) -> None:
        """A round waited and nothing came by its deadline."""
        self.vain = True

    def ready(self) -> bool:
        return (not self.vain and self.arrivals >= MIN_ARRIVALS
                and self.costs.times.rounds() >= MIN_ROUNDS)

    def aim(self, have: int, k: int, since_s: float, fresh: bool) -> tuple[int, float]:
        """(tokens to wait for, seconds to wait at most) for a round that has `have` draft
        tokens, may verify k, and comes `since_s` after the last verdict; `fresh`: the
        branch being drafted started at that verdict (else it runs on, a token per slope).
        (have, 0.0) means verify what is there."""
        if have >= k or not self.ready():
            return have, 0.0
        verify = self.costs.times
        plain, r = verify(1), self.rate
        c, d = self.arrival.coefficients()
        a = self.acceptance
        now = expected_tokens(a, have) - r * verify(have + 1)
        best_m, best_wait, best = have, 0.0, now
        # Only batches priced by rounds seen: beyond them the curve is VERIFY_SLOPE's guess,
        # a GPU's, which on a CPU target prices a batch of 5 at 1.4 steps, not 1.9.
        for m in range(have + 1, min(k, verify.largest() - 1) + 1):
            wait = max(0.0, c + d * m - since_s) if fresh else d * (m - have)
            if wait > plain:  # longer than a plain step would take: never worth the risk
                break
            gain = expected_tokens(a, m) - r * (wait + verify(m + 1))
            if gain > best:
                best_m, best_wait, best = m, wait, gain
        if best < now + self.margin:
            return have, 0.0
        return best_m, best_wait

