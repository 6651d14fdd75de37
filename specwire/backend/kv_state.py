"""A llama.cpp context's KV cache copied out to RAM and back, or shifted in place.

`save` copies sequence 0's cells (K, V and their positions) into bytes with
llama_state_seq_get_data; `restore` puts them back into a context of the same
model and settings with llama_state_seq_set_data. The bytes are what the draft
node keeps of a finished conversation (node/kv_cache.py) and what its
--cache-ram budget counts.

`reuse_chunks` is llama-server's --cache-reuse: past the common prefix, runs of
at least n_min cached tokens that reappear later in the new prompt are moved
to their new positions (llama_memory_seq_add; llama.cpp re-rotates their keys
on the next decode) instead of being evaluated again. `shift` is llama-server's
context shift: it drops a run of cells after the first n_keep and moves the rest
down into its place the same way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp as C
import numpy as np

from specwire.backend.base import BackendError
from specwire.backend.llama import LlamaBackend


@dataclass(slots=True)
class SavedState:
    """The KV cells of one sequence and the tokens they hold."""

    tokens: np.ndarray  # int32, in position order
    data: ctypes.Array  # llama_state_seq_get_data's bytes

    @property
    def size(self) -> int:
        """Bytes this entry holds in RAM."""
        return len(self.data) + self.tokens.nbytes


def state_size(backend: LlamaBackend) -> int:
    """Bytes `save` would take for what the context holds now."""
    return int(C.llama_state_seq_get_size(backend.ctx, 0))


def save(backend: LlamaBackend) -> SavedState:
    n = state_size(backend)
    buf = (ctypes.c_uint8 * n)()
    got = C.llama_state_seq_get_data(backend.ctx, buf, n, 0)
    if got == 0:
        raise BackendError(f"llama.cpp could not save the KV state of {backend.name}")
    if got < n:
        buf = (ctypes.c_uint8 * got).from_buffer_copy(buf, 0)
    return SavedState(np.asarray(backend.tokens, dtype=np.int32), buf)


def restore(backend: LlamaBackend, saved: SavedState) -> bool:
    """Replace the context's sequence with a saved one; False (and an empty cache) if
    llama.cpp refuses it."""
    C.llama_memory_clear(backend.mem, True)
    if C.llama_state_seq_set_data(backend.ctx, saved.data, len(saved.data), 0) == 0:
        C.llama_memory_clear(backend.mem, True)
        backend.adopt([])
        return False
    backend.adopt(saved.tokens.tolist())
    return True


def save_file(view, path: str) -> int:  # noqa: ANN001 - LlamaBackend or its SeqView
    """llama-server's slot save: one sequence's cells and tokens to a file; bytes written."""
    owner, seq = getattr(view, "owner", view), getattr(view, "seq_id", 0)
    tokens = (C.llama_token * max(1, view.n_past))(*view.tokens)
    written = C.llama_state_seq_save_file(owner.ctx, path.encode(), seq, tokens, view.n_past)
    if written == 0:
        raise BackendError(f"llama.cpp could not save the slot's KV cache to {path}")
    return int(written)


def load_file(view, path: str) -> int:  # noqa: ANN001 - LlamaBackend or its SeqView
    """llama-server's slot restore: the file's cells into this sequence (what it held
    before is dropped); tokens restored. A file of another model or context is refused."""
    owner, seq = getattr(view, "owner", view), getattr(view, "seq_id", 0)
    view.truncate(0)
    tokens = (C.llama_token * view.n_ctx)()
    count = ctypes.c_size_t(0)
    read = C.llama_state_seq_load_file(owner.ctx, path.encode(), seq, tokens, view.n_ctx,
                                       ctypes.byref(count))
    if read == 0:
        C.llama_memory_seq_rm(owner.mem, seq, -1, -1)
        view.adopt([])
        raise BackendError(f"llama.cpp could not restore {path} into this slot (another "
                           "model, context size or cache type?)")
    view.adopt(list(tokens[:count.value]))
    return count.value


def can_shift(backend: LlamaBackend) -> bool:
    """Whether the context's memory supports moving cells to new positions."""
    return bool(C.llama_memory_can_shift(backend.mem))


def shift(backend: LlamaBackend, n_keep: int, n_discard: int, seq: int = 0) -> None:
    """Context shift: drop cells [n_keep, n_keep + n_discard) and move the cells after
    them n_discard positions down (llama_memory_seq_rm + llama_memory_seq_add, as
    llama-server does); the sequence then holds its tokens less the dropped run."""
    view = backend.seq(seq)
    held = list(view.tokens)
    if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > len(held):
        raise BackendError(f"context shift of {n_discard} tokens after {n_keep} outside the "
                           f"{len(held)} cached")
    if not can_shift(backend):
        raise BackendError(f"{backend.name}: its KV cache cannot be shifted")
    C.llama_memory_seq_rm(backend.mem, seq, n_keep, n_keep + n_discard)
    C.llama_memory_seq_add(backend.mem, seq, n_keep + n_discard, len(held), -n_discard)
    view.adopt(held[:n_keep] + held[n_keep + n_discard:])


def reuse_chunks(backend: LlamaBackend, prompt: Sequence[int], n_past: int, n_min: int,
                 seq: int = 0) -> int:
    """Move runs of >= n_min cached tokens past the first n_past (the common prefix) to
    where the prompt has them; return how many prompt tokens the cache now holds.

    The cache is left holding exactly prompt[:returned]; the prompt's last token is
    never taken from the cache, so that its logits are computed.
    """
    if n_min <= 0 or not can_shift(backend):
        return n_past
    cache = list(backend.tokens)
    limit = len(prompt) - 1
    head_c = head_p = n_past
    moved = False
    while head_c < len(cache) and head_p < limit:
        n = 0
        while (head_c + n < len(cache) and head_p + n < limit
               and cache[head_c + n] == prompt[head_p + n]):
            n += 1
        if n >= n_min:
            C.llama_memory_seq_rm(backend.mem, seq, head_p, head_c)
            C.llama_memory_seq_add(backend.mem, seq, head_c, head_c + n, head_p - head_c)
            head_p += n
            head_c += n
            n_past, moved = head_p, True
        else:
            head_c += 1
    if moved:
        C.llama_memory_seq_rm(backend.mem, seq, n_past, -1)
        backend.adopt(prompt[:n_past])
    return n_past
