"""Draft-length policies: how many tokens to ask the drafter for each round.

`fixed` always asks for --draft-max. `adaptive` keeps online estimates of the
acceptance rate a, the drafter's cost per token t_d and the target's cost to
verify a batch of n tokens t_v(n), and picks the k that maximises expected
tokens per second:

    E(k) = (1 - a^(k+1)) / (1 - a)        tokens per round
    T(k) = k * t_d + t_v(k + 1)           seconds per round

the same model `specwire plan` uses (see plan.py).
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
class AdaptivePolicy:
    """Online estimate of a, t_d and t_v(n); chooses k by expected throughput.

    Estimates are exponentially weighted (weight `alpha` for the newest round)
    so that the policy follows a prompt that turns from copying to free text.
    """

    n_max: int
    alpha: float = 0.15
    accepted: float = 1.5  # pseudo-counts: start optimistic (a = 0.75), learn fast
    rejected: float = 0.5
    draft_s: float = 0.0  # per draft token
    verify_s: dict[int, float] = field(default_factory=dict)  # batch size -> seconds
    probe_every: int = 32  # rounds at k = 0 between one-token probes
    idle_rounds: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def verify_cost(self, n: int) -> float:
        """t_v(n), interpolated linearly through the batch sizes seen so far."""
        known = sorted(self.verify_s.items())
        if not known:
            return 1.0 + 0.1 * (n - 1)
        if len(known) == 1:
            n0, t0 = known[0]
            return t0 * (1.0 + 0.1 * (n - n0))  # a guess until a second size is seen
        (n0, t0), (n1, t1) = _bracket(known, n)
        return max(t0 + (t1 - t0) * (n - n0) / (n1 - n0), 1e-6)

    def choose(self, limit: int) -> int:
        limit = min(self.n_max, limit)
        a = self.acceptance
        best_k, best = 0, expected_tokens(a, 0) / self.verify_cost(1)
        for k in range(1, limit + 1):
            rate = expected_tokens(a, k) / (k * self.draft_s + self.verify_cost(k + 1))
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
            per_token = draft_s / drafted
            self.draft_s = (
                per_token if self.draft_s == 0.0 else w * self.draft_s + self.alpha * per_token
            )
        n = drafted + 1
        old = self.verify_s.get(n)
        self.verify_s[n] = verify_s if old is None else w * old + self.alpha * verify_s


def _bracket(known: list[tuple[int, float]], n: int) -> tuple[tuple[int, float], tuple[int, float]]:
    for i in range(1, len(known)):
        if known[i][0] >= n:
            return known[i - 1], known[i]
    return known[-2], known[-1]


def make_policy(name: str, n_max: int) -> FixedPolicy | AdaptivePolicy:
    return AdaptivePolicy(n_max) if name == "adaptive" else FixedPolicy(n_max)
