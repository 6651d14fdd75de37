"""llama-server's context shift (--context-shift, --keep N, the request's n_keep).

When a sequence's context is full, the first n_keep tokens of the prompt stay (all of it
for -1, and BOS beside them), half of the rest is dropped, and the cells after it are moved
down (llama_memory_seq_rm + seq_add), so generation goes on past the context's end.

Lossless under speculation: a round never takes the history past the context (the engine
caps its draft), so every shift happens when the history holds exactly n_ctx tokens, with
a draft or without one. The target's cache then holds the same tokens at the same
positions in both runs, and its next logits are the same. The drafter's own sequence is
started again on the shifted history (DraftGuard.rebase): its cache no longer matches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Shift:
    """Cells [keep, keep + discard) go; the ones after them move discard positions down."""

    keep: int
    discard: int


def plan_shift(n_cached: int, n_prompt: int, n_keep: int, n_ctx: int, adds_bos: bool,
               n_discard: int = 0) -> Shift | None:
    """llama-server's arithmetic: keep = n_keep (the prompt for -1), plus BOS, at most
    n_ctx - 4; discard = n_discard, or half of what follows keep. None when nothing can go
    (n_keep holds the whole cache)."""
    keep = n_prompt if n_keep < 0 else n_keep
    keep = min(n_ctx - 4, keep + int(adds_bos))
    left = n_cached - keep
    discard = min(n_discard, left) if n_discard > 0 else left // 2
    if keep < 0 or discard <= 0:
        return None
    return Shift(keep, discard)


def shifted(history: list[int], shift: Shift) -> list[int]:
    """The history less the dropped run (a new list: drafters may hold the old one)."""
    return history[:shift.keep] + history[shift.keep + shift.discard:]
