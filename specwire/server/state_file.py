"""A slot's KV cache as a file: our own header, checked whole before llama.cpp sees a byte.

llama.cpp's own slot files (llama_state_seq_save_file) abort the process on a truncated
file (a GGML_ASSERT: 5 truncations of 5, one byte included), and it takes a file of
another model whose tensors have the same shapes. So specwire writes its own format and
hands llama.cpp only bytes that passed every check:

    b"SWKVSLT1"  magic (8 bytes)
    u32 LE       length of the header (JSON, UTF-8; at most 64 KiB)
    header       {"identity": {...}, "lora": [scales], "n_tokens": N,
                  "state_bytes": M, "sha256": hex}
    N x i32 LE   the tokens the cells hold, in position order
    M bytes      llama_state_seq_get_data's bytes

`identity` is what the state is only valid for (the model's fingerprint, its adapters,
the cache's types: Backend.state_identity); `lora` the adapter scales the cells were
computed under (a cache is reused only by requests of the same scales); `sha256` covers
the header without it and everything after it. A file of another length, a bad digest,
another identity, or more tokens than the slot's context is refused (StateFileError).

Writes are atomic: a temporary file in the same folder (O_EXCL, O_NOFOLLOW), fsync,
rename over the name, fsync of the folder; a failed write leaves no file. Reads open
with O_NOFOLLOW and read one regular file whole into memory, so what is checked is what
is used.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import stat
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

MAGIC = b"SWKVSLT1"
_LEN = struct.Struct("<I")
MAX_HEADER = 64 * 1024
#: the prefix of temporary files (never a name a client may give: slot_files.filename)
TMP_PREFIX = ".tmp-"


class StateFileError(Exception):
    """The file is not a slot file this server may restore; the message says why."""


@dataclass(frozen=True, slots=True)
class SlotState:
    """A decoded, checked file: the tokens, the state bytes, the scales."""

    tokens: list[int]
    state: memoryview
    lora: tuple[float, ...]


def _digest(header: Mapping, body: Sequence[bytes | memoryview]) -> str:
    h = hashlib.sha256(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for part in body:
        h.update(part)
    return h.hexdigest()


def encode(identity: Mapping, lora: Sequence[float], tokens: Sequence[int],
           state: bytes | memoryview) -> list[bytes | memoryview]:
    """The file's bytes, as parts to write one after another."""
    toks = struct.pack(f"<{len(tokens)}i", *tokens)
    header = {"identity": dict(identity), "lora": [float(x) for x in lora],
              "n_tokens": len(tokens), "state_bytes": len(state)}
    header["sha256"] = _digest(header, (toks, state))
    raw = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    return [MAGIC + _LEN.pack(len(raw)), raw, toks, state]


def decode(data: bytes | memoryview, identity: Mapping, n_ctx: int) -> SlotState:
    """Check a whole file's bytes against the slot it would go into: StateFileError if it
    is not exactly a file this server wrote for this model, adapters and cache types."""
    view = memoryview(data)
    head = len(MAGIC) + _LEN.size
    if len(view) < head or bytes(view[:len(MAGIC)]) != MAGIC:
        raise StateFileError("not a specwire slot file (no header; a file of llama-server "
                             "or of an older specwire is not read)")
    (n_head,) = _LEN.unpack_from(view, len(MAGIC))
    if n_head > MAX_HEADER or head + n_head > len(view):
        raise StateFileError("the file is truncated or its header is damaged")
    try:
        header = json.loads(bytes(view[head:head + n_head]))
        n_tokens, n_state = header["n_tokens"], header["state_bytes"]
        lora, digest, ident = header["lora"], header["sha256"], header["identity"]
        ok = (isinstance(header, dict) and isinstance(n_tokens, int) and n_tokens >= 0
              and isinstance(n_state, int) and n_state >= 0 and isinstance(digest, str)
              and isinstance(ident, dict) and isinstance(lora, list)
              and all(isinstance(x, int | float) and not isinstance(x, bool) for x in lora))
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise StateFileError("the file's header is damaged")
    start = head + n_head
    if len(view) != start + 4 * n_tokens + n_state:
        raise StateFileError(f"the file is {len(view)} bytes, its header says "
                             f"{start + 4 * n_tokens + n_state}: truncated or damaged")
    toks = view[start:start + 4 * n_tokens]
    state = view[start + 4 * n_tokens:]
    body = {k: v for k, v in header.items() if k != "sha256"}
    if _digest(body, (toks, state)) != digest:
        raise StateFileError("the file's checksum does not match: it is damaged")
    for key, want in identity.items():
        if ident.get(key) != want:
            raise StateFileError(f"the file was saved under another {key} "
                                 f"({ident.get(key)!r}, this server: {want!r})")
    if n_tokens > n_ctx:
        raise StateFileError(f"the file holds {n_tokens} tokens, more than the slot's "
                             f"context ({n_ctx})")
    return SlotState(list(struct.unpack(f"<{n_tokens}i", toks)), state,
                     tuple(float(x) for x in lora))


def open_folder(path: str, follow: bool = True) -> int:
    """A folder's descriptor, for the calls below (follow=False: not through a symlink)."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.open(path, flags if follow else flags | os.O_NOFOLLOW)


def write_atomic(folder: int, name: str, parts: Sequence[bytes | memoryview]) -> int:
    """Write `parts` as `name` in the folder of descriptor `folder` through a temporary
    file beside it (fsync, rename, fsync of the folder); bytes written. On any failure
    no file is left (the OSError is raised)."""
    tmp = f"{TMP_PREFIX}{name}-{secrets.token_hex(6)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                 | getattr(os, "O_CLOEXEC", 0), 0o600, dir_fd=folder)
    n = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for part in parts:
                f.write(part)
                n += len(part)
            f.flush()
            os.fsync(f.fileno())
        # a symlink planted at `name` is replaced, never followed
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    with contextlib.suppress(OSError):
        os.fsync(folder)
    return n


def read_whole(folder: int, name: str, max_bytes: int) -> bytes:
    """A regular file's bytes, never through a symlink (StateFileError), at most max_bytes
    (StateFileError past them). FileNotFoundError if there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
                     | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise StateFileError(f"cannot open it ({e.strerror}; a symlink is never "
                             "followed)") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise StateFileError("not a regular file")
        if st.st_size > max_bytes:
            raise StateFileError(f"the file is {st.st_size} bytes, more than a slot file "
                                 f"may be here ({max_bytes})")
        data = f.read(st.st_size + 1)
    if len(data) != st.st_size:
        raise StateFileError("the file changed while it was read")
    return data


def usage(folder: int, skip: str = "") -> tuple[int, int]:
    """The slot files in a folder (regular files, not temporary ones, not `skip`, not
    in subfolders) and their bytes."""
    n = size = 0
    with os.scandir(folder) as it:
        for e in it:
            if e.name.startswith(".") or e.name == skip:
                continue
            with contextlib.suppress(OSError):
                if e.is_file(follow_symlinks=False):
                    n += 1
                    size += e.stat(follow_symlinks=False).st_size
    return n, size
