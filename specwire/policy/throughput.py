"""The throughput model of speculative decoding, in one place.

`specwire plan`, the adaptive policy, the n-gram and hybrid drafters and `bench`'s
predictions share this arithmetic and its priors, so that they give one figure for the
same inputs. A round asked for k tokens drafts g + ... + g^k of them (`drafted_tokens`),
yields E = 1 + ga + ... + (ga)^k tokens (`expected_tokens`) and costs the drafter's time
plus its share of the target's decode (`verify_share`); `round_rate` divides one by the
other, and `sync_rate`, `local_rate` and `pipelined_rate` price the deployment modes, over a
request whose draft first reads its prompt where PlanInputs says one (`request_rate`);
`batched` gives the figures each of n requests decoding together sees.
Unmeasured, t_v(n) is the memory-bound prior t_s (1 + VERIFY_SLOPE (n - 1)).
docs/planner.md defines the symbols (a, g, t_s, t_d, t_v, RTT) and the modes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

# --------------------------------------------------------------------------- priors

#: Assumed extra cost of each further token in a verification batch, in plain steps.
VERIFY_SLOPE = 0.1
#: How much an online verification line trusts VERIFY_SLOPE: pseudo-points' weight.
VERIFY_PRIOR_WEIGHT = 0.3
#: A drafter's assumed cost per drafted token, relative to its cost per round.
DRAFT_SLOPE = 1.0
#: Bytes on the wire per drafted token: a chain token's (about 12 in a pipelined chunk) and,
#: for a target that verifies trees, a lone second choice at most positions (at most 10).
DEFAULT_DRAFT_BYTES = 24
DEFAULT_VERDICT_BYTES = 32


# --------------------------------------------------------------------------- a round


def expected_tokens(a: float, k: int) -> float:
    """Tokens produced by a round of k drafts at per-token acceptance a."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def drafted_tokens(g: float, k: int) -> float:
    """Tokens a drafter that continues with probability g drafts when asked for k:
    g + g^2 + ... + g^k (k when g = 1)."""
    return g * expected_tokens(g, k - 1) if k > 0 else 0.0


def verify_share(cost: Callable[[float], float], n: float, batch: float = 0.0) -> float:
    """What verifying n tokens costs when other sequences put `batch` tokens into the
    same target decode: cost(batch + n) - cost(batch), the whole cost(n) alone."""
    if batch <= 0:
        return cost(n)
    return max(cost(batch + n) - cost(batch), 0.0)


def round_rate(a: float, k: int, draft_s: Callable[[float], float],
               verify_s: Callable[[float], float], g: float = 1.0,
               batch: float = 0.0) -> float:
    """Expected tokens per second of a round asked for k tokens: E / (the drafter's
    time for the tokens it drafts + the share of the target's decode of them and
    the target's own token)."""
    drafted = drafted_tokens(g, k)
    tokens = expected_tokens(g * a, k)
    return tokens / (draft_s(drafted) + verify_share(verify_s, 1.0 + drafted, batch))


def step_rate(a: float, k: int, draft_s: Callable[[float], float],
              verify_s: Callable[[float], float], g: float = 1.0, batch: float = 0.0,
              behind: float = 0.0, peers: int = 0, paid: float = 0.0) -> float:
    """Expected tokens per second of a whole target decode in which one sequence's round
    asks for k tokens beside `batch` tokens of other sequences. Its drafting (and the
    catch-up `behind` of a drafter that fell behind) holds up every sequence of the
    step, so the step's tokens are compared with the step's time. Counting each of the
    others' tokens as output is an upper bound, so drafting is chosen only where it surely
    pays. With batch 0 and behind 0 this is round_rate for k > 0.

    Sequences whose drafts share one draft context are drafted in lockstep, one draft
    decode per position for all of them (drafters/lockstep.py): `peers` of them are still
    to choose and are taken to choose as this one does (their rounds replace their one
    token each in `batch`), and `paid` seconds of drafting are run for the ones that
    chose before, so only drafting beyond it holds the step up. draft_s is then the
    lockstep's time for a draft of that length (every drafting sequence's position in
    one decode). With peers 0 and paid 0 this is the step of one drafting sequence."""
    drafted = drafted_tokens(g, k)
    n = 1 + peers
    others = max(0.0, batch - peers)
    tokens = n * expected_tokens(g * a, k) + others
    drafting = max(0.0, draft_s(drafted) - paid) if k else 0.0
    spent = drafting + behind + verify_s(n * (1.0 + drafted) + others)
    return tokens / spent


# --------------------------------------------------------------------------- online lines


@dataclass(slots=True)
class LineFit:
    """Exponentially weighted least squares of y = c + d x, both kept >= 0.

    Two pseudo-points on the prior line y = c (1 + guess x), weight `prior` each,
    keep a fit from few or clustered points sane: one slow round at a size not seen
    again cannot set the slope on its own, and real data outweighs them soon.
    """

    alpha: float
    guess: float
    prior: float = 1.0
    w: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0
    #: the last fit and the sums it came from: the policy prices every k of every
    #: sequence each step, and the sums change once per round
    _fit: tuple = field(default=(), compare=False, repr=False)

    def add(self, x: float, y: float) -> None:
        k = 1.0 - self.alpha
        self.w = k * self.w + 1.0
        self.x, self.y = k * self.x + x, k * self.y + y
        self.xx, self.xy = k * self.xx + x * x, k * self.xy + x * y

    def coefficients(self) -> tuple[float, float]:
        """(c, d); (0, 0) before any data."""
        if self.w == 0.0:
            return 0.0, 0.0
        key = (self.w, self.x, self.y, self.xx, self.xy, self.guess, self.prior)
        if self._fit and self._fit[0] == key:
            return self._fit[1]
        fit = self._solve()
        self._fit = (key, fit)
        return fit

    def _solve(self) -> tuple[float, float]:
        c0 = (self.y / self.w) / (1.0 + self.guess * self.x / self.w)
        y2 = c0 * (1.0 + 2.0 * self.guess)  # the prior's points: (0, c0) and (2, y2)
        lam = self.prior
        w, x, y = self.w + 2 * lam, self.x + 2 * lam, self.y + lam * (c0 + y2)
        xx, xy = self.xx + 4 * lam, self.xy + 2 * lam * y2
        mx, my = x / w, y / w
        d = (xy / w - mx * my) / (xx / w - mx * mx)
        c = my - d * mx
        if d < 0.0:
            return my, 0.0
        if c < 0.0:
            return 0.0, my / mx
        return c, d

    def __call__(self, x: float) -> float:
        c, d = self.coefficients()
        return c + d * x


def verify_line(alpha: float = 0.05) -> LineFit:
    """Seconds of verification against tokens drafted (batch size - 1), starting from
    the assumed curve's shape: VERIFY_SLOPE of a step per extra token."""
    return LineFit(alpha, guess=VERIFY_SLOPE, prior=VERIFY_PRIOR_WEIGHT)


def draft_line(alpha: float = 0.1) -> LineFit:
    """Seconds of drafting against tokens drafted, starting from one evaluation per
    round and one per token (a draft model evaluates the target's newest token)."""
    return LineFit(alpha, guess=DRAFT_SLOPE)


@dataclass(slots=True)
class VerifyTimes:
    """t_v(n): seconds a round of n tokens took (batch size), exponentially weighted per
    size, linear between the sizes seen and along VERIFY_SLOPE beyond them.

    A bigger batch never costs less: the means per size are pooled where they say
    otherwise (weighted by their rounds), so that one round of 5 that happened to run
    fast on a loaded machine does not make waiting for 4 tokens look cheaper than
    waiting for 3."""

    alpha: float = 0.1
    weight: dict[int, float] = field(default_factory=dict)
    total: dict[int, float] = field(default_factory=dict)

    def add(self, n: int, seconds: float) -> None:
        k = 1.0 - self.alpha
        self.weight[n] = k * self.weight.get(n, 0.0) + 1.0
        self.total[n] = k * self.total.get(n, 0.0) + seconds

    def rounds(self) -> float:
        return sum(self.weight.values())

    def largest(self) -> int:
        """The largest batch seen (0 before any)."""
        return max(self.weight, default=0)

    def __call__(self, n: int) -> float | None:
        """Seconds for a batch of n; None before any round."""
        if not self.weight:
            return None
        sizes = sorted(self.weight)
        mean = monotone({s: (self.total[s] / self.weight[s], self.weight[s]) for s in sizes})
        if n in mean:
            return mean[n]
        lo = max((s for s in sizes if s < n), default=None)
        hi = min((s for s in sizes if s > n), default=None)
        if lo is not None and hi is not None:
            f = (n - lo) / (hi - lo)
            return mean[lo] + f * (mean[hi] - mean[lo])
        edge = lo if lo is not None else hi
        # One step of the assumed slope per token, scaled by what the nearest size cost.
        return mean[edge] * (1.0 + VERIFY_SLOPE * (n - 1)) / (1.0 + VERIFY_SLOPE * (edge - 1))


def monotone(points: dict[int, tuple[float, float]]) -> dict[int, float]:
    """{size: (mean, weight)} -> the closest non-decreasing means, weighted least squares
    (pool adjacent violators)."""
    blocks: list[list] = []  # [mean, weight, sizes]
    for size in sorted(points):
        m, w = points[size]
        blocks.append([m, w, [size]])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, s2 = blocks.pop()
            b = blocks[-1]
            b[0] = (b[0] * b[1] + m2 * w2) / (b[1] + w2)
            b[1] += w2
            b[2].extend(s2)
    return {size: b[0] for b in blocks for size in b[2]}


# --------------------------------------------------------------------------- verify cost


@dataclass(frozen=True, slots=True)
class VerifyCurve:
    """t_v(n) in plain steps, through measured points (n, cost).

    Linear between points and linear beyond the last two, because a batch's
    cost grows about linearly once it is compute-bound; n = 1 is a plain step
    (cost 1) unless a point says otherwise.
    """

    points: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.0 + VERIFY_SLOPE))
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
            return (f"t_v(n) = 1 + {VERIFY_SLOPE:g} (n-1) plain steps "
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
    #: a request: the prompt tokens its draft reads before the first draft, and the
    #: tokens it generates, over which that read is spread (0: a steady run, read free)
    prompt_tokens: int = 0
    reply_tokens: int = 0
    #: the draft's prompt-reading rate; 0: a batch costs t_d on the target's curve shape
    #: (a draft of the same family), t_d t_v(n) / t_s
    draft_prompt_tps: float = 0.0
    #: the target's prompt rate: a draft node reads its prompt while the target does
    #: (0: unknown, no overlap counted)
    target_prompt_tps: float = 0.0

    def __post_init__(self) -> None:
        _need(0.0 < self.target_tps < math.inf, "target_tps", "must be > 0")
        _need(0.0 < self.draft_tps < math.inf, "draft_tps", "must be > 0")
        _need(0.0 <= self.acceptance <= 1.0, "acceptance", "must be in [0, 1]")
        _need(0.0 <= self.rtt_s < math.inf, "rtt_s", "must be >= 0")
        _need(self.bandwidth_bps > 0.0, "bandwidth_bps", "must be > 0")
        _need(self.draft_bytes >= 0 and self.verdict_bytes >= 0, "bytes", "must be >= 0")
        _need(1 <= self.draft_max <= 256, "draft_max", "must be in [1, 256]")
        _need(0.0 <= self.stop_evals <= 1.0, "stop_evals", "must be in [0, 1]")
        _need(self.prompt_tokens >= 0 and self.reply_tokens >= 0, "tokens", "must be >= 0")
        _need(0.0 <= self.draft_prompt_tps < math.inf, "draft_prompt_tps", "must be >= 0")
        _need(0.0 <= self.target_prompt_tps < math.inf, "target_prompt_tps", "must be >= 0")

    @property
    def t_s(self) -> float:
        return 1.0 / self.target_tps

    @property
    def t_d(self) -> float:
        return 1.0 / self.draft_tps

    def verify_s(self, n: int) -> float:
        """Seconds to evaluate a batch of n tokens on the target."""
        return self.t_s * self.verify.cost(n)

    def sync_draft_s(self, k: float) -> float:
        """What the target waits for a synchronous draft of k tokens: drafting them (and
        the stop_evals evaluations), the round trip and the link."""
        return (k + self.stop_evals) * self.t_d + self.rtt_s + self.transfer_s(k)

    def transfer_s(self, k: float) -> float:
        """Serialisation time of k draft tokens and one verdict on the link."""
        return 8.0 * (k * self.draft_bytes + self.verdict_bytes) / self.bandwidth_bps

    def draft_cost(self) -> float:
        """TK-SLT's L: one draft token, computed and sent, in target steps."""
        return (self.t_d + 8.0 * self.draft_bytes / self.bandwidth_bps) / self.t_s

    def draft_read_s(self, n: float) -> float:
        """Seconds the draft takes to evaluate n tokens in one decode (a prompt, or a
        catch-up): one token's t_d, the rest at the prompt rate or along the curve."""
        if n <= 0:
            return 0.0
        if self.draft_prompt_tps > 0.0:
            return self.t_d + (n - 1) / self.draft_prompt_tps
        return self.t_d * self.verify.cost(n) / self.verify.cost(1)

    def catch_up_s(self, n: float) -> float:
        """What n tokens the draft missed (plain steps) add to its next decode."""
        return self.draft_read_s(n + 1) - self.draft_read_s(1) if n > 0 else 0.0

    def prompt_lag_s(self, remote: bool) -> float:
        """How late a request's first draft comes: the draft reads the prompt first. In
        this process that adds to decoding; a draft node reads it while the target reads
        its own (the Open goes out first), so only the excess is late."""
        read = self.draft_read_s(self.prompt_tokens)
        if remote and self.target_prompt_tps > 0.0:
            read -= self.prompt_tokens / self.target_prompt_tps
        return max(0.0, read)

    def local(self) -> PlanInputs:
        """The same figures with the drafter in-process: no round trip, no link."""
        return replace(self, rtt_s=0.0, bandwidth_bps=math.inf)


def batched(p: PlanInputs, n: int) -> PlanInputs:
    """The figures as each of n requests decoding together sees them (serve -np n, one
    draft for all: the node's step loop, or a lockstep draft in the target's process).
    A plain step is the target's decode of n tokens, t_s t_v(n); a draft token the draft's
    decode of n sequences (draft_read_s(n): one token's time, the rest on the draft's
    curve); verifying m tokens a decode of n m; the link carries n requests' drafts. Each
    mode's rate under these figures, times n, is the aggregate. Prompts are read as given."""
    if n <= 1:
        return p
    step = p.verify.cost(n)
    curve = VerifyCurve(tuple((m, p.verify.cost(n * m) / step)
                              for m in range(1, p.draft_max + 2)), assumed=p.verify.assumed)
    return replace(p, target_tps=p.target_tps / step, draft_tps=1.0 / p.draft_read_s(n),
                   bandwidth_bps=p.bandwidth_bps / n, verify=curve)


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
    return p.sync_draft_s(k) + p.verify_s(k + 1)


def late_s(lag_s: float, tokens: float, rate: float, plain_tps: float, races: bool) -> float:
    """Seconds a request of `tokens` at `rate` loses to a first draft lag_s late: all of
    it when the target waits. Racing (a pipelined target decodes plainly meanwhile), the
    time its plain tokens took beyond what drafting would have spent on them: the first
    round's token always (the target's first decode begins as its prompt ends, and the
    drafter, which read the same prompt meanwhile, has yet to draft its first token: that
    round decodes plainly, or waits about as long for the first draft where the bubble
    rule has learnt the link), then one per plain step of the lag."""
    if tokens <= 0:
        return 0.0
    if not races:
        return max(lag_s, 0.0)
    plain = min(tokens, 1.0 + max(lag_s, 0.0) * plain_tps)
    return plain / plain_tps - plain / rate


def request_rate(p: PlanInputs, rate: float, remote: bool, races: bool = False) -> float:
    """A mode's steady rate over a request of p.reply_tokens whose draft first reads
    p.prompt_tokens (prompt_lag_s); the steady rate when either is 0."""
    n = p.reply_tokens
    if n <= 0 or p.prompt_tokens <= 0:
        return rate
    return n / (n / rate + late_s(p.prompt_lag_s(remote), n, rate, p.target_tps, races))


def sync_rate(p: PlanInputs, k: int) -> float:
    """Tokens/s of synchronous remote drafting; can be below the plain rate."""
    if k == 0:
        return 1.0 / p.t_s
    return request_rate(p, round_rate(p.acceptance, k, p.sync_draft_s, p.verify_s), True)


def local_rate(p: PlanInputs, k: int) -> float:
    """Draft model in the target's process: synchronous, no round trip, no link; its
    prompt is read on the decoding's time."""
    if k == 0:
        return 1.0 / p.t_s
    q = p.local()
    return request_rate(p, round_rate(q.acceptance, k, q.sync_draft_s, q.verify_s), False)


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
        resume verifying as soon as the drafter's tokens run past the plain
        ones and agreed with them, with the m tokens it has by then
        (`race_resume`: a short round when the drafter is not much faster
        than the target). The race phase runs at the plain rate.
    * Rounds form a renewal process: rate = E[tokens] / E[time] per round.

    Because the race strategy never waits for the network and only verifies
    a draft that has already matched the target's own tokens, round trips and
    a slow or useless drafter cannot push it below the plain rate; only a
    verification that costs more than the tokens it yields can
    (E(k) t_s < max(t_v(k+1), supply)), and then the best k is 0: no draft.
    """
    if k == 0:
        return plain_rate(p)
    return request_rate(p, max(pipelined_rates(p, k).values()), True, races=True)


def pipelined_rates(p: PlanInputs, k: int) -> dict[str, float]:
    """Tokens/s of the two miss strategies of `pipelined_rate`: 'wait' and 'race'.

    Racing, a miss is followed by plain steps (race_plain_s) and then a resumed round of
    the m tokens the drafter has beyond them (race_resume), which can itself miss. The
    rounds form a two-state chain: full rounds S (k tokens) and resumed rounds R (m);
    after a hit the next round is full, after a miss it is resumed, so per full round
    there are (1 - h_k) / h_m resumed ones."""
    if k == 0:
        return {"wait": plain_rate(p), "race": plain_rate(p)}
    tokens, busy, hit = _round(p, k, k)
    waiting = tokens / (busy + (1.0 - hit) * (p.rtt_s + k * p.t_d + p.transfer_s(k)))
    j, m = race_resume(p, k)
    race = _race_s(p, j)
    if math.isinf(race):
        return {"wait": waiting, "race": plain_rate(p)}
    r_tokens, r_busy, r_hit = _round(p, k, m)
    resumed = (1.0 - hit) / r_hit if r_hit > 0.0 else math.inf
    if math.isinf(resumed):
        return {"wait": waiting, "race": plain_rate(p)}
    racing = ((tokens + resumed * (race / p.t_s + r_tokens))
              / (busy + resumed * (race + r_busy)))
    return {"wait": waiting, "race": racing}


def _round(p: PlanInputs, k: int, m: int) -> tuple[float, float, float]:
    """A pipelined round verifying m drafted tokens at draft length k: (expected tokens,
    expected seconds, the chance h = a^(m+1) that the drafter's run-ahead is valid). On a
    hit the target waits for the next draft of k + 1 tokens beyond the verdict, where the
    drafter makes them slower than the verification."""
    t_v = p.verify_s(m + 1)
    hit = p.acceptance ** (m + 1)
    hit_wait = max(0.0, (k + 1) * p.t_d + p.transfer_s(k) - t_v)
    return expected_tokens(p.acceptance, m), t_v + hit * hit_wait, hit


def race_resume(p: PlanInputs, k: int) -> tuple[int, int]:
    """After a miss, racing: (j, m), the plain steps before the target verifies again and
    the tokens it then verifies. The restarted drafter's token i reaches the target at
    RTT + i t_d + transfer; at the start of plain step j + 1 (j t_s after the verdict) the
    tokens past the j plain ones are a draft, m_j = min(k, tokens there - j). The engine
    verifies what has come: the first j whose m_j tokens pay their verification
    (E(a, m) t_s >= t_v(m + 1)), or whose draft is whole. (0, 0) when the drafter is no
    faster than the target."""
    if p.t_d >= p.t_s:
        return 0, 0
    lead = p.rtt_s + p.transfer_s(k)
    j = m = 0
    for want in range(1, k + 1):   # the first step with `want` tokens there: O(k) steps
        j = max(j, 1, math.ceil((lead + want * p.t_d) / (p.t_s - p.t_d) - 1e-12))
        m = max(1, min(k, math.floor((j * p.t_s - lead) / p.t_d + 1e-12) - j))
        if m >= k or expected_tokens(p.acceptance, m) * p.t_s >= p.verify_s(m + 1):
            break
    return j, m


def race_plain_s(p: PlanInputs, k: int) -> float:
    """Expected plain-decoding time after a miss until a draft can be verified.

    The target steps plainly (token i done at i t_s) until the restarted drafter's
    tokens run past its own (race_resume's j), and the draft's first j tokens must
    equal the plain ones (probability a^j); a mismatch at i restarts the race from i.
    Solving P = sum_i a^(i-1)(1-a)(i t_s + P) + a^j j t_s gives
    P = t_s (1 - a^j) / ((1 - a) a^j). Infinite when the drafter is no faster than the
    target or can never agree.
    """
    return _race_s(p, race_resume(p, k)[0])


def _race_s(p: PlanInputs, j: int) -> float:
    """race_plain_s for a race of j plain steps (0: the drafter never catches up)."""
    a = p.acceptance
    if j == 0:
        return math.inf
    if a >= 1.0:
        return j * p.t_s
    agree = a ** j
    if agree <= 0.0:
        return math.inf
    return p.t_s * (1.0 - agree) / ((1.0 - a) * agree)


def free_rate(p: PlanInputs, k: int) -> float:
    """Tokens/s of a free and instant drafter at acceptance a: a round is only its
    verification, t_v(k + 1). No drafter with the same acceptance can beat it on this
    target, so a configuration's share of it says what drafting costs and what is left."""
    return expected_tokens(p.acceptance, k) / p.verify_s(k + 1)


RateFn = Callable[[PlanInputs, int], float]

RATE_FNS: dict[str, RateFn] = {
    "local": local_rate,
    "synchronous": sync_rate,
    "pipelined": pipelined_rate,
}
