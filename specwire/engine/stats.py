"""What a generation measured, under llama-server's names where it has them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """A drafter's counters are cumulative over its life (Drafter.stats): one request's
    share is what they gained during it."""
    return {k: v - before.get(k, 0.0) for k, v in after.items()
            if isinstance(v, int | float) and math.isfinite(v)}


@dataclass(slots=True)
class Stats:
    prompt_n: int = 0
    prompt_ms: float = 0.0
    cache_n: int = 0  # prompt tokens the target's cache already held (llama-server's name)
    #: history tokens the drafter found in its own cache, and those it evaluated to catch
    #: up; None where the drafter did not say (no draft, or a node that predates them)
    draft_cache_n: int | None = None
    draft_prompt_n: int | None = None
    predicted_n: int = 0
    predicted_ms: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    rounds: int = 0
    #: drafting rounds whose draft came back shorter than asked (the draft model
    #: stopped at --draft-p-min after evaluating the position it declined).
    short_rounds: int = 0
    #: rounds that asked the drafter for tokens (the others were plain steps by choice)
    asked_rounds: int = 0
    #: drafting rounds in which the target refused a draft token (the others kept all)
    rejected_rounds: int = 0
    draft_ms: float = 0.0  # time the engine spent waiting on the drafter
    verify_ms: float = 0.0  # target evaluation and verification
    target_decode_ms: float = 0.0  # of which inside the target's llama_decode
    #: accepted-length histogram: hist[n] = rounds that kept n draft tokens.
    hist: list[int] = field(default_factory=list)
    #: by_position[i] = [drafted, accepted] at draft position i.
    by_position: list[list[int]] = field(default_factory=list)
    #: the drafter's own counters (Drafter.stats), this request's share of them
    drafter: dict[str, float] = field(default_factory=dict)
    #: rounds without a draft and their target time: what plain decoding costs a
    #: token, measured in passing (the live page's plain rate)
    plain_steps: int = 0
    plain_ms: float = 0.0

    def record_round(self, drafted: int, accepted: int, k: int) -> None:
        """A round asked for k draft tokens, got `drafted` and kept `accepted` of them."""
        self.rounds += 1
        self.short_rounds += 0 < drafted < k
        self.asked_rounds += k > 0
        self.draft_n += drafted
        self.draft_n_accepted += accepted
        self.rejected_rounds += accepted < drafted
        if drafted:
            while len(self.hist) <= accepted:
                self.hist.append(0)
            self.hist[accepted] += 1
            while len(self.by_position) < drafted:
                self.by_position.append([0, 0])
            for i in range(drafted):
                self.by_position[i][0] += 1
                self.by_position[i][1] += i < accepted

    @property
    def acceptance(self) -> float:
        return self.draft_n_accepted / self.draft_n if self.draft_n else 0.0

    @property
    def mean_accepted(self) -> float:
        """Mean draft tokens kept per round that had a draft."""
        n = sum(self.hist)
        return sum(i * c for i, c in enumerate(self.hist)) / n if n else 0.0

    @property
    def predicted_per_second(self) -> float:
        return 1000.0 * self.predicted_n / self.predicted_ms if self.predicted_ms > 0 else 0.0

    def timings(self) -> dict:
        """llama-server's `timings` object (with draft_cache_n and draft_prompt_n where the
        drafter reported them)."""
        draft_cache = {} if self.draft_cache_n is None else {
            "draft_cache_n": self.draft_cache_n, "draft_prompt_n": self.draft_prompt_n}
        return {
            "cache_n": self.cache_n,
            "prompt_n": self.prompt_n,
            "prompt_ms": round(self.prompt_ms, 3),
            "prompt_per_token_ms": round(self.prompt_ms / self.prompt_n, 3)
            if self.prompt_n
            else 0.0,
            "prompt_per_second": round(1000.0 * self.prompt_n / self.prompt_ms, 3)
            if self.prompt_ms
            else 0.0,
            "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 3),
            "predicted_per_token_ms": round(self.predicted_ms / self.predicted_n, 3)
            if self.predicted_n
            else 0.0,
            "predicted_per_second": round(self.predicted_per_second, 3),
            "draft_n": self.draft_n,
            "draft_n_accepted": self.draft_n_accepted,
            **draft_cache,
        }

    def to_dict(self) -> dict:
        return {
            **self.timings(),
            "rounds": self.rounds,
            "short_rounds": self.short_rounds,
            "asked_rounds": self.asked_rounds,
            "rejected_rounds": self.rejected_rounds,
            "acceptance": round(self.acceptance, 4),
            "mean_accepted": round(self.mean_accepted, 4),
            "accepted_hist": list(self.hist),
            "by_position": [list(x) for x in self.by_position],
            "draft_ms": round(self.draft_ms, 3),
            "verify_ms": round(self.verify_ms, 3),
            "target_decode_ms": round(self.target_decode_ms, 3),
            "drafter": dict(self.drafter),
        }
