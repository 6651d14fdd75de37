"""Token sampling with llama.cpp's meanings, and no hidden random state.

Every function takes one logits row (V,) straight from the backend's buffer and
never writes to it. Randomness comes from `rng`, keyed by the request's seed
and the absolute position, so a position samples the same token however the
decode was split into speculative rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specwire import rng
from specwire.config import SamplingParams

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


def recent_window(history: Sequence[int], params: SamplingParams) -> np.ndarray:
    """The tokens the repeat penalty looks at: the last repeat_last_n of history."""
    if params.repeat_penalty == 1.0 or params.repeat_last_n == 0:
        return _EMPTY
    n = len(history) if params.repeat_last_n < 0 else params.repeat_last_n
    return np.unique(np.asarray(history[-n:], dtype=np.int64)) if n else _EMPTY


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


def greedy(row: np.ndarray, params: SamplingParams, recent: np.ndarray = None) -> int:
    """Argmax of the (penalised) logits. row: (V,)."""
    if recent is not None and recent.size:
        row = penalized(row, recent, params.repeat_penalty)
    return int(np.argmax(row))


def candidates(row: np.ndarray, params: SamplingParams, recent: np.ndarray = None) -> Candidates:
    """Apply penalty, top-k, top-p, min-p, then temperature, as llama.cpp does.

    Filters see probabilities at temperature 1; the temperature scales the survivors.
    """
    if recent is not None and recent.size:
        row = penalized(row, recent, params.repeat_penalty)
    k = params.top_k
    ids = np.argpartition(row, -k)[-k:] if 0 < k < row.shape[0] else np.arange(row.shape[0])
    logits = row[ids].astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    ids, logits = ids[order], logits[order]
    if params.top_p < 1.0 or params.min_p > 0.0:
        p = np.exp(logits - logits[0])
        p /= p.sum()
        n = len(ids)
        if params.top_p < 1.0:
            n = min(n, int(np.searchsorted(np.cumsum(p), params.top_p)) + 1)
        if params.min_p > 0.0:
            n = min(n, max(1, int(np.count_nonzero(p[:n] >= params.min_p * p[0]))))
        ids, logits = ids[:n], logits[:n]
    return Candidates(ids=ids.astype(np.int64), scaled=logits / max(params.temperature, 1e-6))


def coupled(
    row: np.ndarray, params: SamplingParams, position: int, recent: np.ndarray = None
) -> int:
    """Gumbel-max sample keyed by (seed, position, token); greedy when T <= 0.

    Two models calling this with the same seed and position share their noise,
    so they pick the same token wherever their distributions agree enough.
    """
    if params.greedy:
        return greedy(row, params, recent)
    c = candidates(row, params, recent)
    g = rng.gumbel(params.seed, rng.GUMBEL, position, c.ids)
    return int(c.ids[np.argmax(c.scaled + g)])


def top_prob(row: np.ndarray, k: int = P_MIN_TOP_K) -> float:
    """The draft's confidence for --draft-p-min, as llama.cpp computes it.

    llama.cpp's draft sampler keeps the top 10 candidates and compares the first
    one's softmax probability among them with p_min; same here, so the flag
    means what llama.cpp users expect (and the partition is cheaper than a
    softmax over a 262k vocabulary).
    """
    k = min(k, row.shape[0])
    top = np.partition(row, -k)[-k:].astype(np.float64)
    return 1.0 / float(np.exp(top - top.max()).sum())


@dataclass(slots=True)
class SparseDraft:
    """One rejection-mode draft position: the token and its sparse q (TK-SLT).

    ids: (K,) int64, probs: (K,) float32 summing to 1; token is one of ids.
    """

    token: int
    ids: np.ndarray
    probs: np.ndarray


def sparse_draft(
    row: np.ndarray, params: SamplingParams, top_k_q: int, position: int, recent: np.ndarray = None
) -> SparseDraft:
    """Sample from the draft's top-K renormalised distribution, with its own stream."""
    c = candidates(row, params, recent)
    ids, probs = c.ids[:top_k_q], c.probs()[:top_k_q]
    q = (probs / probs.sum()).astype(np.float32)
    q /= q.sum(dtype=np.float64)
    cdf = np.cumsum(q, dtype=np.float64)
    u = rng.scalar(params.seed, rng.DRAFT, position) * cdf[-1]
    j = min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)
    return SparseDraft(token=int(ids[j]), ids=ids, probs=q)


_EMPTY = np.zeros(0, dtype=np.int64)
