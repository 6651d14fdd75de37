"""Prometheus counters for GET /metrics, named like llama-server's with a `specwire:` prefix.

Generations finish on worker threads and scrapes run on the event loop, so the
counters live behind one lock. A drafter's own figures (`Drafter.stats()`) are
cumulative over the drafter's life: they are kept as the latest snapshot per
slot, and the network share of the drafting time is the growth of its
`network_ms` (or `wait_ms`, the remote drafter's name for it) between
generations. Link state comes from `drafter.link_state()` at scrape time.
"""

from __future__ import annotations

import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Mapping

from specwire.stats import Stats

PREFIX = "specwire:"
_NETWORK_KEYS = ("network_ms", "wait_ms")


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()      # endpoint -> accepted requests
        self.outcomes: Counter[str] = Counter()      # finished stop_type / cancelled / failed
        self.rejected = 0                            # queue full (429)
        self.prompt_tokens = 0
        self.prompt_ms = 0.0
        self.cached_tokens = 0                       # prompt tokens found in the target's cache
        self.draft_cached_tokens = 0                 # history tokens found in the drafter's
        self.draft_prompt_tokens = 0                 # history tokens the drafter evaluated
        self.predicted_tokens = 0
        self.predicted_ms = 0.0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.rounds = 0
        self.draft_ms = 0.0
        self.verify_ms = 0.0
        self.network_ms = 0.0
        self.accepted_hist: Counter[int] = Counter()
        self._drafter: dict[int, dict[str, float]] = {}

    # -- updates ---------------------------------------------------------------------------

    def request(self, endpoint: str) -> None:
        with self._lock:
            self.requests[endpoint] += 1

    def reject(self) -> None:
        with self._lock:
            self.rejected += 1

    def outcome(self, what: str) -> None:
        """'eos' | 'limit' | 'word' for a finished request, or 'cancelled' | 'failed'."""
        with self._lock:
            self.outcomes[what] += 1

    def record(self, slot: int, stats: Stats, predicted: int) -> None:
        """Add what one generation measured (finished or cut short)."""
        with self._lock:
            self.prompt_tokens += stats.prompt_n
            self.prompt_ms += stats.prompt_ms
            self.cached_tokens += stats.cache_n
            self.draft_cached_tokens += stats.draft_cache_n or 0
            self.draft_prompt_tokens += stats.draft_prompt_n or 0
            self.predicted_tokens += predicted
            self.predicted_ms += stats.predicted_ms
            self.draft_tokens += stats.draft_n
            self.accepted_tokens += stats.draft_n_accepted
            self.rounds += stats.rounds
            self.draft_ms += stats.draft_ms
            self.verify_ms += stats.verify_ms
            for n, count in enumerate(stats.hist):
                if count:
                    self.accepted_hist[n] += count
            if stats.drafter:
                prev = self._drafter.get(slot, {})
                for key in _NETWORK_KEYS:
                    if key in stats.drafter:
                        now, before = stats.drafter[key], prev.get(key, 0.0)
                        self.network_ms += now - before if now >= before else now
                        break
                self._drafter[slot] = dict(stats.drafter)

    # -- exposition ------------------------------------------------------------------------

    def render(self, queue: Mapping[str, int], links: Iterable[tuple[int, Mapping]] = ()) -> str:
        """The Prometheus text format (version 0.0.4)."""
        with self._lock:
            out = _Writer()
            out.metric("requests_total", "counter", "Requests accepted, per endpoint.",
                       [({"endpoint": k}, v) for k, v in sorted(self.requests.items())])
            out.metric("requests_rejected_total", "counter",
                       "Requests refused with 429 because the queue was full.",
                       [({}, self.rejected)])
            out.metric("requests_finished_total", "counter",
                       "Requests by how they ended: eos, limit, word, cancelled (client gone), "
                       "failed.", [({"outcome": k}, v) for k, v in sorted(self.outcomes.items())])
            out.metric("prompt_tokens_total", "counter", "Prompt tokens evaluated.",
                       [({}, self.prompt_tokens)])
            out.metric("prompt_seconds_total", "counter", "Prompt evaluation time.",
                       [({}, self.prompt_ms / 1000)])
            out.metric("prompt_tokens_cached_total", "counter",
                       "Prompt tokens the target found in its cache (timings.cache_n).",
                       [({}, self.cached_tokens)])
            out.metric("draft_prompt_tokens_cached_total", "counter",
                       "History tokens the drafter found in its cache (draft_cache_n).",
                       [({}, self.draft_cached_tokens)])
            out.metric("draft_prompt_tokens_total", "counter",
                       "History tokens the drafter evaluated to catch up (draft_prompt_n).",
                       [({}, self.draft_prompt_tokens)])
            out.metric("tokens_predicted_total", "counter", "Generated tokens.",
                       [({}, self.predicted_tokens)])
            out.metric("tokens_predicted_seconds_total", "counter", "Generation time.",
                       [({}, self.predicted_ms / 1000)])
            out.metric("draft_tokens_total", "counter", "Draft tokens proposed and verified.",
                       [({}, self.draft_tokens)])
            out.metric("draft_tokens_accepted_total", "counter", "Draft tokens the target kept.",
                       [({}, self.accepted_tokens)])
            acceptance = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            out.metric("draft_acceptance_ratio", "gauge",
                       "Accepted / proposed draft tokens since start.", [({}, acceptance)])
            out.metric("draft_rounds_total", "counter",
                       "Speculative rounds (one target batch each).",
                       [({}, self.rounds)])
            out.metric("draft_accepted_length_total", "counter",
                       "Rounds with a draft, by how many draft tokens were kept.",
                       [({"accepted": str(n)}, c) for n, c in sorted(self.accepted_hist.items())])
            network = min(self.network_ms, self.draft_ms)
            phases = {"draft": self.draft_ms - network, "network": network,
                      "verify": self.verify_ms}
            out.metric("round_seconds_total", "counter",
                       "Time in each phase of the rounds: drafting (local work), waiting on the "
                       "draft link (network), target verification.",
                       [({"phase": k}, v / 1000) for k, v in phases.items()])
            out.metric("round_ms_avg", "gauge", "Mean milliseconds per round in each phase.",
                       [({"phase": k}, v / self.rounds if self.rounds else 0.0)
                        for k, v in phases.items()])
            stats = [({"slot": str(s), "name": k}, v)
                     for s, snap in sorted(self._drafter.items()) for k, v in sorted(snap.items())]
            out.metric("drafter_stat", "gauge",
                       "The drafter's own cumulative figures, as of its last generation.", stats)
        out.metric("draft_link_up", "gauge", "1 when the link to a draft node is usable.",
                   [({"slot": str(s), "link": str(k)}, float(v))
                    for s, state in links for k, v in state.items() if _is_number(v)])
        out.metric("requests_processing", "gauge", "Requests being generated.",
                   [({}, queue.get("processing", 0))])
        out.metric("requests_deferred", "gauge", "Requests waiting in the queue.",
                   [({}, queue.get("deferred", 0))])
        out.metric("queue_capacity", "gauge", "Most requests that may wait (--queue-size).",
                   [({}, queue.get("capacity", 0))])
        out.metric("slots_total", "gauge", "Engines serving requests (-np).",
                   [({}, queue.get("slots", 0))])
        return out.text()


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_: str,
               samples: list[tuple[dict[str, str], float]]) -> None:
        full = PREFIX + name
        self.lines += [f"# HELP {full} {help_}", f"# TYPE {full} {kind}"]
        for labels, value in samples:
            self.lines.append(f"{full}{_labels(labels)} {_number(value)}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{_label_name(k)}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}"


def _label_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("+Inf" if v > 0 else "-Inf")
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    return repr(round(float(v), 6))


def _is_number(v: object) -> bool:
    return isinstance(v, int | float)
