"""Sequences from earlier requests, for n-gram lookups that the current history cannot serve.

A user's repository is rewritten many times: the second request for the same file finds
the first one's answer here. The cache is bounded by total tokens (oldest out first),
keyed by KEY-grams (each at its latest occurrence), and a match grows backwards against
the current history like an in-history one, so its length means the same to the drafter's
calibration. Every sequence belongs to a cache scope (DraftParams.cache_scope) and a lookup
finds only its own scope's, so one client's drafts never copy another's text. Each scope
is sure of a share of the bound (--lookup-cache-per-identity): once full, a scope above
its share evicts its own oldest, else the least recently used scope's go. save() and
load() keep it in a file (version 2, described in docs/memory.md) that load() refuses,
in one line, if it is of another format, version or vocabulary, or cut short.
"""

from __future__ import annotations

import contextlib
import os
import struct
import tempfile
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from specwire.config import ConfigError

#: Length of the n-grams the cache is keyed by: shorter keys match noise across requests.
KEY = 4
DEFAULT_TOKENS = 1 << 17
#: A scope's share of the bound when none is given: four tenants each keep theirs whole.
DEFAULT_SHARE = 4

MAGIC = b"SWLOOKUP"
VERSION = 2
READS = (1, 2)
_HEAD = struct.Struct("<8sIII")      # magic, version, n_vocab, fp_len
_COUNTS = struct.Struct("<IQ")       # n_seqs, n_tokens
_CRC = struct.Struct("<I")
_MAX_FP = 256                        # a fingerprint longer than this is not one
_MAX_SCOPE = 128                     # the draft link's bound on a cache scope


class LookupCacheError(ConfigError):
    """A cache file that cannot be used (cut short, another format, version or vocabulary)
    or written: one line naming the file and the problem."""


@dataclass(slots=True, frozen=True)
class CacheFileContents:
    """What a cache file holds, checked for structure but not yet against a vocabulary."""

    n_vocab: int
    fingerprint: str
    sequences: list[np.ndarray]     # oldest first, each of dtype uint32
    scopes: list[str] | None = None  # each sequence's cache scope (None: all "")


def read_file(path: str | os.PathLike) -> CacheFileContents | None:
    """The file's contents, its structure checked (None: there is no such file)."""
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise LookupCacheError(f"lookup cache {name}: is a directory, not a file") from None
    except OSError as e:
        raise LookupCacheError(f"lookup cache {name}: cannot read it: {e.strerror or e}") from None

    def bad(problem: str) -> LookupCacheError:
        return LookupCacheError(f"lookup cache {name}: {problem}")

    version, n_vocab, fingerprint, table, at = _read_header(data, bad)
    head = at + _COUNTS.size
    if len(data) < head:
        raise bad(f"truncated: {len(data)} bytes, not even a header")
    n_seqs, n_tokens = _COUNTS.unpack_from(data, at)
    per_seq = 2 if version >= 2 else 1
    want = head + 4 * (per_seq * n_seqs + n_tokens) + _CRC.size
    if len(data) < want:
        raise bad(f"truncated: {len(data)} bytes, its header promises {want} "
                  f"({n_seqs} sequences, {n_tokens} tokens)")
    if len(data) > want:
        raise bad(f"corrupt: {len(data) - want} bytes past its end")
    (crc,) = _CRC.unpack_from(data, want - _CRC.size)
    if zlib.crc32(memoryview(data)[:want - _CRC.size]) != crc:
        raise bad("corrupt: its checksum does not match its contents")
    words = np.frombuffer(data, dtype="<u4", count=per_seq * n_seqs + n_tokens, offset=head)
    sequences, scopes = _read_sequences(words, per_seq, n_seqs, table, bad)
    return CacheFileContents(n_vocab, fingerprint, sequences, scopes)


def _read_header(data: bytes, bad: Callable[[str], LookupCacheError]
                 ) -> tuple[int, int, str, list[str], int]:
    """The header up to the counts: (version, n_vocab, fingerprint, the scope table, the
    counts' offset), each field checked against the file's length."""
    if not data:
        raise bad("truncated: the file is empty")
    if len(data) < len(MAGIC) or data[:len(MAGIC)] != MAGIC:
        if MAGIC.startswith(data):
            raise bad(f"truncated: {len(data)} bytes, not even a header")
        raise bad("not a specwire lookup cache (no SWLOOKUP header; llama.cpp's own "
                  "lookup-cache files are not read: move it away or name another file)")
    if len(data) < _HEAD.size:
        raise bad(f"truncated: {len(data)} bytes, not even a header")
    _, version, n_vocab, fp_len = _HEAD.unpack_from(data)
    if version not in READS:
        raise bad(f"format version {version}, this specwire reads versions 1 and 2 only "
                  "(move it away or name another file)")
    if fp_len > _MAX_FP:
        raise bad(f"corrupt header (a {fp_len}-byte vocabulary fingerprint)")
    at = _HEAD.size + fp_len
    if len(data) < at + _COUNTS.size:
        raise bad(f"truncated: {len(data)} bytes, not even a header")
    try:
        fingerprint = data[_HEAD.size:at].decode("ascii")
    except UnicodeDecodeError:
        raise bad("corrupt header (the vocabulary fingerprint is not text)") from None
    table = [""]
    if version >= 2:
        (n_scopes,) = struct.unpack_from("<I", data, at)
        at += 4
        for _ in range(n_scopes):
            if len(data) < at + 4:
                raise bad(f"truncated: {len(data)} bytes, not even a header")
            (size,) = struct.unpack_from("<I", data, at)
            if size > _MAX_SCOPE:
                raise bad(f"corrupt header (a {size}-byte cache scope)")
            padded = 4 + (size + 3) // 4 * 4
            if len(data) < at + padded:
                raise bad(f"truncated: {len(data)} bytes, not even a header")
            try:
                table.append(data[at + 4:at + 4 + size].decode("ascii"))
            except UnicodeDecodeError:
                raise bad("corrupt header (a cache scope is not text)") from None
            at += padded
    return version, n_vocab, fingerprint, table, at


def _read_sequences(words: np.ndarray, per_seq: int, n_seqs: int, table: list[str],
                    bad: Callable[[str], LookupCacheError]
                    ) -> tuple[list[np.ndarray], list[str]]:
    """The n_seqs sequences and their scopes from the words after the counts."""
    sequences, scopes, i = [], [], 0
    for _ in range(n_seqs):
        if i + per_seq > len(words):
            raise bad("corrupt: its sequences overrun their count")
        scope = int(words[i]) if per_seq == 2 else 0
        length = int(words[i + per_seq - 1])
        if scope >= len(table):
            raise bad(f"corrupt: a sequence names scope {scope} of {len(table)}")
        i += per_seq
        if i + length > len(words):
            raise bad("corrupt: its sequences overrun their count")
        sequences.append(words[i:i + length])
        scopes.append(table[scope])
        i += length
    if i != len(words):
        raise bad("corrupt: its sequences do not add up to its token count")
    return sequences, scopes


def encode(sequences: Sequence[Sequence[int]], n_vocab: int, fingerprint: str,
           scopes: Sequence[str] | None = None) -> bytes:
    """The file's bytes for these sequences (oldest first) and their scopes (None: all "")."""
    fp = fingerprint.encode("ascii")
    if len(fp) > _MAX_FP:
        raise ValueError(f"lookup cache: a vocabulary fingerprint of {len(fp)} bytes")
    scopes = list(scopes) if scopes is not None else [""] * len(sequences)
    table = sorted(set(scopes) - {""})
    index = {"": 0, **{sc: i + 1 for i, sc in enumerate(table)}}
    parts = [_HEAD.pack(MAGIC, VERSION, n_vocab, len(fp)), fp, struct.pack("<I", len(table))]
    for sc in table:
        raw = sc.encode("ascii")
        if len(raw) > _MAX_SCOPE:
            raise ValueError(f"lookup cache: a cache scope of {len(raw)} bytes")
        parts.append(struct.pack("<I", len(raw)) + raw + b"\0" * (-len(raw) % 4))
    n_tokens = sum(len(s) for s in sequences)
    parts.append(_COUNTS.pack(len(sequences), n_tokens))
    for seq, sc in zip(sequences, scopes, strict=True):
        parts.append(struct.pack("<II", index[sc], len(seq)))
        parts.append(np.asarray(seq, dtype="<u4").tobytes())
    body = b"".join(parts)
    return body + _CRC.pack(zlib.crc32(body))


def write_atomic(path: str | os.PathLike, data: bytes) -> None:
    """data as the file at path, all or nothing: a temporary file beside it, fsynced, then
    renamed over it (and the directory fsynced, where the system allows)."""
    name = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(name))
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=os.path.basename(name) + ".",
                                   suffix=".tmp")
    except OSError as e:
        raise LookupCacheError(f"lookup cache {name}: cannot write it: "
                               f"{e.strerror or e}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, name)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise LookupCacheError(f"lookup cache {name}: cannot write it: "
                               f"{e.strerror or e}") from None
    with contextlib.suppress(OSError):
        dfd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


@dataclass(slots=True, frozen=True)
class CachedMatch:
    """tokens[end - length:end] of an earlier sequence equals the suffix looked up."""

    tokens: tuple[int, ...]
    end: int
    length: int


@dataclass(slots=True)
class _ScopeHeld:
    """What one cache scope holds: its tokens, and its sequences' ids oldest first."""

    tokens: int = 0
    ids: OrderedDict[int, None] = field(default_factory=OrderedDict)


class LookupCache:
    """Finished sequences (prompt and output), at most max_tokens of them in all, each in
    the cache scope of the request it came from."""

    def __init__(self, max_tokens: int = DEFAULT_TOKENS, match_max: int = 64,
                 vocab: tuple[int, str] | None = None,
                 scope_share: int | None = None) -> None:
        """vocab: (size, fingerprint) of the target's vocabulary, which save() records.
        scope_share: the tokens each cache scope is sure to keep (None: a quarter of
        max_tokens)."""
        if max_tokens < 0:
            raise ValueError(f"lookup cache: max_tokens must be >= 0, got {max_tokens}")
        if scope_share is not None and scope_share < 0:
            raise ValueError(f"lookup cache: scope_share must be >= 0, got {scope_share}")
        self.max_tokens, self.match_max, self.vocab = max_tokens, match_max, vocab
        self.scope_share = (max_tokens // DEFAULT_SHARE if scope_share is None
                            else min(scope_share, max_tokens))
        #: called after each sequence kept (persist.py counts them to save now and then)
        self.on_add: Callable[[], None] | None = None
        # id -> (scope, tokens), oldest first
        self._seqs: OrderedDict[int, tuple[str, tuple[int, ...]]] = OrderedDict()
        self._by_tokens: dict[tuple[str, tuple[int, ...]], int] = {}
        # scope -> KEY-gram -> (id, end): a lookup sees its own scope's grams only
        self._index: dict[str, dict[tuple[int, ...], tuple[int, int]]] = {}
        # scope -> its tokens held, and its sequences' ids, oldest first; least recently
        # used scope first (a sequence kept, or a lookup that found one, uses it)
        self._scopes: OrderedDict[str, _ScopeHeld] = OrderedDict()
        self._next_id = 0
        self.tokens = 0

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, sequence: Sequence[int], scope: str = "") -> None:
        """Keep a finished sequence in `scope`; evict the oldest ones beyond the bound. A
        sequence already held (the same request again) is stored once, refreshed."""
        seq = tuple(sequence)
        if len(seq) <= KEY or len(seq) > self.max_tokens:
            return
        old = self._by_tokens.pop((scope, seq), None)
        if old is not None:
            self._drop(old)
        sid, self._next_id = self._next_id, self._next_id + 1
        self._seqs[sid] = (scope, seq)
        self._by_tokens[(scope, seq)] = sid
        self.tokens += len(seq)
        held = self._scopes.get(scope)
        if held is None:
            held = self._scopes[scope] = _ScopeHeld()
        self._scopes.move_to_end(scope)
        held.tokens += len(seq)
        held.ids[sid] = None
        index = self._index.setdefault(scope, {})
        for end in range(KEY, len(seq)):
            index[seq[end - KEY:end]] = (sid, end)
        while self.tokens > self.max_tokens:
            self._drop(self._victim())
        if self.on_add is not None:
            self.on_add()

    def _victim(self) -> int:
        """The sequence to drop for room: the oldest of the least recently used scope
        above its share, else the oldest of the least recently used scope."""
        for held in self._scopes.values():
            if held.tokens > self.scope_share:
                return next(iter(held.ids))
        return next(iter(next(iter(self._scopes.values())).ids))

    def scope_tokens(self, scope: str) -> int:
        """Tokens held in `scope`."""
        held = self._scopes.get(scope)
        return held.tokens if held is not None else 0

    def sequences(self) -> list[tuple[int, ...]]:
        """The sequences held, oldest first (a snapshot: adding later does not change it)."""
        return [seq for _, seq in self._seqs.values()]

    def scoped(self) -> list[tuple[str, tuple[int, ...]]]:
        """(scope, sequence) of each sequence held, oldest first (a snapshot)."""
        return list(self._seqs.values())

    def save(self, path: str | os.PathLike) -> None:
        """Write the sequences, oldest first, to path atomically (LookupCacheError if it
        cannot be written). Needs the vocabulary (the constructor's or load()'s)."""
        if self.vocab is None:
            raise ValueError("lookup cache: save() needs the target's vocabulary (vocab=)")
        write_atomic(path, self.encode())

    def encode(self) -> bytes:
        """The file's bytes for what is held now (save() writes them)."""
        assert self.vocab is not None
        held = self.scoped()
        return encode([seq for _, seq in held], *self.vocab, [sc for sc, _ in held])

    @classmethod
    def load(cls, path: str | os.PathLike, n_vocab: int, fingerprint: str,
             max_tokens: int = DEFAULT_TOKENS, match_max: int = 64,
             scope_share: int | None = None) -> LookupCache:
        """The cache saved at path for this vocabulary (empty if there is no such file);
        LookupCacheError, naming the file, if it is cut short, of another format or
        version, or of another vocabulary. Beyond max_tokens, the oldest are left out."""
        cache = cls(max_tokens, match_max, (n_vocab, fingerprint), scope_share)
        got = read_file(path)
        if got is None:
            return cache
        name = os.fspath(path)
        if (got.n_vocab, got.fingerprint) != (n_vocab, fingerprint):
            raise LookupCacheError(
                f"lookup cache {name}: written for another vocabulary ({got.n_vocab} tokens, "
                f"fingerprint {got.fingerprint}; the target has {n_vocab} tokens, fingerprint "
                f"{fingerprint}): move it away or name another file")
        for seq in got.sequences:
            if len(seq) and int(seq.max()) >= n_vocab:
                raise LookupCacheError(f"lookup cache {name}: corrupt: token id "
                                       f"{int(seq.max())} is outside the vocabulary "
                                       f"({n_vocab} tokens)")
        scopes = got.scopes if got.scopes is not None else [""] * len(got.sequences)
        for seq, scope in zip(got.sequences, scopes, strict=True):  # oldest first: add()
            cache.add(seq.tolist(), scope)                          # drops the oldest
        return cache

    def _drop(self, sid: int) -> None:
        scope, seq = self._seqs.pop(sid)
        self._by_tokens.pop((scope, seq), None)
        self.tokens -= len(seq)
        held = self._scopes[scope]
        held.tokens -= len(seq)
        del held.ids[sid]
        if not held.ids:
            del self._scopes[scope]
        index = self._index[scope]
        for end in range(KEY, len(seq)):
            key = seq[end - KEY:end]
            if index.get(key, (None,))[0] == sid:
                del index[key]
        if not index:
            del self._index[scope]

    def match(self, history: Sequence[int], scope: str = "") -> CachedMatch | None:
        """The latest occurrence, among `scope`'s sequences, of history's last KEY tokens,
        with its length."""
        if len(history) < KEY:
            return None
        index = self._index.get(scope)
        hit = index.get(tuple(history[len(history) - KEY:])) if index is not None else None
        if hit is None:
            return None
        self._scopes.move_to_end(scope)
        sid, end = hit
        seq = self._seqs[sid][1]
        n, size = KEY, len(history)
        limit = min(self.match_max, end, size)
        while n < limit and seq[end - n - 1] == history[size - n - 1]:
            n += 1
        return CachedMatch(seq, end, n)
