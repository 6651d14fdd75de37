"""The one small protocol every model backend speaks.

A backend owns one sequence's KV cache. The engine only ever appends tokens,
reads logits at the positions it asked for, and truncates after a rejection.
It also declares what the engine measures and reuses: `decode_s` (its time
inside the model, so the engine can tell its own overhead) and `reuse_chunks`
(llama-server's --cache-reuse; a backend that cannot shift its cache keeps the
common prefix only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class BackendError(RuntimeError):
    """A model could not be loaded or evaluated; the message names the file."""


class NonFiniteLogits(BackendError):
    """A decode's logits held inf or NaN; seqs: the sequences of that decode, whose caches
    the backend dropped (llama.py's _check_finite)."""

    def __init__(self, message: str, seqs: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.seqs = list(seqs)


class Backend(Protocol):
    name: str  # file name, for messages and /v1/models
    n_vocab: int
    n_ctx: int
    decode_s: float  # seconds spent evaluating so far (grows; callers take differences)

    @property
    def n_past(self) -> int:
        """Tokens currently held in the KV cache."""

    @property
    def tokens(self) -> Sequence[int]:
        """The token ids held in the KV cache, in order."""

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        """Append tokens at position n_past; return logits rows.

        logits: "last" -> (1, V), "all" -> (len(tokens), V), "none" -> (0, V).
        The rows view the backend's buffer: valid until the next eval.
        """

    def truncate(self, n: int) -> None:
        """Keep the first n tokens of the KV cache (rollback after a rejection)."""

    def reuse_chunks(self, prompt: Sequence[int], n_past: int, n_min: int) -> int:
        """--cache-reuse: the cache holds prompt[:n_past]; shift cached runs of at least
        n_min tokens that the rest of the prompt repeats into place, and return how many
        prompt tokens it then holds (n_past where nothing can be shifted)."""

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...

    def detokenize(self, tokens: Sequence[int]) -> bytes: ...

    def is_eog(self, token: int) -> bool:
        """End of generation (EOS, EOT...)."""

    def vocab_fingerprint(self) -> str:
        """A digest of the token table: two models with equal ones can be paired."""

    def chat_template(self) -> str | None:
        """The GGUF's own Jinja chat template, if it has one."""


def reusable_prefix(cached: Sequence[int], tokens: Sequence[int]) -> int:
    """How many of `tokens` a cache holding `cached` already has: their longest common
    prefix, less the last token of `tokens`, which is always evaluated again for its logits."""
    n = min(len(cached), len(tokens) - 1)
    i = 0
    while i < n and cached[i] == tokens[i]:
        i += 1
    return i


def window_kept(backend: Backend, n: int) -> int:
    """n, the cached tokens a caller means to keep, or 0 where the cache no longer holds
    every cell the token at position n would attend to (a sliding-window cache drops
    the start of a long sequence: `holds_window`, optional on a backend)."""
    holds = getattr(backend, "holds_window", None)
    return n if holds is None or holds(n) else 0


def usable_prefix(backend: Backend, tokens: Sequence[int]) -> int:
    """How many of `tokens` the backend's cache can keep: reusable_prefix, or 0 where
    what follows it would miss cells of its attention window (window_kept)."""
    return window_kept(backend, reusable_prefix(backend.tokens, tokens))


def sync_prefix(backend: Backend, tokens: Sequence[int]) -> int:
    """Truncate the cache to its longest common prefix with `tokens`; return that length.

    Keeps at least one token un-evaluated so that the caller gets fresh logits, and
    none where the cache lost cells of that prefix's attention window (usable_prefix).
    """
    i = usable_prefix(backend, tokens)
    if i != len(backend.tokens):
        backend.truncate(i)
    return i
