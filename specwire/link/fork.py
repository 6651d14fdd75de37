"""Alternates drafted beside their branch: on a fork of its sequence, in the same decodes.

A pipelined session drafts its branch on one sequence of the node's context. Drafting an
alternate (link/alternates.py) on that sequence would hold the branch up by the
alternate's length, and the branch is what the target waits for after a rejection. On a
fork (a sequence of its own that shares the branch's cells up to the alternate's
position: backend/llama.py fork_seq) a thread of its own drafts it while the branch goes
on, and the node's step loop (node/steps.py) puts both sequences' tokens into the same
decodes, where a decode of two sequences costs about what one costs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

from specwire.backend.base import Backend, usable_prefix
from specwire.backend.batch import Forking, Paced
from specwire.config import SamplingParams
from specwire.link import alternates as alt


@dataclass(slots=True)
class ForkJob:
    """One alternate to draft: its first token `first` at position len(ctx) of branch gen."""

    gen: int
    ctx: list[int]
    first: int
    tokens: list[int] | None = None   # drafted (first included), once done
    error: Exception | None = None

    @property
    def at(self) -> int:
        return len(self.ctx)


class ForkDrafter:
    """Drafts a session's alternates one at a time on its sequence's fork.

    The session's thread starts a job (`start`) and takes it back done (`take`); the
    job's thread stops early where `stale(job)` says the branch moved past it. `wake` is
    called when a job is done, so that a session waiting for a verdict sees it.
    """

    def __init__(self, branch: Forking, sampling: SamplingParams, length: int,
                 stale: Callable[[ForkJob], bool], wake: Callable[[], None]) -> None:
        self.branch, self.sampling, self.length = branch, sampling, length
        self.stale, self.wake = stale, wake
        self._fork: Backend | None = None
        self._job: ForkJob | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    @staticmethod
    def usable(backend: Backend) -> bool:
        """Whether this backend's sequence has a fork to draft alternates on."""
        return isinstance(backend, Forking) and bool(backend.forks)

    @property
    def busy(self) -> bool:
        """A job started and not yet taken back."""
        return self._job is not None

    def start(self, gen: int, ctx: list[int], first: int) -> None:
        """Draft the alternate `first` after ctx (branch gen), from the branch's cells that
        ctx begins with; on the session's thread, between its branch's decodes."""
        if self.busy:
            raise RuntimeError("ForkDrafter.start: a job is still out")
        cached = usable_prefix(self.branch, ctx)
        self._fork = self.branch.fork(cached)
        self._job = ForkJob(gen, list(ctx), first)
        self._done.clear()
        self._thread = threading.Thread(target=self._run, args=(self._job, cached),
                                        name="draft-fork", daemon=True)
        self._thread.start()

    def take_ready(self) -> bool:
        """A job is done and waits to be taken."""
        return self._job is not None and self._done.is_set()

    def take(self) -> ForkJob | None:
        """The job, once done (then the drafter is free again); None while it runs."""
        if not self.take_ready():
            return None
        job, self._job = self._job, None
        self._thread.join()
        return job

    def close(self) -> None:
        """Wait for a job still out (it stops at its next token once stale), empty the fork."""
        if self._thread is not None:
            self._thread.join()
        self._job = None
        if self._fork is not None:
            self._fork.close()

    def _run(self, job: ForkJob, cached: int) -> None:
        fork = self._fork
        try:
            with fork.drafting(alternate=True) if isinstance(fork, Paced) else nullcontext():
                job.tokens = alt.draft_alternate(fork, self.sampling, job.ctx, job.first,
                                                 self.length, stop=lambda: self.stale(job),
                                                 cached=cached)
        except Exception as e:  # noqa: BLE001 - the session raises it when it takes the job
            job.error = e
        finally:
            self._done.set()
            self.wake()
