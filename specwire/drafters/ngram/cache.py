"""Sequences from earlier requests, for n-gram lookups that the current history cannot serve.

A user's repository is rewritten many times: the second request for the same
file finds the first one's answer here. The cache is bounded by total tokens
(oldest sequence out first), keyed by KEY-grams (each mapped to its latest
occurrence), and a match grows backwards against the current history like an
in-history one, so its length means the same to the drafter's calibration.
A sequence already held (the same request again) is stored once, refreshed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

#: Length of the n-grams the cache is keyed by: shorter keys match noise across requests.
KEY = 4
DEFAULT_TOKENS = 1 << 17


@dataclass(slots=True, frozen=True)
class CachedMatch:
    """tokens[end - length:end] of an earlier sequence equals the suffix looked up."""

    tokens: tuple[int, ...]
    end: int
    length: int


class LookupCache:
    """Finished sequences (prompt and output), at most max_tokens of them in all."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, n_max: int = 64) -> None:
        if max_tokens < 0:
            raise ValueError(f"lookup cache: max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens, self.n_max = max_tokens, n_max
        self._seqs: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # id -> tokens, oldest first
        self._by_tokens: dict[tuple[int, ...], int] = {}
        self._index: dict[tuple[int, ...], tuple[int, int]] = {}  # KEY-gram -> (id, end)
        self._next_id = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, sequence: Sequence[int]) -> None:
        """Keep a finished sequence; evict the oldest ones beyond the bound."""
        seq = tuple(sequence)
        if len(seq) <= KEY or len(seq) > self.max_tokens:
            return
        old = self._by_tokens.pop(seq, None)
        if old is not None:
            self._drop(old)
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs[sid] = seq
        self._by_tokens[seq] = sid
        self.tokens += len(seq)
        for end in range(KEY, len(seq)):
            self._index[seq[end - KEY:end]] = (sid, end)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._seqs)))

    def _drop(self, sid: int) -> None:
        seq = self._seqs.pop(sid)
        self._by_tokens.pop(seq, None)
        self.tokens -= len(seq)
        for end in range(KEY, len(seq)):
            key = seq[end - KEY:end]
            if self._index.get(key, (None,))[0] == sid:
                del self._index[key]

    def match(self, history: Sequence[int]) -> CachedMatch | None:
        """The latest cached occurrence of history's last KEY tokens, with its length."""
        if len(history) < KEY:
            return None
        hit = self._index.get(tuple(history[len(history) - KEY:]))
        if hit is None:
            return None
        sid, end = hit
        seq = self._seqs[sid]
        n, size = KEY, len(history)
        limit = min(self.n_max, end, size)
        while n < limit and seq[end - n - 1] == history[size - n - 1]:
            n += 1
        return CachedMatch(seq, end, n)
