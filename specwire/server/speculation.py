"""Why a configured draft is not speculating: one warning per cause, and the state for the page.

A server started with a draft can end up decoding plainly: its draft node is
unreachable (or refused the pair), the adaptive policy found that drafting does not
pay and stopped, or the drafter proposes nothing. Output is the same either way, so
nothing fails; this says so, once per cause for the server's life, with the figures
that decided it (the policy's acceptance and costs), and keeps each slot's state for
the live page (/stats.json's "speculation").
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from specwire.engine.stats import Stats
from specwire.policy.adaptive import AdaptivePolicy

log = logging.getLogger("specwire.speculation")

#: rounds a generation must have run before its lack of drafts means anything.
MIN_ROUNDS = 8
#: plain rounds in a row after which the adaptive policy counts as having stopped.
STOPPED_ROUNDS = 4


@dataclass(frozen=True, slots=True)
class SlotState:
    active: bool
    cause: str | None = None     # unreachable | policy | no-drafts
    detail: str = ""


class SpeculationWatch:
    """Reads each finished generation of a slot with a drafter; warns once per cause."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._warned: set[str] = set()
        self._slots: dict[int, SlotState] = {}

    def after(self, slot: int, drafter: str, stats: Stats, policy: Any, enabled: bool,
              links: Mapping[str, float] | None = None) -> SlotState | None:
        """After a generation: its slot's state (None: no drafter, or speculation was
        off for the request, or too short to tell)."""
        if drafter == "none" or not enabled:
            return None
        state = self._judge(drafter, stats, policy, links)
        if state is None:
            return None
        with self._lock:
            self._slots[slot] = state
            warn = state.cause is not None and state.cause not in self._warned
            if warn:
                self._warned.add(state.cause)
        if warn:
            log.warning("speculation inactive on slot %d: %s", slot, state.detail)
        return state

    def states(self) -> list[dict]:
        """Each slot's last state, for /stats.json."""
        with self._lock:
            return [{"slot": s, **asdict(st)} for s, st in sorted(self._slots.items())]

    def _judge(self, drafter: str, stats: Stats, policy: Any,
               links: Mapping[str, float] | None) -> SlotState | None:
        if links and not any(v for v in links.values()):
            return SlotState(False, "unreachable",
                             f"no draft node of {drafter} is reachable "
                             f"({', '.join(sorted(links))}); decoding plainly until one is "
                             "(the live page's Draft nodes card has the last error)")
        if isinstance(policy, AdaptivePolicy) and not policy.state.warm and \
                policy.state.idle_rounds >= STOPPED_ROUNDS:
            return SlotState(False, "policy", policy_reason(policy))
        if stats.rounds >= MIN_ROUNDS and stats.draft_n == 0 and \
                not drafter.startswith(("ngram", "hybrid")):
            return SlotState(False, "no-drafts",
                             f"the drafter {drafter} proposed no token in {stats.rounds} "
                             "rounds")
        if stats.rounds < MIN_ROUNDS and stats.draft_n == 0:
            return None
        return SlotState(True)


def policy_reason(p: AdaptivePolicy) -> str:
    """The adaptive policy's case against drafting, in its own figures."""
    k = max(range(1, p.n_max + 1), key=p.rate) if p.n_max > 0 else 1
    per_token = p.draft.per_token()
    return (f"the adaptive policy stopped drafting: acceptance {p.acceptance:.2f}, "
            f"drafting {1000 * p.draft_cost(1):.1f} ms for one token "
            f"(+{1000 * per_token:.1f} ms per token more), verifying "
            f"{1000 * p.verify_cost(1):.1f} ms for 1 token and "
            f"{1000 * p.verify_cost(k + 1):.1f} ms for {k + 1}; expected "
            f"{p.rate(0):.1f} tokens/s plain against {p.rate(k):.1f} drafting {k}. "
            "It probes now and then and drafts again when that pays "
            "(--draft-policy fixed always drafts)")
