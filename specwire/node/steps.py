"""The draft node's step loop: every drafting session's next tokens in one llama_decode.

The node's sessions draft in one llama.cpp context of many sequences (backend/llama.py
LlamaBackend with n_seq > 1), a session per sequence, so each session's KV stays apart
(and each cache scope's: node/kv_cache.py hands a sequence to one scope at a time). A
session's thread asks for its logits as before (`StepSequence.eval`); one loop gathers
the parts of every session drafting now, its branch or an alternate, and decodes them
together. On a GPU, or a CPU reading a small model from RAM, a decode of several
sequences costs about what one costs, so the weights are read once per node step instead
of once per session. A session says when it is drafting (`StepSequence.drafting`), so
that a step waits for each drafting session's part (at most GATHER_S) and never for one
that waits for its next verdict.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

import numpy as np

from specwire.backend.base import BackendError
from specwire.backend.batch import BatchBackend, Part

#: The longest a step waits for a drafting session's part after the first part came: a
#: session between two tokens picks its next one in well under this, so the wait ends
#: early unless one is busy elsewhere (sending a chunk on a slow connection).
GATHER_S = 0.01
#: A synchronous session drafts as the answer to each verdict, and a batch target sends
#: its sessions' verdicts together, a little apart on the way: the first step after the
#: node was idle waits this long for the other answering sessions of the last wave of
#: steps, so that their drafts begin together. Pipelined sessions never wait so: their
#: fresh branch after a rejection is what the target waits for.
LINGER_S = 0.003


@dataclass(slots=True)
class StepCounters:
    """What the loop decoded since the node started: decodes, and the parts in them by
    kind (a session's branch, or an alternate it drafts), for /metrics and the logs."""

    decodes: int = 0
    branches: int = 0      # branch parts, summed over decodes (sessions per decode)
    alternates: int = 0    # alternate parts, summed over decodes
    beside: int = 0        # ... of them in the same decode as their own branch's part
    tokens: int = 0

    def per_decode(self) -> tuple[float, float]:
        """(sessions, alternates) per decode so far."""
        n = max(1, self.decodes)
        return self.branches / n, self.alternates / n


@dataclass(slots=True)
class _Request:
    """One sequence's part, waiting for its decode."""

    part: Part
    alternate: bool
    parent: int | None = None  # a fork's part: the sequence it branches from
    rows: np.ndarray | None = None
    step: tuple[int, int] = (0, 0)   # (branches, alternates) in its decode
    error: Exception | None = None
    done: bool = False


class StepLoop:
    """Hands out the sequences of one multi-sequence backend and decodes their parts
    together, on a thread of its own; every other call into the context holds its lock."""

    def __init__(self, shared: BatchBackend, gather_s: float = GATHER_S,
                 linger_s: float = LINGER_S) -> None:
        self.shared, self.gather_s, self.linger_s = shared, gather_s, linger_s
        self.n_seq = shared.n_seq
        self.counters = StepCounters()
        self.lock = threading.RLock()        # the context: decodes, truncates, states
        self._cv = threading.Condition()     # the requests, the sequences, the counters
        self._pending: list[_Request] = []
        self._drafting: Counter[int] = Counter()   # sequence -> drafting marks on it now
        self._answering: set[int] = set()   # sequences whose drafts answer a verdict each
        self._wave: set[int] = set()        # sequences decoded since the loop was last idle
        self._last_wave: set[int] = set()   # ... and before that
        self._idle = False                  # since the last step
        self._free = list(range(shared.n_seq - 1, -1, -1))
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="node-steps", daemon=True)
        self._thread.start()

    # -- sequences ---------------------------------------------------------------

    def take(self) -> StepSequence:
        """A free sequence, empty; BackendError when all are taken."""
        with self._cv:
            if self._closed:
                raise BackendError("the node's draft context is closed")
            if not self._free:
                raise BackendError(f"all {self.n_seq} sequences of the node's draft "
                                   "context are in use")
            seq = self._free.pop()
        return StepSequence(self, seq)

    def give_back(self, seq: int) -> None:
        """Sequence seq emptied and free again."""
        with self.lock:
            if not self._closed:
                self.shared.seq(seq).truncate(0)
        with self._cv:
            self._free.append(seq)
            self._answering.discard(seq)

    def taken(self) -> int:
        """Sequences handed out (serving a session, or kept warm by the memory)."""
        with self._cv:
            return self.n_seq - len(self._free)

    def snapshot(self) -> StepCounters:
        with self._cv:
            return replace(self.counters)

    @contextmanager
    def drafting(self, seq: int, answering: bool = False) -> Iterator[None]:
        """Sequence seq drafts meanwhile: each step waits for its part. answering: the
        draft answers a verdict (a synchronous session), see LINGER_S."""
        with self._cv:
            self._drafting[seq] += 1
            if answering:
                self._answering.add(seq)
            else:
                self._answering.discard(seq)
        try:
            yield
        finally:
            with self._cv:
                self._drafting[seq] -= 1
                if not self._drafting[seq]:
                    del self._drafting[seq]
                self._note_idle()
                self._cv.notify_all()     # a step may be waiting for this sequence

    def submit(self, seq: int, tokens: Sequence[int], logits: str, alternate: bool = False,
               parent: int | None = None) -> tuple[np.ndarray, tuple[int, int]]:
        """Sequence seq's tokens appended in the next decode that has room; their rows
        (a copy: the context's buffer is the next decode's) and what that decode held:
        (branches, alternates). parent: the sequence a fork's tokens branch from."""
        req = _Request(Part(seq, list(tokens), logits), alternate, parent)
        with self._cv:
            if self._closed:
                raise BackendError("the node's draft context is closed")
            self._pending.append(req)
            self._cv.notify_all()
            while not req.done:
                self._cv.wait()
        if req.error is not None:
            raise req.error
        return req.rows, req.step

    def close(self) -> None:
        """Stop the loop (a part still waiting fails), then free the context."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(5.0)
        with self.lock:
            self.shared.close()

    # -- the loop ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while (batch := self._gather()) is not None:
                self._decode(batch)
        finally:   # closed, or the loop itself failed: nothing may wait for it any more
            with self._cv:
                self._closed = True
                for r in self._pending:
                    r.error, r.done = BackendError("the node's draft context closed"), True
                self._pending.clear()
                self._cv.notify_all()

    def _gather(self) -> list[_Request] | None:
        """The next step's requests: once a part waits, until every drafting sequence has
        one (at most gather_s), the oldest of each sequence within the batch's tokens.
        None once closed."""
        with self._cv:
            self._note_idle()
            while not self._pending and not self._closed:
                self._cv.wait()
            expect = self._last_wave & self._answering if self._idle else set()
            self._idle = False
            now = time.perf_counter()
            deadline, linger = now + self.gather_s, now + min(self.linger_s, self.gather_s)
            while not self._closed:
                waiting = {r.part.seq for r in self._pending}
                missing = expect - waiting
                if all(seq in waiting for seq in self._drafting) and not missing:
                    break
                now = time.perf_counter()
                if missing and now >= linger:    # an answer's verdict that did not come
                    expect = set()
                    continue
                if now >= deadline:
                    break
                self._cv.wait((linger if missing else deadline) - now)
            return None if self._closed else self._take_batch()

    def _note_idle(self) -> None:
        """Under the condition: nothing drafts nor waits, so a wave of steps ended."""
        if not self._pending and not self._drafting and not self._idle:
            self._last_wave, self._wave, self._idle = self._wave, set(), True

    def _take_batch(self) -> list[_Request]:
        """The oldest part of each sequence waiting, within the batch's tokens."""
        batch: list[_Request] = []
        seqs: set[int] = set()
        total = 0
        for r in self._pending:
            n = len(r.part.tokens)
            if r.part.seq in seqs or (batch and total + n > self.shared.n_batch):
                continue
            batch.append(r)
            seqs.add(r.part.seq)
            total += n
        for r in batch:
            self._pending.remove(r)
        return batch

    def _decode(self, batch: list[_Request]) -> None:
        """One llama_decode for the batch (its parts fit: StepSequence.eval splits)."""
        try:
            with self.lock:
                rows = self.shared.decode([r.part for r in batch])
                for r, got in zip(batch, rows, strict=True):
                    r.rows = np.array(got)
        except Exception as e:  # noqa: BLE001 - the step's sessions fail, the node goes on
            for r in batch:
                r.error = e
        alternates = sum(r.alternate for r in batch)
        step = (len(batch) - alternates, alternates)
        seqs = {r.part.seq for r in batch}
        beside = sum(r.parent in seqs for r in batch if r.alternate and r.parent is not None)
        with self._cv:
            c = self.counters
            c.decodes += 1
            c.alternates += alternates
            c.beside += beside
            c.branches += step[0]
            c.tokens += sum(len(r.part.tokens) for r in batch)
            for r in batch:
                r.done, r.step = True, step
                self._wave.add(r.part.seq)
            self._cv.notify_all()


class StepSequence:
    """One sequence of a StepLoop's context, as a session's Backend: its evals are parts
    of the loop's decodes, everything else a call into the context under its lock. Where
    the context has forks, `fork` gives this sequence's (link/fork.py drafts an alternate
    on it, beside the branch)."""

    def __init__(self, loop: StepLoop, seq: int, parent: StepSequence | None = None) -> None:
        self.loop, self.seq_id, self.parent = loop, seq, parent
        self._view = loop.shared.seq(seq)
        self.model, self.name, self.params = self._view.model, self._view.name, self._view.params
        self.n_vocab, self.n_ctx = self._view.n_vocab, self._view.n_ctx
        self._alternate = False
        self._closed = False
        #: (branches, alternates) the last decode of this sequence's tokens held
        self.step: tuple[int, int] | None = None

    @property
    def ctx(self) -> object | None:
        """The llama.cpp context (None once this sequence went back to the loop)."""
        return None if self._closed else self.loop.shared.ctx

    @property
    def n_past(self) -> int:
        return len(self._view.tokens)

    @property
    def tokens(self) -> Sequence[int]:
        return self._view.tokens

    @property
    def decode_s(self) -> float:
        return self.loop.shared.seq_decode_s(self.seq_id)

    @contextmanager
    def drafting(self, alternate: bool = False, answering: bool = False) -> Iterator[None]:
        """This sequence drafts meanwhile (an alternate: its parts count as one; answering:
        a synchronous session's answer to a verdict)."""
        was, self._alternate = self._alternate, alternate
        try:
            with self.loop.drafting(self.seq_id, answering):
                yield
        finally:
            self._alternate = was

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        """Append tokens, in steps of at most the batch's size; rows as Backend.eval."""
        n, cap = len(tokens), self.loop.shared.n_batch
        if n == 0:
            raise BackendError("eval of an empty token list")
        if logits == "all" and n > cap:
            raise BackendError(f"cannot return logits for {n} tokens at once (batch {cap})")
        done, rows = 0, np.empty((0, self.n_vocab), dtype=np.float32)
        while done < n:
            m = min(cap, n - done)
            last = done + m == n
            rows, self.step = self.loop.submit(
                self.seq_id, tokens[done:done + m], logits if last else "none", self._alternate,
                None if self.parent is None else self.parent.seq_id)
            done += m
        return rows

    def truncate(self, n: int) -> None:
        with self.loop.lock:
            self._view.truncate(n)

    @property
    def forks(self) -> bool:
        """Whether `fork` can give this sequence a fork."""
        return self.parent is None and self.seq_id < getattr(self.loop.shared, "n_forks", 0)

    def fork(self, n: int) -> StepSequence:
        """This sequence's fork, holding its first n tokens (their cells shared), as a
        Backend of its own whose parts join the same decodes; closing it empties it."""
        with self.loop.lock:
            fork = self.loop.shared.fork_seq(self.seq_id, n)
        return StepSequence(self.loop, fork, parent=self)

    def holds_window(self, n: int) -> bool:
        with self.loop.lock:
            return self._view.holds_window(n)

    def state_size(self) -> int:
        with self.loop.lock:
            return self._view.state_size()

    def seq_state(self) -> tuple[list[int], object]:
        with self.loop.lock:
            return self._view.seq_state()

    def set_seq_state(self, tokens: Sequence[int], data: bytes | memoryview) -> int:
        with self.loop.lock:
            return self._view.set_seq_state(tokens, data)

    def adopt(self, tokens: Sequence[int]) -> None:
        self._view.adopt(tokens)

    def is_eog(self, token: int) -> bool:
        return self._view.is_eog(token)

    def tokenize(self, text: str, add_special: bool = True,
                 parse_special: bool = True) -> list[int]:
        return self._view.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return self._view.detokenize(tokens, special)

    def vocab_fingerprint(self) -> str:
        return self._view.vocab_fingerprint()

    def close(self) -> None:
        """The sequence back to the loop, emptied (once); a fork only emptied."""
        if self._closed:
            return
        self._closed = True
        if self.parent is not None:
            with self.loop.lock:
                self._view.truncate(0)
        else:
            self.loop.give_back(self.seq_id)
