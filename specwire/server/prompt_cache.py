"""--prompt-cache FILE: llama-cli's saved prompt state, kept across a server's restarts.

llama-cli saves the KV cache of its prompt to FILE and, started again on a prompt that
begins the same way, loads it instead of evaluating those tokens again. A server has many
prompts, so here FILE holds the cache of the slot that served last: its last prompt, or
with --prompt-cache-all everything its cache holds (the prompt and what was generated).
serve restores FILE into slot 0 before it listens, so that the first request sharing its
prefix starts from there (cache_n), and writes it when it stops, unless --prompt-cache-ro.
FILE is written in specwire's slot-file format (state_file.py) and checked whole before
it is used: a truncated or damaged file, or one of another model, adapters or cache
type, is warned about and serve starts cold (a truncated llama.cpp state file used to
abort serve at start). A cache changes no token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specwire.backend.base import BackendError, reusable_prefix
from specwire.server import state_file

log = logging.getLogger("specwire.prompt_cache")

#: the largest FILE read (a KV cache of 1M tokens of a large model is tens of GB; a file
#: larger than this is not one serve wrote)
MAX_BYTES = 256 << 30


@dataclass(frozen=True, slots=True)
class PromptCache:
    path: str
    save_all: bool = False   # --prompt-cache-all: the generated tokens too
    read_only: bool = False  # --prompt-cache-ro: restore, never write


def restore(cache: PromptCache, slots: Sequence[Any]) -> int:
    """FILE into slot 0, if it exists; the tokens restored (0: none, or not usable). The
    file is checked whole first (state_file.py: a truncated or damaged file, or one of
    another model, adapters or cache type, is warned about and serve starts cold; llama.cpp
    never reads it)."""
    slot = slots[0]
    target = slot.target
    folder, name = os.path.split(os.path.abspath(cache.path))
    try:
        fd = state_file.open_folder(folder)
        try:
            data = state_file.read_whole(fd, name, MAX_BYTES)
        finally:
            os.close(fd)
        if not hasattr(target, "seq_state"):
            raise state_file.StateFileError(f"{target.name} cannot restore a KV cache")
        checked = state_file.decode(data, target.state_identity(), target.n_ctx)
        n = target.set_seq_state(checked.tokens, checked.state)
    except FileNotFoundError:
        log.info("--prompt-cache %s: no such file yet; it is written when serve stops",
                 cache.path)
        return 0
    except (state_file.StateFileError, BackendError, OSError) as e:
        log.warning("--prompt-cache %s: not used, serve starts cold: %s", cache.path,
                    getattr(e, "strerror", None) or e)
        return 0
    slot.engine.cache_lora[slot.seq] = checked.lora
    log.info("--prompt-cache %s: %d tokens restored into slot 0", cache.path, n)
    return n


def save(cache: PromptCache, slots: Sequence[Any]) -> int:
    """The cache of the slot that served last to FILE (its prompt only, unless save_all);
    the tokens written (0: nothing to write, or read-only). Written atomically: a failed
    write leaves the file as it was."""
    if cache.read_only:
        return 0
    used = [s for s in slots if s.job is None and s.last_used and s.target.n_past]
    if not used:
        return 0
    slot = max(used, key=lambda s: s.last_used)
    target = slot.target
    if not cache.save_all:
        # What the cache still holds of the prompt (a context shift may have cut it).
        keep = reusable_prefix(target.tokens, [*slot.last_prompt, -1])
        if keep == 0:
            return 0
        target.truncate(keep)
    t0 = time.perf_counter()
    folder, name = os.path.split(os.path.abspath(cache.path))
    try:
        tokens, state = target.seq_state()
        parts = state_file.encode(target.state_identity(), slot.engine.cache_lora[slot.seq],
                                  tokens, memoryview(state).cast("B"))
        fd = state_file.open_folder(folder)
        try:
            state_file.write_atomic(fd, name, parts)
        finally:
            os.close(fd)
    except (BackendError, OSError) as e:
        log.warning("--prompt-cache %s: not written: %s", cache.path,
                    getattr(e, "strerror", None) or e)
        return 0
    log.info("--prompt-cache %s: %d tokens of slot %d written in %.0f ms", cache.path,
             len(tokens), slot.index, 1000 * (time.perf_counter() - t0))
    return len(tokens)
