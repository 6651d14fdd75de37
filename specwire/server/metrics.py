"""GET /metrics through prometheus_client, named like llama-server's with a `specwire:` prefix.

One registry per app holds the generations' counters and gauges (plain numbers kept behind
a lock by the worker threads and turned into families at scrape time, so that their names
and meanings stay stable), histograms of time to first token, time per output token and
round duration, the state read at scrape time (queue, link, contexts, Python threads by
name, process), and llama.cpp's own speculation counters (`llamacpp:` prefix, vLLM's
schema) so that dashboards built for those work unchanged. `Metrics.figures()` returns the
same samples as numbers, keyed as the exposition writes them, for the pages that show them.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from specwire.engine.stats import Stats

PREFIX = "specwire:"
LLAMA_PREFIX = "llamacpp:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_NETWORK_KEYS = ("network_ms", "wait_ms")

#: Seconds; a first token waits for the queue and the prompt, a round for one target batch.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

QueueState = Callable[[], Mapping[str, int]]
LinkStates = Callable[[], Iterable[tuple[int, Mapping]]]


class Metrics:
    """The server's figures; `watch` tells it where to read the queue and the links."""

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
        self.accepted_at: Counter[int] = Counter()   # draft position -> tokens kept there
        self.decodes = 0                             # target steps (llama_decode batches)
        self.busy_in_decodes = 0                     # running requests summed over steps
        self.n_tokens_max = 0                        # most tokens one request's context held
        self._drafter: dict[int, dict[str, float]] = {}
        self._queue: QueueState = dict
        self._links: LinkStates = list
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds",
                              "Seconds from a request's arrival in the queue to its first token.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Per request: seconds per generated token after the first.",
                              buckets=TOKEN_BUCKETS, registry=self.registry)
        self.round_time = Histogram(PREFIX + "round_duration_seconds",
                                    "Seconds between a request's rounds (its draft, the link, "
                                    "the target step it shares with the other running "
                                    "requests), as the request sees it.",
                                    buckets=TOKEN_BUCKETS, registry=self.registry)

    def watch(self, queue: QueueState, links: LinkStates) -> None:
        """Where scrapes read the queue's state and the draft links' (the scheduler)."""
        self._queue, self._links = queue, links

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

    def step(self, busy: int) -> None:
        """One target step that decoded `busy` requests' rounds (llamacpp:n_decode_total)."""
        with self._lock:
            self.decodes += 1
            self.busy_in_decodes += busy

    def context_used(self, n_tokens: int) -> None:
        """A request's prompt and output together (llamacpp:n_tokens_max)."""
        with self._lock:
            self.n_tokens_max = max(self.n_tokens_max, n_tokens)

    def record(self, slot: int, stats: Stats, predicted: int) -> None:
        """Add what one generation measured (finished or cut short). The drafter's own
        figures (stats.drafter) are added per slot, and its network_ms (wait_ms, the remote
        drafter's name) to the network share of the drafting time."""
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
            for pos, (_drafted, kept) in enumerate(stats.by_position):
                self.accepted_at[pos] += kept
            if stats.drafter:
                for key in _NETWORK_KEYS:
                    if key in stats.drafter:
                        self.network_ms += stats.drafter[key]
                        break
                totals = self._drafter.setdefault(slot, {})
                for key, value in stats.drafter.items():
                    if _is_number(value):
                        totals[key] = totals.get(key, 0.0) + value

    # -- exposition ------------------------------------------------------------------------

    def render(self) -> bytes:
        """The Prometheus text format (version 0.0.4)."""
        return generate_latest(self.registry)

    def figures(self) -> dict[str, float]:
        """Every sample now, as Python numbers: {'specwire:requests_total{endpoint="/completion"}':
        3.0, 'process_resident_memory_bytes': ..., ...}."""
        return {_key(s.name, s.labels): s.value for m in self.registry.collect()
                for s in m.samples}

    def families(self) -> Iterator[Metric]:
        """The generation figures and the scrape-time state, as metric families."""
        with self._lock:
            yield _counter("requests", "Requests accepted, per endpoint.", "endpoint",
                           sorted(self.requests.items()))
            yield _counter("requests_rejected", "Requests refused with 429 because the queue "
                           "was full.", None, [((), self.rejected)])
            yield _counter("requests_finished", "Requests by how they ended: eos, limit, word, "
                           "cancelled (client gone), failed.", "outcome",
                           sorted(self.outcomes.items()))
            yield _counter("prompt_tokens", "Prompt tokens evaluated.", None,
                           [((), self.prompt_tokens)])
            yield _counter("prompt_seconds", "Prompt time summed over requests: from joining "
                           "the batch to the first token (chunks share steps with the "
                           "running requests).", None,
                           [((), self.prompt_ms / 1000)])
            yield _counter("prompt_tokens_cached", "Prompt tokens the target found in its "
                           "cache (timings.cache_n).", None, [((), self.cached_tokens)])
            yield _counter("draft_prompt_tokens_cached", "History tokens the drafter found in "
                           "its cache (draft_cache_n).", None, [((), self.draft_cached_tokens)])
            yield _counter("draft_prompt_tokens", "History tokens the drafter evaluated to "
                           "catch up (draft_prompt_n).", None, [((), self.draft_prompt_tokens)])
            yield _counter("tokens_predicted", "Generated tokens.", None,
                           [((), self.predicted_tokens)])
            yield _counter("tokens_predicted_seconds", "Generation time after the first token, "
                           "summed over requests (concurrent requests overlap).", None,
                           [((), self.predicted_ms / 1000)])
            yield _counter("draft_tokens", "Draft tokens proposed and verified.", None,
                           [((), self.draft_tokens)])
            yield _counter("draft_tokens_accepted", "Draft tokens the target kept.", None,
                           [((), self.accepted_tokens)])
            acceptance = self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0
            yield _gauge("draft_acceptance_ratio", "Accepted / proposed draft tokens since "
                         "start.", (), [((), acceptance)])
            yield _counter("draft_rounds", "Rounds summed over requests: one per request per "
                           "target step it decoded in (running requests share a step).", None,
                           [((), self.rounds)])
            yield _counter("draft_accepted_length", "Rounds with a draft, by how many draft "
                           "tokens were kept.", "accepted",
                           [(str(n), c) for n, c in sorted(self.accepted_hist.items())])
            network = min(self.network_ms, self.draft_ms)
            phases = {"draft": self.draft_ms - network, "network": network,
                      "verify": self.verify_ms}
            yield _counter("round_seconds", "Time in each phase of the rounds, summed over "
                           "requests: drafting (local work), waiting on the draft link "
                           "(network), target verification (a step's shared decode counts for "
                           "each request in it).",
                           "phase", [(k, v / 1000) for k, v in phases.items()])
            yield _gauge("round_ms_avg", "Mean milliseconds per request round in each phase "
                         "(round_seconds over draft_rounds).",
                         ("phase",), [((k,), v / self.rounds if self.rounds else 0.0)
                                      for k, v in phases.items()])
            yield from self._llama_families()
            yield _gauge("drafter_stat", "Each slot's drafter's own figures (Drafter.stats), "
                         "summed over the slot's generations.", ("slot", "name"),
                         [((str(s), k), v) for s, snap in sorted(self._drafter.items())
                          for k, v in sorted(snap.items()) if _is_number(v)])
        yield _gauge("draft_link_up", "1 when a slot's link to a draft node is usable.",
                     ("slot", "link"), [((str(s), str(k)), float(v)) for s, state in self._links()
                                        for k, v in state.items() if _is_number(v)])
        queue = self._queue()
        for name, key, help_ in (("requests_processing", "processing", "Requests in the "
                                  "batch (reading their prompt or generating)."),
                                 ("requests_deferred", "deferred", "Requests waiting in the "
                                  "queue."),
                                 ("queue_capacity", "capacity", "Most requests that may wait "
                                  "(--queue-size)."),
                                 ("slots_total", "slots", "Sequences the target batch "
                                  "holds, one request each (-np).")):
            yield _gauge(name, help_, (), [((), queue.get(key, 0))])
        yield _gauge("contexts_open", "llama.cpp contexts open in this process (target and "
                     "local draft; a draft node reports its own).", ("side",),
                     [(("target",), _open_contexts())])
        yield _gauge("threads", "Python threads of this process by name (numbers left out): "
                     "a count that grows and stays names what holds them.", ("name",),
                     sorted(thread_names().items()))


    def _llama_families(self) -> Iterator[Metric]:
        """llama-server's own names for the same figures (dashboards read `llamacpp:*`),
        and llama.cpp's (and vLLM's) speculation counters."""
        prompt_s, predicted_s = self.prompt_ms / 1000, self.predicted_ms / 1000
        for name, help_, value in (
                ("prompt_tokens", "Number of prompt tokens processed.", self.prompt_tokens),
                ("prompt_seconds", "Prompt process time.", prompt_s),
                ("tokens_predicted", "Number of generation tokens processed.",
                 self.predicted_tokens),
                ("tokens_predicted_seconds", "Predict process time.", predicted_s),
                ("n_decode", "Total number of llama_decode() calls.", self.decodes)):
            family = CounterMetricFamily(LLAMA_PREFIX + name, help_)
            family.add_metric([], float(value))
            yield family
        queue = self._queue()
        for name, help_, value in (
                ("n_tokens_max", "Largest observed n_tokens.", self.n_tokens_max),
                ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() "
                 "call.", self.busy_in_decodes / self.decodes if self.decodes else 0.0),
                ("prompt_tokens_seconds", "Average prompt throughput in tokens/s.",
                 self.prompt_tokens / prompt_s if prompt_s else 0.0),
                ("predicted_tokens_seconds", "Average generation throughput in tokens/s.",
                 self.predicted_tokens / predicted_s if predicted_s else 0.0),
                ("requests_processing", "Number of requests processing.",
                 queue.get("processing", 0)),
                ("requests_deferred", "Number of requests deferred.",
                 queue.get("deferred", 0))):
            gauge = GaugeMetricFamily(LLAMA_PREFIX + name, help_)
            gauge.add_metric([], float(value))
            yield gauge
        for name, help_, value in (
                ("spec_decode_num_drafts", "Rounds that verified a draft.",
                 sum(self.accepted_hist.values())),
                ("spec_decode_num_draft_tokens", "Draft tokens verified.", self.draft_tokens),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                 self.accepted_tokens)):
            family = CounterMetricFamily(LLAMA_PREFIX + name, help_)
            family.add_metric([], float(value))
            yield family
        per_pos = CounterMetricFamily(LLAMA_PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0: the "
                                      "first).", labels=["position"])
        for pos, kept in sorted(self.accepted_at.items()):
            per_pos.add_metric([str(pos)], float(kept))
        yield per_pos


class _Collector:
    """prometheus_client's custom-collector interface over Metrics.families()."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.families()


def _counter(name: str, help_: str, label: str | None,
             samples: Iterable[tuple[object, float]]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, help_, labels=[label] if label else [])
    for value_label, v in samples:
        family.add_metric([value_label] if label else [], float(v))
    return family


def _gauge(name: str, help_: str, labels: tuple[str, ...],
           samples: Iterable[tuple[tuple[str, ...], float]]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, help_, labels=list(labels))
    for values, v in samples:
        family.add_metric(list(values), float(v))
    return family


def thread_names() -> dict[tuple[str], int]:
    """Live Python threads counted by name, digits dropped ("Thread-12 (run)" counts as
    "Thread- (run)", "asyncio_0" as "asyncio_")."""
    counts: Counter = Counter()
    for t in threading.enumerate():
        counts[(re.sub(r"\d+", "", t.name)[:80],)] += 1
    return dict(counts)


def _open_contexts() -> int:
    try:
        from specwire.backend.llama import open_contexts
    except ImportError:     # llama_cpp not installed: no contexts either
        return 0
    return open_contexts()


def _key(name: str, labels: Mapping[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def parse_figures(text: str) -> dict[str, float]:
    """An exposition's samples keyed as `Metrics.figures` keys them (the soak's reader)."""
    return {_key(s.name, s.labels): s.value for family in text_string_to_metric_families(text)
            for s in family.samples}


def _is_number(v: object) -> bool:
    return isinstance(v, int | float)
