"""The engine's step: every running sequence's part in one decode.

`schedule` asks each running sequence for its part, decoding sequences first (their last
token and the draft length their policy picks), then prompts in chunks of what is left of
the decode's -b tokens, so a long prompt does not stall the others. `draft` fills the
rounds (one draft model's sequences in lockstep), and after the one target decode
`postprocess` hands each sequence its rows to verify and roll back in its own KV cells
(round.py). LoRA scales apply to the whole context, so a step decodes only the sequences
whose scales equal those of the one first in turn, and the turn rotates (as llama-server
batches them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specwire.backend.base import BackendError
from specwire.backend.batch import BatchBackend, Part
from specwire.drafters.lockstep import Drafting, draft_together
from specwire.engine import round as rounds
from specwire.engine.sequence import SequenceState

log = logging.getLogger(__name__)


class BatchFull(BackendError):
    """engine.generate found no free sequence (or the one asked for running): the batch
    holds at most n_seq generations, and one leaves only when it is done or closed."""


@dataclass(slots=True)
class Batch:
    """A step's parts, one per sequence that takes part, and its decode's time."""

    planned: list[tuple[SequenceState, Part]] = field(default_factory=list)
    decode_s: float = 0.0

    @property
    def parts(self) -> list[Part]:
        return [p for _, p in self.planned]


class BatchScheduler:
    """The running sequences of one batch target. start: wires a sequence up when it
    is first scheduled (Engine.start)."""

    def __init__(self, batch: BatchBackend, start: Callable[[SequenceState], None]) -> None:
        self.batch = batch
        self.start = start
        self.running: list[SequenceState] = []
        self._lock = threading.RLock()   # join/leave from other threads than the stepper
        self._turn = 0                   # who plans first: rotates, so none is always last

    def free(self) -> list[int]:
        """Sequences no running generation holds."""
        with self._lock:
            held = {s.seq for s in self.running}
        return [i for i in range(self.batch.n_seq) if i not in held]

    def join(self, make: Callable[[int], SequenceState],
             seq: int | None = None) -> SequenceState:
        with self._lock:
            free = self.free()
            n = self.batch.n_seq
            if seq is None:
                if not free:
                    raise BatchFull(
                        f"engine.generate: all {n} sequence{'s' if n > 1 else ''} of the "
                        f"target are busy with running generations; run or close() one "
                        f"first, or give the target more sequences (-np)")
                seq = free[0]
            elif not 0 <= seq < n:
                raise BatchFull(f"engine.generate: sequence {seq} outside 0..{n - 1}")
            elif seq not in free:
                raise BatchFull(f"engine.generate: sequence {seq} is busy with a running "
                                f"generation; run or close() it first, or pass seq=None")
            state = make(seq)
            self.running.append(state)
            return state

    def leave(self, s: SequenceState) -> None:
        """Out of the batch at once (finished, failed or closed): its drafter sequence
        ends and its sequence is free."""
        with self._lock:
            if s not in self.running:
                return
            self.running.remove(s)
        s.done = True
        try:
            s.finish()
        except Exception as e:  # noqa: BLE001 - reported to its owner, not to the batch
            log.error("sequence %d: ending the drafter's sequence failed", s.seq,
                      exc_info=True)
            if s.error is None:
                s.error = e

    def schedule(self) -> Batch:
        """The step's parts, within -b tokens: decoding sequences first, in turns."""
        with self._lock:
            n = len(self.running)
            self._turn += 1
            turn = [self.running[(self._turn + i) % n] for i in range(n)] if n else []
        if turn:   # the adapter scales of the first in turn; the others' in their turn
            lora = turn[0].lora
            turn = [s for s in turn if s.lora == lora]
        seqs = sorted(turn, key=lambda s: not s.decoding)
        space = self.batch.n_batch
        batch = Batch()
        used = 0
        for i, s in enumerate(seqs):
            # What the others put in: those planned, and at least a token from each to come,
            # those still reading their prompt too: they decode from the next step on, so a
            # round beside them is priced as in the batch it is in, not as alone (a first
            # request's draft would otherwise hold up every prompt that arrived with it).
            others = used + max(0, len(seqs) - i - 1)
            part = self.guarded(s, self._plan, s, space - used, others)
            if part is not None:
                batch.planned.append((s, part))
                used += len(part.tokens) + s.k
        return batch

    def _plan(self, s: SequenceState, space: int, others: int) -> Part | None:
        if not s.started:
            self.start(s)
            if s.done:
                return None
        return rounds.plan(s, space, others)

    def draft(self, batch: Batch) -> None:
        """Every round's draft: those of one draft model's sequences in lockstep, a draft
        position of all of them per draft decode (drafters/lockstep.py). Sequences that
        failed meanwhile leave the step."""
        asking = [(s, part) for s, part in batch.planned if s.k > 0]
        for s, _ in asking:  # remote sessions: every request in flight before any wait
            self.guarded(s, rounds.ask, s)
        runs = [self.guarded(s, rounds.drafting, s) for s, _ in asking]
        draft_together([r for r in runs if isinstance(r, Drafting)])
        for (s, part), run in zip(asking, runs, strict=True):
            if not s.done:
                self.guarded(s, rounds.drafted, s, part, run)
        batch.planned = [(s, p) for s, p in batch.planned if not s.done]

    def postprocess(self, batch: Batch, rows: list[np.ndarray]) -> None:
        """Each sequence its rows (verify, roll back, emit); then the done ones leave."""
        for (s, _), r in zip(batch.planned, rows, strict=True):
            self.guarded(s, rounds.take, s, r, batch.decode_s)
        for s in [s for s in self.running if s.done]:
            self.leave(s)

    def guarded(self, s: SequenceState, fn: Callable, *args):
        """Run one sequence's side of the step; an error ends that sequence alone."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to its owner by fail()
            self.fail(s, e)
            return None

    def fail(self, s: SequenceState, e: Exception) -> None:
        s.error = e
        self.leave(s)
