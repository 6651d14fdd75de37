"""One bench invocation: expand the sweep, run every configuration, collect results.

Plain decoding always runs first, whatever --modes says: every speedup and
the plan predictions are relative to it, and measuring it in the same run
(same machine load, same prompts) is what makes the ratios honest. By default
the runs interleave: each prompt runs under every configuration before the
next prompt starts, so a shared machine's slow drift in load lands on all
configurations alike instead of on whichever ran during it.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specwire.bench import calibrate, plots, predict, report
from specwire.bench.modes import MODEL_MODES, REMOTE_MODES, Drafters
from specwire.bench.prompts import Prompt, PromptError, resolve, tokenize
from specwire.bench.runner import (
    PromptRun,
    RunParams,
    Workload,
    run_config,
    run_prompt,
    warm_up,
)
from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.settings import BenchSettings


@dataclass(slots=True)
class SweepSettings:
    """The sweep, checked: what to run, over which values, and where to write."""

    prompts: str
    modes: list[str]
    out: Path
    limit: int | None = None
    #: round trips (None under --emulate: the preset's); emulated time until scaled
    rtts: list[float] | None = field(default_factory=lambda: [0.002])
    bandwidths: list[float | None] = field(default_factory=lambda: [None])
    draft_max: list[int] = field(default_factory=lambda: [8])
    policies: list[str] = field(default_factory=lambda: ["fixed"])
    n_predict: int | None = None
    ignore_eos: bool = False
    chat_template: str | None = None
    progress: bool = True
    plots: bool = True
    interleave: bool = True


def configurations(s: SweepSettings) -> list[RunParams]:
    """Plain first, then each mode over its sweep (links only for remote modes).

    The adaptive policy chooses its own length, so it runs once per mode and link,
    capped at the largest --draft-max, however many fixed lengths are swept.
    """
    out = [RunParams("plain")]
    for mode in s.modes:
        if mode == "plain":
            continue
        links: list[tuple[float | None, float | None]] = (
            [(r, b) for r in s.rtts for b in s.bandwidths] if mode in REMOTE_MODES
            else [(None, None)])
        out += [RunParams(mode, k, pol, rtt, bw) for rtt, bw in links
                for k in s.draft_max for pol in s.policies
                if pol == "fixed" or k == max(s.draft_max)]
    return out


def run(s: SweepSettings, bench: BenchSettings, sampling: SamplingParams,
        draft: DraftParams) -> dict:
    """Run the sweep; write results.json and the plots; return the results."""
    from specwire.backend.base import BackendError
    from specwire.backend.llama import LlamaBackend
    from specwire.backend.placement import check

    try:
        plist = resolve(s.prompts, s.limit)
    except PromptError as e:
        raise ConfigError(str(e)) from None
    s.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    emulation: dict = {}
    with contextlib.ExitStack() as stack:
        try:
            check(bench.target.placement)                    # both, before either loads
            if bench.draft is not None:
                check(bench.draft.placement, dict(bench.draft_flags))
            tree = bench.remote.tree if any(m in ("remote-pipelined", "local-pipelined",
                                                  "hybrid", "hybrid-pipelined")
                                            for m in s.modes) else 0
            target = LlamaBackend(bench.target, tree_branches=tree)
        except BackendError as e:
            raise ConfigError(str(e)) from None
        drafters = Drafters(bench, target, s.out, stack)
        holds: dict = {}
        if bench.emulation is not None:
            target, s, holds, emulation = _emulate(bench, s, target, drafters)
        results = _sweep(plist, s, bench, sampling, draft, target, drafters, stack, holds,
                         t_start)
        if emulation:
            emulation["node"] = node_holds(s.out / "draft-node.log")
    if emulation:
        results["emulation"] = emulation
    report.write_json(s.out / "results.json", results)
    if s.plots:
        results["plots"] = [str(p) for p in plots.write_all(results["records"], s.out)]
    return results


def run_on(s: SweepSettings, bench: BenchSettings, sampling: SamplingParams,
           draft: DraftParams, target: Any, drafters: Drafters,
           stack: contextlib.ExitStack) -> dict:
    """The sweep on a target already loaded and its Drafters (a draft node they started is
    reused), without --emulate: for a caller that measures more on the same models
    (scripts/gpu_check.py). Writes results.json; no plots."""
    try:
        plist = resolve(s.prompts, s.limit)
    except PromptError as e:
        raise ConfigError(str(e)) from None
    s.out.mkdir(parents=True, exist_ok=True)
    results = _sweep(plist, s, bench, sampling, draft, target, drafters, stack, {},
                     time.time())
    report.write_json(s.out / "results.json", results)
    return results


def _sweep(plist: list[Prompt], s: SweepSettings, bench: BenchSettings,
           sampling: SamplingParams, draft: DraftParams, target: Any, drafters: Drafters,
           stack: contextlib.ExitStack, holds: dict, t_start: float) -> dict:
    """Calibrate, run every configuration, and the results (what results.json holds)."""
    cfgs = configurations(s)
    work = _workload(plist, target, bench, s, sampling, draft)
    work.holds = holds
    calib = _calibrate(cfgs, target, drafters, work)
    runs = _run_all(cfgs, target, drafters, work, s, stack)
    return _results(bench, s, cfgs, runs, calib, sampling, draft, time.time() - t_start)


def _emulate(bench: BenchSettings, s: SweepSettings, target: Any, drafters: Drafters
             ) -> tuple[Any, SweepSettings, dict, dict]:
    """--emulate: fit the scale to the real pair (unless given), hold the target and the
    local draft, start any draft node holding its drafts alike, and turn the swept round
    trips (emulated time) into wall time. (target, settings, counters, what to record)."""
    import dataclasses

    from specwire.emulate.hold import HoldCounters, emulate
    from specwire.emulate.regimes import scaled
    assert bench.emulation is not None
    probe = (drafters.real_draft_backend()
             if bench.draft is not None and bench.emulation.draft_tps is not None else None)
    emu, measured = scaled(bench.emulation, bench.fit_scale, target, probe)
    holds = {"target": HoldCounters(), "draft": HoldCounters()}
    held = emulate(target, emu.target_regime(), holds["target"])
    regime = emu.draft_regime()
    node = () if regime is None else (
        "--emulate-scale", f"{emu.scale:.6g}", "--draft-tps", f"{emu.draft_tps:g}",
        "--verify-cost", ",".join(f"{n}:{c:g}" for n, c in emu.verify.points))
    drafters.hold(regime, holds["draft"], node, emu.scale)
    drafters.target = held
    rtts = s.rtts if s.rtts is not None else [emu.rtt_s]
    s = dataclasses.replace(s, rtts=[r * emu.scale for r in rtts])
    print(emu.describe(), file=sys.stderr)
    return held, s, holds, {**emu.to_dict(), "describe": emu.describe(),
                            "emulated_rtts_ms": [1000 * r for r in rtts],
                            "measured": _jsonable_measure(measured)}


def _jsonable_measure(measured: dict) -> dict:
    """Real decode seconds by batch size -> milliseconds, keys as text (JSON)."""
    out: dict = {}
    for k, v in measured.items():
        out[k] = ({str(n): round(1000 * t, 3) for n, t in v.items()} if isinstance(v, dict)
                  else v)
    return out


_NODE_HOLDS = re.compile(r"emulation: (\d+) draft decodes, (\d+) over their emulated time; "
                         r"(\d+) prompt chunks, (\d+) over")


def node_holds(log_path: Path) -> dict | None:
    """The draft node's last count of held drafts (it logs one as each session closes)."""
    try:
        text = log_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    found = _NODE_HOLDS.findall(text)
    if not found:
        return None
    d, o, p, po = map(int, found[-1])
    return {"decodes": d, "over": o, "prompt_chunks": p, "prompt_over": po}


def _workload(plist: list[Prompt], target: Any, bench: BenchSettings, s: SweepSettings,
              sampling: SamplingParams, draft: DraftParams) -> Workload:
    """Tokenize every prompt once; refuse one that cannot fit the context with its budget
    (the draft model's too, when a mode runs it)."""
    from specwire.config import ConfigError
    tokens = []
    for p in plist:
        try:
            toks = tokenize(p, target, s.chat_template)
        except ConfigError as e:
            raise ConfigError(f"{p.source}: {e}") from None
        tokens.append(toks)
    work = Workload(plist, tokens, sampling, draft, s.n_predict, s.ignore_eos)
    n_ctx = min(target.n_ctx, bench.draft.n_ctx if bench.draft else target.n_ctx)
    for i, p in enumerate(plist):
        if len(tokens[i]) + work.budget(i) + 1 > n_ctx:
            raise ConfigError(f"{p.source}: prompt ({len(tokens[i])} tokens) plus "
                           f"{work.budget(i)} new tokens exceed the context {n_ctx} (-c)")
    return work


def _calibrate(cfgs: list[RunParams], target: Any, drafters: Drafters, work: Workload) -> dict:
    """Draft speed and verification curve for the plan predictions (a few seconds)."""
    out: dict[str, Any] = {"draft_tps": None, "verify_cost": None}
    if not any(c.drafting for c in cfgs):
        return out
    prompt = work.tokens[0]
    out["verify"] = calibrate.verify_curve(target, prompt)
    out["verify_cost"] = [list(p) for p in out["verify"].points]
    if any(c.mode in MODEL_MODES for c in cfgs):
        backend = drafters.draft_backend()
        out["draft_tps"] = calibrate.draft_tps(backend, prompt)
        out["draft_prompt_tps"] = calibrate.draft_prompt_tps(backend, prompt, out["draft_tps"])
    return out


def _run_all(cfgs: list[RunParams], target: Any, drafters: Drafters, work: Workload,
             s: SweepSettings, stack: contextlib.ExitStack) -> list[list[PromptRun]]:
    from tqdm import tqdm

    from specwire.engine.engine import Engine
    from specwire.policy.adaptive import PolicyMemory
    bar = tqdm(total=len(cfgs) * len(work.prompts), unit="prompt", disable=not s.progress,
               dynamic_ncols=True, file=sys.stderr)
    stack.callback(bar.close)
    if not s.interleave:
        out = []
        for cfg in cfgs:
            bar.set_description(cfg.label())
            with drafters.build(cfg) as (drafter, emu):
                out.append(run_config(Engine(target, drafter), work, cfg, emu,
                                      on_prompt=lambda _r: bar.update()))
        return out
    # What an adaptive policy learns carries over between prompts of its configuration,
    # as in config-major order (one Engine per configuration) and in a server.
    memory = [PolicyMemory() for _ in cfgs]
    for cfg, mem in zip(cfgs, memory, strict=True):
        bar.set_description(f"warm-up {cfg.label()}")
        with drafters.build(cfg) as (drafter, _emu):
            warm_up(Engine(target, drafter, mem), work, cfg)
    runs: list[list[PromptRun]] = [[] for _ in cfgs]
    for i in range(len(work.prompts)):
        for j, cfg in enumerate(cfgs):
            bar.set_description(f"{work.prompts[i].id} {cfg.label()}")
            with drafters.build(cfg) as (drafter, emu):
                runs[j].append(run_prompt(Engine(target, drafter, memory[j]), work, cfg, i, emu))
            bar.update()
    target.truncate(0)
    return runs


def _results(bench: BenchSettings, s: SweepSettings, cfgs: list[RunParams],
             runs: list[list[PromptRun]], calib: dict, sampling: SamplingParams, draft: DraftParams,
             elapsed_s: float) -> dict:
    plain = runs[0]
    lossless = sampling.greedy or draft.mode is VerifyMode.COUPLED
    records = [report.aggregate(c, r, plain, lossless) for c, r in zip(cfgs, runs, strict=True)]
    # The plan works on rates over the whole workload: all tokens over all decoding time.
    plain_tps = report.overall_rate(records[0]) or 0.0
    for rec, cfg in zip(records, cfgs, strict=True):
        rec["plan"] = prediction(rec, cfg, plain_tps, calib)
        rec["bound"] = predict.bound(cfg, plain_tps, _rounds(rec), calib.get("verify"),
                                     report.overall_rate(rec) or 0.0)
    return {
        "command": _command_line(),
        "args": dict(bench.flags),
        "machine": report.machine_info(),
        "models": {"target": bench.target.path,
                   "draft": bench.draft.path if bench.draft else None},
        "settings": {"prompts": s.prompts, "prompt_ids": [p["id"] for p in records[0]["prompts"]],
                     "n_predict": s.n_predict, "sampling": sampling.to_dict(),
                     "draft": {"p_min": draft.p_min, "n_min": draft.n_min,
                               "verify": draft.mode.value, "top_k_q": draft.top_k_q},
                     "lossless_expected": lossless},
        "calibration": {"draft_tps": calib["draft_tps"], "verify_cost": calib["verify_cost"],
                        "draft_prompt_tps": calib.get("draft_prompt_tps"),
                        "plain_tps_overall": plain_tps},
        "elapsed_s": elapsed_s,
        "records": records,
        "adaptive_vs_fixed": report.adaptive_vs_fixed(records),
        "warnings": report.warnings(records),
    }


def _rounds(rec: dict) -> predict.Rounds:
    return predict.Rounds(rounds=rec["rounds"], drafting_rounds=sum(rec["accepted_hist"]),
                          drafted=rec["draft_n"], accepted=rec["draft_n_accepted"],
                          short=rec.get("short_rounds", 0),
                          asked=rec.get("asked_rounds", rec["rounds"]),
                          rejected=rec.get("rejected_rounds"), reads=_reads(rec),
                          generated=rec["tokens_generated"])


def _reads(rec: dict) -> tuple[tuple[int, float, int, int], ...]:
    """Per request whose drafter was asked: the draft's prompt tokens, the target's prompt
    seconds, the tokens generated, the rounds that did not ask it (predict.Rounds.reads)."""
    out = []
    for p in rec["prompts"]:
        st = p["stats"]
        if st.get("asked_rounds", 0) and st.get("draft_prompt_n") is not None:
            out.append((int(st["draft_prompt_n"]), p["prompt_ms"] / 1000.0, p["generated"],
                        st.get("rounds", 0) - st["asked_rounds"]))
    return tuple(out)


def prediction(rec: dict, cfg: RunParams, plain_tps: float, calib: dict) -> dict | None:
    """What `plan` predicts for a record of this run (predict.predict on its rounds), from
    the calibration (draft_tps, verify: a VerifyCurve, draft_prompt_tps): at the end of a
    sweep, and again from a results.json by benchmarks/repredict.py."""
    measured = report.overall_rate(rec) or 0.0
    rounds = _rounds(rec)
    if cfg.mode in MODEL_MODES and cfg.mode != "hybrid":
        draft_tps = calib["draft_tps"]
    else:
        # n-gram lookups, a hybrid's (mostly lookups, its model now and then), or a
        # llama-server's drafting: the engine's wait less the link
        draft_tps = predict.measured_draft_tps(rec["time"]["ms"]["draft"], rec["draft_n"])
    return predict.predict(cfg, plain_tps, draft_tps, rounds, calib.get("verify"), measured,
                           calib.get("draft_prompt_tps") or 0.0)


#: Flags whose values must not land in a results file that gets shared.
_SECRET_FLAGS = ("--draft-token",)


def _command_line() -> str:
    """The exact command line, with secrets masked."""
    argv = list(sys.argv)
    if argv and (argv[0].endswith("specwire") or argv[0].endswith("__main__.py")):
        argv = ["specwire", *argv[1:]]
    out = []
    for i, arg in enumerate(argv):
        flag, eq, _ = arg.partition("=")
        if flag in _SECRET_FLAGS and eq:
            arg = f"{flag}=***"
        elif i > 0 and argv[i - 1] in _SECRET_FLAGS:
            arg = "***"
        out.append(arg)
    return shlex.join(out)

