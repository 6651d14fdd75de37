"""--prompt-cache FILE: llama-cli's saved prompt state, kept across a server's restarts.

llama-cli saves the KV cache of its prompt to FILE and, started again on a prompt that
begins the same way, loads it instead of evaluating those tokens again. A server has many
prompts, so here FILE holds the cache of the slot that served last: its last prompt, or
with --prompt-cache-all everything its cache holds (the prompt and what was generated).
serve restores FILE into slot 0 before it listens, so that the first request sharing its
prefix starts from there (cache_n), and writes it when it stops, unless --prompt-cache-ro.
A file of another model or context is warned about and not used. A cache changes no token.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from specwire.backend.base import BackendError, reusable_prefix

log = logging.getLogger("specwire.prompt_cache")


@dataclass(frozen=True, slots=True)
class PromptCache:
    path: str
    save_all: bool = False   # --prompt-cache-all: the generated tokens too
    read_only: bool = False  # --prompt-cache-ro: restore, never write


def restore(cache: PromptCache, slots: Sequence[Any]) -> int:
    """FILE into slot 0, if it exists; the tokens restored (0: none, or not usable)."""
    from specwire.backend import llama
    if not os.path.isfile(cache.path):
        log.info("--prompt-cache %s: no such file yet; it is written when serve stops",
                 cache.path)
        return 0
    try:
        n = llama.load_file(slots[0].target, cache.path)
    except BackendError as e:
        log.warning("--prompt-cache %s: not used: %s", cache.path, e)
        return 0
    log.info("--prompt-cache %s: %d tokens restored into slot 0", cache.path, n)
    return n


def save(cache: PromptCache, slots: Sequence[Any]) -> int:
    """The cache of the slot that served last to FILE (its prompt only, unless save_all);
    the tokens written (0: nothing to write, or read-only)."""
    from specwire.backend import llama
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
    tmp = cache.path + ".tmp"
    try:
        llama.save_file(target, tmp)
        os.replace(tmp, cache.path)
    except (BackendError, OSError) as e:
        log.warning("--prompt-cache %s: not written: %s", cache.path, e)
        return 0
    log.info("--prompt-cache %s: %d tokens of slot %d written in %.0f ms", cache.path,
             target.n_past, slot.index, 1000 * (time.perf_counter() - t0))
    return target.n_past
