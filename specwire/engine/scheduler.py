"""The engine's step: every running sequence's part in one decode.

A step asks each running generation for its part, decoding sequences first
(their last token, and the draft length their policy picks), then those still
reading their prompt, which get what is left of the budget (-b tokens) in
chunks: a long prompt does not stall the others. Then the drafts: those of one
draft model's sequences in lockstep, one draft decode per draft position for
all of them. One target decode for all the parts; each generation then verifies its
own rows with its own verifier and rolls back its own KV cells. A generation
joins at the next step and leaves as soon as it is done, failed or closed,
which frees its sequence for the next request.

The scheduler also times the target's curve for every sequence's adaptive
policy (`verify`): the cost of a decode against its size is the target's, not
a sequence's, and one line fed once per decode sees every size the batch
reaches, where each sequence's own would see few (and be fed steps whose
prompt chunks it could not see).

LoRA adapters apply to the whole context: a step decodes only the sequences whose
adapter scales (a request's own `lora`, or the target's) equal those of the one
first in turn; the others sit the step out (as llama-server batches them), and
the turn rotates, so each set of scales gets its steps.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from specwire.backend.base import BackendError
from specwire.backend.batch import BatchBackend, Part
from specwire.drafters.lockstep import Drafting, draft_together
from specwire.policy.throughput import LineFit, verify_line

if TYPE_CHECKING:
    from specwire.engine.engine import Generation

log = logging.getLogger(__name__)


class BatchFull(BackendError):
    """engine.generate found no free sequence (or the one asked for running): the batch
    holds at most n_seq generations, and one leaves only when it is done or closed."""


class BatchScheduler:
    """The running generations of one batch target, and their sequences."""

    def __init__(self, batch: BatchBackend) -> None:
        self.batch = batch
        self.running: list[Generation] = []
        self._lock = threading.RLock()   # join/leave from other threads than the stepper
        self._turn = 0                   # who plans first: rotates, so none is always last
        #: seconds of a decode of rounds only against its tokens - 1: the target's
        #: verification curve, shared by the sequences' adaptive policies (Engine.policy)
        self.verify: LineFit = verify_line()

    def free(self) -> list[int]:
        """Sequences no running generation holds."""
        with self._lock:
            held = {g.seq for g in self.running}
        return [i for i in range(self.batch.n_seq) if i not in held]

    def join(self, make: Callable[[int], Generation], seq: int | None = None) -> Generation:
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
            gen = make(seq)
            self.running.append(gen)
            return gen

    def leave(self, gen: Generation) -> None:
        """Out of the batch at once (finished, failed or closed): its drafter sequence
        ends and its sequence is free."""
        with self._lock:
            if gen not in self.running:
                return
            self.running.remove(gen)
        gen.done = True
        try:
            gen.finish()
        except Exception as e:  # noqa: BLE001 - reported to its owner, not to the batch
            log.error("sequence %d: ending the drafter's sequence failed", gen.seq,
                      exc_info=True)
            if gen.error is None:
                gen.error = e

    def step(self) -> None:
        """Plan every part (a decoding sequence's policy picks its k), draft them together,
        decode them together, hand each its rows."""
        planned = self.plan()
        self.draft(planned)
        planned = [(g, p) for g, p in planned if not g.done]
        if planned:
            parts = [p for _, p in planned]
            t0 = time.perf_counter()
            try:
                if planned[0][0].lora:
                    planned[0][0].target.apply_lora(planned[0][0].lora)
                rows = self.batch.decode(parts)
            except Exception as e:  # noqa: BLE001 - each sequence in the step reports it
                for gen, _ in planned:
                    self.fail(gen, e)
                return
            spent = time.perf_counter() - t0
            # A step that reads a prompt chunk is off the curve: its chunk's tokens cost
            # far less each than rounds' (one logits row, not one per token), and a long
            # one would set the line's slope alone.
            if all(p.logits == "all" for p in parts):
                self.verify.add(sum(len(p.tokens) for p in parts) - 1, spent)
            for (gen, _), r in zip(planned, rows, strict=True):
                self.guarded(gen, gen.take, r, spent)
        for gen in [g for g in self.running if g.done]:
            self.leave(gen)

    def plan(self) -> list[tuple[Generation, Part]]:
        """The step's parts, within the budget: decoding sequences first, in turns."""
        with self._lock:
            n = len(self.running)
            self._turn += 1
            turn = [self.running[(self._turn + i) % n] for i in range(n)] if n else []
        gens = sorted(turn, key=lambda g: not g.decoding)
        budget = self.batch.n_batch
        planned: list[tuple[Generation, Part]] = []
        used = 0
        if turn:   # the adapter scales of the first in turn; the others' in their turn
            lora = turn[0].lora
            gens = [g for g in gens if g.lora == lora]
        for i, gen in enumerate(gens):
            # What the others put in: those planned, and at least a token from each to come,
            # those still reading their prompt too: they decode from the next step on, so a
            # round beside them is priced as in the batch it is in, not as alone (a first
            # request's draft would otherwise hold up every prompt that arrived with it).
            others = used + max(0, len(gens) - i - 1)
            part = self.guarded(gen, gen.plan, budget - used, others)
            if part is not None:
                planned.append((gen, part))
                used += len(part.tokens) + gen.asked
        return planned

    def draft(self, planned: list[tuple[Generation, Part]]) -> None:
        """Every round's draft: those of one draft model's sequences in lockstep, a draft
        position of all of them per draft decode (drafters/lockstep.py)."""
        asking = [(gen, part) for gen, part in planned if gen.asked > 0]
        for gen, _ in asking:  # remote sessions: every request in flight before any wait
            self.guarded(gen, gen.ask)
        runs = [self.guarded(gen, gen.drafting) for gen, _ in asking]
        draft_together([r for r in runs if isinstance(r, Drafting)])
        for (gen, part), run in zip(asking, runs, strict=True):
            if not gen.done:
                self.guarded(gen, gen.drafted, part, run)

    def guarded(self, gen: Generation, fn: Callable, *args):
        """Run one generation's side of the step; an error ends that generation alone."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - handed to its owner by fail()
            self.fail(gen, e)
            return None

    def fail(self, gen: Generation, e: Exception) -> None:
        gen.error = e
        self.leave(gen)
