"""The last requests and acceptance by draft position, for the live page.

/metrics keeps running totals; a user watching the page also wants to see the
requests one by one (did this reply speed up?), where in a draft the target
stops agreeing, and what plain decoding would do, which need each generation's
per-position counts and its rounds without a draft (each one a plain decoding
step, timed). They are recorded here as requests finish. Records and reads happen on the event loop
only, so there is no lock.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from specwire.server.slots import Result

#: How many finished requests the page lists.
KEEP = 20


@dataclass(slots=True)
class RecentRequests:
    keep: int = KEEP
    rows: deque[dict] = field(init=False)       # every API key's requests
    #: each API key's own (its key_scope; with keys, /stats.json lists only the caller's)
    by_key: dict[str, deque[dict]] = field(default_factory=dict)
    served_by_key: dict[str, int] = field(default_factory=dict)
    #: by_position[i] = [drafted, accepted] at draft position i, over every finished request
    by_position: list[list[int]] = field(default_factory=list)
    served: int = 0
    plain_steps: int = 0
    plain_ms: float = 0.0

    def __post_init__(self) -> None:
        self.rows = deque(maxlen=self.keep)

    @property
    def plain_tokens_per_s(self) -> float | None:
        """Plain decoding's rate, from every round that had no draft (None before one)."""
        return 1000 * self.plain_steps / self.plain_ms if self.plain_ms > 0 else None

    def rows_of(self, key: str | None) -> tuple[list[dict], int]:
        """The rows and the count served that a caller of API key scope `key` sees: every
        request's without keys (None), else its key's own."""
        if key is None:
            return list(self.rows), self.served
        return list(self.by_key.get(key, ())), self.served_by_key.get(key, 0)

    def record(self, endpoint: str, result: Result, key: str = "") -> None:
        """A finished request of API key scope `key` ("" without keys)."""
        st = result.stats
        timings = result.timings
        row = {
            "time": round(time.time(), 3),
            "endpoint": endpoint,
            "slot": result.slot,
            "drafter": result.drafter,
            "prompt_n": result.tokens_evaluated,
            "predicted_n": result.tokens_predicted,
            "predicted_ms": timings.get("predicted_ms", 0.0),
            "tokens_per_s": timings.get("predicted_per_second", 0.0),
            "draft_n": timings.get("draft_n", 0),
            "draft_n_accepted": timings.get("draft_n_accepted", 0),
            "stop_type": result.stop_type,
        }
        if st is not None:
            row |= {"rounds": st.rounds, "acceptance": round(st.acceptance, 4),
                    "mean_accepted": round(st.mean_accepted, 3)}
            for i, (drafted, accepted) in enumerate(st.by_position):
                while len(self.by_position) <= i:
                    self.by_position.append([0, 0])
                self.by_position[i][0] += drafted
                self.by_position[i][1] += accepted
            self.plain_steps += st.plain_steps
            self.plain_ms += st.plain_ms
        self.served += 1
        self.rows.appendleft(row)
        if key not in self.by_key:
            self.by_key[key] = deque(maxlen=self.keep)
        self.by_key[key].appendleft(row)
        self.served_by_key[key] = self.served_by_key.get(key, 0) + 1
