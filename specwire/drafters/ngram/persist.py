"""--lookup-cache-dynamic FILE: one LookupCache, shared by an engine's n-gram drafters,
kept in a file across restarts.

Loaded when the engine is built (a missing file is an empty cache); saved when the
command ends (serve: as the app's lifespan ends; generate: after its completion), and
every `every` sequences kept in between, so that a crash loses little. Those saves
write a snapshot of the sequences (taken on the thread that ended the request: the
tuples are immutable, so a list of them is the whole copy) on a thread of their own,
so that the batch does not wait for the disk; one such write runs at a time.
"""

from __future__ import annotations

import logging
import os
import threading

from specwire.drafters.ngram.cache import (
    DEFAULT_TOKENS,
    LookupCache,
    LookupCacheError,
    read_file,
    write_atomic,
)

log = logging.getLogger(__name__)

#: sequences kept between two saves of a running server
SAVE_EVERY = 8


def check_file(path: str | os.PathLike) -> None:
    """What can be checked before the target loads: the file, if there is one, is a
    whole cache file of this format, and its directory exists (for the save)."""
    name = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(name))
    if not os.path.isdir(folder):
        raise LookupCacheError(f"lookup cache {name}: no such directory: {folder}")
    read_file(name)


class CacheFile:
    """A LookupCache bound to its file."""

    def __init__(self, path: str | os.PathLike, n_vocab: int, fingerprint: str, *,
                 every: int = SAVE_EVERY, max_tokens: int = DEFAULT_TOKENS,
                 match_max: int = 64, scope_share: int | None = None) -> None:
        self.path = os.fspath(path)
        self.every = every
        check_file(self.path)
        self.cache = LookupCache.load(self.path, n_vocab, fingerprint, max_tokens, match_max,
                                      scope_share)
        self.loaded = len(self.cache)
        self._existed = os.path.exists(self.path)
        self._added_n = 0       # sequences kept since the load
        self._queued_n = 0      # ... when the last snapshot was taken
        self._saved_n = 0       # ... when the last snapshot written was taken
        self._lock = threading.Lock()        # one write at a time
        self._writer: threading.Thread | None = None
        self.saves = 0
        self.cache.on_add = self._added
        log.info("lookup cache %s: %d sequences, %d tokens loaded", self.path, self.loaded,
                 self.cache.tokens)

    def _added(self) -> None:
        self._added_n += 1
        if self.every > 0 and self._added_n - self._queued_n >= self.every:
            self.save_soon()

    def save_soon(self) -> None:
        """Write a snapshot on a thread of its own (unless one is being written: the next
        sequence kept tries again)."""
        if self._writer is not None and self._writer.is_alive():
            return
        n, data = self._snapshot()
        self._writer = threading.Thread(target=self._write, args=(n, data),
                                        name="lookup-cache-save", daemon=True)
        self._writer.start()

    def _snapshot(self) -> tuple[int, bytes]:
        # list() of the dict's values runs in C, under the GIL: a consistent copy even
        # while another thread adds (a sequence added meanwhile waits for the next save)
        n, data = self._added_n, self.cache.encode()
        self._queued_n = n
        return n, data

    def _write(self, n: int, data: bytes) -> bool:
        with self._lock:
            try:
                write_atomic(self.path, data)
            except LookupCacheError as e:
                log.error("%s", e)
                return False
            self._existed = True
            self._saved_n = max(self._saved_n, n)
            self.saves += 1
            return True

    def close(self) -> bool:
        """The command ends: wait for a save in flight, then write what it left out (and
        the file, if there was none). False, with the error logged, if it could not be
        written."""
        if self._writer is not None:
            self._writer.join()
        if self._saved_n == self._added_n and self._existed:
            return True
        ok = self._write(*self._snapshot())
        if ok:
            log.info("lookup cache %s: %d sequences, %d tokens saved", self.path,
                     len(self.cache), self.cache.tokens)
        return ok
