"""Will a draft pay, and with how many tokens per round? The planning model.

Everything here is arithmetic on a handful of measured figures, so that
`specwire plan`, the benchmarks and the adaptive policy can predict a
configuration before loading a model:

    a       per-token acceptance (the chance the next draft token is kept)
    t_s     one plain target step, 1 / target tokens per second
    t_d     one draft token, 1 / draft tokens per second
    t_v(n)  the target evaluating a batch of n = k + 1 tokens, in plain steps
            (`VerifyCurve`); without a measurement we ASSUME
            t_v(n) = t_s * (1 + 0.05 (n - 1)): a memory-bound target reads its
            weights once per batch, so a small batch costs little more than a
            step. On a CPU with a huge vocabulary, or an MoE target whose batch
            touches more experts, it costs much more: measure it.
    RTT     network round trip; bandwidth with 16 bytes per drafted token and
            32 bytes per verdict (both adjustable).

A round with k draft tokens yields E(k) = (1 - a^(k+1)) / (1 - a) tokens
(`specwire.policy.expected_tokens`). The modes differ in what a round costs
and in what follows a rejected draft; see `sync_rate`, `local_rate` and
`pipelined_rate` (whose docstring states the overlap model and why it never
drops below the plain rate for round-trip reasons). `tkslt_k_star` is
the closed form of the simple model (verification costs one step, no round
trip), through the lower branch of Lambert W (`lambert_w`).

The external case in FIELD.md (Qwen3-Coder-480B at 6.60 tokens/s, a 30B-A3B
draft in the same process, 810 of 1093 drafts accepted, 7.81 tokens/s) is
worked through in tests/test_plan.py. The model reproduces it (1.16x) with a
draft of 30 tokens/s and a batch of 8 costing 3 plain steps: an MoE target's
batch routes its tokens to different experts, so it reads several times the
weights of one step, and a 30B-A3B draft sharing the box is not cheap
(L = t_d / t_s = 0.22). With the default, nearly free verification the same
draft would predict 1.5x; the gap is the verification cost, and only a
measured --verify-cost tells.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from specwire.policy import expected_tokens

#: Assumed extra cost of each further token in a verification batch, in plain steps.
DEFAULT_VERIFY_SLOPE = 0.05
DEFAULT_DRAFT_BYTES = 16
DEFAULT_VERDICT_BYTES = 32
#: The brute-force search range of the full model.
SEARCH_K_MAX = 64
MODES = ("plain", "local", "synchronous", "pipelined")


# --------------------------------------------------------------------------- verify cost


@dataclass(frozen=True, slots=True)
class VerifyCurve:
    """t_v(n) in plain steps, through measured points (n, cost).

    Linear between points and linear beyond the last two, because a batch's
    cost grows about linearly once it is compute-bound; n = 1 is a plain step
    (cost 1) unless a point says otherwise.
    """

    points: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.0 + DEFAULT_VERIFY_SLOPE))
    assumed: bool = True

    @classmethod
    def parse(cls, text: str) -> VerifyCurve:
        """'1:1,8:1.3' -> points; ValueError with the reason on bad input."""
        pts: dict[int, float] = {}
        for item in text.split(","):
            n_s, sep, c_s = item.strip().partition(":")
            if not sep:
                raise ValueError(f"{item.strip()!r} is not N:COST (e.g. 8:1.3)")
            try:
                n, cost = int(n_s), float(c_s)
            except ValueError:
                raise ValueError(f"{item.strip()!r} is not N:COST (e.g. 8:1.3)") from None
            if n < 1 or not (0.0 < cost < math.inf):
                raise ValueError(f"{item.strip()!r}: N must be >= 1 and COST > 0")
            if n in pts:
                raise ValueError(f"batch size {n} given twice")
            pts[n] = cost
        pts.setdefault(1, 1.0)
        if len(pts) < 2:
            raise ValueError("give at least one batch size besides 1 (e.g. 1:1,8:1.3)")
        return cls(tuple(sorted(pts.items())), assumed=False)

    def cost(self, n: int) -> float:
        """t_v(n) / t_s, kept positive however steeply the points fall."""
        pts = self.points
        lo, hi = pts[-2], pts[-1]
        for i in range(1, len(pts)):
            if pts[i][0] >= n:
                lo, hi = pts[i - 1], pts[i]
                break
        (n0, c0), (n1, c1) = lo, hi
        return max(c0 + (c1 - c0) * (n - n0) / (n1 - n0), 1e-6)

    def describe(self) -> str:
        if self.assumed:
            return (f"t_v(n) = 1 + {DEFAULT_VERIFY_SLOPE:g} (n-1) plain steps "
                    "(assumed; measure it and pass --verify-cost)")
        return "t_v(n) through " + ", ".join(f"{n}:{c:g}" for n, c in self.points) + " plain steps"


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, slots=True)
class PlanInputs:
    """The measured figures; times in seconds, bandwidth in bits/s (inf: free)."""

    target_tps: float
    draft_tps: float
    acceptance: float
    rtt_s: float = 0.0
    bandwidth_bps: float = math.inf
    draft_bytes: int = DEFAULT_DRAFT_BYTES
    verdict_bytes: int = DEFAULT_VERDICT_BYTES
    verify: VerifyCurve = field(default_factory=VerifyCurve)
    draft_max: int = 16
    #: draft evaluations per round beyond its k tokens (bench: the share of rounds
    #: a draft model ended at --draft-p-min, having evaluated the declined position)
    stop_evals: float = 0.0

    def __post_init__(self) -> None:
        _need(0.0 < self.target_tps < math.inf, "target_tps", "must be > 0")
        _need(0.0 < self.draft_tps < math.inf, "draft_tps", "must be > 0")
        _need(0.0 <= self.acceptance <= 1.0, "acceptance", "must be in [0, 1]")
        _need(0.0 <= self.rtt_s < math.inf, "rtt_s", "must be >= 0")
        _need(self.bandwidth_bps > 0.0, "bandwidth_bps", "must be > 0")
        _need(self.draft_bytes >= 0 and self.verdict_bytes >= 0, "bytes", "must be >= 0")
        _need(1 <= self.draft_max <= 256, "draft_max", "must be in [1, 256]")
        _need(0.0 <= self.stop_evals <= 1.0, "stop_evals", "must be in [0, 1]")

    @property
    def t_s(self) -> float:
        return 1.0 / self.target_tps

    @property
    def t_d(self) -> float:
        return 1.0 / self.draft_tps

    def verify_s(self, n: int) -> float:
        """Seconds to evaluate a batch of n tokens on the target."""
        return self.t_s * self.verify.cost(n)

    def transfer_s(self, k: int) -> float:
        """Serialisation time of k draft tokens and one verdict on the link."""
        return 8.0 * (k * self.draft_bytes + self.verdict_bytes) / self.bandwidth_bps

    def draft_cost(self) -> float:
        """TK-SLT's L: one draft token, computed and sent, in target steps."""
        return (self.t_d + 8.0 * self.draft_bytes / self.bandwidth_bps) / self.t_s

    def local(self) -> PlanInputs:
        """The same figures with the drafter in-process: no round trip, no link."""
        return replace(self, rtt_s=0.0, bandwidth_bps=math.inf)


def _need(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {msg}")


# --------------------------------------------------------------------------- the modes


def plain_rate(p: PlanInputs) -> float:
    """Tokens/s without a draft: one token per plain step."""
    return p.target_tps


def sync_round_s(p: PlanInputs, k: int) -> float:
    """One synchronous round: draft k, ship them, verify k + 1, ship the verdict.

    Nothing overlaps: the target waits for the draft and the drafter for the
    verdict. k = 0 is a plain step (no drafter is asked, nothing is sent).
    """
    if k == 0:
        return p.t_s
    return (k + p.stop_evals) * p.t_d + p.verify_s(k + 1) + p.rtt_s + p.transfer_s(k)


def sync_rate(p: PlanInputs, k: int) -> float:
    """Tokens/s of synchronous remote drafting; can be below the plain rate."""
    return expected_tokens(p.acceptance, k) / sync_round_s(p, k)


def local_rate(p: PlanInputs, k: int) -> float:
    """Draft model in the target's process: synchronous, no round trip, no link."""
    return sync_rate(p.local(), k)


def pipelined_rate(p: PlanInputs, k: int) -> float:
    """Tokens/s when the remote drafter works ahead while the target verifies.

    Model (assumptions stated so the prediction can be argued with):

    * While the target verifies d1..dk (t_v(k+1)) the drafter assumes they
      will all be kept and goes on drafting: its next token is its guess for
      the target's bonus token, then k more. That run-ahead draft is valid
      with probability h = a^(k+1) (all k kept and the bonus guessed); it
      needs supply = (k+1) t_d + transfer, so after a hit the target waits
      max(0, supply - t_v(k+1)). The round trip is hidden on hits.
    * After a miss the drafter hears the verdict RTT/2 later and restarts
      from the corrected token. The target chooses the better of two
      fixed strategies, whichever gives the higher long-run rate:
      - wait: idle RTT + k t_d + transfer for a fresh draft (what a fast
        drafter on a short link wants);
      - race (`race_plain_s`): decode plainly meanwhile, never idle, and
        resume verifying once the drafter has caught up and its tokens
        agreed with the plain ones. The race phase runs at the plain rate.
    * Rounds form a renewal process: rate = E[tokens] / E[time] per round.

    Because the race strategy never waits for the network and only verifies
    a draft that has already matched the target's own tokens, round trips and
    a slow or useless drafter cannot push it below the plain rate; only a
    verification that costs more than the tokens it yields can
    (E(k) t_s < max(t_v(k+1), supply)), and then the best k is 0: no draft.
    """
    return max(pipelined_rates(p, k).values())


def pipelined_rates(p: PlanInputs, k: int) -> dict[str, float]:
    """Tokens/s of the two miss strategies of `pipelined_rate`: 'wait' and 'race'."""
    if k == 0:
        return {"wait": plain_rate(p), "race": plain_rate(p)}
    a, t_v = p.acceptance, p.verify_s(k + 1)
    tokens = expected_tokens(a, k)
    hit = a ** (k + 1)
    hit_wait = max(0.0, (k + 1) * p.t_d + p.transfer_s(k) - t_v)
    busy = t_v + hit * hit_wait
    waiting = tokens / (busy + (1.0 - hit) * (p.rtt_s + k * p.t_d + p.transfer_s(k)))
    race = race_plain_s(p, k)
    if math.isinf(race):
        racing = plain_rate(p)
    else:
        racing = (tokens + (1.0 - hit) * race / p.t_s) / (busy + (1.0 - hit) * race)
    return {"wait": waiting, "race": racing}


def race_plain_s(p: PlanInputs, k: int) -> float:
    """Expected plain-decoding time after a miss until a usable draft is ready.

    The target steps plainly (token i done at i t_s); the restarted drafter's
    token i reaches it at RTT + i t_d + transfer. Verification can resume at
    position j once draft tokens j+1..j+k have arrived by j t_s, i.e.
    j = ceil((RTT + k t_d + transfer) / (t_s - t_d)); and the draft's first j
    tokens must equal the plain ones (probability a^j). A mismatch at i
    restarts the race from i. Solving P = sum_i a^(i-1)(1-a)(i t_s + P)
    + a^j j t_s gives P = t_s (1 - a^j) / ((1 - a) a^j). Infinite when the
    drafter is no faster than the target or can never agree.
    """
    a = p.acceptance
    if p.t_d >= p.t_s:
        return math.inf
    j = math.ceil((p.rtt_s + k * p.t_d + p.transfer_s(k)) / (p.t_s - p.t_d) - 1e-12)
    if j <= 0 or a >= 1.0:
        return 0.0
    agree = a ** j
    if agree <= 0.0:
        return math.inf
    return p.t_s * (1.0 - agree) / ((1.0 - a) * agree)


def free_rate(p: PlanInputs, k: int) -> float:
    """Tokens/s of a free and instant drafter at acceptance a: a round is only its
    verification, t_v(k + 1). No drafter with the same acceptance can beat it on this
    target, so a configuration's share of it says what drafting costs and what is left."""
    return expected_tokens(p.acceptance, k) / p.verify_s(k + 1)


def free_bound(p: PlanInputs) -> ModePlan:
    """The free drafter at its best k in 0..draft_max (k = 0: plain, when no draft pays)."""
    k, rate = best_k(free_rate, p, k_min=0)
    return ModePlan(k, rate, rate / plain_rate(p))


RateFn = Callable[[PlanInputs, int], float]

RATE_FNS: dict[str, RateFn] = {
    "local": local_rate,
    "synchronous": sync_rate,
    "pipelined": pipelined_rate,
}


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
    modes: dict[str, ModePlan]
    closed_form: ClosedForm
    verdict: str
    bound: ModePlan | None = None  # a free, instant drafter at the same acceptance

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
            },
            "modes": {name: {"k": m.k, "tokens_per_s": m.tokens_per_s, "speedup": m.speedup}
                      for name, m in self.modes.items()},
            "closed_form": {"L": self.closed_form.cost, "k_real": _finite(self.closed_form.k_real),
                            "k": self.closed_form.k, "speedup": self.closed_form.speedup},
            "verdict": self.verdict,
            "bound": None if self.bound is None else {
                "k": self.bound.k, "tokens_per_s": self.bound.tokens_per_s,
                "speedup": self.bound.speedup,
                "share": {name: m.tokens_per_s / self.bound.tokens_per_s
                          for name, m in self.modes.items()}},
        }


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def plan(p: PlanInputs) -> Plan:
    """Every mode at its best k in 1..draft_max, the closed form, and a verdict."""
    plain = plain_rate(p)
    modes = {"plain": ModePlan(0, plain, 1.0)}
    for name, fn in RATE_FNS.items():
        k, rate = best_k(fn, p)
        modes[name] = ModePlan(k, rate, rate / plain)
    cost = p.draft_cost()
    k_cf = tkslt_k_star(p.acceptance, cost, SEARCH_K_MAX)
    closed = ClosedForm(cost, tkslt_k_real(p.acceptance, cost), k_cf,
                        tkslt_speedup(p.acceptance, cost, k_cf))
    return Plan(p, modes, closed, verdict(modes), free_bound(p))


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
