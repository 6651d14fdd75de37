"""POST /slots/{id}?action=save|restore|erase: llama-server's slot files (--slot-save-path).

save writes the slot's KV cache and its tokens to a file in the --slot-save-path folder;
restore reads one back, so that the next request sharing its prefix starts from there
(cache_n); erase empties the slot's cache. Each runs between the batch's steps, on an idle
slot only (409 otherwise), and changes no output.

What a shared server needs beyond llama-server's (issue 40):
- the file is ours (state_file.py): a header naming the model, adapters and cache types
  it is valid for, the scales its cells were computed under, its length and a checksum,
  all checked before llama.cpp sees a byte (a truncated llama.cpp file aborts the
  process); a file that fails is a 400, never restored. Restored cells are reused only
  by requests of the scales they were computed under (Engine.cache_lora).
- written atomically: a failed save (a full disk) leaves no file;
- with API keys each key has its own folder (named by a digest of its cache scope): a
  key can neither restore, overwrite nor learn of another's files; a slot whose cache
  holds another key's tokens can neither be saved (403) nor erased (403) by this key
  (restoring into it, as a request would, empties it first: Engine.enter_scope);
- a quota per key (--slot-save-files, --slot-save-bytes): a save past it is a 403;
- no symlink is followed, in the folder or at the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import time
from dataclasses import dataclass
from typing import Any

from specwire.backend.base import BackendError
from specwire.server import state_file
from specwire.server.errors import ApiError, bad_request

ACTIONS = ("save", "restore", "erase")
#: a file name as llama-server accepts one: no folders, no leading dot, printable.
_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,254}")


@dataclass(frozen=True, slots=True)
class Quota:
    """What one API key (or the server without keys) may keep in the folder."""

    files: int = 16
    bytes: int = 8 << 30


def filename(body: Any) -> str:
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise bad_request("filename: required, a plain file name (letters, digits, '.', '_', "
                          "'-'; no folders)")
    return name


def key_folder(scope: str) -> str:
    """The subfolder of the files of cache scope `scope` ("" without API keys: the folder
    itself); a digest, so that neither the key nor its scope can be read from it."""
    if not scope:
        return ""
    return "key-" + hashlib.sha256(b"specwire slot files\0" + scope.encode()).hexdigest()[:24]


def _open_folder(folder: str, scope: str) -> int:
    """The descriptor of the folder of scope `scope`'s files, made if missing; never
    through a symlink."""
    sub = key_folder(scope)
    try:
        root = state_file.open_folder(folder)
        if not sub:
            return root
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(sub, 0o700, dir_fd=root)
            st = os.stat(sub, dir_fd=root, follow_symlinks=False)
            if not stat.S_ISDIR(st.st_mode):
                raise OSError(errno.ENOTDIR, "not a folder (a symlink is never followed)")
            return os.open(sub, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0),
                           dir_fd=root)
        finally:
            os.close(root)
    except OSError as e:
        raise ApiError(500, f"--slot-save-path: cannot use the folder of this API key's "
                       f"files: {e.strerror or e}", "server_error") from None


def run(slot: Any, action: str, folder: str | None, body: Any, scope: str = "",
        quota: Quota = Quota()) -> dict:  # noqa: B008 - frozen
    """One action on an idle slot (its engine is not stepping: the caller holds the
    scheduler's lock) for a client of cache scope `scope`."""
    if action not in ACTIONS:
        raise bad_request(f"action: must be save, restore or erase, got {action!r}")
    if slot.job is not None:
        raise ApiError(409, f"slot {slot.index} is processing a request; try when it is idle",
                       "conflict_error")
    target = slot.target
    if action in ("save", "erase") and slot.scope != scope and target.n_past:
        raise ApiError(403, f"slot {slot.index} holds the cache of another API key's "
                       f"request; it can be {action}d with that key only", "permission_error")
    if action == "erase":
        n = target.n_past
        target.truncate(0)
        return {"id_slot": slot.index, "n_erased": n}
    if not folder:
        raise ApiError(501, "slot files need serve --slot-save-path DIR", "not_supported_error")
    name = filename(body)
    dir_fd = _open_folder(folder, scope)
    try:
        if action == "save":
            return _save(slot, dir_fd, name, quota)
        return _restore(slot, dir_fd, name, scope, quota)
    finally:
        os.close(dir_fd)


def _unsupported(target: Any) -> None:
    if not hasattr(target, "seq_state"):
        raise ApiError(501, f"{target.name}: this backend cannot save or restore its KV "
                       "cache", "not_supported_error")


def _save(slot: Any, dir_fd: int, name: str, quota: Quota) -> dict:
    target, t0 = slot.target, time.perf_counter()
    _unsupported(target)
    try:
        tokens, state = target.seq_state()
    except BackendError as e:
        raise bad_request(str(e)) from None
    parts = state_file.encode(target.state_identity(), slot.engine.cache_lora[slot.seq],
                              tokens, memoryview(state).cast("B"))
    size = sum(len(p) for p in parts)
    n_files, n_bytes = state_file.usage(dir_fd, skip=name)
    if n_files + 1 > quota.files or n_bytes + size > quota.bytes:
        raise ApiError(403, f"slot files: this API key's quota is {quota.files} files and "
                       f"{quota.bytes} bytes (--slot-save-files, --slot-save-bytes); it holds "
                       f"{n_files} files and {n_bytes} bytes besides {name!r}, and this one "
                       f"is {size} bytes: overwrite or erase one", "permission_error")
    try:
        written = state_file.write_atomic(dir_fd, name, parts)
    except OSError as e:
        raise ApiError(507, f"slot file {name!r} not written: {e.strerror or e} (no file "
                       "was left)", "server_error") from None
    return {"id_slot": slot.index, "filename": name, "n_saved": len(tokens),
            "n_written": written,
            "timings": {"save_ms": round(1000 * (time.perf_counter() - t0), 3)}}


def _restore(slot: Any, dir_fd: int, name: str, scope: str, quota: Quota) -> dict:
    target, t0 = slot.target, time.perf_counter()
    try:
        data = state_file.read_whole(dir_fd, name, quota.bytes)
    except FileNotFoundError:
        raise ApiError(404, f"no slot file {name!r} in --slot-save-path",
                       "not_found_error") from None
    except state_file.StateFileError as e:
        raise bad_request(f"slot file {name!r}: not restored: {e}") from None
    except OSError as e:
        raise bad_request(f"slot file {name!r}: cannot read it: {e.strerror or e}") from None
    _unsupported(target)
    try:
        checked = state_file.decode(data, target.state_identity(), target.n_ctx)
    except state_file.StateFileError as e:
        raise bad_request(f"slot file {name!r}: not restored: {e}") from None
    slot.engine.enter_scope(slot.seq, scope)   # its caches emptied if another's
    try:
        n = target.set_seq_state(checked.tokens, checked.state)
    except BackendError as e:
        raise bad_request(f"slot file {name!r}: {e}") from None
    slot.engine.cache_lora[slot.seq] = checked.lora
    return {"id_slot": slot.index, "filename": name, "n_restored": n, "n_read": len(data),
            "timings": {"restore_ms": round(1000 * (time.perf_counter() - t0), 3)}}
