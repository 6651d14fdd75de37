"""Draft-length policies: how many tokens to ask the drafter for each round.

`fixed` always asks for --draft-max. `adaptive` keeps online estimates of the
acceptance rate a, the drafter's cost per round t_d(k) = c + k d and the
target's cost to verify a batch of n tokens t_v(n), and picks the k that
maximises expected tokens per second:

    E(k) = (1 - a^(k+1)) / (1 - a)        tokens per round
    T(k) = t_d(k) + t_v(k + 1)            seconds per round

the same model `specwire plan` uses (see plan.py). The intercept c is what a
round costs the drafter whatever its length: a draft model evaluates the
target's newest token, and the position where --draft-p-min stops it; a
synchronous remote drafter adds the round trip.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def expected_tokens(a: float, k: int) -> float:
    """Tokens produced by a round of k drafts at per-token acceptance a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(slots=True)
class FixedPolicy:
    n_max: int

    def choose(self, limit: int) -> int:
        return min(self.n_max, limit)

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        pass


@dataclass(slots=True)
class LineFit:
    """Exponentially weighted least squares of y = c + d x, both kept >= 0.

    Until x has varied, the split between c and d is a guess: d = guess * c when
    `guess` is given, else all of y is slope.
    """

    alpha: float
    guess: float | None = None
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def add(self, x: float, y: float) -> None:
        k = 1.0 - self.alpha
        self.w = k * self.w + 1.0
        self.x, self.y = k * self.x + x, k * self.y + y
        self.xx, self.xy = k * self.xx + x * x, k * self.xy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(c, d); (0, 0) before any data."""
        if self.w == 0.0:
            return 0.0, 0.0
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var < 0.05 * max(mx * mx, 1e-9):
            if self.guess is not None:
                c = my / (1.0 + self.guess * mx)
                return c, self.guess * c
            return (0.0, my / mx) if mx > 0 else (my, 0.0)
        d = (self.xy / self.w - mx * my) / var
        c = my - d * mx
        if d < 0.0:
            return my, 0.0
        if c < 0.0:
            return 0.0, my / mx
        return c, d

    def __call__(self, x: float) -> float:
        c, d = self.coefficients()
        return c + d * x


@dataclass(slots=True)
class AdaptivePolicy:
    """Online estimate of a, t_d(k) and t_v(n); chooses k by expected throughput.

    Estimates are exponentially weighted (weight `alpha` for the newest round)
    so that the policy follows a prompt that turns from copying to free text.
    A round that follows a round without a draft is left out of t_d: the
    drafter first caught up with the tokens it had not seen (the prompt, or a
    stretch of plain steps), work that a steady run of rounds does not repeat.
    """

    n_max: int
    alpha: float = 0.15
    accepted: float = 1.5  # pseudo-counts: start optimistic (a = 0.75), learn fast
    rejected: float = 0.5
    draft: LineFit = field(default_factory=lambda: LineFit(0.1))  # seconds vs tokens drafted
    verify: LineFit = field(default_factory=lambda: LineFit(0.05, guess=0.1))  # s vs n - 1
    probe_every: int = 32  # rounds at k = 0 between one-token probes
    idle_rounds: int = 0
    asked: int = 0  # k of the round in progress
    warm: bool = False  # the previous round asked for a draft

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def draft_cost(self, k: int) -> float:
        """t_d(k) in seconds: what waiting for a k-token draft costs the target."""
        return self.draft(k) if k > 0 else 0.0

    def verify_cost(self, n: int) -> float:
        """t_v(n) in seconds: a line through every verification seen, so that one slow
        round at a batch size the policy then avoids cannot stick (until a second size
        is seen, each extra token is guessed at 10% of a step)."""
        if self.verify.w == 0.0:
            return 1.0 + 0.1 * (n - 1)
        return max(self.verify(n - 1), 1e-6)

    def choose(self, limit: int) -> int:
        self.asked = self._best(min(self.n_max, limit))
        return self.asked

    def _best(self, limit: int) -> int:
        a = self.acceptance
        best_k, best = 0, expected_tokens(a, 0) / self.verify_cost(1)
        for k in range(1, limit + 1):
            rate = expected_tokens(a, k) / (self.draft_cost(k) + self.verify_cost(k + 1))
            if rate > best * 1.0001:
                best_k, best = k, rate
        if best_k == 0 and limit >= 1:
            # Probe now and then: with k = 0 forever the estimates could never recover.
            self.idle_rounds += 1
            if self.idle_rounds >= self.probe_every:
                self.idle_rounds = 0
                return 1
        return best_k

    def observe(self, drafted: int, accepted: int, draft_s: float, verify_s: float) -> None:
        w = 1.0 - self.alpha
        if drafted:
            self.accepted = w * self.accepted + accepted
            self.rejected = w * self.rejected + (1 if accepted < drafted else 0)
        if self.asked and self.warm:
            self.draft.add(drafted, draft_s)
        self.warm = self.asked > 0
        self.verify.add(drafted, verify_s)


def make_policy(name: str, n_max: int) -> FixedPolicy | AdaptivePolicy:
    return AdaptivePolicy(n_max) if name == "adaptive" else FixedPolicy(n_max)
