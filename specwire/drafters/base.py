"""The drafter protocol: two methods, propose and learn, inside a begin/end pair.

Local model, n-gram and remote drafters all implement it, so the engine loop is
the same in one process and across the network. A drafter that can stop a draft
by the adaptive policy's rule also has `steer(policy | None)`, which the engine
calls around an adaptive request.

What a drafter can do in rejection mode it declares with class attributes, which
the engine checks when it is built (drafters/guard.py): `provides_q` (its
drafts carry their sparse q), `deterministic` (its drafts never depend on the
target's random draws, so a point mass is their exact q), and `remote` (its q
comes over the network and is trusted, which is logged once).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from specwire.config import DraftParams, SamplingParams
from specwire.sampling import SparseDraft


@dataclass(slots=True)
class Draft:
    """Proposed continuation of the history: token ids, plus q in rejection mode.

    confidence: a draft model's top probability for each token (llama.cpp's
    --draft-p-min measure), where it computed one; the adaptive policy learns
    from them how far to trust the draft.
    """

    tokens: list[int] = field(default_factory=list)
    sparse: list[SparseDraft] | None = None
    confidence: list[float] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> Draft:
        return Draft(
            self.tokens[:n],
            None if self.sparse is None else self.sparse[:n],
            None if self.confidence is None else self.confidence[:n],
        )


class Drafter(Protocol):
    name: str

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams) -> None:
        """A new sequence starts; a remote drafter may start prefilling now."""

    def propose(self, history: Sequence[int], max_n: int) -> Draft:
        """Up to max_n tokens that would follow history (history[-1] is the newest token)."""

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        """The round ended: `appended` tokens were added to history, `accepted` of them drafted."""

    def end(self) -> None:
        """The sequence is over; free its state."""

    def stats(self) -> dict[str, float]:
        """Cumulative figures the drafter measured (ms of network wait, bytes...)."""


class StatelessDrafter:
    """A drafter that keeps no per-sequence state: begin, learn and end do nothing.

    Subclasses propose, and count what they proposed in `drafted`.
    """

    name = "stateless"
    drafted = 0

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams) -> None:
        pass

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {"drafted": float(self.drafted)} if self.drafted else {}


class NoDrafter(StatelessDrafter):
    """Plain decoding: proposes nothing."""

    name = "none"
    deterministic = True

    def propose(self, history: Sequence[int], max_n: int) -> Draft:
        return Draft()
