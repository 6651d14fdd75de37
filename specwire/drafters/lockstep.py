"""Many sequences' drafts in lockstep: draft position i of every sequence in one decode.

A draft model drafts one token per llama_decode, so drafting N requests in turn reads its
weights N times per position. When their ModelDrafters share one multi-sequence draft
context, `draft_together` feeds every unfinished `Drafting` in one decode (its catch-up
first, then one drafted token) and hands each its own logits row; each still picks its
tokens by its own rule, so a draft is what that sequence drafts alone. Each draft counts
what it would have cost alone (`spent`), priced by the shared context's DraftCost line
(policy/costs.py), since the lockstep's wall time would charge each sequence for every
other's catch-up; the adaptive policy prices drafting from it.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from typing import Any

import numpy as np

from specwire.backend.batch import Part
from specwire.drafters.base import Draft
from specwire.policy.costs import DraftCost

#: A draft in progress: yields the tokens to evaluate next, is sent their last logits
#: row, and returns the draft.
DraftSteps = Generator[list[int], np.ndarray, Draft]


class Drafting:
    """One sequence's draft in progress, stepped by draft_together (or alone)."""

    __slots__ = ("backend", "shared", "seq", "cost", "want", "draft", "error", "spent",
                 "first_s", "decodes", "_steps")

    def __init__(self, steps: DraftSteps, backend: Any, shared: Any = None,
                 seq: int = 0, cost: DraftCost | None = None) -> None:
        """backend: the sequence's own Backend; shared: the multi-sequence backend it is
        sequence `seq` of (None: it decodes alone); cost: the shared backend's DraftCost,
        whose decode line prices each draft's part of a shared decode."""
        self.backend, self.shared, self.seq = backend, shared, seq
        self.cost = cost if cost is not None else DraftCost()
        self.want: list[int] | None = None     # tokens to evaluate next; None once over
        self.draft = Draft()
        self.error: Exception | None = None
        self.spent = 0.0                       # seconds of decoding, as if alone
        self.first_s = 0.0                     # ... of which the first decode (the catch-up)
        self.decodes = 0
        self._steps = steps
        self._advance(None)

    @property
    def done(self) -> bool:
        return self.want is None

    @property
    def steady_s(self) -> float | None:
        """What the draft would have cost had the drafter been caught up: its later
        decodes, one more of them in place of the catch-up (None: one decode only)."""
        if self.decodes < 2:
            return None
        return (self.spent - self.first_s) * self.decodes / (self.decodes - 1)

    def _charge(self, seconds: float) -> None:
        if self.decodes == 0:
            self.first_s = seconds
        self.decodes += 1
        self.spent += seconds

    def feed(self, row: np.ndarray) -> None:
        """The last logits row of `want`: the draft goes on to its next tokens."""
        self._advance(row)

    def fail(self, e: Exception) -> None:
        self.error, self.want = e, None
        self._steps.close()

    def _advance(self, row: np.ndarray | None) -> None:
        try:
            self.want = next(self._steps) if row is None else self._steps.send(row)
        except StopIteration as stop:
            self.want, self.draft = None, stop.value
        except Exception as e:  # noqa: BLE001 - the drafter's failure, reported by its guard
            self.error, self.want = e, None


def draft_together(runs: Sequence[Drafting]) -> None:
    """Step every draft to its end: those of one shared backend in one decode per step."""
    live = [r for r in runs if not r.done]
    while live:
        groups: dict[int, list[Drafting]] = {}
        for r in live:
            groups.setdefault(id(r.shared) if r.shared is not None else id(r), []).append(r)
        for group in groups.values():
            _step(group)
        live = [r for r in live if not r.done]


def _step(group: list[Drafting]) -> None:
    """One decode for the group (or each alone: a single draft, or catch-ups too long
    for one batch, which the backend's eval reads in chunks)."""
    shared = group[0].shared
    total = sum(len(r.want) for r in group)
    if len(group) == 1 or shared is None or total > shared.n_batch:
        for r in group:
            t0 = time.perf_counter()
            try:
                row = r.backend.eval(r.want, "last")[-1]
            except Exception as e:  # noqa: BLE001 - this sequence's draft fails alone
                r.fail(e)
                continue
            r.feed(row)
            r._charge(time.perf_counter() - t0)
        return
    t0 = time.perf_counter()
    try:
        rows = shared.decode([Part(r.seq, r.want, "last") for r in group])
    except Exception as e:  # noqa: BLE001 - the decode failed for every draft in it
        for r in group:
            r.fail(e)
        return
    spent = time.perf_counter() - t0
    cost = group[0].cost        # the shared backend's, which its drafters share
    cost.observe_decode(total, spent)
    for r, got in zip(group, rows, strict=True):
        t1 = time.perf_counter()
        alone = cost.share(len(r.want), total, spent)
        r.feed(got[-1])            # picks its next token: its own time, all of it
        r._charge(alone + time.perf_counter() - t1)
