"""Alternates: where a draft is unsure, also draft its second choice and a few tokens on.

After a rejection a pipelined node's lookahead is gone and the target has nothing to
verify until a fresh draft arrives. Where the draft model hesitates and the target is
likely to pick its second choice (`worth_branching`), the node also drafts that choice
and a few tokens after it (an alternate); a tree-verifying target may take the second
choice alone (Open.second_choices). If the target's own token there is that choice, the
continuation is verified at once (docs/protocol.md, "Pre-drafted branches"). Only the
draft changes, so output stays lossless; greedy and coupled verification only (rejection
would need a q for every alternate token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specwire.backend.base import Backend
from specwire.config import SamplingParams
from specwire.link.messages import MAX_ALTERNATE_TOKENS, MAX_ALTERNATES
from specwire.sample import rng, sampling


@dataclass(slots=True, frozen=True)
class AlternateParams:
    """How many alternates a node drafts, how long, and where."""

    per_chunk: int = 2  # at most this many alternates in one chunk (B)
    length: int = 4  # tokens per alternate, its first token included (L)
    top_below: float = 0.8  # branch where the draft's top probability is below this...
    # ...and the chance that the target reaches this position and picks the second
    # choice, judged by the draft (the product of its top probabilities since the last
    # verdict, times the second's probability), is at least this
    value_min: float = 0.15
    # Before the branch's next token: an alternate of worth w costs length - 1 drafted
    # tokens and, taken, saves a round without a draft (about `gain` tokens verified); the
    # next token is worth the chance the target ever verifies it.
    gain: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.per_chunk <= MAX_ALTERNATES:
            raise ValueError(f"alternates per chunk: {self.per_chunk} outside 0..{MAX_ALTERNATES}")
        if not 1 <= self.length <= MAX_ALTERNATE_TOKENS:
            raise ValueError(f"alternate length: {self.length} outside 1..{MAX_ALTERNATE_TOKENS}")


#: The draft's confidence is judged among its best few tokens, as llama.cpp's p_min is
#: (sampling.top_prob): a partition, not a softmax over the whole vocabulary.
_TOP = sampling.P_MIN_TOP_K


@dataclass(slots=True, frozen=True)
class TopTwo:
    """The draft's first and second choice at one position, and their probabilities."""

    first: int
    second: int
    p_first: float
    p_second: float


def top_two(row: np.ndarray, params: SamplingParams, position: int,
            recent: sampling.Window | None = None) -> TopTwo | None:
    """The two tokens the draft would pick first at `position`, by the rule it drafts
    with (argmax for greedy, the shared Gumbel noise for coupled); None if only one
    token survives the sampling filters."""
    adjusted = sampling.adjusted(row, params, recent)
    top = sampling.top_ids(adjusted, _TOP)
    logits = adjusted[top].astype(np.float64)
    probs = np.exp(logits - logits[0])
    probs /= probs.sum()
    if params.greedy:
        return TopTwo(int(top[0]), int(top[1]), float(probs[0]), float(probs[1]))
    cand = sampling.candidates(row, params, recent)
    if cand.ids.size < 2:
        return None
    g = rng.gumbel(params.seed, rng.GUMBEL, position, cand.ids)
    order = np.argsort(-(cand.scaled + g), kind="stable")[:2]
    first, second = int(cand.ids[order[0]]), int(cand.ids[order[1]])
    where = {int(t): k for k, t in enumerate(top)}
    p1 = float(probs[where[first]]) if first in where else 0.0
    p2 = float(probs[where[second]]) if second in where else 0.0
    return TopTwo(first, second, p1, p2)


def alternate_params(per_chunk: int | None) -> AlternateParams | None:
    """The --draft-branches setting (None: the default): None for 0, no alternates."""
    if per_chunk is None:
        return AlternateParams()
    return AlternateParams(per_chunk=per_chunk) if per_chunk else None


def worth_branching(two: TopTwo | None, reach: float, params: AlternateParams) -> bool:
    """Draft the second choice here: the draft is unsure, and by its own judgment the
    target will likely get here (`reach`: the product of the draft's top probabilities
    at the branch's unverified positions before this one) and pick the second choice."""
    return (two is not None and params.per_chunk > 0 and two.p_first < params.top_below
            and reach * two.p_second >= params.value_min)


def second_choice_due(two: TopTwo | None, reach: float, params: AlternateParams) -> bool:
    """Send the second choice alone here (a target that verifies it in a tree): wherever
    a drafted alternate is not worth it (worth_branching), however sure the draft is. A
    sure draft is rejected too, and then the target's token is often its second choice;
    alone it costs no drafting, and taken it adds the target's own token after it. The
    target hangs only a few in each tree, the first positions' (the likeliest reached)."""
    return (two is not None and params.per_chunk > 0
            and not worth_branching(two, reach, params))


def alternate_first(value: float, reach_next: float, params: AlternateParams) -> bool:
    """Draft an alternate of this worth before the branch's next token, whose chance of
    being verified at all is reach_next: when its worth per token drafted is higher."""
    return value * params.gain / max(1, params.length - 1) > reach_next


def draft_alternate(backend: Backend, params: SamplingParams, ctx: list[int], first: int,
                    length: int, stop: Callable[[], bool] | None = None,
                    cached: int | None = None) -> list[int]:
    """Draft `first` and up to length - 1 tokens after it, from ctx, until stop() says so.
    The backend's cache holds ctx's first `cached` tokens (None: all of it); the rest go
    into the first decode with `first`. The cache holds at most ctx afterwards."""
    n = len(ctx)
    out = [first]
    room = backend.n_ctx - n - 1
    todo = ctx[n if cached is None else cached:]
    try:
        while len(out) < min(length, room) and not (stop is not None and stop()):
            row = backend.eval([*todo, out[-1]], logits="last")[-1]
            todo = []
            seq = ctx + out
            out.append(sampling.coupled(row, params, len(seq), sampling.recent_window(seq, params)))
    finally:
        backend.truncate(min(n, backend.n_past))
    return out
