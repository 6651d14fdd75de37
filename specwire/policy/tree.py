"""Whether a tree pays: its extra tokens priced on the verification curve.

A tree verifies side branches beside the chain in the same decode (sample/tree.py).
Its extra tokens make the decode longer, by what the policy's measured curve says a
decode of that size costs; they pay back with the tokens the branches add when one
is taken. A branch token is worth what a token costs at the round's expected rate,
and how many tokens a branch token adds is learnt from the trees verified so far
(`TreeYield`). Where the curve is flat (a memory-bound target) nearly any tree pays;
where every token costs (a compute-bound one, or a MoE whose batch reads more experts)
only branches that are often taken do. The curve is the engine's for every policy: a
fixed draft length fixes the chain, not whether its side branches are worth a decode.
"""

from __future__ import annotations

from dataclasses import dataclass

from specwire.policy.adaptive import AdaptivePolicy, Policy
from specwire.policy.costs import VerifyCost


@dataclass(slots=True)
class TreeYield:
    """Tokens gained per side-branch token verified, exponentially weighted. The prior
    (gained / sent) is optimistic, so that trees are tried and measured."""

    gained: float = 1.0
    sent: float = 4.0
    alpha: float = 0.1
    rounds: int = 0   # trees verified
    taken: int = 0    # ... whose kept path ended in a side branch
    #: the draft rounds' tokens kept and their seconds (drafting and decoding),
    #: exponentially weighted: what a token is worth where the policy has no model of its
    #: own rate (fixed)
    kept: float = 0.0
    seconds: float = 0.0

    @property
    def per_token(self) -> float:
        return self.gained / self.sent if self.sent else 0.0

    @property
    def rate(self) -> float:
        """Tokens per second of the draft rounds measured so far (0 before any)."""
        return self.kept / self.seconds if self.seconds > 0.0 else 0.0

    def observe_round(self, kept: int, seconds: float) -> None:
        """A draft round (chain or tree) kept `kept` tokens in `seconds`, its wait for the
        draft and its decode."""
        w = 1.0 - self.alpha
        self.kept = w * self.kept + kept
        self.seconds = w * self.seconds + seconds

    def observe(self, sent: int, gained: int) -> None:
        """A tree of `sent` side-branch tokens; `gained` of them were kept."""
        w = 1.0 - self.alpha
        self.gained = w * self.gained + gained
        self.sent = w * self.sent + sent
        self.rounds += 1
        self.taken += gained > 0


def tree_pays(policy: Policy, costs: VerifyCost | None, chain: int, extra: int,
              tree_yield: TreeYield, gain: float | None = None) -> bool:
    """Verify `extra` side-branch tokens beside a chain of `chain` draft tokens: whether
    the tokens they are expected to add (`gain`, where the drafter estimated it, as the
    hybrid does for its second candidate; else the learnt yield per branch token) are
    worth more than the longer decode. An adaptive policy prices them on its curve and
    its expected rate; any other on the engine's measured curve (`costs`) and the rate
    its draft rounds made, and tries the tree while either is still unmeasured."""
    if extra <= 0:
        return False
    n = chain + 1
    added = tree_yield.per_token * extra if gain is None else gain
    if isinstance(policy, AdaptivePolicy):
        cost_s = policy.verify_cost(n + extra) - policy.verify_cost(n)
        rate = policy.rate(chain)
        return rate > 0.0 and added / rate > cost_s
    base = None if costs is None else costs.seconds(n)   # None: no decode measured yet
    if base is None or tree_yield.rate <= 0.0:
        return True
    return added / tree_yield.rate > costs.seconds(n + extra) - base
