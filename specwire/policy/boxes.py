"""One box or two: does a draft node pay against speculation in the target's process?

The user's question, answered from the planner's model (policy/throughput.py): one box is
the target with its draft in the same process (or plain decoding, where that is faster);
two boxes add a draft node, with the draft's speed on its own box, drafting synchronously
or pipelined (or not at all, where neither pays). Both sides are priced for the same
request (its prompt, which the draft reads first, and its reply), and the verdict comes
with the range that the acceptance's uncertainty gives it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specwire.policy.plan import best_k
from specwire.policy.throughput import (
    PlanInputs,
    batched,
    local_rate,
    pipelined_rate,
    plain_rate,
    sync_rate,
)

#: Below this gain either way the verdict says the two are even.
EVEN = 0.02
#: What a mode must gain over plain decoding to be run at all.
GAINS = 0.001
#: The z of the acceptance's range: a 90% interval.
Z90 = 1.645


@dataclass(frozen=True, slots=True)
class Side:
    """One side of the comparison at its best: mode, draft length and tokens/s."""

    mode: str
    k: int
    tokens_per_s: float


@dataclass(frozen=True, slots=True)
class Boxes:
    """One box against two, at the acceptance and at both ends of its range."""

    one: Side
    two: Side
    acceptance: tuple[float, float, float]   # one box's (low, estimate, high)
    gain: tuple[float, float, float]         # two / one - 1 at each

    def verdict(self) -> str:
        lo, mid, hi = self.gain
        span = (f" ({_pct(min(self.gain))} to {_pct(max(self.gain))} over the acceptance's "
                "90% range)" if self.gain[0] != self.gain[2] else
                " (no range: give the acceptance as ACCEPTED/DRAFTED)")
        if mid > EVEN:
            head = f"a draft node pays, by {_pct(mid)}"
        elif mid < -EVEN:
            head = f"a draft node does not pay: one box is faster by {_pct(1 / (1 + mid) - 1)}"
        else:
            head = f"a draft node does not pay: even ({_pct(mid)})"
        sure = len({g > EVEN for g in self.gain}) == 1
        return head + span + ("" if sure else "; the range holds both answers: "
                              "measure the acceptance on more tokens")

    def to_dict(self) -> dict:
        return {"one_box": _side(self.one), "two_boxes": _side(self.two),
                "acceptance": list(self.acceptance), "gain": list(self.gain),
                "verdict": self.verdict()}


def one_box(p: PlanInputs) -> Side:
    """The target's box alone: its draft in the same process, or plain decoding."""
    k, rate = best_k(local_rate, p)
    plain = plain_rate(p)
    return Side("local", k, rate) if rate > plain * (1.0 + GAINS) else Side("plain", 0, plain)


def two_boxes(p: PlanInputs) -> Side:
    """The target and a draft node (p's draft speed is the node's): the better of its
    modes, or plain decoding where neither pays."""
    best = Side("plain", 0, plain_rate(p))
    for mode, fn in (("synchronous", sync_rate), ("pipelined", pipelined_rate)):
        k, rate = best_k(fn, p)
        if rate > best.tokens_per_s * (1.0 + GAINS):
            best = Side(mode, k, rate)
    return best


def compare(one: PlanInputs, two: PlanInputs, one_range: tuple[float, float] | None = None,
            two_range: tuple[float, float] | None = None, parallel: int = 1) -> Boxes:
    """one: the figures with the draft in the target's process; two: with the draft on its
    own box (its speed there, its acceptance there, the link). one_range/two_range: the
    acceptances' ranges (None: none); the ends are taken together, low with low.
    parallel: requests decoding together (throughput.batched); the sides' summed rates."""
    lo1, hi1 = one_range or (one.acceptance, one.acceptance)
    lo2, hi2 = two_range or (two.acceptance, two.acceptance)
    pairs = ((lo1, lo2), (one.acceptance, two.acceptance), (hi1, hi2))
    one, two = batched(one, parallel), batched(two, parallel)
    sides = [(one_box(replace(one, acceptance=x)), two_boxes(replace(two, acceptance=y)))
             for x, y in pairs]
    gains = tuple(t.tokens_per_s / o.tokens_per_s - 1.0 for o, t in sides)
    o, t = sides[1]
    return Boxes(replace(o, tokens_per_s=parallel * o.tokens_per_s),
                 replace(t, tokens_per_s=parallel * t.tokens_per_s),
                 (lo1, one.acceptance, hi1), gains)


def acceptance_range(accepted: int, drafted: int, z: float = Z90) -> tuple[float, float]:
    """The Wilson interval of accepted / drafted: a binomial's, so a lower bound on the
    true spread (a draft's tokens are judged in runs, not one by one)."""
    if drafted <= 0:
        return 0.0, 1.0
    p = accepted / drafted
    d = 1.0 + z * z / drafted
    centre = (p + z * z / (2 * drafted)) / d
    half = z * math.sqrt(p * (1 - p) / drafted + z * z / (4 * drafted * drafted)) / d
    return max(0.0, centre - half), min(1.0, centre + half)


def _side(s: Side) -> dict:
    return {"mode": s.mode, "k": s.k, "tokens_per_s": s.tokens_per_s}


def _pct(x: float) -> str:
    return f"{100 * x:+.0f}%" if abs(x) >= 0.005 else "0%"
