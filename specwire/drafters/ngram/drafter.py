"""Prompt-lookup drafting: no model, just the history (and earlier requests) copying itself.

When the answer repeats the prompt (renaming, refactoring, quoting), the tokens that
followed the last occurrence of the current suffix are an excellent guess at almost no
cost. Where llama.cpp's n-gram types fix key and draft lengths in advance, this drafter
finds the longest match (ngram/index.py, then earlier requests of the same cache scope in
ngram/cache.py) and learns from verification how far to copy: MatchCalibration counts how
often the target kept a token per effective match length, and a draft goes on while
P(every token so far is kept) stays above the threshold (the adaptive policy's, or the
measured rate times the verification slope, or `keep`); below it at the first token there
is no draft. docs/drafting.md section 2 has the rule and its measurements.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Capabilities, Draft, DrafterBase
from specwire.drafters.ngram.cache import LookupCache
from specwire.drafters.ngram.index import HistoryIndex, continuation
from specwire.policy.costs import DraftCost, VerifyCost
from specwire.policy.scoped import Scoped
from specwire.sample.sampling import SparseDraft

#: Bins of a copied token's effective match length (match length + tokens copied before it).
LENGTH_EDGES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48)
_LOWS = (1, *LENGTH_EDGES)
#: P(every token so far is kept) below which a draft stops, when no policy steers it.
KEEP = 0.3
DEFAULT_MATCH_MAX = 64


def _bin(length: int) -> int:
    return bisect.bisect_right(LENGTH_EDGES, length)


@dataclass(slots=True)
class MatchCalibration:
    """P(the target keeps a copied token | its effective match length), learnt per bin.

    Prior: L / (L + 1) at the bin's shortest length, from 2 pseudo-tokens; a short
    match is worth trying until verification says otherwise. Exponentially weighted
    (alpha per token judged) so that it follows the kind of text being written; it
    outlives a request (NgramDrafter keeps it), as the policy's estimates do.
    """

    alpha: float = 0.02
    seen: list[float] = field(default_factory=lambda: [2.0] * len(_LOWS))
    hits: list[float] = field(default_factory=lambda: [2.0 * n / (n + 1) for n in _LOWS])

    def __call__(self, length: int) -> float:
        b = _bin(length)
        return self.hits[b] / self.seen[b]

    def learn(self, lengths: Sequence[int], kept: int) -> None:
        """Tokens with these effective lengths were judged: the first `kept` kept, the
        next (if any) not."""
        w = 1.0 - self.alpha
        for j, length in enumerate(lengths):
            b = _bin(length)
            self.seen[b] = w * self.seen[b] + 1.0
            self.hits[b] = w * self.hits[b] + (1.0 if j < kept else 0.0)


@dataclass(slots=True)
class RoundCost:
    """A round's yield, measured by the drafter itself: tokens per second over recent
    rounds, from a proposal to the round's end; times the seconds one more drafted
    token adds to the target's verification (`costs`), the least P(kept) for which one
    more drafted token pays (KEEP until a few rounds are seen)."""

    #: the target's verification cost (an engine's, handed by use_costs)
    costs: VerifyCost = field(default_factory=VerifyCost)
    #: no engine handed `costs`: each round's seconds feed it (the round's verification,
    #: nearly all of it)
    own_costs: bool = True
    alpha: float = 0.05
    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0

    def add(self, drafted: int, seconds: float, appended: int) -> None:
        if self.own_costs:
            self.costs.observe(drafted + 1, seconds)
        w = 1.0 - self.alpha
        self.tokens, self.seconds = w * self.tokens + appended, w * self.seconds + seconds
        self.rounds += 1

    def threshold(self) -> float:
        if self.rounds < 8 or self.seconds <= 0.0:
            return KEEP
        return min(1.0, self.tokens / self.seconds * self.costs.per_token())


@dataclass(slots=True)
class Offer:
    """A lookup's draft and, per token, the calibrated P(it is kept | those before were)."""

    tokens: list[int]
    keep: list[float]
    length: int = 0  # the match length the copy starts from
    cached: bool = False  # found in an earlier request

    def expected_kept(self) -> float:
        """Tokens verification is expected to keep: sum of P(the first i + 1 all kept)."""
        total, run = 0.0, 1.0
        for p in self.keep:
            run *= p
            total += run
        return total


@dataclass(slots=True)
class NgramCounters:
    """A lookup drafter's counters, cumulative over its life (Drafter.stats)."""

    drafted: float = 0  # tokens handed out as drafts
    cache_drafts: float = 0  # drafts found in the lookup cache rather than the history
    stopped_early: float = 0  # offers cut short by the calibrated stop

    def as_dict(self) -> dict[str, float]:
        """The counters that moved, by name."""
        return {f.name: float(v) for f in fields(self) if (v := getattr(self, f.name))}


class NgramDrafter(DrafterBase):
    """Longest-match lookup with learned stops and a cross-request cache.

    match_max, match_min: the longest match measured and the shortest one used. keep: a fixed
    stop threshold without a steering policy (0: copy up to the asked length, as a
    classic prompt lookup does; None: measured, RoundCost). cache: sequences of
    earlier requests (None: none). calibration and cost may be shared by drafters
    that take turns on one target (bench builds one per prompt): they are cache scope
    ""'s; each other scope learns its own from the priors (policy/scoped.py), so that
    one tenant's text never sets another's draft lengths.
    """

    name = "ngram"
    # deterministic, with the point mass as its q in begin's rejection mode; it ends its
    # own drafts: a lookup costs nothing, and its own stop, per match and token, decides
    # better where a draft ends (or whether there is one) than the policy's chain of
    # equal per-token chances, so the adaptive policy asks it for the most
    capabilities = Capabilities(provides_q=True, deterministic=True, stops=True)

    def __init__(self, match_max: int = DEFAULT_MATCH_MAX, match_min: int = 1, *,
                 keep: float | None = None,
                 cache: LookupCache | None | bool = True,
                 calibration: MatchCalibration | None = None,
                 cost: RoundCost | None = None) -> None:
        if keep is not None and not 0.0 <= keep <= 1.0:
            raise ValueError(f"ngram keep threshold: must be in [0, 1], got {keep}")
        self.index = HistoryIndex(match_max, match_min)
        self.match_max, self.match_min, self.keep = match_max, match_min, keep
        if cache is True:
            cache = LookupCache(match_max=match_max)
        self.cache = cache if isinstance(cache, LookupCache) else None
        self.calibration = calibration if calibration is not None else MatchCalibration()
        self.cost = cost if cost is not None else RoundCost()
        #: per cache scope, what its requests taught: (calibration, cost); begin picks one
        self.learned: Scoped[tuple[MatchCalibration, RoundCost]] = Scoped(
            self._fresh, (self.calibration, self.cost))
        self._asked: tuple[float, int] | None = None  # (when, tokens handed out) this round
        self.policy = None
        self._point_q = False
        self._offer: tuple[int, Offer] | None = None  # (len(history) at the offer, offer)
        self._history: Sequence[int] = ()
        self._scope, self._store = "", True   # the request's cache scope; keep it after?
        self.counters = NgramCounters()

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        """The target's verification cost (a lookup has no draft backend to price)."""
        for scope in self.learned.scopes():
            cost = self.learned.peek(scope)[1]
            cost.costs, cost.own_costs = costs, False

    def _fresh(self) -> tuple[MatchCalibration, RoundCost]:
        """A new scope's calibration and yield: the priors, beside the machine's costs."""
        return MatchCalibration(), RoundCost(costs=self.cost.costs, own_costs=self.cost.own_costs)

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar=None) -> None:
        """policy: stop drafts at its stop_threshold() (None: at `keep`, or measured)."""
        self.policy = policy
        self.index.clear()
        self._offer, self._history = None, prompt
        self._scope, self._store = params.cache_scope, params.cache_store
        self.calibration, self.cost = self.learned.get(self._scope)
        # Rejection mode needs q for every token: a lookup is deterministic, so q is a
        # point mass on it (accepted with probability p(x), else norm(max(0, p - q))).
        self._point_q = params.mode is VerifyMode.REJECTION and not sampling.greedy

    def threshold(self) -> float:
        if self.policy is not None:
            return self.policy.stop_threshold()
        return self.keep if self.keep is not None else self.cost.threshold()

    def offer(self, history: Sequence[int], k: int) -> Offer:
        """The draft a lookup gives now, cut where it stops paying; remembered for learn()."""
        self._history = history
        found = self._lookup(history, k)
        if found is None:
            self._offer = None
            return Offer([], [])
        tokens, length, cached = found
        keep = [self.calibration(length + i) for i in range(len(tokens))]
        offer = Offer(tokens, keep, length, cached)
        self._offer = (len(history), offer)
        return offer

    def _lookup(self, history: Sequence[int], k: int) -> tuple[list[int], int, bool] | None:
        if k <= 0:
            return None
        here = self.index.match(history)
        there = self.cache.match(history, self._scope) if self.cache is not None else None
        if there is not None and (here is None or there.length > here.length):
            tokens = list(there.tokens[there.end:there.end + k])
            return (tokens, there.length, True) if tokens else None
        if here is None:
            return None
        return continuation(history, here.end, k), here.length, False

    def propose(self, history: Sequence[int], k: int) -> Draft:
        return self.take(self.usable(self.offer(history, k)))

    def usable(self, offer: Offer) -> Offer:
        """The offer cut where P(every token so far is kept) falls below the threshold."""
        threshold, run, n = self.threshold(), 1.0, 0
        for p in offer.keep:
            run *= p
            if run < threshold:
                break
            n += 1
        if n < len(offer.tokens):
            self.counters.stopped_early += 1
        return Offer(offer.tokens[:n], offer.keep[:n], offer.length, offer.cached)

    def take(self, offer: Offer) -> Draft:
        """The offer as the round's draft (counted), with the point-mass q rejection mode
        needs."""
        tokens = offer.tokens
        self._asked = (time.perf_counter(), len(tokens))
        self.counters.drafted += len(tokens)
        if offer.cached and tokens:
            self.counters.cache_drafts += 1
        return self.draft(tokens)

    def draft(self, tokens: list[int]) -> Draft:
        """tokens as a Draft, with the point-mass q rejection mode needs."""
        if self._point_q and tokens:
            one = np.ones(1, dtype=np.float32)
            return Draft(tokens, [SparseDraft(t, np.array([t], dtype=np.int64), one.copy())
                                  for t in tokens])
        return Draft(tokens)

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        """Judge the last offer against the tokens that were appended after it."""
        self._history = history
        if self._asked is not None:
            t0, drafted = self._asked
            self._asked = None
            self.cost.add(drafted, time.perf_counter() - t0, appended)
        if self._offer is None:
            return
        base, offer = self._offer
        self._offer = None
        new = history[base:base + appended]
        kept = 0
        for t, h in zip(offer.tokens, new, strict=False):
            if t != h:
                break
            kept += 1
        judged = kept + 1 if kept < min(len(offer.tokens), len(new)) else kept
        self.calibration.learn([offer.length + i for i in range(judged)], kept)

    def end(self) -> None:
        """The sequence is over: keep it for later requests."""
        if self.cache is not None and self._history and self._store:
            self.cache.add(self._history, self._scope)
        self._offer, self._history, self._asked = None, (), None
        self.policy = None

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()
