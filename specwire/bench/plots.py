"""PNG plots of a bench run (matplotlib's Agg backend: no display needed).

Three questions, one plot each:
* speedup_vs_draft_length.png: which draft length pays, per mode and link?
* speedup_vs_rtt.png: how far away can the draft node be?
* acceptance_by_position.png: how quickly does the draft lose the thread?

A plot whose data the run did not produce (no sweep over RTT, say) is still
written, with a note saying what to sweep, so a script can rely on the files.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

from specwire.bench.runner import format_bps, format_ms

FILES = ("speedup_vs_draft_length.png", "speedup_vs_rtt.png", "acceptance_by_position.png")


def write_all(records: Sequence[dict], out_dir: Path) -> list[Path]:
    """All three plots into out_dir; returns their paths."""
    import matplotlib
    matplotlib.use("Agg", force=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [speedup_vs_draft_length(records, out_dir / FILES[0]),
            speedup_vs_rtt(records, out_dir / FILES[1]),
            acceptance_by_position(records, out_dir / FILES[2])]


def _speedup(r: dict) -> float | None:
    s = r["speedup"]
    return s["paired_median"] if s["paired_median"] is not None else s["ratio_of_medians"]


def _drafting(records: Sequence[dict]) -> Iterator[tuple[dict, float]]:
    """(record, speedup) of every drafting record that has a speedup."""
    for r in records:
        s = _speedup(r)
        if r["mode"] != "plain" and s is not None:
            yield r, s


def _link(r: dict) -> str:
    if r["rtt_ms"] is None:
        return ""
    bw = "" if r["bandwidth_bps"] is None else f" {format_bps(r['bandwidth_bps'])}"
    return f" rtt {format_ms(r['rtt_ms'] / 1000)}{bw}"


def speedup_vs_draft_length(records: Sequence[dict], path: Path) -> Path:
    """Fixed-length lines per mode and link; the adaptive policy as a dashed level."""
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    levels: dict[str, float] = {}
    for r, s in _drafting(records):
        name = r["mode"] + _link(r)
        if r["policy"] == "fixed":
            lines[name].append((r["draft_max"], s))
        else:
            levels[f"{name} adaptive<={r['draft_max']}"] = s
    fig, ax = _figure("speedup over plain decoding against draft length",
                      "draft length (--draft-max)", "speedup (median of per-prompt ratios)")
    for name, pts in sorted(lines.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    for (name, s), style in zip(sorted(levels.items()), _LEVEL_STYLES * 4, strict=False):
        ax.axhline(s, linewidth=1, label=name, **style)
    return _finish(fig, ax, path, bool(lines or levels), "no drafting mode in this run")


def speedup_vs_rtt(records: Sequence[dict], path: Path) -> Path:
    """Remote modes against round trip; in-process drafting as a dashed reference."""
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    levels: dict[str, float] = {}
    for r, s in _drafting(records):
        k = f"k={r['draft_max']}" if r["policy"] == "fixed" else f"adaptive<={r['draft_max']}"
        if r["rtt_ms"] is None:
            levels[f"{r['mode']} {k}"] = s
            continue
        bw = "" if r["bandwidth_bps"] is None else f" {format_bps(r['bandwidth_bps'])}"
        lines[f"{r['mode']} {k}{bw}"].append((r["rtt_ms"], s))
    fig, ax = _figure("speedup over plain decoding against round trip", "round trip (ms)",
                      "speedup (median of per-prompt ratios)")
    for name, pts in sorted(lines.items()):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, ys, marker="o", label=name)
    rtts = sorted({x for p in lines.values() for x, _ in p})
    if len(rtts) > 1 and rtts[0] > 0:
        _log_axis_at(ax, rtts)
    for (name, s), style in zip(sorted(levels.items()), _LEVEL_STYLES * 4, strict=False):
        ax.axhline(s, linewidth=1, label=name, **style)
    return _finish(fig, ax, path, bool(lines), "no remote mode in this run (try --modes "
                   "remote-sync,remote-pipelined --rtt 0.2ms,2ms,20ms)")


def acceptance_by_position(records: Sequence[dict], path: Path) -> Path:
    """Share of drafted tokens kept at each draft position, per configuration."""
    fig, ax = _figure("acceptance by draft position", "draft position (0 = first)",
                      "accepted / drafted")
    drawn = False
    for r in records:
        pts = [(p["position"], p["rate"]) for p in r["by_position"] if p["rate"] is not None]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker=".", label=r["label"])
            drawn = True
    ax.set_ylim(0, 1.05)
    return _finish(fig, ax, path, drawn, "no drafted tokens in this run")


def _log_axis_at(ax, ticks: list[float]) -> None:
    """Log scale (round trips span decades) labelled at the swept values, not powers of 10."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: f"{x:g}"))
    ax.xaxis.set_minor_locator(NullLocator())


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _finish(fig, ax, path: Path, has_data: bool, note: str) -> Path:
    import matplotlib.pyplot as plt
    if has_data:
        if "speedup" in ax.get_ylabel():
            ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.legend(fontsize="small", loc="best")
    else:
        ax.text(0.5, 0.5, note, ha="center", va="center", transform=ax.transAxes, wrap=True)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


#: Reference levels (modes without a swept axis): each its own colour and dash.
_LEVEL_STYLES = [{"color": c, "linestyle": ls} for c, ls in
                 (("tab:green", "--"), ("tab:red", "-."), ("tab:purple", ":"), ("tab:brown", "--"))]
