"""The concurrency benchmark's figures: bursts -> one cell per (configuration, level) -> table.

Ratios are taken within one run only: to concurrency 1 of the same configuration
(how throughput scales with requests in flight), to the plain configuration of
the same server at the same concurrency (what the draft buys), and to llama-server
with the same variant at the same concurrency (where it was run). The machine's
drift between runs would otherwise swamp what is compared. Tokens per CPU second
of the server (user + system time of its process during the burst) stand beside
tokens per wall second: on a machine shared with other work they swing far less.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from benchmarks.burst import Burst


@dataclass(frozen=True, slots=True)
class Variant:
    """One server configuration; plain names its plain partner, rival the llama-server one."""

    label: str
    plain: str
    rival: str | None = None


@dataclass(slots=True)
class Cell:
    config: str
    level: int
    aggregate: list[float] = field(default_factory=list)   # tok/s of each repeat's burst
    request_tps: list[float] = field(default_factory=list)
    decode_tps: list[float] = field(default_factory=list)
    draft_n: int = 0
    draft_accepted: int = 0
    has_draft_timings: bool = False
    errors: list[str] = field(default_factory=list)
    short: int = 0                      # answers with fewer or more tokens than asked
    loads: list[float] = field(default_factory=list)
    cpu_tps: list[float] = field(default_factory=list)  # tokens per server CPU second
    same: int = 0
    compared: int = 0

    @property
    def median(self) -> float:
        return statistics.median(self.aggregate) if self.aggregate else 0.0

    @property
    def acceptance(self) -> float | None:
        return self.draft_accepted / self.draft_n if self.draft_n else None

    def to_dict(self) -> dict:
        return {"config": self.config, "concurrency": self.level,
                "aggregate_tps": self.aggregate, "aggregate_tps_median": self.median,
                "request_tps_median": _median(self.request_tps),
                "decode_tps_median": _median(self.decode_tps),
                "draft_n": self.draft_n, "draft_n_accepted": self.draft_accepted,
                "acceptance": self.acceptance, "errors": self.errors, "short": self.short,
                "cpu_tps": self.cpu_tps, "cpu_tps_median": _median(self.cpu_tps),
                "load_1min": self.loads, "same_text": self.same, "compared_text": self.compared}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(runs: list[tuple[str, Burst]], n_predict: int,
              reference: dict[str, str]) -> dict[tuple[str, int], Cell]:
    """(config label, burst) in run order -> cells; texts are compared with `reference`
    (prompt id -> text of the first configuration), which greedy decoding must match."""
    cells: dict[tuple[str, int], Cell] = {}
    for label, burst in runs:
        c = cells.setdefault((label, burst.level), Cell(label, burst.level))
        c.aggregate.append(burst.aggregate_tps)
        if burst.load is not None:
            c.loads.append(burst.load)
        if burst.cpu_tps is not None:
            c.cpu_tps.append(burst.cpu_tps)
        for r in burst.replies:
            if r.error:
                c.errors.append(r.error)
                continue
            c.request_tps.append(r.tps)
            c.short += r.tokens != n_predict
            if r.decode_tps is not None:
                c.decode_tps.append(r.decode_tps)
            if r.draft_n is not None:
                c.has_draft_timings = True
                c.draft_n += r.draft_n
                c.draft_accepted += r.draft_accepted or 0
            if r.prompt_id in reference:
                c.compared += 1
                c.same += r.text == reference[r.prompt_id]
    return cells


def reference_texts(runs: list[tuple[str, Burst]], label: str) -> dict[str, str]:
    """Prompt id -> the first error-free text `label` produced for it."""
    out: dict[str, str] = {}
    for run_label, burst in runs:
        if run_label == label:
            for r in burst.replies:
                if not r.error:
                    out.setdefault(r.prompt_id, r.text)
    return out


def _ratio(num: float, den: float | None) -> str:
    return f"{num / den:.2f}x" if den else "-"


def markdown(configs: list[Variant], levels: list[int],
             cells: dict[tuple[str, int], Cell]) -> str:
    """One row per configuration and level, in the order given."""
    rivals = any(c.rival for c in configs)
    head = ["configuration", "conc", "agg tok/s", "min-max", "x conc 1", "x plain"]
    head += ["x llama-server"] if rivals else []
    head += ["tok/CPU-s", "x plain CPU"]
    head += ["req tok/s", "decode tok/s", "accepted", "same text", "errors", "load"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for conf in configs:
        for level in levels:
            c = cells.get((conf.label, level))
            if c is None:
                continue
            one = cells.get((conf.label, 1))
            plain = cells.get((conf.plain, level))
            rival = cells.get((conf.rival, level)) if conf.rival else None
            row = [conf.label, str(level), f"{c.median:.1f}",
                   f"{min(c.aggregate):.1f}-{max(c.aggregate):.1f}" if c.aggregate else "-",
                   _ratio(c.median, one.median if one else None),
                   "-" if conf.plain == conf.label else
                   _ratio(c.median, plain.median if plain else None)]
            if rivals:
                row.append(_ratio(c.median, rival.median if rival else None))
            cpu = _median(c.cpu_tps)
            plain_cpu = _median(plain.cpu_tps) if plain else None
            row += [_fmt(cpu), "-" if conf.plain == conf.label or cpu is None else
                    _ratio(cpu, plain_cpu)]
            row += [_fmt(_median(c.request_tps)), _fmt(_median(c.decode_tps)),
                    _accept(c),
                    f"{c.same}/{c.compared}" if c.compared else "-",
                    str(len(c.errors) + c.short) if c.errors or c.short else "0",
                    f"{statistics.mean(c.loads):.1f}" if c.loads else "-"]
            rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def _accept(c: Cell) -> str:
    """'0.85 of 46' drafted tokens; '0 drafted' where timings said none; '-' without timings."""
    if not c.has_draft_timings:
        return "-"
    return f"{c.acceptance:.2f} of {c.draft_n}" if c.draft_n else "0 drafted"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"
