"""The drafter protocol: begin / propose / learn / end, and a declaration of capabilities.

    begin(prompt, sampling, params, policy=, grammar=)  a sequence starts
    propose(history, k) -> Draft        up to k tokens after history
    learn(history, accepted, appended)  the round's verdict
    end()                               the sequence is over: drop its state

A drafter also reports (`stats`, `cache_use`), takes the engine's cost models once
(`use_costs`), is closed once, and declares in `capabilities` what else it does: callers
branch on that declaration, never on probing attributes, and go through one wrapper,
DraftGuard (guard.py). DrafterBase declares nothing and gives the reports empty defaults.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

from specwire.config import DraftParams, SamplingParams
from specwire.sample.sampling import SparseDraft

if TYPE_CHECKING:
    from specwire.backend.base import Backend
    from specwire.policy.costs import DraftCost, VerifyCost
    from specwire.sample.constraints.grammar import GrammarSpec



def counter_values(counters: object) -> dict[str, float]:
    """Every field of a drafter's counters dataclass, by name, as a float (stats())."""
    return {f.name: float(getattr(counters, f.name)) for f in fields(counters)}

@dataclass(slots=True)
class Draft:
    """Proposed continuation of the history: token ids, plus q in rejection mode.

    confidence: a draft model's top probability for each token (llama.cpp's
    --draft-p-min measure), where it computed one; the adaptive policy learns
    from them how far to trust the draft.

    branches: side branches a target may verify beside the chain in one decode
    (sample/tree.py), each (offset, tokens): tokens[0] in place of tokens[offset],
    the rest after it; none reaches deeper than the chain. gain: the tokens the
    drafter expects its branches to add to the chain's (None: it has no estimate; the
    tree rule then uses the yield it learnt, policy/tree.py).
    """

    tokens: list[int] = field(default_factory=list)
    sparse: list[SparseDraft] | None = None
    confidence: list[float] | None = None
    branches: list[tuple[int, list[int]]] | None = None
    gain: float | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> Draft:
        return Draft(
            self.tokens[:n],
            None if self.sparse is None else self.sparse[:n],
            None if self.confidence is None else self.confidence[:n],
            None if self.branches is None else cut_branches(self.branches, n),
            self.gain if n >= len(self.tokens) else None,
        )


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a drafter does beyond the protocol's four calls, declared once.

    provides_q: its drafts carry their sparse q (rejection mode).
    deterministic: its drafts never depend on the target's random draws, so a point
      mass at each drafted token is their exact q (DraftGuard supplies it).
    remote: its q comes over the network; rejection mode trusts it (logged once).
    pipelined: it drafts on its own while the target verifies, so asking is free.
    asks_ahead: `ask(history, k)` sends a round's request before `propose`, so that a
      batch's requests are all in flight before the first answer is awaited.
    lockstep: `draft_in_steps(history, k)` drafts beside the other sequences of one
      shared draft context, a draft decode per position for all (lockstep.py).
    stops: it ends its own drafts (per match, per token): the adaptive policy asks it
      for the most tokens rather than choosing k itself.
    waits: it may hold a round for a fresh branch after a rejection (bubble.py);
      `never_wait()` turns that off where a round must not hold.
    links: `status()` reports its links to draft nodes (the web page, /metrics).
    """

    provides_q: bool = False
    deterministic: bool = False
    remote: bool = False
    pipelined: bool = False
    asks_ahead: bool = False
    lockstep: bool = False
    stops: bool = False
    waits: bool = False
    links: bool = False


@dataclass(frozen=True, slots=True)
class LinkStatus:
    """One link of a drafter to a draft node, as the web page and /metrics show it.

    The node's details are None where the drafter has none to give (a llama-server).
    """

    url: str
    up: bool
    model: str | None = None        # the draft model the node announced ("" before Hello)
    rtt_s: float | None = None      # the handshake's round trip (inf before one)
    failures: int | None = None     # failures in a row
    error: str | None = None        # the last failure's reason
    retry_in_s: float | None = None  # seconds until the next connection attempt
    #: the node's batch: (sessions, alternates) its last decode for this target held
    step: tuple[int, int] | None = None


def cut_branches(branches: Sequence[tuple[int, Sequence[int]]],
                 n: int) -> list[tuple[int, list[int]]]:
    """The branches within a chain of n tokens: each cut to end where the chain ends."""
    return [(off, list(alt[: n - off])) for off, alt in branches if 0 <= off < n and alt]


class Drafter(Protocol):
    name: str
    capabilities: Capabilities
    backend: Backend | None  # the local draft model's backend, if any (bench empties it)

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy: Any = None, grammar: GrammarSpec | None = None) -> None:
        """A new sequence starts; a remote drafter may start prefilling now. policy: the
        adaptive policy whose stop rule drafts follow (None: the drafter's own rule);
        grammar: the request's, which drafts may follow (more of them accepted)."""

    def propose(self, history: Sequence[int], k: int) -> Draft:
        """Up to k tokens that would follow history (history[-1] is the newest token)."""

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        """The round ended: `appended` tokens were added to history, `accepted` of them drafted."""

    def end(self) -> None:
        """The sequence is over; free its state (its policy and grammar too)."""

    def stats(self) -> dict[str, float]:
        """Cumulative figures the drafter measured (ms of network wait, bytes...)."""

    def cache_use(self) -> tuple[int, int] | None:
        """(draft_cache_n, draft_prompt_n) of the sequence, if it keeps a cache."""

    def close(self) -> None:
        """Release what outlives requests."""

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        """The target's verification cost and the draft backend's drafting cost
        (policy/costs.py), handed once by the engine, for a drafter that weighs its own
        rounds (the n-gram, the hybrid, the bubble rule) or times its draft model
        (None: it keeps its own)."""


class DrafterBase:
    """A drafter that declares no capability: the reports' defaults, and the optional
    members as no-ops (called only where a subclass declares them)."""

    name = "drafter"
    capabilities = Capabilities()
    backend: Backend | None = None

    def cache_use(self) -> tuple[int, int] | None:
        return None

    def close(self) -> None:
        pass

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        pass

    def ask(self, history: Sequence[int], k: int) -> None:
        """Capabilities.asks_ahead: a round is coming (propose follows in the same step);
        send its request now."""

    def never_wait(self) -> None:
        """Capabilities.waits: never hold a round for a fresh branch from now on."""

    def status(self) -> tuple[LinkStatus, ...]:
        """Capabilities.links: each link's state now."""
        return ()


class StatelessDrafter(DrafterBase):
    """A drafter that keeps no per-sequence state: begin, learn and end do nothing.

    Subclasses propose, and count what they proposed in `drafted`.
    """

    name = "stateless"
    drafted = 0

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy: Any = None, grammar: GrammarSpec | None = None) -> None:
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
    capabilities = Capabilities(deterministic=True)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        return Draft()

    def rebase(self, history: Sequence[int]) -> None:
        """A context shift (DraftGuard.rebase): nothing to follow."""
