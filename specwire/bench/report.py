"""Turn per-prompt runs into the figures bench reports, as a table and as JSON.

Speedups are against the plain mode of the same run, two ways: the ratio of median rates
(what a user sees on the whole set) and the median of per-prompt ratios (each prompt paired
with itself, what to quote when sets differ). Spread is p10/p90 and the interquartile
range, since a mean and a standard deviation mislead over a handful of prompts. Lossless
modes must generate plain decoding's very tokens, so each prompt's token digest is compared
with plain's and a mismatch is flagged loudly: a speedup on different text is no speedup.
"""

from __future__ import annotations

import json
import math
import os
import platform
import textwrap
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specwire.bench.runner import PromptRun, RunParams, format_bps, format_ms

REMOTE = ("remote-sync", "remote-pipelined", "remote-chains", "llama-server")


# --------------------------------------------------------------------------- statistics


def spread(xs: Sequence[float]) -> dict:
    """Median, p10/p90, quartiles, mean, min and max; all None for no data."""
    keys = ("median", "p10", "p90", "q1", "q3", "iqr", "mean", "min", "max")
    if not xs:
        return dict.fromkeys(keys)
    a = np.asarray(xs, dtype=float)
    p10, q1, med, q3, p90 = np.percentile(a, [10, 25, 50, 75, 90])
    return {"median": float(med), "p10": float(p10), "p90": float(p90), "q1": float(q1),
            "q3": float(q3), "iqr": float(q3 - q1), "mean": float(a.mean()),
            "min": float(a.min()), "max": float(a.max())}


def median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return float(np.median(xs)) if xs else None


def paired_speedups(runs: Sequence[PromptRun], plain: Sequence[PromptRun]) -> list[float]:
    """tokens/s of each prompt over plain's on the same prompt (matched by id)."""
    base = {r.id: r.tokens_per_s for r in plain}
    return [r.tokens_per_s / base[r.id] for r in runs
            if base.get(r.id, 0.0) > 0.0 and r.tokens_per_s > 0.0]


def speedup(runs: Sequence[PromptRun], plain: Sequence[PromptRun] | None) -> dict:
    """Ratio of medians and the spread of the per-prompt paired ratios."""
    if not plain:
        return {"ratio_of_medians": None, "paired_median": None, "paired_p10": None,
                "paired_p90": None}
    mine, ref = median(r.tokens_per_s for r in runs), median(r.tokens_per_s for r in plain)
    pairs = spread(paired_speedups(runs, plain))
    return {"ratio_of_medians": mine / ref if mine is not None and ref else None,
            "paired_median": pairs["median"], "paired_p10": pairs["p10"],
            "paired_p90": pairs["p90"]}


def merge_hist(hists: Iterable[Sequence[int]]) -> list[int]:
    out: list[int] = []
    for h in hists:
        out.extend([0] * (len(h) - len(out)))
        for i, c in enumerate(h):
            out[i] += c
    return out


def merge_by_position(tables: Iterable[Sequence[Sequence[int]]]) -> list[dict]:
    """Sum [drafted, accepted] per draft position; add the rate."""
    sums: list[list[int]] = []
    for t in tables:
        while len(sums) < len(t):
            sums.append([0, 0])
        for i, (d, a) in enumerate(t):
            sums[i][0] += d
            sums[i][1] += a
    return [{"position": i, "drafted": d, "accepted": a, "rate": a / d if d else None}
            for i, (d, a) in enumerate(sums)]


def token_match(runs: Sequence[PromptRun], plain: Sequence[PromptRun] | None,
                lossless: bool) -> tuple[bool | None, list[str]]:
    """(all equal to plain?, ids that differ); None when equality is not expected or known."""
    if not lossless or not plain:
        return None, []
    ref = {r.id: r.tokens_sha for r in plain}
    bad = [r.id for r in runs if r.id in ref and ref[r.id] != r.tokens_sha]
    return not bad, bad


# --------------------------------------------------------------------------- one record


def time_split(cfg: RunParams, runs: Sequence[PromptRun]) -> dict:
    """Where the decoding time went: draft, network, verify, and the rest (overhead).

    The engine times how long it waits on the drafter and how long verification
    takes. For remote modes the emulated round trip inside that wait is known:
    at most one per drafting round, so network = min(wait, rounds x RTT) and the
    remainder of the wait is the node drafting (or its queue). A pipelined
    drafter that never makes the engine wait shows no network time: its cost is
    in acceptance, not in waiting.
    """
    total = sum(r.predicted_ms for r in runs)
    draft = network = verify = 0.0
    for r in runs:
        wait = r.stats.get("draft_ms", 0.0)
        net = 0.0
        if cfg.mode in REMOTE and cfg.rtt_s:
            net = min(wait, r.stats.get("rounds", 0) * 1000 * cfg.rtt_s)
        draft, network = draft + wait - net, network + net
        verify += r.stats.get("verify_ms", 0.0)
    other = total - draft - network - verify
    ms = {"total": total, "prompt": sum(r.prompt_ms for r in runs), "draft": draft,
          "network": network, "verify": verify, "overhead": other}
    frac = {k: (v / total if total else None) for k, v in ms.items() if k not in ("total",
                                                                                 "prompt")}
    return {"ms": ms, "fraction": frac}


def wire_bytes(runs: Sequence[PromptRun]) -> dict:
    """Bytes per generated token: as the link emulator counted them (HTTP/2 included), and
    as the drafter did (gRPC messages); and the drafter's per token it received, both
    directions, with and without the Opens that carry the prompts."""
    gen = sum(r.generated for r in runs)
    up, down = sum(r.link_bytes_up for r in runs), sum(r.link_bytes_down for r in runs)

    def drafter(key: str) -> float:
        return sum(r.stats.get("drafter", {}).get(key, 0.0) for r in runs)

    d_up, d_down, d_open = drafter("bytes_up"), drafter("bytes_down"), drafter("bytes_open")
    drafted = drafter("tokens_received")
    return {"link_up": up, "link_down": down,
            "link_per_token": (up + down) / gen if gen else None,
            "drafter_up": d_up, "drafter_down": d_down, "drafter_open": d_open,
            "drafter_per_token": (d_up + d_down) / gen if gen else None,
            "drafter_per_drafted_token": (d_up + d_down) / drafted if drafted else None,
            "drafter_per_drafted_token_after_open":
                (d_up - d_open + d_down) / drafted if drafted else None}


def starved(runs: Sequence[PromptRun]) -> dict | None:
    """A drafter working ahead: rounds after a rejection with nothing to verify, their
    share of the rounds and of the decoding time; rounds drafted from a pre-drafted
    alternate instead; rounds without a draft for any reason (`empty`); rounds that
    waited for the drafter (drafters/bubble.py), how long in all and in what share of
    the decoding time, and how many of them still found nothing (`waited_empty`).
    None for drafters that do not count them."""
    def drafter(key: str) -> float:
        return sum(r.stats.get("drafter", {}).get(key, 0.0) for r in runs)

    if not any("starved_rounds" in r.stats.get("drafter", {}) for r in runs):
        return None
    rounds = sum(r.stats.get("rounds", 0) for r in runs)
    total = sum(r.stats.get("predicted_ms", 0.0) for r in runs)
    n, ms = drafter("starved_rounds"), drafter("starved_ms")
    return {"rejections": drafter("rejections"), "rounds": n, "ms": ms,
            "share_of_rounds": n / rounds if rounds else None,
            "share_of_time": ms / total if total else None,
            "alternate_rounds": drafter("alternate_rounds"),
            "alternate_trees": drafter("alternate_trees"),
            "second_choices_taken": drafter("second_choices_taken"),
            "empty_rounds": drafter("empty_rounds"),
            "waited_rounds": drafter("waited_rounds"), "waited_ms": drafter("waited_ms"),
            "waited_share_of_time": drafter("waited_ms") / total if total else None,
            "waited_empty": drafter("waited_empty"),
            "fresh_first_ms_mean": (drafter("fresh_first_ms") / drafter("fresh_branches")
                                    if drafter("fresh_branches") else None)}


def by_category(runs: Sequence[PromptRun], plain: Sequence[PromptRun] | None) -> dict:
    groups: dict[str, list[PromptRun]] = defaultdict(list)
    for r in runs:
        groups[r.category].append(r)
    out = {}
    for cat, rs in groups.items():
        ref = [r for r in plain if r.category == cat] if plain else None
        drafted = sum(r.stats.get("draft_n", 0) for r in rs)
        out[cat] = {"n_prompts": len(rs),
                    "tokens_per_s_median": median(r.tokens_per_s for r in rs),
                    "speedup": speedup(rs, ref),
                    "acceptance": (sum(r.stats.get("draft_n_accepted", 0) for r in rs) / drafted
                                   if drafted else None)}
    return out


def aggregate(cfg: RunParams, runs: Sequence[PromptRun], plain: Sequence[PromptRun] | None,
              lossless: bool) -> dict:
    """One configuration's record: every figure bench reports, plus per-prompt data."""
    drafted = sum(r.stats.get("draft_n", 0) for r in runs)
    accepted = sum(r.stats.get("draft_n_accepted", 0) for r in runs)
    hist = merge_hist(r.stats.get("accepted_hist", []) for r in runs)
    rounds_with_draft = sum(hist)
    match, mismatched = token_match(runs, plain, lossless)
    return {
        **cfg.to_dict(),
        "n_prompts": len(runs),
        "tokens_generated": sum(r.generated for r in runs),
        "tokens_per_s": spread([r.tokens_per_s for r in runs]),
        "speedup": speedup(runs, plain),
        "acceptance": accepted / drafted if drafted else None,
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "rounds": sum(r.stats.get("rounds", 0) for r in runs),
        "short_rounds": sum(r.stats.get("short_rounds", 0) for r in runs),
        "asked_rounds": sum(r.stats.get("asked_rounds", 0) for r in runs),
        "rejected_rounds": sum(r.stats.get("rejected_rounds", 0) for r in runs),
        "mean_accepted": (sum(i * c for i, c in enumerate(hist)) / rounds_with_draft
                          if rounds_with_draft else None),
        "drafting_rounds": rounds_with_draft,
        #: llama-spec-bench's "mean accepted length": tokens per drafting round, the
        #: target's own (bonus or corrected) token included
        "mean_accepted_length": ((accepted + rounds_with_draft) / rounds_with_draft
                                 if rounds_with_draft else None),
        "accepted_hist": hist,
        "by_position": merge_by_position(r.stats.get("by_position", []) for r in runs),
        "time": time_split(cfg, runs),
        "bytes": wire_bytes(runs),
        "starved": starved(runs),
        "tokens_match_plain": match,
        "mismatched_prompts": mismatched,
        "by_category": by_category(runs, plain),
        "emulation": emulation(runs),
        "prompts": [r.to_dict() for r in runs],
    }


_HOLD_SUMS = ("decodes", "over", "prompt_chunks", "prompt_over", "real_s", "emulated_s")


def emulation(runs: Sequence[PromptRun]) -> dict | None:
    """--emulate: per model, the decodes held and those over their emulated time, and
    whether the configuration is a valid emulation (at most 5% over, each model)."""
    from specwire.emulate.hold import MAX_OVER_SHARE

    parts = [r.extra["emulation"] for r in runs if r.extra.get("emulation")]
    if not parts:
        return None
    out: dict = {}
    for name in parts[0]:
        tot = {k: sum(p[name][k] for p in parts) for k in _HOLD_SUMS}
        tot["over_share"] = tot["over"] / tot["decodes"] if tot["decodes"] else 0.0
        out[name] = tot
    out["valid"] = all(v["over_share"] <= MAX_OVER_SHARE for v in out.values())
    return out


# --------------------------------------------------------------------------- across records


def adaptive_vs_fixed(records: Sequence[dict]) -> list[dict]:
    """Per mode, link and prompt set: the adaptive policy against the best fixed length.

    Rates are tokens/s over the whole set (tokens generated / decoding time), what a
    user running those prompts gets; `paired` is the median over prompts of the
    per-prompt ratio to that best fixed length, which cancels prompt-to-prompt spread.
    `interval` is a 90% bootstrap interval of `ratio` over the set's prompts: the
    best fixed length is picked after the fact among noisy rates, so a ratio a
    little under 1 whose interval holds 1 is a match this run cannot tell apart.
    """
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        if r["mode"] != "plain":
            groups[(r["mode"], r["rtt_ms"], r["bandwidth_bps"])].append(r)
    out = []
    for (mode, rtt, bw), rs in groups.items():
        fixed = [r for r in rs if r["policy"] == "fixed"]
        for ad in (r for r in rs if r["policy"] == "adaptive"):
            for cat in sorted({p["category"] for p in ad["prompts"]}):
                rated = [(set_rate(r, cat), r) for r in fixed]
                rated = [(t, r) for t, r in rated if t]
                mine = set_rate(ad, cat)
                if not rated or not mine:
                    continue
                tps, best = max(rated, key=lambda x: x[0])
                out.append({"mode": mode, "rtt_ms": rtt, "bandwidth_bps": bw, "category": cat,
                            "adaptive_max": ad["draft_max"], "adaptive_tps": mine,
                            "best_fixed_k": best["draft_max"], "best_fixed_tps": tps,
                            "ratio": mine / tps, "paired": _paired(ad, best, cat),
                            "interval": ratio_interval(ad, best, cat)})
    return out


def ratio_interval(a: dict, b: dict, category: str, resamples: int = 2000,
                   seed: int = 0) -> list[float] | None:
    """90% bootstrap interval of set_rate(a) / set_rate(b), resampling prompts in pairs."""
    theirs = {p["id"]: p for p in b["prompts"] if p["category"] == category}
    pairs = [(p, theirs[p["id"]]) for p in a["prompts"]
             if p["category"] == category and p["id"] in theirs]
    if len(pairs) < 2:
        return None
    # (4, m): tokens and ms of a, then of b, per prompt
    cols = np.array([[pa["generated"], pa["predicted_ms"], pb_["generated"], pb_["predicted_ms"]]
                     for pa, pb_ in pairs], dtype=np.float64).T
    idx = np.random.default_rng(seed).integers(0, len(pairs), (resamples, len(pairs)))
    sums = cols[:, idx].sum(axis=2)  # (4, resamples)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = (sums[0] / sums[1]) / (sums[2] / sums[3])  # (resamples,)
    ratios = ratios[np.isfinite(ratios)]
    if ratios.size == 0:
        return None
    return [float(x) for x in np.quantile(ratios, [0.05, 0.95])]


def overall_rate(record: dict) -> float | None:
    """Tokens/s over all of a record's prompts: all tokens over all decoding time."""
    return set_rate(record, None)


def set_rate(record: dict, category: str | None) -> float | None:
    """Tokens/s over the prompts of one category (None: all): all tokens over all
    decoding time."""
    ps = [p for p in record["prompts"] if category is None or p["category"] == category]
    ms = sum(p["predicted_ms"] for p in ps)
    return 1000.0 * sum(p["generated"] for p in ps) / ms if ms > 0 else None


def _paired(a: dict, b: dict, category: str) -> float | None:
    theirs = {p["id"]: p["tokens_per_s"] for p in b["prompts"] if p["category"] == category}
    ratios = [p["tokens_per_s"] / theirs[p["id"]] for p in a["prompts"]
              if p["category"] == category and theirs.get(p["id"])]
    return float(np.median(ratios)) if ratios else None


def warnings(records: Sequence[dict]) -> list[str]:
    out = []
    for r in records:
        if r["tokens_match_plain"] is False:
            out.append(f"{r['label']}: generated tokens differ from plain decoding on "
                       f"{', '.join(r['mismatched_prompts'])} (speculation should be lossless "
                       "here: this is a bug or floating-point divergence between batch sizes)")
    return out


def machine_info() -> dict:
    """What a reader needs to judge the numbers: cores, Python, llama-cpp-python."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        llama_version = version("llama-cpp-python")
    except PackageNotFoundError:
        llama_version = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu_count": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "machine": platform.machine(),
            "llama_cpp_python": llama_version,
            "load_average": [round(x, 2) for x in load] if load else None}


def write_json(path: Path, results: dict) -> None:
    """Strict JSON: infinities and NaN become null so any parser reads the file."""
    path.write_text(json.dumps(_finite(results), indent=2) + "\n", encoding="utf-8")


def _finite(x):
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


# --------------------------------------------------------------------------- the table


LEGEND = ("tok/s: median over prompts (p10-p90); speedup: ratio of medians to plain; "
          "paired: median of per-prompt ratios; accept: accepted/drafted; len: mean tokens "
          "kept per drafting round; B/tok: bytes on the wire per generated token; plan: "
          "predicted tok/s over the set (err% vs the measured all tokens / all decoding "
          "time); bound: tok/s of a free, instant drafter with the measured acceptance on "
          "this target (only verification costs), of%: the measured share of it; same: tokens "
          "identical to plain")


def render_table(records: Sequence[dict]) -> str:
    """One line per configuration, then a legend (see specwire/bench/README.md)."""
    width = max([len("configuration"), *(len(r["label"]) for r in records)])
    head = (f"{'configuration':<{width}} {'tok/s':>7} {'p10-p90':>13} {'speedup':>7} "
            f"{'paired':>6} {'accept':>6} {'len':>5} {'draft/net/verify/other %':>24} "
            f"{'B/tok':>6} {'plan':>7} {'err%':>6} {'bound':>7} {'of%':>4} {'same':>4}")
    lines = [head, "-" * len(head)]
    lines += [_row(r, width) for r in records]
    return "\n".join([*lines, textwrap.fill(LEGEND, width=len(head))])


def _row(r: dict, width: int) -> str:
    t, s, frac = r["tokens_per_s"], r["speedup"], r["time"]["fraction"]
    split = "/".join(_pct(frac.get(k)) for k in ("draft", "network", "verify", "overhead"))
    pl = r.get("plan") or {}
    bd = r.get("bound") or {}
    same = {True: "yes", False: "NO", None: "-"}[r["tokens_match_plain"]]
    b = r["bytes"]["link_per_token"] if r["bytes"]["link_up"] else r["bytes"]["drafter_per_token"]
    return (f"{r['label']:<{width}} {_num(t['median'], 7, 2)} "
            f"{_num(t['p10'], 6, 1)}-{_num(t['p90'], 6, 1, left=True)} "
            f"{_x(s['ratio_of_medians'], 7)} {_x(s['paired_median'], 6)} "
            f"{_pct_cell(r['acceptance'], 6)} {_num(r['mean_accepted'], 5, 2)} "
            f"{split:>24} {_num(b or None, 6, 0)} {_num(pl.get('predicted_tps'), 7, 2)} "
            f"{_signed(pl.get('error_pct'), 6)} {_num(bd.get('tokens_per_s'), 7, 2)} "
            f"{_pct(bd.get('share')):>4} {same:>4}")


def _num(x: float | None, width: int, digits: int, left: bool = False) -> str:
    text = "-" if x is None else f"{x:.{digits}f}"
    return f"{text:<{width}}" if left else f"{text:>{width}}"


def _x(x: float | None, width: int) -> str:
    return f"{'-' if x is None else f'{x:.2f}x':>{width}}"


def _signed(x: float | None, width: int) -> str:
    return f"{'-' if x is None else f'{x:+.0f}':>{width}}"


def _interval(iv: Sequence[float] | None) -> str:
    return f" [{iv[0]:.2f}-{iv[1]:.2f}]" if iv else ""


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}"


def _pct_cell(x: float | None, width: int) -> str:
    return f"{'-' if x is None else f'{100 * x:.1f}%':>{width}}"


#: draft positions the speculation table shows (llama-spec-bench's per-position acceptance).
POSITIONS = 8


def render_speculation(records: Sequence[dict]) -> str:
    """What users compare across tools, as ik_llama.cpp's llama-spec-bench prints it:
    rounds, drafts, drafted and accepted tokens, the acceptance rate, the mean accepted
    length (the target's own token included) and acceptance at each draft position."""
    width = max([len("configuration"), *(len(r["label"]) for r in records)])
    pos = " ".join(f"{f'p{i}':>4}" for i in range(POSITIONS))
    head = (f"{'configuration':<{width}} {'rounds':>6} {'drafts':>6} {'drafted':>7} "
            f"{'accepted':>8} {'rate':>6} {'mean len':>8}  acceptance by position {pos}")
    lines = [head, "-" * len(head)]
    for r in records:
        by_pos = {p["position"]: p["rate"] for p in r.get("by_position", [])}
        cells = " ".join(f"{_pct(by_pos.get(i)):>4}" for i in range(POSITIONS))
        lines.append(f"{r['label']:<{width}} {r['rounds']:>6} "
                     f"{r.get('drafting_rounds', 0):>6} {r['draft_n']:>7} "
                     f"{r['draft_n_accepted']:>8} {_pct_cell(r['acceptance'], 6)} "
                     f"{_num(r.get('mean_accepted_length'), 8, 2)}  "
                     f"{'':>22} {cells}")
    legend = ("rounds: target steps of every request; drafts: rounds that verified a draft; "
              "rate: accepted/drafted; mean len: tokens per draft round, the target's own "
              "token included (llama-spec-bench's mean accepted length); p0..: % of the "
              "drafts reaching each position that the target kept there")
    return "\n".join([*lines, textwrap.fill(legend, width=len(head))])


def render_summary(results: dict) -> str:
    """The tables, then warnings, adaptive against fixed, and the plan's error."""
    records = results["records"]
    parts = [render_table(records), "", render_speculation(records)]
    ad = results.get("adaptive_vs_fixed") or []
    if ad:
        parts.append("adaptive policy against the best fixed draft length (tokens/s over the "
                     "set, its 90% bootstrap interval over prompts; paired: median per-prompt "
                     "ratio):")
        for a in ad:
            link = "" if a["rtt_ms"] is None else (f" rtt={format_ms(a['rtt_ms'] / 1000)}"
                                                   f" bw={format_bps(a['bandwidth_bps'])}")
            parts.append(f"  {a['mode']}{link} [{a['category']}]: adaptive<={a['adaptive_max']} "
                         f"{_num(a['adaptive_tps'], 0, 2)} vs k={a['best_fixed_k']} "
                         f"{_num(a['best_fixed_tps'], 0, 2)} ({_x(a['ratio'], 0)}"
                         f"{_interval(a.get('interval'))}, paired {_x(a['paired'], 0)})")
    for r in records:
        sv = r.get("starved")
        if sv and sv["rejections"]:
            parts.append(f"  {r['label']}: {sv['rounds']:.0f} of {r['rounds']} rounds found "
                         f"nothing to verify after a rejection ({_pct(sv['share_of_rounds'])}%, "
                         f"{_pct(sv['share_of_time'])}% of decoding time; "
                         f"{sv.get('empty_rounds', 0):.0f} rounds without a draft in all); "
                         f"{sv['alternate_rounds']:.0f} verified a pre-drafted alternate "
                         f"({sv.get('alternate_trees', 0):.0f} in the same decode, as a "
                         f"tree, {sv.get('second_choices_taken', 0):.0f} of them a second "
                         "choice alone); "
                         f"{sv.get('waited_rounds', 0):.0f} waited for the drafter "
                         f"({sv.get('waited_ms', 0):.0f} ms, "
                         f"{_pct(sv.get('waited_share_of_time'))}% of decoding time, "
                         f"{sv.get('waited_empty', 0):.0f} in vain); a fresh branch's first "
                         f"token came {_num(sv.get('fresh_first_ms_mean'), 0, 1)} ms after "
                         f"the verdict")
    parts += emulation_lines(results)
    errs = [abs(r["plan"]["error_pct"]) for r in records
            if r.get("plan") and r["mode"] != "plain"]
    if errs:
        parts.append(f"plan prediction error: median {np.median(errs):.0f}%, "
                     f"worst {max(errs):.0f}% over {len(errs)} configurations")
    parts += [f"WARNING: {w}" for w in results.get("warnings", [])]
    return "\n".join(parts)


def emulation_lines(results: dict) -> list[str]:
    """--emulate: the regime and its scale, each configuration's decodes over their time
    (those above 5% marked: not a valid emulation), the node's over the whole run."""
    emu = results.get("emulation")
    if not emu:
        return []
    scale = emu["scale"]
    out = [f"emulation: {emu['describe']}; tokens/s above are wall time, x {scale:.3g} gives "
           f"the emulated model's (round trips shown are wall time too)"]
    for r in results["records"]:
        e = r.get("emulation")
        if not e:
            continue
        shares = ", ".join(f"{name} {v['over']}/{v['decodes']} ({100 * v['over_share']:.1f}%)"
                           for name, v in e.items() if name != "valid" and v["decodes"])
        rate = overall_rate(r)
        emulated = f"{rate * scale:.2f} emulated tok/s; " if rate else ""
        out.append(f"  {r['label']}: {emulated}decodes over their emulated time: {shares}"
                   f"{'' if e['valid'] else ' - NOT A VALID EMULATION'}")
    node = emu.get("node")
    if node:
        share = node["over"] / node["decodes"] if node["decodes"] else 0.0
        out.append(f"  draft node (all its configurations): {node['over']}/{node['decodes']} "
                   f"drafts over their emulated time ({100 * share:.1f}%)"
                   f"{'' if share <= 0.05 else ' - NOT A VALID EMULATION'}")
    return out
