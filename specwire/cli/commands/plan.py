"""`specwire plan`: predict whether a draft pays before loading any model.

Takes the figures one can measure separately (plain target speed, draft
speed, acceptance, link) and prints every mode at its best draft length, the
TK-SLT closed form and a verdict. The model and its assumptions are in
specwire/policy/plan.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from specwire.bench import calibrate
from specwire.bench.netemu import parse_bandwidth, parse_duration
from specwire.cli.args import CliError, add_draft_model_args, add_model_args
from specwire.cli.settings import measure_settings
from specwire.policy import boxes, rpc
from specwire.policy.plan import MODES, Plan, plan
from specwire.policy.throughput import VERIFY_SLOPE, PlanInputs, VerifyCurve

T = TypeVar("T")

_MODE_NOTES = {
    "plain": "target alone",
    "local": "draft in the target's process, one after the other",
    "synchronous": "remote draft, each waits for the other",
    "pipelined": "remote draft works ahead while the target verifies",
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="predict the speedup of a draft from measured speeds",
                       description=__doc__.splitlines()[0])
    p.add_argument("--target-tps", metavar="TPS",
                   help="target's plain decoding speed, tokens/s")
    p.add_argument("--draft-tps", metavar="TPS",
                   help="draft model's decoding speed, tokens/s")
    p.add_argument("--acceptance", metavar="A",
                   help="per-token acceptance, 0..1 or ACCEPTED/DRAFTED (e.g. 810/1093)")
    p.add_argument("--rtt",
                   help="round trip to the draft node (default 1ms; bare number = ms)")
    p.add_argument("--bandwidth", default="1gbit",
                   help="link bandwidth, e.g. 1gbit, 100mbit, or 'inf' (default 1gbit)")
    p.add_argument("--verify-cost", metavar="N:COST,...",
                   help="target's cost of a batch of N tokens in plain steps, e.g. 1:1,8:1.3 "
                        f"(default: assumed 1 + {VERIFY_SLOPE:g} (N-1))")
    p.add_argument("--draft-max", "--spec-draft-n-max", dest="draft_max", default="16",
                   metavar="K",
                   help="longest draft to consider (default 16)")
    p.add_argument("--draft-bytes", default="24", metavar="B",
                   help="bytes on the wire per drafted token, its second choice included "
                        "(default 24)")
    p.add_argument("--verdict-bytes", default="32", metavar="B",
                   help="bytes on the wire per verdict (default 32)")
    p.add_argument("-np", "--parallel", default="1", metavar="N",
                   help="requests decoding together (llama-server's -np): the target verifies "
                   "all of them in one decode, the draft drafts all of them in one decode "
                   "(a node's step, or a lockstep local draft), each on its --verify-cost "
                   "curve; tokens/s summed over them (default 1)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    b = p.add_argument_group("one box or two: the draft in the target's process or on a node")
    b.add_argument("--node-draft-tps", metavar="TPS",
                   help="the draft's speed on a box of its own (default: --draft-tps, its "
                   "speed beside the target)")
    b.add_argument("--node-acceptance", metavar="A",
                   help="the acceptance of the draft node's drafts, as --acceptance (default: "
                   "--acceptance; a pipelined node never stops a draft early, so its tokens "
                   "are kept less often than a stopped local draft's)")
    b.add_argument("--prompt-tokens", default="0", metavar="N",
                   help="a request's prompt: the draft reads it before its first draft "
                   "(default 0: a steady run)")
    b.add_argument("--reply-tokens", default="0", metavar="N",
                   help="tokens a request generates, over which that read is spread "
                   "(default 0: a steady run)")
    b.add_argument("--draft-prompt-tps", metavar="TPS",
                   help="the draft's prompt reading speed (default: a batch on the "
                   "--verify-cost curve at the draft's speed)")
    b.add_argument("--target-prompt-tps", metavar="TPS",
                   help="the target's prompt speed: a draft node reads its prompt meanwhile "
                   "(default: no overlap counted)")
    b.add_argument("--bench", metavar="RESULTS",
                   help="a `specwire bench` results.json: the figures not given come from its "
                   "run (plain rate, draft speed, verification curve, the acceptance of its "
                   "local run, prompt and reply lengths)")
    g = p.add_argument_group("a second box: split target (llama.cpp --rpc) or draft node")
    g.add_argument("--rpc-embd", metavar="N",
                   help="the target's hidden size (n_embd, in its GGUF): compare splitting it "
                   "over two boxes with --rpc against a draft node on the second box")
    g.add_argument("--rpc-round-trips", default="2", metavar="R",
                   help="waits of one RTT per decode of the split target (default 2: "
                   "graph_compute and get_tensor)")
    g.add_argument("--rpc-act-bytes", default="4", metavar="B",
                   help="bytes per activation value at the layer boundary (default 4, f32)")
    g.add_argument("--rpc-graph-bytes", default="0", metavar="B",
                   help="graph description bytes sent per decode (default 0)")
    add_measure_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    apply_bench(args)            # --bench and --measure fill the figures not given
    apply_measurement(args)
    inputs = inputs_from_args(args)
    parallel = _int("--parallel", args.parallel)
    if not 1 <= parallel <= 256:
        raise CliError(f"--parallel: must be in 1..256, got {parallel}")
    result = plan(inputs, parallel)
    second = rpc_from_args(args, inputs)
    two = boxes_from_args(args, inputs, parallel)
    if args.json:
        out = result.to_dict()
        out["boxes"] = two.to_dict()
        if second is not None:
            out["second_box"] = {**second.to_dict(), "verdict": second.verdict()}
        print(json.dumps(out, indent=2))
    else:
        print(render(result) + "\n\n"
              + render_boxes(two, inputs, args, result.modes["plain"].tokens_per_s)
              + ("" if second is None else "\n\n" + render_rpc(second)))
    return 0


def boxes_from_args(args: argparse.Namespace, p: PlanInputs,
                    parallel: int = 1) -> boxes.Boxes:
    """One box (p) against two (the node's draft speed), over the acceptance's range when
    it was given as counts, for `parallel` requests at once."""
    node = p if args.node_draft_tps is None else replace(
        p, draft_tps=_positive("--node-draft-tps", args.node_draft_tps))
    node_a = args.acceptance if args.node_acceptance is None else args.node_acceptance
    node = replace(node, acceptance=_acceptance(node_a, "--node-acceptance"))
    return boxes.compare(p, node, _range(args.acceptance), _range(node_a), parallel)


def _range(text: str) -> tuple[float, float] | None:
    """The acceptance's 90% range where it was given as counts."""
    counts = _acceptance_counts(text)
    return boxes.acceptance_range(*counts) if counts else None


def render_boxes(b: boxes.Boxes, p: PlanInputs, args: argparse.Namespace,
                 plain: float | None = None) -> str:
    """One box and two side by side, and the verdict; speedups against `plain` (default:
    the target's plain rate)."""
    node_tps = p.draft_tps if args.node_draft_tps is None else float(args.node_draft_tps)
    request = (f"requests of {p.prompt_tokens} prompt + {p.reply_tokens} reply tokens"
               if p.prompt_tokens and p.reply_tokens else "a steady run (no prompt read)")
    plain = plain or p.target_tps
    rows = [("one box", b.one, f"draft at {p.draft_tps:.4g} tokens/s in the target's process"),
            ("two boxes", b.two, f"draft node at {node_tps:.4g} tokens/s, RTT "
             f"{p.rtt_s * 1e3:g} ms")]
    lines = [f"one box or two ({request}):"]
    for name, side, note in rows:
        lines.append(f"  {name:<10} {side.mode:<12} k={side.k:<3} {side.tokens_per_s:>9.2f} "
                     f"tokens/s {side.tokens_per_s / plain:>6.2f}x   {note}")
    lines.append(f"  verdict: {b.verdict()}")
    return "\n".join(lines)


def apply_bench(args: argparse.Namespace) -> None:
    """Fill the figures not given from a bench run's results.json (--bench)."""
    if getattr(args, "bench", None) is None:
        return
    try:
        with open(args.bench, encoding="utf-8") as f:
            got = bench_figures(json.load(f))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CliError(f"--bench: {args.bench}: {e}") from None
    for name, value in got.items():
        if getattr(args, name, None) in (None, "0") and value is not None:
            setattr(args, name, value)


def bench_figures(results: dict) -> dict[str, str | None]:
    """A bench run's figures as plan's flags: the plain rate over the set, the calibrated
    draft speed and curve, the acceptance of its local run (else its first drafting one)
    and of its remote one as counts (`_judged`), a request's mean prompt and reply, the
    target's prompt rate, its first remote configuration's RTT."""
    records = results["records"]
    cal = results["calibration"]
    drafting = [r for r in records if r["mode"] != "plain" and r.get("draft_n")]
    local = [r for r in drafting if r["mode"] == "local"] or drafting
    out: dict[str, str | None] = {
        "target_tps": repr(cal["plain_tps_overall"]),
        "draft_tps": repr(cal["draft_tps"]) if cal.get("draft_tps") else None,
        "draft_prompt_tps": (repr(cal["draft_prompt_tps"]) if cal.get("draft_prompt_tps")
                             else None),
        "verify_cost": ",".join(f"{n}:{c:g}" for n, c in cal["verify_cost"] or []) or None,
        "acceptance": None, "prompt_tokens": None, "reply_tokens": None}
    remote = [r for m in ("remote-pipelined", "remote-sync") for r in drafting
              if r["mode"] == m]
    if remote:
        out["node_acceptance"] = _judged(remote[0])
    if local:
        r = local[0]
        out["acceptance"] = _judged(r)
        ps = r["prompts"]
        out["prompt_tokens"] = str(round(sum(p["prompt_tokens"] for p in ps) / len(ps)))
        out["reply_tokens"] = str(round(sum(p["generated"] for p in ps) / len(ps)))
    plain = [p for r in records if r["mode"] == "plain" for p in r["prompts"]]
    prompt_s = sum(p["prompt_ms"] for p in plain) / 1000.0
    if prompt_s > 0:
        out["target_prompt_tps"] = repr(sum(p["prompt_tokens"] for p in plain) / prompt_s)
    rtts = [r["rtt_ms"] for r in records if r.get("rtt_ms") is not None]
    if rtts:
        out["rtt"] = f"{rtts[0]:g}ms"
    return out


def rpc_from_args(args: argparse.Namespace, p: PlanInputs) -> rpc.SecondBox | None:
    """--rpc-embd and its fellows -> the second box's comparison (None without it)."""
    if args.rpc_embd is None:
        return None
    n_embd = _int("--rpc-embd", args.rpc_embd)
    if n_embd < 1:
        raise CliError(f"--rpc-embd: must be >= 1, got {n_embd}")
    trips = _parsed("--rpc-round-trips", float, args.rpc_round_trips)
    if not 0.0 <= trips < math.inf:
        raise CliError(f"--rpc-round-trips: must be >= 0, got {args.rpc_round_trips!r}")
    act = _int("--rpc-act-bytes", args.rpc_act_bytes)
    if act < 1:
        raise CliError(f"--rpc-act-bytes: must be >= 1, got {act}")
    link = rpc.RpcLink(n_embd, trips, act, _count("--rpc-graph-bytes", args.rpc_graph_bytes))
    return rpc.compare(p, link)


def render_rpc(s: rpc.SecondBox) -> str:
    """The second box's two uses, with the link figures the split was priced with."""
    mode, k, tps = s.draft_node
    smode, sk, stps = s.split_drafted
    one = s.one_box_tps
    return "\n".join([
        f"a second box (n_embd {s.link.n_embd}, {s.link.round_trips:g} RTT + "
        f"{s.split_bytes / 1024:.1f} KiB per plain decode of the split target):",
        f"  split target (llama.cpp --rpc), alone   {s.split_tps:>9.2f} tokens/s "
        f"({s.split_tps / one:.2f}x the target on one box; link {1e3 * s.split_link_s:.2f} ms "
        "per decode)",
        f"  target on box 1, draft node on box 2    {tps:>9.2f} tokens/s ({tps / one:.2f}x; "
        f"{mode} k={k}; needs the target to fit on box 1)",
        f"  split target, draft node on a 3rd box   {stps:>9.2f} tokens/s ({stps / one:.2f}x; "
        f"{smode} k={sk})",
        f"  verdict: {s.verdict()}",
        "  (a model of the RPC link, not a measurement: see docs/planner.md)",
    ])


def add_measure_args(p: argparse.ArgumentParser) -> None:
    """`--measure` and the model flags it needs (generate's names), in their own group."""
    g = p.add_argument_group("measuring (--measure)")
    g.add_argument("--measure", action="store_true",
                   help="measure target/draft speed, verification cost and acceptance on this "
                   "machine (bundled pair unless -m/-md); flags given explicitly win")
    g.add_argument("--measure-prompts", default="code", metavar="SET",
                   help="prompt set(s) for the measurement (default code)")
    g.add_argument("--measure-limit", type=int, default=4, metavar="N",
                   help="prompts used from each set (default 4)")
    g.add_argument("--measure-n", type=int, default=64, metavar="N",
                   help="tokens generated per prompt (default 64)")
    g.add_argument("-md", "--model-draft", "--spec-draft-model", dest="model_draft",
                   help="draft GGUF (default: the bundled Q2_K draft)")
    add_model_args(p, draft=False)
    add_draft_model_args(g)


def apply_measurement(args: argparse.Namespace) -> None:
    """Fill the figures `plan` was not given from a measurement (--measure), else insist."""
    missing = [f for f in ("target_tps", "draft_tps", "acceptance") if getattr(args, f) is None]
    if not getattr(args, "measure", False):
        if missing:
            flags = ", ".join("--" + f.replace("_", "-") for f in missing)
            raise CliError(f"missing {flags} (or --measure to measure them here)")
        return
    m = calibrate.measure(measure_settings(args))
    print(m.describe(), file=sys.stderr)
    if args.target_tps is None:
        args.target_tps = repr(m.target_tps)
    if args.draft_tps is None:
        args.draft_tps = repr(m.draft_tps)
    if args.acceptance is None:
        args.acceptance = f"{m.draft_n_accepted}/{m.draft_n}" if m.draft_n else "0"
    if args.verify_cost is None:
        args.verify_cost = ",".join(f"{n}:{c:g}" for n, c in m.verify.points)


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Flags -> PlanInputs; any bad value is a CliError naming its flag."""
    verify = VerifyCurve()
    if args.verify_cost:
        verify = _parsed("--verify-cost", VerifyCurve.parse, args.verify_cost)
    draft_max = _int("--draft-max", args.draft_max)
    if not 1 <= draft_max <= 256:
        raise CliError(f"--draft-max: must be in 1..256, got {draft_max}")
    return PlanInputs(
        target_tps=_positive("--target-tps", args.target_tps),
        draft_tps=_positive("--draft-tps", args.draft_tps),
        acceptance=_acceptance(args.acceptance),
        rtt_s=_parsed("--rtt", parse_duration, args.rtt or "1ms"),
        bandwidth_bps=_bandwidth(args.bandwidth),
        draft_bytes=_count("--draft-bytes", args.draft_bytes),
        verdict_bytes=_count("--verdict-bytes", args.verdict_bytes),
        verify=verify,
        draft_max=draft_max,
        prompt_tokens=_count("--prompt-tokens", args.prompt_tokens),
        reply_tokens=_count("--reply-tokens", args.reply_tokens),
        draft_prompt_tps=_optional("--draft-prompt-tps", args.draft_prompt_tps),
        target_prompt_tps=_optional("--target-prompt-tps", args.target_prompt_tps),
    )


def _judged(record: dict) -> str:
    """A bench record's geometric acceptance as counts: the tokens judged were the kept
    ones and one per rejected round (all drafted, where those were not counted)."""
    kept = record["draft_n_accepted"]
    rejected = record.get("rejected_rounds")
    return f"{kept}/{kept + rejected if rejected is not None else record['draft_n']}"


def _optional(flag: str, text: str | None) -> float:
    """A positive rate, or 0 where the flag was not given."""
    return 0.0 if text is None else _positive(flag, text)


def _parsed(flag: str, fn: Callable[[str], T], text: str) -> T:
    try:
        return fn(text)
    except ValueError as e:
        raise CliError(f"{flag}: {e}") from None


def _positive(flag: str, text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise CliError(f"{flag}: not a number: {text!r}") from None
    if not 0.0 < x < math.inf:
        raise CliError(f"{flag}: must be a positive number, got {text!r}")
    return x


def _int(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise CliError(f"{flag}: not an integer: {text!r}") from None


def _count(flag: str, text: str) -> int:
    n = _int(flag, text)
    if n < 0:
        raise CliError(f"{flag}: must be >= 0, got {n}")
    return n


def _acceptance(text: str, flag: str = "--acceptance") -> float:
    """'0.74' or '810/1093' (llama-server's draft_n_accepted / draft_n)."""
    num, sep, den = text.partition("/")
    try:
        a = float(num) / float(den) if sep else float(text)
    except (ValueError, ZeroDivisionError):
        raise CliError(f"{flag}: expected 0..1 or ACCEPTED/DRAFTED, got {text!r}") from None
    if not 0.0 <= a <= 1.0:
        raise CliError(f"{flag}: must be in [0, 1], got {text!r}")
    return a


def _acceptance_counts(text: str) -> tuple[int, int] | None:
    """(accepted, drafted) where --acceptance was given as counts, else None."""
    num, sep, den = text.partition("/")
    if not sep:
        return None
    try:
        accepted, drafted = int(float(num)), int(float(den))
    except ValueError:
        return None
    return (accepted, drafted) if drafted > 0 else None


def _bandwidth(text: str) -> float:
    if text.strip().lower() in ("inf", "unlimited", "none"):
        return math.inf
    bps = _parsed("--bandwidth", parse_bandwidth, text)
    if not bps > 0.0:
        raise CliError(f"--bandwidth: must be > 0, got {text!r}")
    return bps


def render(result: Plan) -> str:
    """The human-readable table."""
    p, cf = result.inputs, result.closed_form
    lines = [
        f"target {p.target_tps:g} tokens/s, draft {p.draft_tps:g} tokens/s, "
        f"acceptance {p.acceptance:.3f}, RTT {p.rtt_s * 1e3:g} ms, "
        f"bandwidth {_bits(p.bandwidth_bps)}",
        f"verify cost: {p.verify.describe()}",
        *([f"{result.parallel} requests decoding together: tokens/s summed over them "
           "(each step of the target and of the draft holds all of them)"]
          if result.parallel > 1 else []),
        "",
        f"{'mode':<12} {'best k':>6} {'tokens/s':>9} {'speedup':>8} {'of bound':>8}",
    ]
    bound = result.bound
    for name in MODES:
        m = result.modes[name]
        share = f"{m.tokens_per_s / bound.tokens_per_s:>8.2f}" if bound else f"{'-':>8}"
        lines.append(f"{name:<12} {m.k:>6} {m.tokens_per_s:>9.2f} {m.speedup:>7.2f}x {share}"
                     f"   {_MODE_NOTES[name]}")
    if bound:
        lines.append(f"{'bound':<12} {bound.k:>6} {bound.tokens_per_s:>9.2f} "
                     f"{bound.speedup:>7.2f}x {1.0:>8.2f}   a free, instant drafter with this "
                     "acceptance (only verification costs)")
    k_real = "inf" if math.isinf(cf.k_real) else f"{max(cf.k_real, 0.0):.2f}"
    lines += [
        "",
        f"TK-SLT closed form (verify = 1 step, no RTT): L = {cf.cost:.3f}, "
        f"k* = {cf.k} (real {k_real}), speedup {cf.speedup:.2f}x",
        f"verdict: {result.verdict}",
    ]
    return "\n".join(lines)


def _bits(bps: float) -> str:
    if math.isinf(bps):
        return "unlimited"
    for scale, unit in ((1e9, "Gbit/s"), (1e6, "Mbit/s"), (1e3, "kbit/s")):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} bit/s"
