"""Token sampling with llama.cpp's meanings, and no hidden random state.

Every function takes one logits row (V,) straight from the backend's buffer and
never writes to it. Randomness comes from `rng`, keyed by the request's seed
and the absolute position, so a position samples the same token however the
decode was split into speculative rounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specwire.config import ConfigError, SamplingParams
from specwire.sample import rng

#: Candidates llama.cpp's draft sampler keeps before it applies p_min.
P_MIN_TOP_K = 10


@dataclass(slots=True)
class Candidates:
    """The tokens that survive the filters, with temperature-scaled logits.

    ids: (n,) int64, in descending logit order. scaled: (n,) float64, logit / T.
    """

    ids: np.ndarray
    scaled: np.ndarray

    def probs(self) -> np.ndarray:
        """(n,) float64 probabilities over the candidates."""
        e = np.exp(self.scaled - self.scaled[0])
        return e / e.sum()


@dataclass(slots=True)
class Window:
    """The recent tokens the penalties look at: ids (n,) int64 unique, counts (n,) int64."""

    ids: np.ndarray
    counts: np.ndarray

    @property
    def size(self) -> int:
        return int(self.ids.size)


#: A history-independent constraint: (n,) candidate ids -> (n,) bool, which may come next.
Allow = Callable[[np.ndarray], np.ndarray]


def recent_window(history: Sequence[int], params: SamplingParams) -> Window:
    """The tokens the penalties look at: the last repeat_last_n of history, with counts."""
    if not params.penalised:
        return _NO_WINDOW
    n = len(history) if params.repeat_last_n < 0 else params.repeat_last_n
    if not n:
        return _NO_WINDOW
    ids, counts = np.unique(np.asarray(history[-n:], dtype=np.int64), return_counts=True)
    return Window(ids, counts.astype(np.int64))


def penalized(row: np.ndarray, recent: np.ndarray, penalty: float) -> np.ndarray:
    """llama.cpp's repeat penalty: positive logits divided, negative multiplied.

    row: (V,) float32, left untouched; returns it, or a penalised copy.
    """
    if penalty == 1.0 or recent.size == 0:
        return row
    out = row.copy()
    vals = out[recent]
    out[recent] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


def adjusted(row: np.ndarray, params: SamplingParams,
             recent: Window | np.ndarray | None = None) -> np.ndarray:
    """llama.cpp's logit bias, then its penalties sampler (repeat, frequency, presence).

    row: (V,) float32, left untouched; returns it, or an adjusted copy. A bare id
    array as `recent` means the repeat penalty alone over those ids.
    """
    if isinstance(recent, np.ndarray):
        recent = Window(recent, np.ones_like(recent))
    penalise = recent is not None and recent.size > 0
    if not params.logit_bias and not penalise:
        return row
    out = row.copy()
    if params.logit_bias:
        ids, values = bias_arrays(params.logit_bias)
        out[ids] += values
    if penalise:
        vals = out[recent.ids]
        rp = params.repeat_penalty
        if rp != 1.0:
            vals = np.where(vals > 0, vals / rp, vals * rp)
        counts = recent.counts.astype(np.float32)
        vals = vals - counts * params.frequency_penalty - (counts > 0) * params.presence_penalty
        out[recent.ids] = vals
    return out


_BIAS_CACHE: dict[int, tuple[tuple, np.ndarray, np.ndarray]] = {}
_BIAS_CACHE_SIZE = 64


def bias_arrays(bias: tuple[tuple[int, float], ...]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, values) of a logit bias, converted once per bias tuple (a request's), not per
    sampled token: keyed by the tuple's identity, which the cache holds on to."""
    hit = _BIAS_CACHE.get(id(bias))
    if hit is not None and hit[0] is bias:
        return hit[1], hit[2]
    ids = np.fromiter((t for t, _ in bias), dtype=np.int64, count=len(bias))
    values = np.fromiter((b for _, b in bias), dtype=np.float32, count=len(bias))
    if len(_BIAS_CACHE) >= _BIAS_CACHE_SIZE:
        _BIAS_CACHE.pop(next(iter(_BIAS_CACHE)), None)
    _BIAS_CACHE[id(bias)] = (bias, ids, values)
    return ids, values


def top_allowed(row: np.ndarray, n: int | None, allow: Allow) -> np.ndarray:
    """The ids of the n best tokens `allow` accepts, best first (n None: all it accepts).

    The constraint is asked about the best tokens first (see _TIERS) and only
    then about the whole vocabulary: a grammar is asked per token, and the model's
    favourites are usually allowed. Same answer as masking the
    whole row, only cheaper.
    """
    if n is not None:
        for ids in _tiers(row, n):
            ok = ids[allow(ids)]
            if ok.size >= n:
                return ok[:n]
    return _all_allowed(row, allow, n)


def greedy(row: np.ndarray, params: SamplingParams, recent: Window | None = None,
           allow: Allow | None = None) -> int:
    """Argmax of the adjusted logits (among the tokens `allow` accepts). row: (V,)."""
    row = adjusted(row, params, recent)
    if allow is None:
        return int(np.argmax(row))
    return _first(top_allowed(row, 1, allow))


def candidates(row: np.ndarray, params: SamplingParams, recent: Window | None = None,
               allow: Allow | None = None) -> Candidates:
    """Apply bias and penalties, top-k, top-p, min-p, then temperature, as llama.cpp does.

    Filters see probabilities at temperature 1; the temperature scales the survivors.
    With `allow`, the tokens it refuses are out before any filter (llama.cpp's
    grammar-first order).
    """
    row = adjusted(row, params, recent)
    k = params.top_k
    if allow is not None:
        ids = _allowed_candidates(row, params, allow)
    else:
        if 0 < k < row.shape[0]:
            ids = top_ids(row, k)
        else:
            ids = np.arange(row.shape[0])
            ids = ids[np.argsort(-row[ids], kind="stable")]
        ids = ids[: _kept(row[ids].astype(np.float64), params)]
    return Candidates(ids=ids.astype(np.int64),
                      scaled=row[ids].astype(np.float64) / max(params.temperature, 1e-6))


def _kept(logits: np.ndarray, params: SamplingParams, unseen: float | None = None,
          unseen_top: float = 0.0) -> int | None:
    """How many of these descending logits survive top-p and min-p.

    With `unseen` given, the logits are only the best of the tokens top-k kept:
    the others add `unseen` to the softmax's sum (relative to the best token's
    weight 1) and each weighs at most `unseen_top`. None: the cut may lie among
    those unseen tokens.
    """
    n = len(logits)
    if n == 0 or (params.top_p >= 1.0 and params.min_p <= 0.0):
        return n if unseen is None else None
    p = np.exp(logits - logits[0])
    cut: int | None = n if unseen is None else None
    if params.top_p < 1.0:
        i = int(np.searchsorted(np.cumsum(p) / (p.sum() + (unseen or 0.0)), params.top_p))
        if i < n:
            cut = i + 1
    if params.min_p > 0.0:
        c = int(np.count_nonzero(p >= params.min_p))
        if c < n or unseen_top < params.min_p:
            cut = max(1, c) if cut is None else min(cut, max(1, c))
    return cut


def _allowed_candidates(row: np.ndarray, params: SamplingParams, allow: Allow) -> np.ndarray:
    """The candidate ids among the tokens `allow` accepts, best first: exactly those a
    whole-vocabulary mask would leave, usually found from the best few thousand.

    The tokens not asked about all have lower logits than the last one asked, so
    their weight in top-p's sum is bounded; where the cut is the same with none
    and with all of that weight, it is the cut.
    """
    k = params.top_k if params.top_k > 0 else None
    v = row.shape[0]
    for ids in _tiers(row, k or 1):
        ok = ids[allow(ids)]
        if k is not None and ok.size >= k:
            ok = ok[:k]
            return ok[: _kept(row[ok].astype(np.float64), params)]
        if ok.size == 0:
            continue
        logits = row[ok].astype(np.float64)
        top = float(np.exp(float(row[ids[-1]]) - logits[0]))     # the heaviest unseen token
        count = (k - ok.size) if k is not None else v - ids.size
        lo = _kept(logits, params, unseen=0.0, unseen_top=top)
        hi = _kept(logits, params, unseen=count * top, unseen_top=top)
        if lo is not None and lo == hi:
            return ok[:lo]
    ok = _all_allowed(row, allow, k)
    return ok[: _kept(row[ok].astype(np.float64), params)]


#: How many of the best tokens a constraint is asked about before the next tier.
_TIERS = (64, 4096)


def _tiers(row: np.ndarray, n: int):
    """The best max(64, 4n) token ids, then the best 4096, each best first."""
    v = row.shape[0]
    for m in (max(_TIERS[0], 4 * n), _TIERS[1]):
        if m >= v:
            return
        ids = np.argpartition(row, -m)[-m:]
        yield ids[np.argsort(-row[ids], kind="stable")]


def _all_allowed(row: np.ndarray, allow: Allow, n: int | None) -> np.ndarray:
    ids = np.flatnonzero(allow(np.arange(row.shape[0])))
    ids = ids[np.argsort(-row[ids], kind="stable")]
    return (ids if n is None else ids[:n]).astype(np.int64)


def coupled(
    row: np.ndarray, params: SamplingParams, position: int, recent: Window | None = None,
    allow: Allow | None = None,
) -> int:
    """Gumbel-max sample keyed by (seed, position, token); greedy when T <= 0.

    Two models calling this with the same seed and position share their noise,
    so they pick the same token wherever their distributions agree enough.
    """
    if params.greedy:
        return greedy(row, params, recent, allow)
    c = candidates(row, params, recent, allow)
    g = rng.gumbel(params.seed, rng.GUMBEL, position, c.ids)
    return int(c.ids[np.argmax(c.scaled + g)])


#: top_ids looks for the best tokens among those within this many nats of the best one
#: first (a few hundred at most in a real model's row), and only then in the whole row.
_NEAR_TOP = (8.0, 32.0)


def top_ids(row: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k largest values of row, largest first (ties: lowest id first, as
    np.argmax picks).

    The same set as np.argpartition(row, -k)[-k:], much cheaper on a model's logits:
    a comparison of the whole row finds the few tokens near the best one, and only
    those are partitioned.
    The set {row >= m} holds the top |set| values, so once it has k it has the top k.
    """
    k = min(k, row.shape[0])
    if k <= 0:
        return np.empty(0, dtype=np.int64)
    best = row.max()
    ids = None
    if np.isfinite(best):
        for margin in _NEAR_TOP:
            near = np.flatnonzero(row >= best - margin)
            if near.size >= k:
                ids = near
                break
    if ids is None:
        ids = np.arange(row.shape[0])
    if ids.size > k:  # ids ascend: of the tokens tied at the k-th value, the first ones
        vals = row[ids]
        kth = np.partition(vals, -k)[-k]
        above = ids[vals > kth]
        ids = np.concatenate([above, ids[vals == kth][: k - above.size]])
    return ids[np.lexsort((ids, -row[ids]))]


def top_prob(row: np.ndarray, k: int = P_MIN_TOP_K) -> float:
    """The draft's confidence for --draft-p-min, as llama.cpp computes it.

    llama.cpp's draft sampler keeps the top 10 candidates and compares the first
    one's softmax probability among them with p_min; same here, so the flag
    means what llama.cpp users expect (and the partition is cheaper than a
    softmax over a 262k vocabulary).
    """
    top = row[top_ids(row, k)].astype(np.float64)
    return 1.0 / float(np.exp(top - top[0]).sum())


@dataclass(slots=True)
class SparseDraft:
    """One rejection-mode draft position: the token and its sparse q (TK-SLT).

    ids: (K,) int64, probs: (K,) float32 summing to 1; token is one of ids.
    """

    token: int
    ids: np.ndarray
    probs: np.ndarray


def sparse_draft(
    row: np.ndarray, params: SamplingParams, top_k_q: int, position: int,
    recent: Window | None = None, allow: Allow | None = None,
) -> SparseDraft:
    """Sample from the draft's top-K renormalised distribution, with its own stream."""
    c = candidates(row, params, recent, allow)
    ids, probs = c.ids[:top_k_q], c.probs()[:top_k_q]
    q = (probs / probs.sum()).astype(np.float32)
    q /= q.sum(dtype=np.float64)
    cdf = np.cumsum(q, dtype=np.float64)
    u = rng.scalar(params.seed, rng.DRAFT, position) * cdf[-1]
    j = min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)
    return SparseDraft(token=int(ids[j]), ids=ids, probs=q)


def _first(ids: np.ndarray) -> int:
    if ids.size == 0:
        raise ConfigError("grammar: no token can continue the output here (the constraint "
                          "allows none, not even end of generation)")
    return int(ids[0])


_EMPTY = np.zeros(0, dtype=np.int64)
_NO_WINDOW = Window(_EMPTY, _EMPTY)
