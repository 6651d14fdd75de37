"""The drafter protocol: two methods, propose and learn, inside a begin/end pair.

Local model, n-gram and remote drafters all implement it, so the engine loop is
the same in one process and across the network.

Beyond that, a drafter declares what it can do instead of callers probing for
it; DrafterBase gives every capability a do-nothing default:

* `steer(policy | None)`: stop drafts by the adaptive policy's rule (the engine
  calls it around an adaptive request);
* `self_stopping`: steered, it prices each of its tokens and stops where they stop
  paying, so the policy asks it for the most (the engine tells the policy);
* `use_costs(costs, draft)`: the target's verification cost and the draft backend's
  drafting cost (policy/costs.py), handed by the engine, for a drafter that weighs
  its own rounds or times its draft model;
* `constrain(grammar | None)`: draft only what a request's grammar allows;
* `cache_use()`: (tokens reused from its cache, prompt tokens evaluated), or None;
* `close()`: release what outlives requests (threads, connections);
* `backend`: the local draft model's backend, if any (bench empties its cache);
* `pipelined`: it drafts on its own while the target verifies, so asking is free;
* for rejection mode, checked when the engine is built (drafters/guard.py):
  `provides_q` (its drafts carry their sparse q), `deterministic` (its drafts
  never depend on the target's random draws, so a point mass is their exact q),
  and `remote` (its q comes over the network and is trusted, logged once).

A drafter written before these were declared is given the defaults for what it
lacks by `declared`, once, where the engine is built.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from specwire.config import DraftParams, SamplingParams
from specwire.sample.sampling import SparseDraft

if TYPE_CHECKING:
    from specwire.backend.base import Backend
    from specwire.policy.costs import DraftCost, VerifyCost
    from specwire.sample.constraints.grammar import GrammarSpec


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
    provides_q: bool
    deterministic: bool
    remote: bool
    pipelined: bool
    self_stopping: bool
    backend: Backend | None  # the local draft model's backend, if any

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

    def steer(self, policy: Any) -> None:
        """Stop drafts by this adaptive policy's rule (None: by its own)."""

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        """Price rounds on the target's verification cost, which the engine feeds, and
        on the draft backend's drafting cost (None: keep its own)."""

    def constrain(self, spec: GrammarSpec | None) -> None:
        """Draft only what this grammar allows (None: anything)."""

    def cache_use(self) -> tuple[int, int] | None:
        """(draft_cache_n, draft_prompt_n) of the sequence, if it keeps a cache."""

    def close(self) -> None:
        """Release what outlives requests."""


class DrafterBase:
    """Every optional capability of the Drafter protocol, declared absent: subclasses
    override what they can do."""

    name = "drafter"
    provides_q = False
    deterministic = False
    remote = False
    pipelined = False
    lockstep = False  # drafts beside other sequences of a shared draft context (lockstep.py)
    self_stopping = False
    backend: Backend | None = None

    def steer(self, policy: Any) -> None:
        pass

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        pass

    def ask(self, history: Sequence[int], max_n: int) -> None:
        """A round is coming (propose follows in the same step): a drafter that waits on
        another machine sends its request now, so that the requests of a batch's sequences
        are all in flight before the first answer is awaited."""

    def constrain(self, spec: GrammarSpec | None) -> None:
        pass

    def cache_use(self) -> tuple[int, int] | None:
        return None

    def close(self) -> None:
        pass


#: The capabilities `declared` fills in, with DrafterBase's defaults.
CAPABILITIES = ("provides_q", "deterministic", "remote", "pipelined", "self_stopping",
                "steer", "use_costs", "ask", "constrain", "cache_use", "close", "backend")


class _Declared(DrafterBase):
    """A drafter that does not derive from DrafterBase, with the defaults for what it
    lacks: the protocol's calls forward to it, absent capabilities do nothing."""

    def __init__(self, inner: object) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name", "?"))
        for attr in ("provides_q", "deterministic", "remote", "pipelined", "self_stopping"):
            setattr(self, attr, bool(getattr(inner, attr, False)))
        for method in ("begin", "propose", "learn", "end", "stats"):
            setattr(self, method, getattr(inner, method))
        for method in ("steer", "use_costs", "ask", "constrain", "cache_use", "close"):
            own = getattr(inner, method, None)
            if callable(own):
                setattr(self, method, own)
        self.backend = getattr(inner, "backend", None)


def declared(drafter: object) -> Drafter:
    """The drafter itself when it derives from DrafterBase, else a view of it that
    declares every capability (absent ones as DrafterBase's no-ops). Called once,
    where an engine is built, so that nothing later probes a drafter for a method."""
    if isinstance(drafter, DrafterBase):
        return drafter  # type: ignore[return-value]
    return _Declared(drafter)  # type: ignore[return-value]


class StatelessDrafter(DrafterBase):
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
