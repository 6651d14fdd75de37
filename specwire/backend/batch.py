"""Several sequences in one decode: what each puts into a step, and a backend that takes them.

The engine's step asks every running sequence for its part (a chunk of its
prompt, or its last token and its draft), hands all parts to one `decode`, and
gives each sequence back the logits rows of its own part. A backend that holds
many sequences in one context (LlamaBackend with n_seq > 1) reads the weights
once for all of them; any other Backend is a batch of one (`OneSequence`).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from specwire.backend.base import Backend, BackendError

#: The logits rows a part asks for.
LOGITS = ("all", "last", "none")


@dataclass(slots=True)
class Part:
    """One sequence's tokens in a step, appended at its n_past."""

    seq: int
    tokens: list[int]
    logits: str = "all"   # "all": a row per token; "last": one; "none": none
    #: A tree part (sample/tree.py): (len(tokens),) each token's parent index in the part,
    #: -1 for the first; a token sits one position after its parent. Its logits are "all",
    #: and the sequence then holds the tree until keep_tree says which path to keep.
    parents: list[int] | None = None

    @property
    def n_rows(self) -> int:
        return {"all": len(self.tokens), "last": 1, "none": 0}[self.logits]


@runtime_checkable
class BatchBackend(Protocol):
    """A target holding n_seq sequences, each a Backend of its own (`seq(i)`)."""

    n_seq: int
    #: The most tokens one decode takes (llama.cpp's -b): the step's budget.
    n_batch: int
    #: Seconds spent inside the model's decode (all sequences together).
    decode_s: float

    def seq(self, i: int) -> Backend:
        """Sequence i's view: its tokens, truncate, eval (a decode of its part alone)."""

    def seq_decode_s(self, i: int) -> float:
        """Sequence i's share of decode_s (by its tokens in each decode)."""

    def decode(self, parts: Sequence[Part]) -> list[np.ndarray]:
        """Append every part to its sequence in one decode; each part's logits rows.

        The rows view the backend's buffer: valid until the next decode.
        """


@runtime_checkable
class TreeBackend(Protocol):
    """A BatchBackend that also decodes tree parts (Part.parents), of at most
    `tree_leaves` leaves each."""

    tree_leaves: int

    def keep_tree(self, seq: int, nodes: Sequence[int]) -> None:
        """After a tree part of sequence seq: keep the part's first token and then the
        tokens of `nodes` (a path from the first, its index excluded), drop the rest."""


@runtime_checkable
class Paced(Protocol):
    """A sequence whose decodes are shared with other sequences' (a draft node's,
    node/steps.py): its user says while it drafts, so that each shared decode waits for
    its next tokens then, and not while it waits for something else."""

    #: (sessions' branches, alternates) the last decode of its tokens held; None before one
    step: tuple[int, int] | None

    def drafting(self, alternate: bool = False,
                 answering: bool = False) -> AbstractContextManager[None]:
        """Drafting meanwhile (alternate: an alternate's tokens, counted apart; answering:
        the answer to a verdict, as a synchronous session drafts)."""


@runtime_checkable
class Forking(Protocol):
    """A Paced sequence with a fork: a sequence of its own that shares this one's first
    cells and decodes in the same shared decodes (a draft node's, node/steps.py)."""

    #: whether `fork` gives one (the context was made with forks)
    forks: bool

    def fork(self, n: int) -> Backend:
        """The fork, holding this sequence's first n tokens; close() empties it."""


def tree_leaves(batch: BatchBackend) -> int:
    """The most leaves a tree part of this batch may have (1: chains only)."""
    return batch.tree_leaves if isinstance(batch, TreeBackend) else 1


class OneSequence:
    """Any Backend as a batch of one sequence: its decode is the backend's eval.

    The budget is unbounded: the backend's eval chunks a long prompt itself.
    """

    n_seq = 1
    n_batch = 1 << 30

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @property
    def decode_s(self) -> float:
        return float(getattr(self.backend, "decode_s", 0.0))   # optional on a Backend

    def seq_decode_s(self, i: int) -> float:
        return self.decode_s

    def seq(self, i: int) -> Backend:
        if i != 0:
            raise BackendError(f"sequence {i}: this backend holds one sequence")
        return self.backend

    def decode(self, parts: Sequence[Part]) -> list[np.ndarray]:
        if len(parts) != 1 or parts[0].seq != 0:
            raise BackendError(f"this backend decodes one sequence, not {len(parts)} parts")
        return [self.backend.eval(parts[0].tokens, parts[0].logits)]


def as_batch(target: Backend | BatchBackend) -> BatchBackend:
    """The target as a batch of sequences (a plain Backend is a batch of one)."""
    return target if isinstance(target, BatchBackend) else OneSequence(target)
