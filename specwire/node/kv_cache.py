"""The draft node's conversation memory: contexts kept warm, finished sequences kept in RAM.

A chat's next turn repeats its whole history, so a session starts from the cached sequence
(a pooled llama.cpp context, or a state saved to RAM) that shares the longest token prefix
with its history, and evaluates only the rest; a session that a still-open one would serve
much better waits for it to close (WORTH_WAITING, WAIT_FOR_CLOSE_S). Every entry belongs to
a Scope (node/tenants.py) and a session sees only its own scope's, reused only up to the
first token that differs: no session computes on a token outside its own history, nor learns
what another scope holds. docs/memory.md has the stores, budgets, expiry and purge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specwire.backend import llama
from specwire.backend.base import BackendError
from specwire.backend.llama import LlamaBackend, Model
from specwire.config import ModelParams
from specwire.link.messages import NOTICE_AFTER

log = logging.getLogger("specwire.node")

#: Whose an entry is: (the peer's authenticated identity, the request's scope).
Scope = tuple[str, str]
SHARED: Scope = ("", "")

MIB = 1 << 20
#: How long a new session waits for an open one that holds more of its history.
WAIT_FOR_CLOSE_S = 1.0
#: ...when that one holds more than this many tokens of it beyond what the memory has
#: (fewer are evaluated sooner than a session ends; as many as a catch-up notice are not).
WORTH_WAITING = NOTICE_AFTER


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int32 arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass(slots=True)
class CacheCounters:
    """What the memory did since the node started (logged, and read by tests)."""

    sessions: int = 0
    reused_tokens: int = 0  # history tokens sessions found cached
    evaluated_tokens: int = 0  # history tokens sessions had to evaluate
    warm_hits: int = 0  # sessions that reused a pooled context's cells
    restores: int = 0  # sessions that reused a saved state
    saves: int = 0
    evictions: int = 0
    too_big: int = 0  # sequences not saved: larger than the whole budget


@dataclass(slots=True)
class _Pooled:
    backend: LlamaBackend
    tokens: np.ndarray
    scope: Scope = SHARED
    used_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Saved:
    state: llama.SavedState
    scope: Scope
    used_at: float = field(default_factory=time.monotonic)

    @property
    def tokens(self) -> np.ndarray:
        return self.state.tokens

    @property
    def size(self) -> int:
        return self.state.size


class KvCache:
    """Hands out contexts for sessions, starting each from the best cached prefix.

    ram_mib 0 (or sessions 0) turns the memory off: every session gets a fresh
    context and it is freed at the end, as the node did before.
    """

    def __init__(self, params: ModelParams, model: Model, ram_mib: int = 8192,
                 sessions: int = 32, max_contexts: int = 8, ttl_s: float = 0.0,
                 new_backend: Callable[[], LlamaBackend] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wrap: Callable[[LlamaBackend], LlamaBackend] | None = None,
                 identity_mib: int = 0, identity_sessions: int = 0) -> None:
        """ttl_s > 0: entries unused that long are dropped (see expire). new_backend and
        clock replace llama.cpp's contexts and the monotonic clock (tests); wrap is applied
        to every context made (the node's --emulate holds them). identity_mib,
        identity_sessions: the most saved states one identity holds (0: the whole)."""
        self.params, self.model = params, model
        self.ttl_s = max(0.0, ttl_s)
        hold = wrap or (lambda backend: backend)
        self._new = new_backend or (lambda: hold(LlamaBackend(params, model)))
        self._clock = clock
        self.budget = max(0, ram_mib) * MIB
        self.max_entries = max(0, sessions)
        self.max_contexts = max(1, max_contexts)
        self.identity_budget = min(self.budget, max(0, identity_mib) * MIB) or self.budget
        self.identity_entries = (min(self.max_entries, max(0, identity_sessions))
                                 or self.max_entries)
        self.enabled = self.budget > 0 and self.max_entries > 0
        self.counters = CacheCounters()
        self._lock = threading.Condition()
        self._pool: list[_Pooled] = []
        # id(backend) -> its session's scope and Open history
        self._active: dict[int, tuple[Scope, np.ndarray]] = {}
        self._private: set[int] = set()  # id(backend) of sessions that store nothing
        self._saved: OrderedDict[int, _Saved] = OrderedDict()  # LRU first
        self._next_key = 0
        self._bytes = 0
        self._closed = threading.Event()
        if self.enabled and self.ttl_s > 0:
            threading.Thread(target=self._sweep, name="kv-cache-ttl", daemon=True).start()

    # -- sessions ---------------------------------------------------------------------

    def acquire(self, history: Sequence[int], scope: Scope = SHARED,
                store: bool = True) -> LlamaBackend:
        """A context for a session with this history, holding as much of it as the
        memory had in this scope (the session's drafter truncates the rest and
        evaluates the gap). store False: a fresh context, kept out of the memory."""
        if not self.enabled or not store:
            backend = self._new()
            if self.enabled:
                with self._lock:
                    self._private.add(id(backend))
            return backend
        self.expire()
        want = np.asarray(history, dtype=np.int32)
        deadline = self._clock() + WAIT_FOR_CLOSE_S
        with self._lock:
            while True:
                warm, warm_n = self._best_pooled(want, scope)
                key, saved_n = self._best_saved(want, scope)
                busy_n = max((common_prefix(h, want) for s, h in self._active.values()
                              if s == scope), default=0)
                left = deadline - self._clock()
                if busy_n <= max(warm_n, saved_n) + WORTH_WAITING or left <= 0:
                    break
                self._lock.wait(left)
            if key is not None and saved_n > warm_n:
                taken = self._oldest_pooled()  # None: a new context gets the saved state
                entry = self._saved[key]
                entry.used_at = self._clock()
                self._saved.move_to_end(key)
            else:
                taken, entry = warm, None
            if taken is not None:
                self._pool.remove(taken)
                self._active[id(taken.backend)] = (scope, want)
        if taken is None:
            backend = self._new()
            with self._lock:
                self._active[id(backend)] = (scope, want)
            foreign = False
        else:
            backend = taken.backend
            foreign = taken.scope != scope
            if self._loses_cells(taken, want, entry is not None or foreign):
                self._save(taken)
        if entry is not None:
            if llama.restore(backend, entry.state):
                self.counters.restores += 1
            else:
                log.warning("kv cache: llama.cpp refused a saved state; evaluating afresh")
        elif foreign:
            backend.truncate(0)  # another scope's cells: none of them serve this session
        elif taken is not None and len(taken.tokens) and common_prefix(taken.tokens, want):
            self.counters.warm_hits += 1
        return backend

    def account(self, reused: int, evaluated: int) -> None:
        """A session started: `reused` history tokens were cached, `evaluated` were not."""
        with self._lock:
            self.counters.sessions += 1
            self.counters.reused_tokens += reused
            self.counters.evaluated_tokens += evaluated

    def release(self, backend: LlamaBackend, committed: Sequence[int] | None = None) -> None:
        """A session ended: its context goes back to the pool with its cells in place,
        cut to the `committed` history where given (a draft branch past it is worth
        nothing to the next session, and keeping it would make that session save the
        whole sequence before truncating it)."""
        if not self.enabled:
            backend.close()
            return
        with self._lock:
            private = id(backend) in self._private
            self._private.discard(id(backend))
            scope = self._active.get(id(backend), (SHARED, None))[0]
        if private:
            backend.close()
            return
        if backend.ctx is None:
            with self._lock:
                self._active.pop(id(backend), None)
                self._lock.notify_all()
            return
        if committed is not None:
            keep = common_prefix(np.asarray(backend.tokens, dtype=np.int32),
                                 np.asarray(committed, dtype=np.int32))
            if keep < backend.n_past:
                backend.truncate(keep)
        pooled = _Pooled(backend, np.asarray(backend.tokens, dtype=np.int32), scope,
                         self._clock())
        with self._lock:
            self._active.pop(id(backend), None)
            self._lock.notify_all()
            self._pool.append(pooled)
            extra = self._oldest_pooled() if len(self._pool) > self.max_contexts else None
            if extra is not None:
                self._pool.remove(extra)
        if extra is not None:
            if len(extra.tokens):
                self._save(extra)
            extra.backend.close()
        self.expire()

    def expire(self, now: float | None = None) -> int:
        """Drop the entries (pooled contexts, saved states) unused for ttl_s before `now`
        (the clock's time by default); how many. Called on each acquire and release, and
        by a sweeper thread every ttl_s / 4 (at most 30 s), so an idle node forgets too."""
        if self.ttl_s <= 0:
            return 0
        old = (self._clock() if now is None else now) - self.ttl_s
        return self._drop_where(lambda scope, used_at: used_at <= old)

    def _sweep(self) -> None:
        while not self._closed.wait(max(0.05, min(self.ttl_s / 4, 30.0))):
            try:
                if n := self.expire():
                    log.info("kv cache: %d entries unused for %g s dropped (--cache-ttl)",
                             n, self.ttl_s)
            except Exception:  # noqa: BLE001 - the sweeper must not die
                log.exception("kv cache: expiring entries failed")

    def purge(self, identity: str | None = None) -> int:
        """Drop every finished conversation's entries (of one identity, when given: an
        identity of that token or certificate, node/tenants.identity); how many. Open
        sessions keep their contexts."""
        return self._drop_where(lambda scope, used_at: identity is None or
                                identity in scope[0].split(" "))

    def _drop_where(self, doomed: Callable[[Scope, float], bool]) -> int:
        with self._lock:
            pool = [p for p in self._pool if doomed(p.scope, p.used_at)]
            for p in pool:
                self._pool.remove(p)
            keys = [k for k, e in self._saved.items() if doomed(e.scope, e.used_at)]
            for k in keys:
                self._drop(k)
        for p in pool:
            p.backend.close()
        return len(pool) + len(keys)

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            pool, self._pool = self._pool, []
            self._saved.clear()
            self._bytes = 0
        for p in pool:
            p.backend.close()

    def pooled(self) -> int:
        """Contexts held for finished sessions (open in llama.cpp, serving no session)."""
        with self._lock:
            return len(self._pool)

    def describe(self) -> str:
        with self._lock:
            c = self.counters
            return (f"{len(self._saved)} saved sequences in {self._bytes / MIB:.1f} MiB "
                    f"(budget {self.budget // MIB} MiB, {self.max_entries} sequences), "
                    f"{len(self._pool)} warm contexts; so far {c.reused_tokens} history "
                    f"tokens reused, {c.evaluated_tokens} evaluated, {c.warm_hits} warm "
                    f"hits, {c.restores} restores, {c.saves} saves, {c.evictions} evictions")

    @property
    def saved_bytes(self) -> int:
        return self._bytes

    # -- under the lock ---------------------------------------------------------------

    def _best_pooled(self, want: np.ndarray, scope: Scope) -> tuple[_Pooled | None, int]:
        """The pooled context of this scope sharing most with `want`, or else the least
        recently used of any scope."""
        best, best_n = None, -1
        for p in self._pool:
            if p.scope != scope:
                continue
            n = common_prefix(p.tokens, want)
            if n > best_n or (n == best_n and best is not None and p.used_at < best.used_at):
                best, best_n = p, n
        if best_n <= 0:
            return self._oldest_pooled(), 0
        return best, best_n

    def _oldest_pooled(self) -> _Pooled | None:
        return min(self._pool, key=lambda p: p.used_at, default=None)

    def _best_saved(self, want: np.ndarray, scope: Scope) -> tuple[int | None, int]:
        best, best_n = None, 0
        for key, s in self._saved.items():
            if s.scope != scope:
                continue
            n = common_prefix(s.tokens, want)
            if n > best_n:
                best, best_n = key, n
        return best, best_n

    # -- saving (on the session's thread, outside the lock) ---------------------------

    @staticmethod
    def _loses_cells(p: _Pooled, want: np.ndarray, replaced: bool) -> bool:
        """Whether taking p for `want` destroys cells beyond what `want` keeps."""
        return len(p.tokens) > 0 and (replaced or common_prefix(p.tokens, want) < len(p.tokens))

    def _save(self, p: _Pooled) -> None:
        """Copy a pooled context's sequence to RAM, evicting the least recently used."""
        try:
            size = llama.state_size(p.backend) + p.tokens.nbytes
        except Exception:  # noqa: BLE001 - a cache that cannot save only forgets
            return
        if size > self.identity_budget:
            self.counters.too_big += 1
            log.info("kv cache: a %d-token sequence (%.1f MiB) exceeds --cache-ram%s %d MiB; "
                     "not kept", len(p.tokens), size / MIB,
                     "-per-identity" if self.identity_budget < self.budget else "",
                     self.identity_budget // MIB)
            return
        with self._lock:
            if any(s.scope == p.scope and self._covers(s.tokens, p.tokens)
                   for s in self._saved.values()):
                return  # a saved sequence already starts with all of these tokens
        try:
            state = llama.save(p.backend)
        except BackendError as e:
            log.warning("kv cache: %s", e)
            return
        with self._lock:
            for key in [k for k, s in self._saved.items()
                        if s.scope == p.scope and self._covers(p.tokens, s.tokens)]:
                self._drop(key)  # this sequence extends them: turn N+1 replaces turn N
            who = p.scope[0]
            while True:     # the identity's share first: it evicts its own entries only
                own = [k for k, e in self._saved.items() if e.scope[0] == who]
                used = sum(self._saved[k].size for k in own)
                if not own or (len(own) < self.identity_entries and
                               used + state.size <= self.identity_budget):
                    break
                self._drop(own[0])
                self.counters.evictions += 1
            while self._saved and (len(self._saved) >= self.max_entries
                                   or self._bytes + state.size > self.budget):
                self._drop(next(iter(self._saved)))
                self.counters.evictions += 1
            self._saved[self._next_key] = _Saved(state, p.scope, p.used_at)
            self._next_key += 1
            self._bytes += state.size
            self.counters.saves += 1

    @staticmethod
    def _covers(longer: np.ndarray, shorter: np.ndarray) -> bool:
        return len(longer) >= len(shorter) and common_prefix(longer, shorter) == len(shorter)

    def _drop(self, key: int) -> None:
        self._bytes -= self._saved.pop(key).size
