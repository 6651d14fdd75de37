"""What a second box buys: part of a split target (llama.cpp --rpc), or a draft node.

A target split by layers over two boxes computes its layers one box after the other, so
for one stream the split buys memory, not speed: a decode of n tokens costs t_v(n) plus
the link (`round_trips` waits of one RTT, the boundary activations there and back,
2 n n_embd `act_bytes`, and `graph_bytes` of graph description). `plan` therefore answers
what the second box gives as a draft node if the target fits on the first, and what a split
target (an ordinary target of that speed and curve) gives with a draft node on a third.
The link figures are inputs, not measurements; docs/planner.md has the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specwire.policy.throughput import PlanInputs, VerifyCurve


@dataclass(frozen=True, slots=True)
class RpcLink:
    """The split target's link, per decode (see the module's docstring)."""

    n_embd: int
    round_trips: float = 2.0
    act_bytes: int = 4
    graph_bytes: int = 0

    def __post_init__(self) -> None:
        if self.n_embd < 1:
            raise ValueError(f"n_embd: must be >= 1, got {self.n_embd}")
        if not 0.0 <= self.round_trips < math.inf:
            raise ValueError(f"round_trips: must be >= 0, got {self.round_trips}")
        if self.act_bytes < 1 or self.graph_bytes < 0:
            raise ValueError("act_bytes must be >= 1 and graph_bytes >= 0")

    def bytes(self, n: int) -> int:
        """Bytes over the LAN for a decode of n tokens."""
        return 2 * n * self.n_embd * self.act_bytes + self.graph_bytes

    def link_s(self, p: PlanInputs, n: int) -> float:
        """The link's share of a decode of n tokens: waits plus bytes at the bandwidth."""
        wire = 0.0 if math.isinf(p.bandwidth_bps) else 8.0 * self.bytes(n) / p.bandwidth_bps
        return self.round_trips * p.rtt_s + wire


def split_step_s(p: PlanInputs, link: RpcLink, n: int) -> float:
    """A decode of n tokens on the split target: t_v(n) of compute plus the link."""
    return p.verify_s(n) + link.link_s(p, n)


def split_inputs(p: PlanInputs, link: RpcLink) -> PlanInputs:
    """The split target as a target of its own: its plain speed and its verification
    curve (a batch's tokens share the link's waits but each carries its own
    activations, so the curve can be flatter or steeper than on one box)."""
    step = split_step_s(p, link, 1)
    points = tuple((n, split_step_s(p, link, n) / step) for n in range(1, p.draft_max + 2))
    return replace(p, target_tps=1.0 / step, verify=VerifyCurve(points, assumed=p.verify.assumed))


@dataclass(frozen=True, slots=True)
class SecondBox:
    """The two uses of a second box, in tokens/s of one stream."""

    link: RpcLink
    one_box_tps: float        # the target alone on one box (if it fits)
    split_tps: float          # the split target alone
    split_link_s: float       # the link's share of one plain decode of the split target
    split_bytes: int          # bytes over the LAN per plain decode
    draft_node: tuple[str, int, float]     # target on box 1, draft node on box 2
    split_drafted: tuple[str, int, float]  # split target, a draft node on a third box

    def to_dict(self) -> dict:
        return {"n_embd": self.link.n_embd, "round_trips": self.link.round_trips,
                "act_bytes": self.link.act_bytes, "graph_bytes": self.link.graph_bytes,
                "one_box_tps": self.one_box_tps, "split_tps": self.split_tps,
                "split_link_s": self.split_link_s, "split_bytes": self.split_bytes,
                "draft_node": dict(zip(("mode", "k", "tokens_per_s"), self.draft_node,
                                       strict=True)),
                "split_with_draft_node": dict(zip(("mode", "k", "tokens_per_s"),
                                                  self.split_drafted, strict=True))}

    def verdict(self) -> str:
        mode, k, tps = self.draft_node
        one = self.one_box_tps
        return (f"a split never speeds one stream up (its layers run one box after the other: "
                f"{self.split_tps:.2f} against {one:.2f} tokens/s on one box); it is for a "
                f"target that does not fit one box, where a draft node on a third box gives "
                f"{self.split_drafted[2]:.2f}. If the target fits on one box, the second box "
                f"as a draft node gives {tps:.2f} tokens/s ({tps / one:.2f}x, {mode} k={k})")


def compare(p: PlanInputs, link: RpcLink) -> SecondBox:
    """Both uses of the second box at their best modes and draft lengths."""
    from specwire.policy.plan import plan

    def best(result) -> tuple[str, int, float]:   # noqa: ANN001 - a Plan
        name = max(("synchronous", "pipelined"), key=lambda m: result.modes[m].tokens_per_s)
        m = result.modes[name]
        return name, m.k, m.tokens_per_s

    split = split_inputs(p, link)
    return SecondBox(link, p.target_tps, split.target_tps, link.link_s(p, 1), link.bytes(1),
                     best(plan(p)), best(plan(split)))
