"""Will a draft pay, and with how many tokens per round? The planner.

`specwire plan` and the benchmarks predict a configuration before loading a model: each
mode of the throughput model (policy/throughput.py, the adaptive policy's priors) at its
best draft length by brute force (`best_k`), beside a free and instant drafter
(`free_bound`), and the closed form of the simple model through the lower branch of
Lambert W (`tkslt_k_star`). The verification cost decides many plans, and only a measured
--verify-cost tells it for an MoE target (docs/planner.md works a published case).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specwire.policy.throughput import (
    RATE_FNS,
    PlanInputs,
    RateFn,
    batched,
    expected_tokens,
    free_rate,
    plain_rate,
)

#: The brute-force search range of the full model.
SEARCH_K_MAX = 64
MODES = ("plain", "local", "synchronous", "pipelined")


def free_bound(p: PlanInputs) -> ModePlan:
    """The free drafter at its best k in 0..draft_max (k = 0: plain, when no draft pays)."""
    k, rate = best_k(free_rate, p, k_min=0)
    return ModePlan(k, rate, rate / plain_rate(p))


def best_k(rate: RateFn, p: PlanInputs, k_min: int = 1, k_max: int | None = None
           ) -> tuple[int, float]:
    """Brute force: the k in [k_min, k_max] with the highest rate (smallest on ties)."""
    k_max = p.draft_max if k_max is None else k_max
    best = (k_min, rate(p, k_min))
    for k in range(k_min + 1, k_max + 1):
        r = rate(p, k)
        if r > best[1] * (1.0 + 1e-12):
            best = (k, r)
    return best


# --------------------------------------------------------------------------- TK-SLT closed form


def tkslt_speedup(a: float, cost: float, k: int) -> float:
    """S(k) = (1 - a^(k+1)) / ((1 - a)(1 + kL)): the simple model's speedup."""
    return expected_tokens(a, k) / (1.0 + k * cost)


def tkslt_k_real(a: float, cost: float) -> float:
    """The real stationary point of S(k); -inf/inf at the degenerate ends.

    With b = -ln a, dS/dk = 0 reads e^(-b(k+1)) (b (1 + kL) + L) = L.
    Putting z = -(b (1 + kL) + L) / L turns it into z e^z = -e^(b - 1 - b/L),
    so k = -(W(-e^(b - 1 - b/L)) + 1) / b - 1/L. For L < 1 the argument lies
    in [-1/e, 0); the principal branch gives k <= -1/L < 0, so the maximum
    is on the lower branch W_{-1}. For L >= 1 a draft never pays.
    """
    if cost >= 1.0 or a <= 0.0:
        return -math.inf
    if a >= 1.0:
        return math.inf
    b = -math.log(a)
    w = _wm1_of_neg_exp(b - 1.0 - b / cost)
    return -(w + 1.0) / b - 1.0 / cost


def tkslt_k_star(a: float, cost: float, k_max: int = SEARCH_K_MAX) -> int:
    """The best integer draft length of the simple model, 0 when S <= 1.

    S is unimodal in k, so the best integer is a neighbour of the real
    stationary point; the better of the two is taken, clamped to [0, k_max].
    """
    k_real = tkslt_k_real(a, cost)
    if k_real <= 0.0:
        return 0
    lo = k_max if math.isinf(k_real) else min(math.floor(k_real), k_max)
    hi = min(lo + 1, k_max)
    k = hi if tkslt_speedup(a, cost, hi) > tkslt_speedup(a, cost, lo) * (1 + 1e-12) else lo
    return k if tkslt_speedup(a, cost, k) > 1.0 else 0


def _wm1_of_neg_exp(c: float) -> float:
    """W_{-1}(-e^c) for c <= -1, also where e^c underflows (a long cheap draft).

    In log form W_{-1} solves w + ln(-w) = c; far from the branch point
    (w << -1) Newton on that converges in a few steps from c - ln(-c).
    """
    if c > -700.0:
        return lambert_w(-math.exp(min(c, -1.0)), -1)
    w = c - math.log(-c)
    for _ in range(50):
        step = (w + math.log(-w) - c) / (1.0 + 1.0 / w)
        w -= step
        if abs(step) <= 1e-15 * abs(w):
            break
    return w


def lambert_w(x: float, branch: int = 0) -> float:
    """Lambert W: the w with w e^w = x, on branch 0 (w >= -1) or -1 (w <= -1).

    Real branches only: W0 on [-1/e, inf), W_{-1} on [-1/e, 0). Halley's
    iteration from a series guess (near the branch point) or the asymptotic
    logarithms (elsewhere), to full double precision.
    """
    if branch not in (0, -1):
        raise ValueError(f"branch must be 0 or -1, got {branch}")
    x_min = -1.0 / math.e
    if math.isnan(x) or x < x_min - 1e-15 or (branch == -1 and x >= 0.0):
        raise ValueError(f"W_{branch}({x}) is not real")
    if x <= x_min:
        return -1.0
    if x == 0.0:
        return 0.0
    if math.isinf(x):
        return math.inf
    w = _w_guess(x, branch)
    for _ in range(100):
        ew = math.exp(w)
        f = w * ew - x
        if f == 0.0 or w == -1.0:
            break
        step = f / (ew * (w + 1.0) - (w + 2.0) * f / (2.0 * w + 2.0))
        w -= step
        if abs(step) <= 4e-16 * (1.0 + abs(w)):
            break
    return w


def _w_guess(x: float, branch: int) -> float:
    if x < -0.25:                                   # near the branch point -1/e
        q = math.sqrt(max(2.0 * (math.e * x + 1.0), 0.0))
        return -1.0 + q - q * q / 3.0 if branch == 0 else -1.0 - q - q * q / 3.0
    if branch == -1:
        l1 = math.log(-x)
        l2 = math.log(-l1)
        return l1 - l2 + l2 / l1
    if x < 3.0:
        return math.log1p(x) * (1.0 - math.log1p(math.log1p(x)) / (2.0 + math.log1p(x)))
    l1 = math.log(x)
    l2 = math.log(l1)
    return l1 - l2 + l2 / l1


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class ModePlan:
    """One deployment at its best draft length."""

    k: int
    tokens_per_s: float
    speedup: float


@dataclass(frozen=True, slots=True)
class ClosedForm:
    """TK-SLT's answer for the simple model (verify = 1 step, no round trip)."""

    cost: float
    k_real: float
    k: int
    speedup: float


@dataclass(frozen=True, slots=True)
class Plan:
    inputs: PlanInputs
    modes: dict[str, ModePlan]   # tokens/s of all `parallel` requests together
    closed_form: ClosedForm
    verdict: str
    bound: ModePlan | None = None  # a free, instant drafter at the same acceptance
    parallel: int = 1   # requests decoding together (serve -np), each mode's rate summed

    def to_dict(self) -> dict:
        """JSON-ready; infinities become null."""
        p = self.inputs
        return {
            "inputs": {
                "target_tps": p.target_tps, "draft_tps": p.draft_tps,
                "acceptance": p.acceptance, "rtt_s": p.rtt_s,
                "bandwidth_bps": _finite(p.bandwidth_bps),
                "draft_bytes": p.draft_bytes, "verdict_bytes": p.verdict_bytes,
                "verify_cost": [list(pt) for pt in p.verify.points],
                "verify_cost_assumed": p.verify.assumed, "draft_max": p.draft_max,
                "prompt_tokens": p.prompt_tokens, "reply_tokens": p.reply_tokens,
                "draft_prompt_tps": p.draft_prompt_tps or None,
                "target_prompt_tps": p.target_prompt_tps or None,
            },
            "modes": {name: {"k": m.k, "tokens_per_s": m.tokens_per_s, "speedup": m.speedup}
                      for name, m in self.modes.items()},
            "closed_form": {"L": self.closed_form.cost, "k_real": _finite(self.closed_form.k_real),
                            "k": self.closed_form.k, "speedup": self.closed_form.speedup},
            "verdict": self.verdict,
            "parallel": self.parallel,
            "bound": None if self.bound is None else {
                "k": self.bound.k, "tokens_per_s": self.bound.tokens_per_s,
                "speedup": self.bound.speedup,
                "share": {name: m.tokens_per_s / self.bound.tokens_per_s
                          for name, m in self.modes.items()}},
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def plan(p: PlanInputs, parallel: int = 1) -> Plan:
    """Every mode at its best k in 1..draft_max, the closed form, and a verdict; for
    `parallel` requests decoding together (throughput.batched), their summed rates."""
    if parallel < 1:
        raise ValueError(f"parallel: must be >= 1, got {parallel}")
    q = batched(p, parallel)
    plain = parallel * plain_rate(q)
    modes = {"plain": ModePlan(0, plain, 1.0)}
    for name, fn in RATE_FNS.items():
        k, rate = best_k(fn, q)
        modes[name] = ModePlan(k, parallel * rate, parallel * rate / plain)
    cost = q.draft_cost()
    k_cf = tkslt_k_star(q.acceptance, cost, SEARCH_K_MAX)
    closed = ClosedForm(cost, tkslt_k_real(q.acceptance, cost), k_cf,
                        tkslt_speedup(q.acceptance, cost, k_cf))
    bound = free_bound(q)
    bound = ModePlan(bound.k, parallel * bound.tokens_per_s, bound.speedup)
    return Plan(p, modes, closed, verdict(modes), bound, parallel)


def verdict(modes: dict[str, ModePlan]) -> str:
    """Plain English on the remote modes (the point of specwire), local for comparison."""
    name = max(("synchronous", "pipelined"), key=lambda m: modes[m].speedup)
    best = modes[name]
    local = modes["local"]
    aside = f" (a draft in the target's process: {local.speedup:.2f}x with k={local.k})"
    if best.speedup < 1.0 - 1e-9:
        return (f"speculation would be slower than plain decoding ({best.speedup:.2f}x at best)"
                f"; run without a draft{aside}")
    if best.speedup < 1.02:
        return (f"speculation would gain nothing measurable ({best.speedup:.2f}x at best)"
                f"; run without a draft{aside}")
    if best.speedup < 1.10:
        return f"speculation pays a little: {best.speedup:.2f}x with k={best.k} ({name}){aside}"
    return f"speculation pays: {best.speedup:.2f}x with k={best.k} ({name}){aside}"
