"""Read back the Prometheus text that GET /metrics serves.

The live page shows the same figures as a scrape, so it reads them from the
same text rather than from the counters' internals: whichever library writes
/metrics (our writer, or prometheus_client), the page and Prometheus agree as
long as the metric names do.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping

from specwire.server.metrics import PREFIX

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}

Labels = dict[str, str]


class Exposition:
    """Samples by metric name (without the `specwire:` prefix)."""

    def __init__(self, samples: Mapping[str, list[tuple[Labels, float]]]) -> None:
        self.samples = samples

    @classmethod
    def parse(cls, text: str, prefix: str = PREFIX) -> Exposition:
        """Every sample line of `text` whose name starts with `prefix`; comments skipped,
        a line that is not a sample ignored (a newer writer's extras must not break us)."""
        out: dict[str, list[tuple[Labels, float]]] = {}
        for line in text.splitlines():
            if not line.startswith(prefix):
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            name, labels, value = m.groups()
            try:
                number = float(value)
            except ValueError:
                continue
            out.setdefault(name[len(prefix):], []).append((_labels(labels or ""), number))
        return cls(out)

    def total(self, name: str) -> float:
        """The sum of a metric's samples (0 when absent or not finite)."""
        return sum(v for _, v in self.samples.get(name, ()) if math.isfinite(v))

    def by(self, name: str, label: str) -> dict[str, float]:
        """A metric's samples keyed by one label's value."""
        out: dict[str, float] = {}
        for labels, v in self.samples.get(name, ()):
            if label in labels and math.isfinite(v):
                out[labels[label]] = out.get(labels[label], 0.0) + v
        return out

    def rows(self, name: str) -> list[tuple[Labels, float]]:
        return list(self.samples.get(name, ()))


def _labels(text: str) -> Labels:
    return {k: re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group()], v)
            for k, v in _LABEL.findall(text)}
