"""Whether a tree pays: its extra tokens priced on the verification curve.

A tree verifies side branches beside the chain in the same decode (sample/tree.py).
Its extra tokens make the decode longer, by what the policy's measured curve says a
decode of that size costs; they pay back with the tokens the branches add when one
is taken. A branch token is worth what a token costs at the round's expected rate,
and how many tokens a branch token adds is learnt from the trees verified so far
(`TreeYield`). Where the curve is flat (a memory-bound target) nearly any tree pays;
where every token costs (a compute-bound one) only branches that are often taken do.
"""

from __future__ import annotations

from dataclasses import dataclass

from specwire.policy.adaptive import AdaptivePolicy, Policy


@dataclass(slots=True)
class TreeYield:
    """Tokens gained per side-branch token verified, exponentially weighted. The prior
    (gained / sent) is optimistic, so that trees are tried and measured."""

    gained: float = 1.0
    sent: float = 4.0
    alpha: float = 0.1
    rounds: int = 0   # trees verified
    taken: int = 0    # ... whose kept path ended in a side branch

    @property
    def per_token(self) -> float:
        return self.gained / self.sent if self.sent else 0.0

    def observe(self, sent: int, gained: int) -> None:
        """A tree of `sent` side-branch tokens; `gained` of them were kept."""
        w = 1.0 - self.alpha
        self.gained = w * self.gained + gained
        self.sent = w * self.sent + sent
        self.rounds += 1
        self.taken += gained > 0


def tree_pays(policy: Policy, chain: int, extra: int, tree_yield: TreeYield,
              gain: float | None = None) -> bool:
    """Verify `extra` side-branch tokens beside a chain of `chain` draft tokens: whether
    the tokens they are expected to add (`gain`, where the drafter estimated it, as the
    hybrid does for its second candidate; else the learnt yield per branch token) are
    worth more than the longer decode. A fixed policy has no curve: the tree is sent as
    the drafter made it."""
    if extra <= 0:
        return False
    if not isinstance(policy, AdaptivePolicy):
        return True
    n = chain + 1
    cost_s = policy.verify_cost(n + extra) - policy.verify_cost(n)
    rate = policy.rate(chain)
    if rate <= 0.0:
        return False
    added = tree_yield.per_token * extra if gain is None else gain
    return added / rate > cost_s
