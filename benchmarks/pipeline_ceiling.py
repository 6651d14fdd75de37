"""How close to the free-drafter bound can a pipelined drafter get? A modelled clock.

    python -m benchmarks.pipeline_ceiling [--acceptance 0.85] [--draft-cost 0.3,0.2,...]
    python -m benchmarks.pipeline_ceiling --from BENCH_OUT   # a bench run's own inputs

The bound (docs/drafting.md, 1) is a drafter that costs nothing and answers at
once. A real pipelined drafter works on its own core at d target steps per
token and learns each verdict half a round trip after the target gives it, so
after a rejection its next tokens are late. This simulates that pipeline, event
by event, in plain target steps, and reports each schedule's share of the bound:

* the truth: the draft model's greedy guess at each position, given the true
  prefix, is right with probability a (geometric acceptance; greedy drafting is
  a function of the prefix, so a fresh branch's guess at a position is the old
  branch's, and "wrong" is a property of the position);
* the target verifies min(k, tokens that arrived) draft tokens in t_v(n + 1),
  keeps the right prefix and adds its own token; with nothing to verify it
  decodes plainly, or it waits up to a plain step for m tokens (`wait`);
* the drafter drafts the branch past the last verdict it heard, at most
  `lookahead` tokens past it; a verdict that passed a wrong token restarts it
  there.

Schedules: `today` (the branch as built: past a wrong token it drafts on,
uselessly, until the verdict; a plain step when nothing is there), `today+wait`
(the best fixed wait), `today+rule` (the target waits as drafters/bubble.py's
BubbleWait decides, fed on this clock what it measures on a real one),
`branches q` (a ceiling of pre-drafted branches: the drafter knows which of its
guesses are wrong and, with probability q, the target's token there, so what it
drafts after such a position serves the round after the rejection; it drafts
nothing past the others), and `oracle` (q = 1: every token drafted is one the
target will verify; only the drafter's speed and the round trip limit it).
Every round is still cut at the draft's first wrong guess, as the bound's are.
Each schedule is run at every k in 1..draft_max (and every wait m), the best
reported; the figures are Monte Carlo (a few thousand tokens a seed), good to
about 0.01, and the best of many is a little optimistic (the oracle's 1.00x).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path

from specwire.drafters.bubble import BubbleWait
from specwire.policy.throughput import VerifyCurve, expected_tokens

#: the bundled pair on one thread each, quiet machine (benchmarks/NOTES.md)
DEFAULT_CURVE = "1:1,2:1.52,4:1.69,8:2.55,16:3.13"
DEFAULT_COSTS = (0.3, 0.2, 0.1, 0.05, 0.02)
#: the draft's second choice is the target's token after about half the rejections
MEASURED_SECOND = 0.5


@dataclass(frozen=True, slots=True)
class Pipeline:
    """The pair and link, in plain target steps."""

    acceptance: float
    verify: Callable[[int], float]  # t_v(n), n tokens in the batch
    draft: float                    # one draft token
    rtt: float = 0.0
    lookahead: int = 16
    #: co-location: a verification takes (1 + contention u) t_v when the drafter drafted
    #: during a share u of the verification before (a node on the target's machine,
    #: sharing memory bandwidth and cores; not while the target waits); 0: a node elsewhere
    contention: float = 0.0


@dataclass(frozen=True, slots=True)
class Schedule:
    """What the drafter knows and what the target does in a bubble."""

    name: str
    k: int
    wait: int = 0        # tokens to wait for (at most a plain step) when fewer are there
    through: float = 0.0  # chance the drafter drafts the target's token at a wrong position
    stops: bool = False   # the drafter knows where its guesses are wrong and stops there
    rule: bool = False    # the target waits as drafters/bubble.py decides (not `wait`)


@dataclass(slots=True)
class Truth:
    """Per position: is the draft's guess wrong, and (branches) does the drafter also
    have the target's token there, so that what it drafts after it stays useful.

    A verification still stops at every wrong position (the target's token there is
    the round's last); a passed one only keeps the drafter's tokens after it alive for
    the next round, as a pre-drafted branch would."""

    wrong: list[bool]
    passed: list[bool]
    next_wrong: list[int] = field(default_factory=list)   # first wrong position >= p
    next_broken: list[int] = field(default_factory=list)  # first wrong, not passed, >= p

    def __post_init__(self) -> None:
        n = len(self.wrong)
        self.next_wrong, self.next_broken = [n] * (n + 1), [n] * (n + 1)
        for p in range(n - 1, -1, -1):
            self.next_wrong[p] = p if self.wrong[p] else self.next_wrong[p + 1]
            broken = self.wrong[p] and not self.passed[p]
            self.next_broken[p] = p if broken else self.next_broken[p + 1]

    @classmethod
    def sample(cls, n: int, a: float, through: float, rng: random.Random) -> Truth:
        wrong, passed = [], []
        for _ in range(n):
            w, u = rng.random() >= a, rng.random()
            wrong.append(w)
            passed.append(w and u < through)
        return cls(wrong, passed)


@dataclass(slots=True)
class Drafter:
    """The draft node: one branch at a time, tokens in order, verdicts between tokens."""

    truth: Truth
    pipe: Pipeline
    stops: bool
    start: int = 0            # the branch's first position
    done: list[float] = field(default_factory=list)  # completion time per branch token
    free: float = 0.0         # when the drafter may start its next token
    known: int = 0            # committed tokens the drafter has heard of
    inbox: collections.deque = field(default_factory=collections.deque)
    broken: int = 0           # the branch's first wrong position (set from the truth)
    fresh_from: float = -1.0  # when the target sent the verdict that began this branch
    drafted: int = 0          # tokens drafted in all, used or not

    def broken_at(self) -> int:
        """The branch's first position whose token differs from the target's."""
        return self.truth.next_broken[min(self.start, len(self.truth.wrong))]

    def __post_init__(self) -> None:
        self.broken = self.broken_at()

    def _apply(self, committed: int, sent: float) -> None:
        self.known = committed
        nxt = self.start + len(self.done)
        if committed > self.broken or committed > nxt:
            self.start, self.done, self.fresh_from = committed, [], sent
            self.broken = self.broken_at()

    def _can_draft(self) -> bool:
        p = self.start + len(self.done)
        if p >= len(self.truth.wrong) or p >= self.known + self.pipe.lookahead:
            return False
        return not (self.stops and p > self.broken)  # it drafts its guess there

    def advance(self, until: float) -> None:
        """Draft every token finished by `until`, applying verdicts as they arrive."""
        while True:
            while self.inbox and self.inbox[0][0] <= self.free:
                _, committed, sent = self.inbox.popleft()
                self._apply(committed, sent)
            if self._can_draft():
                end = self.free + self.pipe.draft
                if end > until:
                    return
                self.done.append(end)
                self.free = end
                self.drafted += 1
            elif self.inbox and self.inbox[0][0] <= until:
                self.free = max(self.free, self.inbox[0][0])
            else:
                self.free = max(self.free, until)
                return

    def ready(self, committed: int, now: float) -> int:
        """Tokens at positions committed, committed + 1, ... that reached the target by now."""
        if self.broken < committed or committed < self.start:
            return 0
        half = self.pipe.rtt / 2.0
        i, n = committed - self.start, 0
        while i + n < len(self.done) and self.done[i + n] + half <= now:
            n += 1
        if self.stops and committed + n > self.broken:
            return len(self.truth.wrong)  # past a token it knows is wrong, padding is free
        return n

    def arrival(self, committed: int, n: int) -> float | None:
        """When the n-th token from `committed` reached the target (None: not drafted).
        A drafter that stops at a guess it knows is wrong has them all when that one came."""
        if self.stops:
            n = min(n, self.broken - committed + 1)
        i = committed - self.start + n - 1
        if self.broken < committed or committed < self.start or i >= len(self.done):
            return None
        return self.done[i] + self.pipe.rtt / 2.0


@dataclass(slots=True)
class Result:
    tokens: int = 0
    steps: float = 0.0
    rounds: int = 0
    plain_rounds: int = 0
    waited: float = 0.0
    drafted: int = 0  # tokens the drafter drafted, used or not

    @property
    def rate(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0

    def add(self, other: Result) -> None:
        """Another run's counts into these (every field is a count or a sum)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def simulate(pipe: Pipeline, sched: Schedule, truth: Truth) -> Result:
    """Decode the whole truth on the modelled clock; tokens per plain step."""
    dr = Drafter(truth, pipe, sched.stops)
    half, n_pos = pipe.rtt / 2.0, len(truth.wrong)
    now, committed, res = 0.0, 0, Result()
    rule = BubbleWait() if sched.rule else None
    busy = 0.0  # the share of the last verification during which the drafter drafted
    sent, fed = -1.0, 0  # the last verdict's time; fresh-branch tokens told to the rule
    while committed < n_pos:
        dr.advance(now - half)
        if rule is not None:
            fed = _feed(rule, dr, fed, now, sent)
        have = min(dr.ready(committed, now), sched.k)
        want, deadline = min(sched.wait, sched.k), now + pipe.verify(1)
        if rule is not None and sent >= 0.0 and have < sched.k:
            want, wait = rule.aim(have, sched.k, now - sent, fresh=have == 0)
            # what branch.py allows: the wait, half a token's time more, and a millisecond
            deadline = now + wait + 0.5 * rule.arrival.coefficients()[1] + 0.02
        waited, began = False, now
        if have < want:
            waited = rule is not None
            at = _arrival(dr, committed, want, now, deadline)
            start = deadline if at is None and rule is not None else at
            if start is not None:
                res.waited += max(0.0, start - now)
                now = max(now, start)
                dr.advance(now - half)
                have = min(dr.ready(committed, now), sched.k)
        n = min(have, n_pos - committed - 1)
        if rule is not None and waited and n == 0:
            rule.missed()
        kept = min(n, truth.next_wrong[committed] - committed)
        t_v = pipe.verify(n + 1) * (1.0 + pipe.contention * busy)
        if rule is not None:
            rule.observe_round(n, kept, t_v, now - began)
        dr.advance(now - half)
        drafted0 = dr.drafted
        now += t_v
        dr.advance(now - half)
        busy = min(1.0, (dr.drafted - drafted0) * pipe.draft / t_v)
        if rule is not None:  # the fresh branch's tokens that came before this verdict
            fed = _feed(rule, dr, fed, now, sent)
        committed += kept + 1
        res.tokens += kept + 1
        res.rounds += 1
        res.plain_rounds += n == 0
        sent, fed = now, 0
        dr.inbox.append((now + half, committed, now))
    res.steps, res.drafted = now, dr.drafted
    return res


def _feed(rule: BubbleWait, dr: Drafter, fed: int, now: float, sent: float) -> int:
    """Tell the rule when each token of a branch begun by the last verdict (sent then)
    arrived, up to now: as branch.py does until it sends the next verdict."""
    if sent < 0.0 or dr.fresh_from != sent:
        return fed
    half = dr.pipe.rtt / 2.0
    while fed < len(dr.done) and dr.done[fed] + half <= now:
        rule.observe_arrival(fed + 1, dr.done[fed] + half - dr.fresh_from)
        fed += 1
    return fed


def _arrival(dr: Drafter, committed: int, want: int, now: float, deadline: float
             ) -> float | None:
    """When the want-th token from `committed` reaches the target, if by the deadline.
    The drafter is stepped half a token at a time: no verdict comes while the target
    waits, and none can arrive before a round after the wait has ended."""
    half, step = dr.pipe.rtt / 2.0, max(dr.pipe.draft / 2.0, 1e-3)
    t = now
    while True:
        at = dr.arrival(committed, want)
        if at is not None:
            return at if at <= deadline else None
        if t >= deadline:
            return None
        t = min(t + step, deadline)
        dr.advance(t - half)


def free_bound(pipe: Pipeline, draft_max: int) -> tuple[int, float]:
    """(k, tokens per step) of the free, instant drafter: max E(k) / t_v(k + 1)."""
    return max(((k, expected_tokens(pipe.acceptance, k) / pipe.verify(k + 1))
                for k in range(draft_max + 1)), key=lambda kr: kr[1])


def oracle_closed_form(pipe: Pipeline, draft_max: int) -> float:
    """The oracle in steady state, ignoring the round trip: each round's k tokens must be
    drafted while rounds take t_v(k + 1), so max over k of E(k) / max(t_v(k + 1), k d)."""
    a = pipe.acceptance
    return max(expected_tokens(a, k) / max(pipe.verify(k + 1), k * pipe.draft)
               for k in range(1, draft_max + 1))


SCHEMES: dict[str, tuple[float, bool]] = {
    "today": (0.0, False),
    "branches": (MEASURED_SECOND, True),
    "oracle": (1.0, True),
}


#: in `waits`: the target waits as drafters/bubble.py decides
RULE = -1


def best(pipe: Pipeline, scheme: str, draft_max: int, waits: Sequence[int],
         truths: Sequence[Truth], through: float | None = None) -> tuple[Schedule, Result]:
    """The schedule of this scheme (k, wait) with the most tokens per step over `truths`,
    and its rounds summed over them."""
    q, stops = SCHEMES[scheme]
    q = q if through is None else through
    top: tuple[Schedule, Result] | None = None
    for k in range(1, draft_max + 1):
        for m in waits:
            if m > k:
                continue
            s = Schedule(scheme, k, max(m, 0), q, stops, rule=m == RULE)
            total = Result()
            for t in truths:
                total.add(simulate(pipe, s, t))
            if top is None or total.rate > top[1].rate:
                top = (s, total)
    assert top is not None
    return top


def table(acceptance: float, curve: VerifyCurve, costs: Sequence[float], rtt: float,
          draft_max: int, tokens: int, seeds: int, through: float,
          waits: Sequence[int] = (0, 1, 2, 3, 4, 8), contention: float = 0.0) -> list[dict]:
    """Per draft cost: the bound and each scheme's best share of it."""
    rows = []
    for d in costs:
        pipe = Pipeline(acceptance, curve.cost, d, rtt, 2 * draft_max, contention)
        k_b, bound = free_bound(pipe, draft_max)
        row: dict = {"d": d, "bound": bound, "bound_k": k_b,
                     "oracle_closed_form": oracle_closed_form(pipe, draft_max) / bound}
        runs = [("today", (0,)), ("today+wait", waits), ("today+rule", (RULE,)),
                ("branches", waits), ("oracle", waits)]
        for name, ms in runs:
            scheme = name.split("+")[0]
            q = through if scheme == "branches" else SCHEMES[scheme][0]
            truths = [Truth.sample(tokens, acceptance, q, random.Random(s)) for s in range(seeds)]
            sched, res = best(pipe, scheme, draft_max, ms, truths, q)
            row[name] = {"share": res.rate / bound, "k": sched.k, "wait": sched.wait,
                         "tokens_per_round": res.tokens / res.rounds,
                         "plain_share_of_rounds": res.plain_rounds / res.rounds,
                         "drafted_per_token": res.drafted / res.tokens,
                         "drafter_busy": res.drafted * d / res.steps}
        rows.append(row)
    return rows


def render(rows: Sequence[dict], through: float) -> str:
    names = ("today", "today+wait", "today+rule", f"branches q={through:g}", "oracle")
    lines = [f"{'d':>5} {'bound':>6} " + " ".join(f"{n:>15}" for n in names)
             + f" {'closed':>7}"]
    for r in rows:
        cells = []
        for key in ("today", "today+wait", "today+rule", "branches", "oracle"):
            c = r[key]
            how = f"k={c['k']}" + (f",m={c['wait']}" if c["wait"] else "")
            cells.append(f"{c['share']:>6.3f} {how:<8}")
        lines.append(f"{r['d']:>5g} {r['bound']:>6.3f} " + " ".join(cells)
                     + f" {r['oracle_closed_form']:>7.3f}")
    lines.append("shares of the bound (bound: tokens per plain step of a free, instant drafter); "
                 "d: a draft token in target steps; k: the best draft length, m: tokens waited "
                 "for (at most a plain step) when fewer are there; rule: waits as "
                 "drafters/bubble.py decides, on this clock; closed: the oracle's steady state "
                 "without the round trip")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_ceiling",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--acceptance", type=float, default=0.85)
    ap.add_argument("--verify-cost", default=DEFAULT_CURVE,
                    help="t_v(n) in plain steps, N:COST,... (default: the bundled pair)")
    ap.add_argument("--draft-cost", default=",".join(map(str, DEFAULT_COSTS)),
                    help="draft token costs in target steps, comma-separated")
    ap.add_argument("--rtt-ms", type=float, default=2.0)
    ap.add_argument("--step-ms", type=float, default=50.0, help="one plain target step")
    ap.add_argument("--draft-max", type=int, default=8)
    ap.add_argument("--through", type=float, default=MEASURED_SECOND,
                    help="branches: the chance the drafter has the target's token at a "
                         "wrong position (the draft's second choice: about 0.5 here)")
    ap.add_argument("-n", "--tokens", type=int, default=4000)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--contention", type=float, default=0.0,
                    help="a node on the target's machine: verification slows by this "
                         "fraction times the drafter's busy share (0: a node elsewhere)")
    ap.add_argument("--from", dest="results", metavar="RESULTS",
                    help="a bench results.json (or its folder): the acceptance, verification "
                         "curve, draft cost, step and round trip of its pipelined "
                         "configuration, whose measured share is printed beside the model's")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    measured = None
    try:
        if args.results:
            measured = from_results(args.results)
            args.acceptance, args.verify_cost = measured["acceptance"], measured["verify_cost"]
            args.rtt_ms, args.step_ms = measured["rtt_ms"], measured["step_ms"]
            args.draft_max = measured["draft_max"]
            if args.draft_cost == ap.get_default("draft_cost"):
                args.draft_cost = f"{measured['d']:.3f}"
        curve = VerifyCurve.parse(args.verify_cost)
        costs = [float(c) for c in args.draft_cost.split(",") if c.strip()]
    except ValueError as e:
        print(f"pipeline_ceiling: {e}", file=sys.stderr)
        return 2
    bad = [(not 0.0 <= args.acceptance < 1.0, "--acceptance must be in [0, 1)"),
           (any(c <= 0 for c in costs) or not costs, "--draft-cost: give costs > 0"),
           (args.rtt_ms < 0 or args.step_ms <= 0, "--rtt-ms >= 0 and --step-ms > 0"),
           (not 1 <= args.draft_max <= 32, "--draft-max must be in [1, 32]"),
           (not 0.0 <= args.through <= 1.0, "--through must be in [0, 1]"),
           (args.tokens < 10 or args.seeds < 1, "-n >= 10 and --seeds >= 1"),
           (not 0.0 <= args.contention <= 10.0, "--contention must be in [0, 10]")]
    for cond, msg in bad:
        if cond:
            print(f"pipeline_ceiling: {msg}", file=sys.stderr)
            return 2
    rows = table(args.acceptance, curve, costs, args.rtt_ms / args.step_ms, args.draft_max,
                 args.tokens, args.seeds, args.through, contention=args.contention)
    if args.json:
        print(json.dumps({"measured": measured, "rows": rows}, indent=1))
        return 0
    print(render(rows, args.through))
    if measured:
        print(f"measured ({measured['label']}): {measured['share']:.3f} of its bound; a = "
              f"{measured['acceptance']:.3f}, d = {measured['d']:.3f} (calibrated, alone), "
              f"a plain step {measured['step_ms']:.1f} ms")
    return 0


def from_results(path: str) -> dict:
    """The inputs of the first pipelined configuration of a bench results.json."""
    p = Path(path)
    p = p / "results.json" if p.is_dir() else p
    try:
        res = json.loads(p.read_text())
        cal = res["calibration"]
        rec = next(r for r in res["records"] if "pipelined" in r["mode"] and r.get("bound"))
        plain_tps, draft_tps = float(cal["plain_tps_overall"]), float(cal["draft_tps"])
        return {"label": rec["label"], "share": float(rec["bound"]["share"]),
                "acceptance": float(rec["bound"]["acceptance"]),
                "verify_cost": ",".join(f"{int(n)}:{c}" for n, c in cal["verify_cost"]),
                "d": plain_tps / draft_tps, "step_ms": 1000.0 / plain_tps,
                "rtt_ms": float(rec.get("rtt_ms") or 0.0), "draft_max": int(rec["draft_max"])}
    except OSError as e:
        raise ValueError(f"--from: cannot read {p}: {e.strerror}") from None
    except StopIteration:
        raise ValueError(f"--from: {p} has no pipelined configuration with a bound") from None
    except (KeyError, TypeError, json.JSONDecodeError, ZeroDivisionError) as e:
        raise ValueError(f"--from: {p} is not a bench results.json ({e!r})") from None


if __name__ == "__main__":
    sys.exit(main())
