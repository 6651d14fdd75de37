"""`specwire bench`: measure speculation against plain decoding on prompt sets.

One invocation runs plain decoding plus any of local, remote-sync,
remote-pipelined, ngram and llama-server drafting, sweeping draft lengths,
policies, round trips and bandwidths, with fresh caches for every prompt.
It prints a table, writes DIR/results.json and PNG plots. The pieces live in
specwire/bench/ (prompts, runner, modes, report, plots, predict, sweep).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path

from specwire.backend.base import BackendError
from specwire.bench.netemu import parse_bandwidth, parse_duration
from specwire.cli.args import (
    CliError,
    add_emulation_args,
    add_model_args,
    add_sampling_args,
    draft_model_params,
    draft_params,
    emulation_args,
    sampling_params,
    target_params,
)
from specwire.cli.placement import draft_flag_names, node_flags
from specwire.cli.settings import remote_settings
from specwire.settings import BenchSettings

QUICK = {"prompts": "code", "limit": 6, "n_predict": 64, "modes": "plain,local,local-pipelined"}
DEFAULTS = {"prompts": "code,prose,qa", "limit": None, "n_predict": None, "modes": "plain,local"}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="benchmark speculative decoding against plain decoding",
        description=__doc__.splitlines()[0], conflict_handler="resolve",
        epilog="Examples: specwire bench --quick;  specwire bench --prompts code,qa "
        "--modes plain,local,remote-sync,remote-pipelined,ngram --rtt 0.2ms,2ms,20ms "
        "--draft-max 4,8 --out bench-out;  several requests in flight against specwire serve "
        "and llama-server: python -m benchmarks.concurrency --help")
    g = p.add_argument_group("benchmark")
    g.add_argument("--prompts", default=None, metavar="SETS",
                   help="JSONL files or shipped sets (code, prose, qa), comma separated "
                   "(default code,prose,qa)")
    g.add_argument("--limit", type=int, default=None, metavar="N",
                   help="first N prompts of each set")
    g.add_argument("--modes", default=None,
                   help="comma list of plain, local, local-pipelined, remote-sync, "
                   "remote-pipelined, ngram, ngram-classic, random, hybrid, hybrid-pipelined, "
                   "llama-server (default plain,local; plain always runs as the reference)")
    g.add_argument("-n", "--n-predict", type=int, default=None,
                   help="tokens per prompt (default: each prompt's max_tokens, else 128)")
    g.add_argument("--rtt", default=None,
                   help="round trips of the emulated link for remote modes, comma list "
                   "(e.g. 0.2ms,2ms,20ms; bare number = ms; default 2ms; under --emulate "
                   "emulated time, default the preset's)")
    g.add_argument("--bandwidth", default="inf",
                   help="link bandwidths, comma list (e.g. 1gbit,100mbit; default inf)")
    g.add_argument("--quick", action="store_true",
                   help="code set, 6 prompts, -n 64, modes plain,local (explicit flags win)")
    g.add_argument("--out", default="bench-out", metavar="DIR",
                   help="folder for results.json and the plots (default bench-out)")
    g.add_argument("--llama-server", metavar="URL",
                   help="llama-server drafting over the emulated link (mode llama-server)")
    g.add_argument("--ignore-eos", action="store_true", help="always generate -n tokens")
    g.add_argument("--chat-template", default=None, metavar="NAME",
                   help="template for prompts given as chat messages (llama.cpp names)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    g.add_argument("--shared-cpus", action="store_true",
                   help="let the target and the draft node it starts share every CPU (default: "
                        "remote modes run them on disjoint halves, as two machines would)")
    g.add_argument("--config-major", action="store_true",
                   help="run each configuration over all prompts in turn (default: each prompt "
                        "under every configuration in turn, so machine drift hits all alike)")
    add_model_args(p)
    add_sampling_args(p)
    add_emulation_args(p)
    d = p.add_argument_group("sweep (comma lists)")
    d.add_argument("--draft-max", "--spec-draft-n-max", "--draft", "--draft-n", dest="draft_max",
                   default="8",
                   help="draft lengths to sweep, e.g. 4,8 (default 8)")
    d.add_argument("--draft-policy", default="fixed",
                   help="policies to sweep: fixed, adaptive or fixed,adaptive (default fixed); "
                   "adaptive runs once, capped at the largest --draft-max")
    d.add_argument("--draft-url", metavar="HOST:PORT",
                   help="a running draft node for the remote modes (default: start one with "
                   "the draft model, -md or the bundled one)")
    # generate's ways to pick one drafter; bench runs every mode named in --modes instead
    for flag in ("--draft-ngram", "--no-draft", "--draft-mode", "--draft-hybrid"):
        p.add_argument(flag, dest=f"unused_{flag[2:].replace('-', '_')}", nargs="?",
                       const=True, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run, temp=0.0, draft_ngram=False, no_draft=False, draft_hybrid=False)


def run(a: argparse.Namespace) -> int:
    from specwire.bench import report, sweep

    settings = settings_from_args(a)
    if not getattr(a, "verbose", False):
        logging.getLogger("specwire.remote").setLevel(logging.WARNING)
    # draft_params() builds one DraftParams; the sweep then replaces n_max and the policy
    one = argparse.Namespace(**{**vars(a), "draft_max": settings.draft_max[0],
                                "draft_policy": settings.policies[0]})
    results = sweep.run(settings, bench_settings(a, settings.modes), sampling_params(a),
                        draft_params(one))
    print(report.render_summary(results))
    files = ["results.json", *(Path(p).name for p in results.get("plots", []))]
    print(f"wrote {', '.join(files)} to {settings.out}", file=sys.stderr)
    return 0


def settings_from_args(a: argparse.Namespace):
    """Flags -> sweep.SweepSettings; --quick fills what was not given; bad values name the flag."""
    from specwire.bench.modes import parse_modes
    from specwire.bench.sweep import SweepSettings

    for flag in ("draft_ngram", "no_draft", "draft_mode", "draft_hybrid"):
        if getattr(a, f"unused_{flag}", None) is not None:
            raise CliError(f"--{flag.replace('_', '-')}: not a bench flag; name the modes to "
                           "run with --modes (plain, local, remote-sync, remote-pipelined, "
                           "ngram, hybrid, llama-server)")
    if a.spec_type is not None:
        raise CliError("--spec-type: not a bench flag; name the modes to run with --modes")
    base = QUICK if a.quick else DEFAULTS
    pick = {k: getattr(a, k) if getattr(a, k) is not None else v for k, v in base.items()}
    if pick["limit"] is not None and pick["limit"] < 1:
        raise CliError(f"--limit: must be >= 1, got {pick['limit']}")
    if pick["n_predict"] is not None and pick["n_predict"] < 1:
        raise CliError(f"-n: must be >= 1, got {pick['n_predict']}")
    modes = parse_modes(pick["modes"])
    if "llama-server" in modes and not a.llama_server:
        raise CliError("mode llama-server needs --llama-server URL")
    return SweepSettings(
        prompts=pick["prompts"], modes=modes, out=Path(a.out), limit=pick["limit"],
        rtts=(_list("--rtt", a.rtt, parse_duration) if a.rtt is not None
              else None if emulation_args(a)[0] is not None else [0.002]),
        bandwidths=_list("--bandwidth", a.bandwidth, _bandwidth),
        draft_max=_list("--draft-max", a.draft_max, _draft_len),
        policies=_list("--draft-policy", a.draft_policy, _policy),
        n_predict=pick["n_predict"], ignore_eos=a.ignore_eos, chat_template=a.chat_template,
        progress=not a.no_progress, plots=not a.no_plots, interleave=not a.config_major)


def bench_settings(a: argparse.Namespace, modes: list[str]) -> BenchSettings:
    """Flags -> the models and links the sweep uses; the draft model only when a mode runs
    it (a missing one is then a CliError, as is a bad placement flag)."""
    from specwire.bench.modes import MODEL_MODES
    from specwire.build import resolve_draft, resolve_target

    try:
        target = target_params(a, resolve_target(a.model))
        draft = (draft_model_params(a, resolve_draft(a.model_draft))
                 if any(m in MODEL_MODES for m in modes) else None)
    except BackendError as e:
        raise CliError(str(e)) from None
    node = ["-c", str(a.ctx_size_draft or a.ctx_size), "-td", str(a.threads_draft),
            "-tbd", str(a.threads_batch_draft), "-ngl", str(a.n_gpu_layers_draft),
            "-ctk", a.cache_type_k_draft, "-ctv", a.cache_type_v_draft, *node_flags(a),
            *(["-s", str(a.seed_draft)] if a.seed_draft is not None else [])]
    flags = {k: "***" if k in SECRETS and v else v for k, v in vars(a).items()
             if k != "func" and _jsonable(v)}
    emu, scale = emulation_args(a)
    return BenchSettings(target, draft, tuple(node), remote_settings(a), a.draft_url,
                         a.llama_server, a.shared_cpus, emu, scale is None, flags,
                         draft_flag_names())


#: Flags whose values must not land in a results file that gets shared.
SECRETS = ("draft_token",)


def _jsonable(v: object) -> bool:
    return v is None or isinstance(v, str | int | float | bool | list)


def _list(flag: str, text: str, parse) -> list:
    """'a,b' -> [parse(a), parse(b)], duplicates dropped, order kept."""
    out = []
    for item in (s.strip() for s in str(text).split(",")):
        if not item:
            continue
        try:
            value = parse(item)
        except ValueError as e:
            raise CliError(f"{flag}: {e}") from None
        if value not in out:
            out.append(value)
    if not out:
        raise CliError(f"{flag}: no value given")
    return out


def _bandwidth(text: str) -> float | None:
    if text.lower() in ("inf", "unlimited", "none"):
        return None
    bps = parse_bandwidth(text)
    return None if math.isinf(bps) else bps


def _draft_len(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None
    if not 1 <= k <= 64:
        raise ValueError(f"must be in 1..64, got {k}")
    return k


def _policy(text: str) -> str:
    if text not in ("fixed", "adaptive"):
        raise ValueError(f"must be fixed or adaptive, got {text!r}")
    return text
