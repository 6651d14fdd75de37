"""POST /slots/{id}?action=save|restore|erase: llama-server's slot files (--slot-save-path).

save writes the slot's KV cache and its tokens to a file in the --slot-save-path folder;
restore reads one back, so that the next request sharing its prefix starts from there
(cache_n); erase empties the slot's cache. Each runs between the batch's steps, on an idle
slot only (409 otherwise), and changes no output. With API keys a slot's cache belongs to
the cache scope that filled it (Engine.enter_scope): save refuses (403) another key's, and
a restored cache belongs to the key that restored it; the folder is shared by every key, as
in llama-server.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any

from specwire.backend.base import BackendError
from specwire.server.errors import ApiError, bad_request

ACTIONS = ("save", "restore", "erase")
#: a file name as llama-server accepts one: no folders, no leading dot, printable.
_NAME = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,254}")


def filename(body: Any) -> str:
    name = body.get("filename") if isinstance(body, dict) else None
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise bad_request("filename: required, a plain file name (letters, digits, '.', '_', "
                          "'-'; no folders)")
    return name


def run(slot: Any, action: str, folder: str | None, body: Any, scope: str = "") -> dict:
    """One action on an idle slot (its engine is not stepping: the caller holds the
    scheduler's lock) for a client of cache scope `scope`."""
    if action not in ACTIONS:
        raise bad_request(f"action: must be save, restore or erase, got {action!r}")
    if slot.job is not None:
        raise ApiError(409, f"slot {slot.index} is processing a request; try when it is idle",
                       "conflict_error")
    target = slot.target
    if action == "erase":
        n = target.n_past
        target.truncate(0)
        return {"id_slot": slot.index, "n_erased": n}
    if action == "save" and slot.scope != scope and target.n_past:
        raise ApiError(403, f"slot {slot.index} holds the cache of another API key's "
                       "request; it can be saved with that key only", "permission_error")
    if not folder:
        raise ApiError(501, "slot files need serve --slot-save-path DIR", "not_supported_error")
    name = filename(body)
    path = os.path.join(folder, name)
    from specwire.backend import llama
    t0 = time.perf_counter()
    try:
        if action == "save":
            n = target.n_past
            written = llama.save_file(target, path)
            return {"id_slot": slot.index, "filename": name, "n_saved": n,
                    "n_written": written,
                    "timings": {"save_ms": round(1000 * (time.perf_counter() - t0), 3)}}
        if not os.path.isfile(path):
            raise ApiError(404, f"no slot file {name!r} in --slot-save-path", "not_found_error")
        slot.engine.enter_scope(slot.seq, scope)   # its caches emptied if another's
        n = llama.load_file(target, path)
        return {"id_slot": slot.index, "filename": name, "n_restored": n,
                "n_read": os.path.getsize(path),
                "timings": {"restore_ms": round(1000 * (time.perf_counter() - t0), 3)}}
    except BackendError as e:
        raise bad_request(str(e)) from None
