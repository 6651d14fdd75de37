"""One sequence on a draft node: its KV cache, its branch, how it drafts.

A synchronous session drafts exactly `k` tokens on the caller's thread per verdict; a
pipelined one drafts on its own thread past the last verdict, applying verdicts between
tokens, so one thread alone touches the branch and the KV cache. A session starts from
the best cached prefix of its history (node/kv_cache.py) and says how much that was
(DraftChunk.cache_n, prompt_n); a long catch-up is announced at once and can be closed.
An adaptive target's synchronous session stops its drafts by the calibrated rule
(policy/adaptive.py CalibratedStop) instead of --draft-p-min.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace

from specwire.backend.base import Backend, sync_prefix, usable_prefix
from specwire.backend.batch import Paced
from specwire.config import DraftParams, VerifyMode
from specwire.drafters.model import ModelDrafter
from specwire.link import alternates as alt
from specwire.link.alternate_plan import AlternatePlan
from specwire.link.catch_up import CatchUp
from specwire.link.fork import ForkDrafter, ForkJob
from specwire.link.messages import (
    NOTICE_AFTER,
    Chunk,
    DraftMessage,
    Failure,
    Open,
    ProtocolError,
    Verdict,
    pad_sparse,
)
from specwire.link.rule import follow, take_tree_alternate
from specwire.policy.adaptive import CalibratedStop, Calibration

log = logging.getLogger(__name__)


class DraftSession:
    """Drafts for one sequence; `send` is called on the thread that drafts.

    Synchronous: call `step` for the Open and each verdict. Pipelined: `start` the
    drafting thread, then `push` verdicts and `close` it from any thread.
    """

    def __init__(
        self,
        backend: Backend,
        open_msg: Open,
        send: Callable[[DraftMessage], None],
        seed: int | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        open_msg.check(backend.n_vocab, backend.n_ctx)
        self.backend, self.send = backend, send
        # A draft node's sequence decodes with the other sessions' (node/steps.py): it is
        # told while this session drafts, so that a shared decode waits for it then, and
        # the target is told what the node's decodes hold.
        self._paced = backend if isinstance(backend, Paced) else None
        self._told_step: tuple[int, int] | None = None
        sampling = open_msg.sampling
        if seed is not None:  # the node's own --seed wins over the target's
            sampling = replace(sampling, seed=seed)
        self.mode = open_msg.mode
        self.pipelined = open_msg.pipelined
        self.lookahead = max(1, open_msg.lookahead)
        self.q_k = max(1, open_msg.top_k_q)
        # Pipelined drafting runs on a core the target does not use: stopping early
        # would only idle it, so p_min and the calibrated stop are for synchronous drafts.
        self.stop = None
        if open_msg.calibrated and not self.pipelined:
            self.stop = CalibratedStop(calibration or Calibration(), open_msg.keep_min)
        p_min = 0.0 if self.pipelined or self.stop else open_msg.p_min
        params = DraftParams(
            n_max=min(64, self.lookahead), p_min=p_min, mode=self.mode, top_k_q=self.q_k
        )
        self.drafter = ModelDrafter(backend, stop_rule=self.stop)
        self.drafter.begin(open_msg.history, sampling, params)
        # Pre-drafted branches (pipelined, where a draft token carries no q of its own).
        self.plan: AlternatePlan | None = None
        if self.pipelined and open_msg.alternates and (
                self.mode is not VerifyMode.REJECTION or sampling.greedy):
            self.plan = AlternatePlan(
                alt.AlternateParams(per_chunk=open_msg.alternates,
                                 length=max(1, open_msg.alternate_len)),
                self.drafter.sampling, open_msg.tree, open_msg.second_choices)
        # A node's sequence with a fork drafts the alternates beside the branch, in the
        # same decodes; any other backend drafts them between the branch's tokens.
        self.fork: ForkDrafter | None = None
        if self.plan is not None and ForkDrafter.usable(backend):
            self.fork = ForkDrafter(backend, self.drafter.sampling, self.plan.params.length,
                                    stale=self._stale, wake=self._wake)
        self.committed: list[int] = list(open_msg.history)
        # What the backend's cache already holds of the history, and what is left to evaluate.
        self.cache_n = usable_prefix(backend, self.committed)
        self.prompt_n = len(self.committed) - self.cache_n
        self._told_cache = False  # cache_n and prompt_n went out in a message
        self.branch: list[int] = []  # drafted beyond `committed`, on branch `gen`
        self.confidence: list[float] = []  # calibrated sessions: per branch token
        self.gen = 0
        self.sent = 0  # branch tokens already sent
        #: how far past the last verdict to draft now: the lookahead, or the round's k
        self.reach = self.lookahead if self.pipelined else open_msg.k
        self.stalled = False  # p_min ended the branch; wait for a verdict
        self.timing = open_msg.timing
        self._busy_since = 0.0  # perf_counter when the work for the next chunk began
        self._inbox: collections.deque[Verdict] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name="draft-session", daemon=True)
        # Synchronous sessions with a long history catch up on a thread of its own,
        # answering verdicts meanwhile with empty chunks (see announce).
        self.catch_up = CatchUp(backend, self.committed, self.cache_n, lambda: self._closed)

    # -- synchronous: on the caller's thread --------------------------------------

    def announce(self) -> None:
        """Right after the Open: if catching up on the history will take a while, send the
        cache figures now in an empty chunk (otherwise they ride on the first draft); a
        synchronous session then catches up on a thread of its own, so that it can
        answer verdicts (with nothing) and hear a Close meanwhile."""
        if self.prompt_n > NOTICE_AFTER and not self._told_cache:
            self._busy_since = time.perf_counter()
            self._flush([], [], done=False)
            if not self.pipelined:
                self.catch_up.start()

    def finish(self) -> None:
        """Close, and wait for the session's threads to stop."""
        self.close()
        if self.thread.is_alive():
            self.thread.join()
        with contextlib.suppress(Exception):   # the catch-up's error: reported by step
            self.catch_up.finish()
        if self.fork is not None:
            self.fork.close()

    def step(self, verdict: Verdict | None) -> None:
        """Apply a verdict (None right after the Open), then draft the tokens wanted."""
        self._busy_since = time.perf_counter()
        if self.catch_up.started:
            if self.catch_up.running:  # still catching up: no draft yet, and how far behind
                if verdict is not None:
                    self._apply(verdict)
                    self._flush([], [], done=False,
                                behind=self.catch_up.behind(len(self.committed)))
                return
            self.catch_up.finish()
        if verdict is not None:
            self._apply(verdict)
        if not self.stalled and len(self.branch) < self._limit():
            with self._pace(alternate=False, answering=True):
                self._draft_burst()

    def _pace(self, alternate: bool, answering: bool) -> AbstractContextManager[None]:
        """While this session drafts (a draft node's shared decodes wait for it then)."""
        if self._paced is None:
            return nullcontext()
        return self._paced.drafting(alternate, answering)

    # -- pipelined: the drafting thread and what other threads call --------------

    def start(self) -> None:
        self.thread.start()

    def push(self, verdict: Verdict) -> None:
        with self._cv:
            self._inbox.append(verdict)
            self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()

    # -- the drafting thread ------------------------------------------------------

    def _run(self) -> None:
        try:
            self.announce()
            self.catch_up.run()
            while (work := self._next_work()) is not None:
                if work == "fork":
                    self._fork_work(send=True)
                    continue
                with self._pace(alternate=work != "draft", answering=False):
                    if work == "draft":
                        self._draft_burst()
                    else:
                        self._draft_late_alternate(work)
        except Exception as e:  # noqa: BLE001 - the node must survive any one session
            msg = error_message(e)
            self.error = msg.message
            self.send(msg)

    def _next_work(self) -> str | int | None:
        """Apply verdicts; wait until there is work: "fork" (an alternate drafted on the
        fork is done, or one is due there), the index of a sent branch token whose
        alternate is worth drafting first, or "draft" the branch on. None when closed."""
        with self._cv:
            while True:
                while self._inbox:
                    self._apply(self._inbox.popleft())
                if self._closed:
                    return None
                if self.fork is not None and (self.fork.take_ready() or self._fork_due()):
                    return "fork"
                j = self._alternate_first()
                if j is not None:
                    return j
                if not self.stalled and len(self.branch) < self._limit():
                    return "draft"
                self._cv.wait()

    def _alternate_first(self) -> int | None:
        """The sent branch token whose alternate to draft before the branch's next token
        (AlternatePlan.first); None for sessions without alternates, or with a fork."""
        if self.plan is None or self.fork is not None:
            return None
        full = self.stalled or len(self.branch) >= self._limit()
        return self.plan.first(len(self.committed), self.sent, full, self.lookahead)

    # -- alternates on the fork (link/fork.py) -----------------------------------

    def _fork_due(self) -> int | None:
        """The sent branch token whose alternate the idle fork should draft now."""
        if self.fork.busy:
            return None
        return self.plan.beside(len(self.committed), self.sent)

    def _fork_work(self, send: bool) -> None:
        """Take the fork's finished alternate into the next chunk (send: in a chunk of its
        own now), and start the next one due."""
        job = self.fork.take()
        if job is not None:
            if job.error is not None:
                raise job.error
            fresh = not self._stale(job) and job.at not in self.plan.alts
            if fresh and self.plan.drafted(job.at, job.tokens) and send:
                self._flush([], [], done=self.stalled or len(self.branch) >= self._limit())
        j = self._fork_due()
        if j is not None:
            ctx = self.committed + self.branch[:j]
            self.fork.start(self.gen, ctx, self.plan.choices[j].second)

    def _stale(self, job: ForkJob) -> bool:
        """The branch moved past this job's alternate (or the session closed)."""
        return self._closed or job.gen != self.gen or job.at < len(self.committed)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _draft_late_alternate(self, j: int) -> None:
        """Draft the alternate for branch token j and send it in a chunk of its own; a
        verdict cuts it short. The cache re-syncs to the branch at its next burst."""
        self._busy_since = time.perf_counter()
        ctx = self.committed + self.branch[:j]
        tokens = alt.draft_alternate(self.backend, self.drafter.sampling, ctx,
                                     self.plan.choices[j].second, self.plan.params.length,
                                     stop=lambda: bool(self._inbox) or self._closed,
                                     cached=sync_prefix(self.backend, ctx))
        if self.plan.drafted(len(ctx), tokens):
            self._flush([], [], done=len(self.branch) >= self._limit())

    def _limit(self) -> int:
        room = self.backend.n_ctx - len(self.committed) - 1
        return max(0, min(self.reach, room))

    def _apply(self, v: Verdict) -> None:
        """The branch rule (specwire/link/rule.py), on a verdict checked here."""
        if v.position != len(self.committed):
            raise ProtocolError(f"verdict at position {v.position}, expected {len(self.committed)}")
        a = v.accepted
        if a > self.sent or (a and v.gen != self.gen):
            raise ProtocolError(
                f"verdict accepts {a} tokens of gen {v.gen}; sent {self.sent} of gen {self.gen}"
            )
        tokens = v.check(self.backend.n_vocab)
        if len(self.committed) + a + len(tokens) > self.backend.n_ctx:
            raise ProtocolError("verdict runs past the node's context")
        if self.stop is not None:
            self._calibrate(a, tokens)
            if v.keep_min:
                self.stop.threshold = v.keep_min
        if v.alternate:
            self._take_alternate(v, tokens)
            return
        start = len(self.committed)
        self.committed += self.branch[:a] + tokens
        n = follow(start, self.branch, self.committed)
        if n >= 0:
            self.branch = self.branch[n:]
            del self.confidence[:n]
            self.sent = max(0, self.sent - n)
            if self.plan is not None:
                self.plan.kept(n, len(self.committed))
        else:  # dead, or passed: this end holds the whole branch, so it is over
            self.branch, self.confidence, self.sent, self.gen = [], [], 0, self.gen + 1
            if self.plan is not None:
                self.plan.restart()
        if not self.pipelined:
            # A smaller k drops what is unsent past it, never what was sent: the target
            # holds that (or will, from a chunk on its way) and would read new tokens of
            # this gen as a chunk that contradicts it (tests/link/test_draftlink.py).
            self.reach = v.k or self.reach
            keep = max(self.reach, self.sent)
            del self.branch[keep:]
            del self.confidence[keep:]
        self.stalled = False

    def _take_alternate(self, v: Verdict, tokens: list[int]) -> None:
        """A verdict that takes the alternate sent for position + accepted: its rest,
        already sent, is branch gen + 1 (specwire/link/rule.py)."""
        at = v.position + v.accepted
        sent = self.plan.alts.get(at) if self.plan is not None and v.gen == self.gen else None
        rest = take_tree_alternate(sent, tokens)
        if rest is None:
            raise ProtocolError(f"verdict takes an alternate at {at} of gen {v.gen} "
                                "that was not sent, or does not begin with its tokens")
        self.committed += self.branch[: v.accepted] + tokens
        self.branch, self.sent, self.gen = rest, len(rest), self.gen + 1
        self.confidence = []
        self.plan.restart(len(rest))
        self.stalled = False

    def _calibrate(self, accepted: int, tokens: list[int]) -> None:
        """Judge the sent branch against what the verdict commits: its first `accepted`
        tokens were kept, and the next one is judged by whether the target's own token
        is the same (the target may not have verified it; where it did, greedy and
        coupled verification keep exactly the tokens that agree)."""
        judged = self.confidence[: min(self.sent, accepted + 1)]
        agrees = accepted < self.sent and tokens[:1] == self.branch[accepted : accepted + 1]
        self.stop.calibration.learn(judged, accepted + 1 if agrees else accepted)

    def _draft_burst(self) -> None:
        """Draft until the limit, p_min, or a pending verdict; send as we go."""
        target = self._limit() - len(self.branch)
        if self.pipelined:
            self._busy_since = time.perf_counter()
        pending: list[int] = []
        sparse_pending: list = []
        base = self.committed + self.branch
        paused = False  # stopped for an alternate, to go on after it

        def on_token(i: int, tok: int, sd) -> bool:
            nonlocal paused
            self.branch.append(tok)
            pending.append(tok)
            if sd is not None:
                sparse_pending.append(sd)
            due = (self.plan is not None and self.plan.tree and self.plan.tree_at(
                len(self.committed), len(self.branch), self.lookahead) is not None)
            if self.fork is not None:
                self._fork_work(send=False)
            if self.pipelined and (self.sent == 0 or len(pending) >= 2 or due):
                self._flush(pending, sparse_pending, done=False)
                if self._alternate_first() is not None:
                    paused = True
                    return False  # an alternate first: the next work says which
            return not self._inbox and not self._closed

        result = self.drafter.draft_from(
            base, target, on_token=on_token,
            at_choice=self.plan.note if self.plan is not None else None)
        if self.stop is not None:
            self.confidence += result.confidence or []
        stopped_by_pmin = len(result) < target and not self._inbox and not paused
        self.stalled = stopped_by_pmin
        done = stopped_by_pmin or len(self.branch) >= self._limit()
        if pending or done or (self.plan is not None and self.plan.pending):
            self._flush(pending, sparse_pending, done=done)

    def _flush(self, pending: list[int], sparse_pending: list, done: bool,
               behind: int | None = None) -> None:
        start = len(self.committed) + self.sent
        if self.plan is not None and self.plan.second_choices and pending:
            self.plan.queue_second_choices(len(self.committed), self.sent, len(pending))
        # A synchronous chunk is the whole answer to its verdict: no `done` to send.
        chunk = Chunk(self.gen, start, list(pending), done=done and self.pipelined,
                      sparse=pad_sparse(sparse_pending, self.q_k) if sparse_pending else None)
        if self.timing:
            now = time.perf_counter()
            chunk.busy_us = min(2**32 - 1, int(1e6 * (now - self._busy_since)))
            self._busy_since = now
        if self.plan is not None and self.plan.pending:
            chunk.alternates = self.plan.take_pending()
        if self._paced is not None and self._paced.step != self._told_step:
            chunk.step = self._told_step = self._paced.step
        if not self._told_cache:
            chunk.cache_n, chunk.prompt_n, self._told_cache = self.cache_n, self.prompt_n, True
        elif behind is not None:
            chunk.prompt_n = behind
        self.sent += len(pending)
        pending.clear()
        sparse_pending.clear()
        self.send(chunk)


def error_message(e: Exception) -> Failure:
    """The DraftError that ends a session: a peer's mistake, or this node's own failure."""
    if isinstance(e, ProtocolError):
        log.warning("draft session: protocol error: %s", e)
        text = str(e)
    else:
        log.error("draft session failed", exc_info=e)
        text = f"{type(e).__name__}: {e}"
    return Failure(text)
