"""The draft node's figures for Prometheus (`specwire draft --metrics-port PORT`).

A target's /metrics shows its own side of the link; what the node holds for
all its targets is only visible here: admitted calls, sequences of the node's
llama.cpp context (one per open session, so 0 when no target is drafting: a leak
shows as a count that stays up), its decodes and what each held (sessions and
alternates per decode: node/steps.py), refusals by reason, and the process
collector (resident memory, open files). Served on a port of its own
(node/exporter.py), with the node's token when it has one.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from specwire.node.steps import StepCounters

PREFIX = "specwire:node_"
#: Peers (address and port: one per connection) remembered to count connections.
MAX_PEERS = 4096


class NodeMetrics:
    """Counters updated by the RPC threads, read at scrape time."""

    def __init__(self, slots_in_use: Callable[[], int], contexts: Callable[[], int],
                 calibrations: Callable[[], int], cached: Callable[[], int] = lambda: 0,
                 steps: Callable[[], StepCounters] | None = None) -> None:
        """contexts: sequences of the node's context handed out; cached: those of them held
        for finished sessions (docs/memory.md), counted apart so that contexts_open reads 0
        when no session is open; steps: what the node's decodes held so far."""
        self._lock = threading.Lock()
        self._slots_in_use, self._contexts, self._calibrations = (slots_in_use, contexts,
                                                                 calibrations)
        self._cached = cached
        self._steps = steps
        self.calls: Counter[str] = Counter()       # admitted calls by method
        self.refused: Counter[str] = Counter()     # reason -> calls refused or ended by the node
        self.connections: Counter[str] = Counter()  # port -> connections that made a call
        self._peers: OrderedDict[tuple[str, str], None] = OrderedDict()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._http = None
        ProcessCollector(registry=self.registry)

    def call(self, method: str) -> None:
        with self._lock:
            self.calls[method] += 1

    def peer(self, port: str, peer: str) -> None:
        """A call from `peer` (its address and port) on `port` ('main' or 'sync'): a peer
        not seen before is a new connection. A target's slots share one per port."""
        key = (port, peer)
        with self._lock:
            if key in self._peers:
                self._peers.move_to_end(key)
                return
            self._peers[key] = None
            if len(self._peers) > MAX_PEERS:
                self._peers.popitem(last=False)
            self.connections[port] += 1

    def refuse(self, reason: str) -> None:
        """'token', 'busy', 'quota' (--sessions-per-identity), 'silent' (no Open or ping in
        time), 'bad_open'."""
        with self._lock:
            self.refused[reason] += 1

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            calls = CounterMetricFamily(PREFIX + "calls", "Calls admitted, by method.",
                                        labels=["method"])
            for k, v in sorted(self.calls.items()):
                calls.add_metric([k], v)
            refused = CounterMetricFamily(PREFIX + "refused", "Calls refused or ended by the "
                                          "node, by reason: token, busy (--max-sessions), "
                                          "silent (no Open or ping before the deadline), "
                                          "bad_open.", labels=["reason"])
            for k, v in sorted(self.refused.items()):
                refused.add_metric([k], v)
            conns = CounterMetricFamily(PREFIX + "connections", "Connections that made a "
                                        "call, by port (main, sync).", labels=["port"])
            for k, v in sorted(self.connections.items()):
                conns.add_metric([k], v)
        yield calls
        yield conns
        yield refused
        yield GaugeMetricFamily(PREFIX + "slots_in_use", "Admitted calls open now (sessions and "
                                "pings; at most --max-sessions).", value=self._slots_in_use())
        cached = self._cached()
        yield _contexts_gauge(self._contexts() - cached)
        yield GaugeMetricFamily(PREFIX + "contexts_cached", "llama.cpp contexts kept for "
                                "finished sessions, reused by the next one that shares their "
                                "prefix (at most --max-sessions).", value=cached)
        yield GaugeMetricFamily(PREFIX + "calibrations", "Targets whose draft calibration this "
                                "node keeps (bounded).", value=self._calibrations())
        if self._steps is not None:
            yield from _step_families(self._steps())

    def serve(self, host: str, port: int, token: str | None = None, purge=None,
              tokens: dict[str, str] | None = None, tls=None) -> int:  # noqa: ANN001
        """Start the HTTP exporter on a daemon thread (with POST /purge when `purge` is
        given, wanting `token` or one of `tokens`, over TLS when `tls` is an SSLContext:
        exporter.py); the port it listens on."""
        from specwire.node.exporter import Exporter

        self._http = Exporter(host, port, self.registry, token, purge=purge, tokens=tokens,
                              tls=tls)
        return self._http.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def _step_families(c: StepCounters) -> Iterator[Metric]:
    """The node's decodes and what they held: sessions per decode is branches / decodes."""
    yield CounterMetricFamily(PREFIX + "decodes", "Decodes of the node's draft context "
                              "(every drafting session's next tokens in one).", value=c.decodes)
    parts = CounterMetricFamily(PREFIX + "decode_parts", "Sequences' parts in the node's "
                                "decodes, by kind: a session's branch, or an alternate.",
                                labels=["kind"])
    parts.add_metric(["branch"], c.branches)
    parts.add_metric(["alternate"], c.alternates)
    yield parts
    yield CounterMetricFamily(PREFIX + "alternates_beside", "Alternate parts decoded in the "
                              "same decode as their own branch's part (drafted on its fork).",
                              value=c.beside)
    sessions, alternates = c.per_decode()
    yield GaugeMetricFamily(PREFIX + "sessions_per_decode", "Sessions' branches per decode "
                            "since the node started.", value=sessions)
    yield GaugeMetricFamily(PREFIX + "alternates_per_decode", "Alternates per decode since "
                            "the node started.", value=alternates)


def _contexts_gauge(n: int) -> GaugeMetricFamily:
    g = GaugeMetricFamily("specwire:contexts_open", "llama.cpp sequences serving a session now: "
                          "one per drafting session.", labels=["side"])
    g.add_metric(["node"], n)
    return g
