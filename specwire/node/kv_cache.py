"""The draft node's conversation memory: contexts kept warm, finished sequences kept in RAM.

Turn N+1 of a chat repeats turn N's whole history, and a draft node that started
every session from an empty cache evaluated all of it again. Here a session
starts from the cached sequence that shares the longest prefix of token ids
with its history, so it evaluates only what is new. Two stores:

* contexts: a finished session's llama.cpp context goes back to a pool (at most
  --max-sessions of them, the node's peak anyway) with its KV cells in place; a
  new session takes the pooled context whose tokens match its history best.
* saved states: when a pooled context is taken for a sequence that does not
  extend what it holds, that sequence is first copied out to RAM
  (backend/kv_state.py), within --cache-ram MiB and --cache-sessions entries,
  least recently used out first. A later session whose history matches a saved
  state better than any pooled context gets it copied back in.

Nothing is kept longer than --cache-ttl seconds after its last use (`ttl_s`): a
sweeper thread forgets older saved states and closes older pooled contexts, so a
finished conversation does not stay in the node's RAM for ever.

A chat's next turn usually opens its session while the node is still closing
the previous one (the Close and the new Open travel on different streams), so
a session whose history shares many more tokens (WORTH_WAITING) with a session
still open than with anything cached waits for that one to end, up to
WAIT_FOR_CLOSE_S.

Isolation: a cached sequence is reused only up to the first token where it and
the new history differ, so a session computes on no token that is not in its
own history, whichever target or conversation left the cache there. The node
serves one draft model, and every entry is that model's: token ids from targets
with the same vocabulary (the handshake checks it) mean the same thing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specwire.backend import kv_state
from specwire.backend.base import BackendError
from specwire.backend.llama import LlamaBackend, Model
from specwire.config import ModelParams
from specwire.link.messages import NOTICE_AFTER

log = logging.getLogger("specwire.node")

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
    used_at: float = field(default_factory=time.monotonic)


class KvCache:
    """Hands out contexts for sessions, starting each from the best cached prefix.

    ram_mib 0 (or sessions 0) turns the memory off: every session gets a fresh
    context and it is freed at the end, as the node did before.
    """

    def __init__(self, params: ModelParams, model: Model, ram_mib: int = 8192,
                 sessions: int = 32, max_contexts: int = 8, ttl_s: float = 0.0,
                 wrap: Callable[[LlamaBackend], LlamaBackend] | None = None) -> None:
        """ttl_s: entries unused this long are forgotten (0: kept until evicted); wrap:
        applied to every context made (the node's --emulate holds them)."""
        self.params, self.model = params, model
        self._wrap = wrap or (lambda backend: backend)
        self.budget = max(0, ram_mib) * MIB
        self.max_entries = max(0, sessions)
        self.max_contexts = max(1, max_contexts)
        self.enabled = self.budget > 0 and self.max_entries > 0
        self.counters = CacheCounters()
        self._lock = threading.Condition()
        self._pool: list[_Pooled] = []
        self._active: dict[int, np.ndarray] = {}  # id(backend) -> its session's Open history
        self._saved: OrderedDict[int, kv_state.SavedState] = OrderedDict()  # LRU first
        self._saved_at: dict[int, float] = {}  # key -> last use (time.monotonic)
        self._next_key = 0
        self._bytes = 0
        self.ttl_s = ttl_s
        self._closing = threading.Event()
        if self.enabled and ttl_s > 0:
            threading.Thread(target=self._sweep, name="kv-cache-ttl", daemon=True).start()

    # -- sessions ---------------------------------------------------------------------

    def acquire(self, history: Sequence[int]) -> LlamaBackend:
        """A context for a session with this history, holding as much of it as the
        memory had (the session's drafter truncates the rest and evaluates the gap)."""
        if not self.enabled:
            return self._wrap(LlamaBackend(self.params, self.model))
        want = np.asarray(history, dtype=np.int32)
        deadline = time.monotonic() + WAIT_FOR_CLOSE_S
        with self._lock:
            while True:
                warm, warm_n = self._best_pooled(want)
                key, saved_n = self._best_saved(want)
                busy_n = max((common_prefix(h, want) for h in self._active.values()),
                             default=0)
                left = deadline - time.monotonic()
                if busy_n <= max(warm_n, saved_n) + WORTH_WAITING or left <= 0:
                    break
                self._lock.wait(left)
            if key is not None and saved_n > warm_n:
                taken = self._oldest_pooled()
                entry = self._saved[key]
                self._saved.move_to_end(key)
                self._saved_at[key] = time.monotonic()
            else:
                taken, entry = warm, None
            if taken is not None:
                self._pool.remove(taken)
                self._active[id(taken.backend)] = want
        if taken is None:
            backend = self._wrap(LlamaBackend(self.params, self.model))
            with self._lock:
                self._active[id(backend)] = want
        else:
            backend = taken.backend
            if self._loses_cells(taken, want, entry is not None):
                self._save(taken)
            if entry is not None:
                if kv_state.restore(backend, entry):
                    self.counters.restores += 1
                else:
                    log.warning("kv cache: llama.cpp refused a saved state; evaluating afresh")
            elif len(taken.tokens) and common_prefix(taken.tokens, want):
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
        pooled = _Pooled(backend, np.asarray(backend.tokens, dtype=np.int32))
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

    def expire(self, now: float | None = None) -> int:
        """Forget what was last used more than ttl_s ago; how many entries went."""
        if self.ttl_s <= 0:
            return 0
        cutoff = (time.monotonic() if now is None else now) - self.ttl_s
        with self._lock:
            old = [k for k, t in self._saved_at.items() if t < cutoff]
            for key in old:
                self._drop(key)
            stale = [p for p in self._pool if p.used_at < cutoff]
            for p in stale:
                self._pool.remove(p)
        for p in stale:
            p.backend.close()
        if old or stale:
            log.info("kv cache: forgot %d saved sequences and %d warm contexts unused for "
                     "%g s (--cache-ttl)", len(old), len(stale), self.ttl_s)
        return len(old) + len(stale)

    def _sweep(self) -> None:
        while not self._closing.wait(max(0.05, min(self.ttl_s / 4, 30.0))):
            try:
                self.expire()
            except Exception:  # noqa: BLE001 - the sweeper must not die
                log.exception("kv cache: expiring entries failed")

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            pool, self._pool = self._pool, []
            self._saved.clear()
            self._saved_at.clear()
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

    def _best_pooled(self, want: np.ndarray) -> tuple[_Pooled | None, int]:
        """The pooled context sharing most with `want`, or else the least recently used."""
        best, best_n = None, -1
        for p in self._pool:
            n = common_prefix(p.tokens, want)
            if n > best_n or (n == best_n and best is not None and p.used_at < best.used_at):
                best, best_n = p, n
        return best, max(best_n, 0)

    def _oldest_pooled(self) -> _Pooled | None:
        return min(self._pool, key=lambda p: p.used_at, default=None)

    def _best_saved(self, want: np.ndarray) -> tuple[int | None, int]:
        best, best_n = None, 0
        for key, s in self._saved.items():
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
            size = kv_state.state_size(p.backend) + p.tokens.nbytes
        except Exception:  # noqa: BLE001 - a cache that cannot save only forgets
            return
        if size > self.budget:
            self.counters.too_big += 1
            log.info("kv cache: a %d-token sequence (%.1f MiB) exceeds --cache-ram %d MiB; "
                     "not kept", len(p.tokens), size / MIB, self.budget // MIB)
            return
        with self._lock:
            if any(self._covers(s.tokens, p.tokens) for s in self._saved.values()):
                return  # a saved sequence already starts with all of these tokens
        try:
            state = kv_state.save(p.backend)
        except BackendError as e:
            log.warning("kv cache: %s", e)
            return
        with self._lock:
            for key in [k for k, s in self._saved.items() if self._covers(p.tokens, s.tokens)]:
                self._drop(key)  # this sequence extends them: turn N+1 replaces turn N
            while self._saved and (len(self._saved) >= self.max_entries
                                   or self._bytes + state.size > self.budget):
                self._drop(next(iter(self._saved)))
                self.counters.evictions += 1
            self._saved[self._next_key] = state
            self._saved_at[self._next_key] = time.monotonic()
            self._next_key += 1
            self._bytes += state.size
            self.counters.saves += 1

    @staticmethod
    def _covers(longer: np.ndarray, shorter: np.ndarray) -> bool:
        return len(longer) >= len(shorter) and common_prefix(longer, shorter) == len(shorter)

    def _drop(self, key: int) -> None:
        self._bytes -= self._saved.pop(key).size
        self._saved_at.pop(key, None)
