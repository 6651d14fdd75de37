"""Token probabilities from the target's own logits rows, as llama-server reports them.

Every generated token is committed by the verifier from one target row, with or without a
draft, so its probabilities are read there: the same numbers whether the token was drafted
or sampled in a plain step. Two views, llama-server's: pre-sampling (default), the softmax
of the raw row over the whole vocabulary with the chosen token and the n most likely; and
post-sampling (`post_sampling_probs`), the distribution the token was drawn from, after the
constraint, bias, penalties, top-k/p, min-p and temperature (at temperature 0 the chosen
token has probability 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specwire.config import ConfigError, SamplingParams
from specwire.sample import sampling

#: The most alternatives a request may ask for per token (OpenAI allows 20; llama-server more).
MAX_N_PROBS = 100


@dataclass(slots=True, frozen=True)
class LogprobsSpec:
    """What a request wants: n alternatives per token, before or after sampling."""

    n: int = 0
    post_sampling: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.n <= MAX_N_PROBS:
            raise ConfigError(f"n_probs: must be in [0, {MAX_N_PROBS}], got {self.n}")


@dataclass(slots=True, frozen=True)
class TokenProb:
    """One generated token: its log-probability and the top alternatives (id, logprob)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_prob(row: np.ndarray, spec: LogprobsSpec, params: SamplingParams, token: int,
               recent: sampling.Window | None = None,
               allow: sampling.Allow | None = None) -> TokenProb:
    """The probabilities of `token` at a position, from the target's row there. row: (V,)."""
    if spec.post_sampling:
        return _post(row, spec, params, token, recent, allow)
    r = row.astype(np.float64)
    m = float(r.max())
    lse = m + float(np.log(np.exp(r - m).sum()))
    top: tuple = ()
    if spec.n:
        n = min(spec.n, r.shape[0])
        ids = np.argpartition(r, -n)[-n:]
        ids = ids[np.argsort(-r[ids], kind="stable")]
        top = tuple((int(t), float(r[t] - lse)) for t in ids)
    return TokenProb(int(token), float(r[token] - lse), top)


def _post(row: np.ndarray, spec: LogprobsSpec, params: SamplingParams, token: int,
          recent: sampling.Window | None, allow: sampling.Allow | None) -> TokenProb:
    if params.greedy:
        return TokenProb(int(token), 0.0, ((int(token), 0.0),) if spec.n else ())
    c = sampling.candidates(row, params, recent, allow)
    logp = np.log(c.probs())
    hit = np.flatnonzero(c.ids == token)
    chosen = float(logp[hit[0]]) if hit.size else float("-inf")
    top = tuple((int(t), float(lp)) for t, lp in zip(c.ids[: spec.n], logp[: spec.n],
                                                       strict=True))
    return TokenProb(int(token), chosen, top)
