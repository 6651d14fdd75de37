"""Verification of a draft against the target's logits: the lossless part.

Names follow the papers: p is the target's distribution, q the draft's. A round verifies
k draft tokens with k + 1 target rows, keeps the `accepted` prefix and emits one token of
the target's own: the *recovered* token where a draft token was rejected, or the *bonus*
token after a fully accepted draft. Greedy and coupled modes draw the target's own sample
at each position (argmax, or Gumbel-max with keyed noise) and keep a draft token iff it
equals it, so the output is the target's sample sequence whatever the draft; rejection
mode is Leviathan/Chen speculative sampling with TK-SLT's sparse q, lossless in
distribution. A grammar masks each position's row and advances only by committed tokens,
and verification stops at the first rejection, so the grammar never needs a rollback.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specwire.config import SamplingParams, VerifyMode
from specwire.sample import rng, sampling
from specwire.sample.constraints.grammar import Grammar
from specwire.sample.logprobs import LogprobsSpec, TokenProb, token_prob
from specwire.sample.sampling import SparseDraft


@dataclass(slots=True, frozen=True)
class Outcome:
    """The outcome of one round: `accepted` draft tokens kept, then `token`."""

    accepted: int
    token: int

    def __post_init__(self) -> None:
        assert self.accepted >= 0 and self.token >= 0, self


class Verifier:
    """Verifies drafts for one request (its sampling settings, seed and constraint).

    Every token the verifier returns or keeps is committed: it advances the
    grammar and, when asked for, its probabilities are appended to `probs`.
    """

    __slots__ = ("params", "mode", "grammar", "logprobs", "probs")

    def __init__(self, params: SamplingParams, mode: VerifyMode, grammar: Grammar | None = None,
                 logprobs: LogprobsSpec | None = None) -> None:
        self.params = params
        self.mode = VerifyMode.GREEDY if params.greedy else mode
        self.grammar, self.logprobs = grammar, logprobs
        self.probs: list[TokenProb] = []

    def sample(self, row: np.ndarray, history: Sequence[int]) -> int:
        """The target's own token for position len(history), committed. row: (V,)."""
        recent = sampling.recent_window(history, self.params)
        allow = self.grammar.allowed if self.grammar is not None else None
        t = sampling.coupled(row, self.params, len(history), recent, allow)
        self._commit(row, t, recent, allow)
        return t

    def _commit(self, row: np.ndarray, token: int, recent: sampling.Window,
                allow: sampling.Allow | None) -> None:
        if self.logprobs is not None:
            self.probs.append(token_prob(row, self.logprobs, self.params, token, recent, allow))
        if self.grammar is not None:
            self.grammar.accept(token)

    def verify(
        self,
        rows: np.ndarray,
        history: Sequence[int],
        draft: Sequence[int],
        sparse: Sequence[SparseDraft] | None = None,
    ) -> Outcome:
        """Decide one round.

        rows: (k + 1, V) target logits; row i predicts position len(history) + i,
        having seen draft[:i]. draft: k token ids. sparse: k SparseDraft, rejection mode only.
        """
        k = len(draft)
        assert rows.shape[0] >= k + 1, (rows.shape, k)
        if self.mode is VerifyMode.REJECTION and k:
            if sparse is None or len(sparse) != k:
                raise ValueError(
                    "rejection verification needs the draft's sparse q for every token"
                )
            return self._rejection(rows, history, draft, sparse)
        ctx = list(history)
        for i, d in enumerate(draft):
            t = self.sample(rows[i], ctx)
            if t != d:
                return Outcome(i, t)
            ctx.append(d)
        return Outcome(k, self.sample(rows[k], ctx))

    def _rejection(
        self,
        rows: np.ndarray,
        history: Sequence[int],
        draft: Sequence[int],
        sparse: Sequence[SparseDraft],
    ) -> Outcome:
        params, ctx = self.params, list(history)
        allow = self.grammar.allowed if self.grammar is not None else None
        for i, (x, q) in enumerate(zip(draft, sparse, strict=True)):
            pos = len(ctx)
            recent = sampling.recent_window(ctx, params)
            c = sampling.candidates(rows[i], params, recent, allow)
            p = c.probs()  # (n,) target probs over c.ids
            p_x = _prob_of(c.ids, p, x)
            q_x = _prob_of(q.ids, q.probs.astype(np.float64), x)
            if q_x > 0.0 and rng.scalar(params.seed, rng.ACCEPT, pos) * q_x < p_x:
                self._commit(rows[i], x, recent, allow)
                ctx.append(x)
                continue
            # rejected, or a token q could not have drawn: the residual's sample
            t = _residual_sample(c.ids, p, q, params.seed, pos)
            self._commit(rows[i], t, recent, allow)
            return Outcome(i, t)
        return Outcome(len(draft), self.sample(rows[len(draft)], ctx))


def _prob_of(ids: np.ndarray, probs: np.ndarray, token: int) -> float:
    hit = np.flatnonzero(ids == token)
    return float(probs[hit[0]]) if hit.size else 0.0


def _residual_sample(ids: np.ndarray, p: np.ndarray, q: SparseDraft, seed: int, pos: int) -> int:
    """Sample norm(max(0, p - q)) over the target's candidates. ids, p: (n,)."""
    q_on_p = np.zeros_like(p)  # (n,) q evaluated at ids
    where = {int(t): j for j, t in enumerate(ids)}
    for t, qv in zip(q.ids.tolist(), q.probs.tolist(), strict=True):
        j = where.get(t)
        if j is not None:
            q_on_p[j] = qv
    r = np.maximum(p - q_on_p, 0.0)  # (n,) residual mass
    total = r.sum()
    if total <= 0.0:  # p == q up to rounding
        r, total = p, p.sum()
    cdf = np.cumsum(r)
    u = rng.scalar(seed, rng.RESIDUAL, pos) * total
    return int(ids[min(int(np.searchsorted(cdf, u, side="right")), len(ids) - 1)])
