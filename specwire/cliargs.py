"""Command-line flags shared by generate, serve, draft and bench, with llama.cpp's names.

Each group adds its flags to a parser and builds the matching settings object
from the parsed namespace, so a bad value is refused with the flag's name.
"""

from __future__ import annotations

import argparse
import os

from specwire.cli import placement as cliplacement
from specwire.config import ConfigError, DraftParams, ModelParams, SamplingParams, VerifyMode


class CliError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""


def add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    g = p.add_argument_group("target model")
    g.add_argument("-m", "--model", help="target GGUF (default: the bundled F32 Gemma-3-270M)")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, help="target context size")
    g.add_argument("-t", "--threads", type=int, default=1, help="target threads")
    g.add_argument(
        "-tb", "--threads-batch", type=int, default=0, help="target batch threads (0: = -t)"
    )
    g.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="target layers on the GPU")
    g.add_argument("-b", "--batch-size", type=int, default=512)
    g.add_argument("-ub", "--ubatch-size", type=int, default=512,
                   help="physical batch size (at most -b)")
    g.add_argument("-ctk", "--cache-type-k", default="f16")
    g.add_argument("-ctv", "--cache-type-v", default="f16")
    cliplacement.add_target_placement_args(g)
    if not draft:
        return
    d = p.add_argument_group("draft")
    src = d.add_mutually_exclusive_group()
    src.add_argument(
        "-md", "--model-draft", "--spec-draft-model",
        help="draft GGUF, in this process (default: the bundled Q2_K draft)"
    )
    src.add_argument(
        "--draft-url",
        action="append",
        metavar="HOST:PORT",
        help="remote draft node (gRPC) or llama-server (http://...); repeat for failover",
    )
    src.add_argument(
        "--draft-ngram", action="store_true", help="prompt-lookup n-gram drafter, no model"
    )
    src.add_argument("--no-draft", action="store_true", help="plain target decoding")
    d.add_argument(
        "--spec-type", default=None, metavar="TYPE",
        help="llama.cpp's name for the drafter: draft-simple (a draft model, the default), "
        "ngram-simple (or any ngram-*: prompt lookup), none (plain decoding)"
    )
    d.add_argument(
        "--draft-hybrid", action="store_true",
        help="the n-gram lookup beside the draft model (-md or --draft-url): each round "
        "verifies the draft worth more",
    )
    add_draft_model_args(d)
    add_draft_args(d)


def add_draft_model_args(d: argparse._ActionsContainer, plain: bool = False) -> None:
    """The draft model's flags; `plain` (specwire draft): also under the target's names."""
    def names(*draft_names: str, plain_names: tuple[str, ...] = ()) -> tuple[str, ...]:
        return (*plain_names, *draft_names) if plain else draft_names

    d.add_argument("-cd", "--ctx-size-draft", type=int, default=0, help="draft context (0: = -c)")
    d.add_argument(*names("-td", "--threads-draft", "--spec-draft-threads",
                          plain_names=("-t", "--threads")),
                   dest="threads_draft", type=int, default=1, metavar="N", help="draft threads")
    d.add_argument(*names("-tbd", "--threads-batch-draft", "--spec-draft-threads-batch",
                          plain_names=("-tb", "--threads-batch")),
                   dest="threads_batch_draft", type=int, default=0, metavar="N")
    d.add_argument(*names("-ngld", "--n-gpu-layers-draft", "--gpu-layers-draft",
                          "--spec-draft-ngl", plain_names=("-ngl", "--n-gpu-layers")),
                   dest="n_gpu_layers_draft", type=int, default=0, metavar="N",
                   help="draft layers on the GPU")
    d.add_argument(*names("-ctkd", "--cache-type-k-draft", "--spec-draft-type-k",
                          plain_names=("-ctk", "--cache-type-k")),
                   dest="cache_type_k_draft", default="f16", metavar="TYPE")
    d.add_argument(*names("-ctvd", "--cache-type-v-draft", "--spec-draft-type-v",
                          plain_names=("-ctv", "--cache-type-v")),
                   dest="cache_type_v_draft", default="f16", metavar="TYPE")
    if plain:
        d.add_argument("-b", "--batch-size", dest="batch_size_draft", type=int, default=512,
                       metavar="N")
        d.add_argument("-ub", "--ubatch-size", dest="ubatch_size_draft", type=int, default=512,
                       metavar="N", help="physical batch size (at most -b)")
    cliplacement.add_draft_placement_args(d, plain)
    d.add_argument(
        "--seed-draft", type=int, default=None,
        help="the draft's own sampling seed (default: --seed, which couples draft and target "
        "for the most accepted tokens; output is the target's either way)"
    )


def add_draft_args(d: argparse._ActionsContainer) -> None:
    d.add_argument(
        "--draft-max",
        "--spec-draft-n-max",
        "--draft",
        "--draft-n",
        dest="draft_max",
        type=int,
        default=8,
        help="most draft tokens per round",
    )
    d.add_argument("--draft-min", "--spec-draft-n-min", dest="draft_min", type=int, default=0,
                   help="fewest draft tokens worth verifying")
    d.add_argument(
        "--draft-p-min",
        "--spec-draft-p-min",
        dest="draft_p_min",
        type=float,
        default=0.75,
        help="stop drafting when the draft's top probability is below this (with "
        "--draft-policy fixed; adaptive stops a draft model, local or a synchronous draft "
        "node, by its own calibrated rule; pipelined drafters never stop early)",
    )
    d.add_argument(
        "--verify",
        choices=[m.value for m in VerifyMode],
        default="coupled",
        help="verification at temperature > 0 (greedy is used at --temp 0); rejection "
        "trusts the draft's q (a remote drafter could steer the output), coupled cannot be "
        "steered by any draft",
    )
    d.add_argument("--draft-top-k", type=int, default=8, help="sparse q size in rejection mode")
    d.add_argument(
        "--draft-policy",
        choices=["fixed", "adaptive"],
        default="adaptive",
        help="adaptive (default): each round the draft length with the most expected "
        "tokens/s, up to --draft-max, 0 when drafting does not pay; a draft model (local, "
        "or a synchronous draft node) stops where the next token, by its calibrated "
        "confidence, no longer pays; "
        "fixed: --draft-max, stopped at --draft-p-min",
    )
    d.add_argument(
        "--draft-mode",
        choices=["auto", "pipelined", "sync"],
        default="auto",
        help="pipelined: the drafter works ahead while the target verifies; sync: each waits "
        "for the other (llama.cpp's way). auto: pipelined for a draft node, and for a local "
        "draft model when -t + -td fit the cores",
    )
    d.add_argument(
        "--draft-branches",
        type=_branch_count,
        default=2,
        metavar="N",
        help="pipelined drafting: where the draft is unsure, it also drafts its second "
        "choice a few tokens on, up to N per chunk, so that a rejection there has a draft "
        "at once (0: off; at most 4)",
    )
    d.add_argument(
        "--draft-no-poll",
        action="store_true",
        help="with a synchronous draft node, sleep until each draft arrives instead of "
        "busy-polling the socket across its forecast arrival (costs about 0.1 ms a round, "
        "saves a core for a few ms of it)",
    )
    d.add_argument(
        "--draft-token",
        default=os.environ.get("SPECWIRE_TOKEN"),
        help="shared secret for the draft link (env SPECWIRE_TOKEN)",
    )
    d.add_argument("--draft-tls-ca", help="CA certificate: use TLS to the draft node")
    d.add_argument("--draft-tls-cert", help="client certificate for mutual TLS")
    d.add_argument("--draft-tls-key", help="client key for mutual TLS")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--temp", type=float, default=0.8, help="temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=40)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--min-p", type=float, default=0.05)
    g.add_argument("--repeat-penalty", type=float, default=1.0)
    g.add_argument("--repeat-last-n", type=int, default=64)
    g.add_argument(
        "-s", "--seed", type=int, default=0, help="sampling seed (the draft uses it too)"
    )


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return _build(
        SamplingParams,
        temperature=a.temp,
        top_k=a.top_k,
        top_p=a.top_p,
        min_p=a.min_p,
        repeat_penalty=a.repeat_penalty,
        repeat_last_n=a.repeat_last_n,
        seed=a.seed,
    )


def draft_params(a: argparse.Namespace) -> DraftParams:
    enabled = not getattr(a, "no_draft", False) and getattr(a, "spec_type", None) != "none"
    return _build(
        DraftParams,
        n_max=a.draft_max,
        n_min=a.draft_min,
        p_min=a.draft_p_min,
        mode=a.verify,
        top_k_q=a.draft_top_k,
        policy=a.draft_policy,
        enabled=enabled,
        seed=getattr(a, "seed_draft", None),
    )


def target_params(a: argparse.Namespace, path: str) -> ModelParams:
    try:
        place = cliplacement.placement(a, draft=False)
        fa = cliplacement.flash_attn(a.flash_attn, "-fa")
        numa = cliplacement.numa(getattr(a, "numa", None))
    except cliplacement.PlacementError as e:
        raise CliError(str(e)) from None
    return _build(
        ModelParams,
        path=path,
        n_ctx=a.ctx_size,
        n_threads=a.threads,
        n_threads_batch=a.threads_batch,
        n_gpu_layers=a.n_gpu_layers,
        n_batch=a.batch_size,
        n_ubatch=a.ubatch_size,
        type_k=a.cache_type_k,
        type_v=a.cache_type_v,
        flash_attn=fa,
        placement=place,
        numa=numa,
    )


def draft_model_params(a: argparse.Namespace, path: str) -> ModelParams:
    """The draft's ModelParams; --numa, --no-mmap, --mlock, -sm, -mg, -ts are the target's
    (one process), or the node's own under the same names."""
    try:
        place = cliplacement.placement(a, draft=True)
        fa = cliplacement.flash_attn(getattr(a, "flash_attn_draft", "auto"), "-fad")
        numa = cliplacement.numa(getattr(a, "numa", None))
    except cliplacement.PlacementError as e:
        raise CliError(str(e)) from None
    return _build(
        ModelParams,
        flags=DRAFT_FLAG_OF,
        path=path,
        n_ctx=a.ctx_size_draft or getattr(a, "ctx_size", 4096),
        n_threads=a.threads_draft,
        n_threads_batch=a.threads_batch_draft,
        n_gpu_layers=a.n_gpu_layers_draft,
        n_batch=getattr(a, "batch_size_draft", 512),
        n_ubatch=getattr(a, "ubatch_size_draft", 512),
        type_k=a.cache_type_k_draft,
        type_v=a.cache_type_v_draft,
        flash_attn=fa,
        placement=place,
        numa=numa,
    )


def spec_type(a: argparse.Namespace) -> str | None:
    """--spec-type -> "model", "ngram" or "none" (None: not given); conflicts refused."""
    value = getattr(a, "spec_type", None)
    if value is None:
        return None
    if value in ("draft", "draft-simple"):
        kind = "model"
    elif value.startswith("ngram"):
        kind = "ngram"
    elif value == "none":
        kind = "none"
    else:
        raise CliError(f"--spec-type: {value!r} is not supported; specwire drafts with "
                       "draft-simple (a draft model), ngram-* (prompt lookup) or none")
    clash = {"--draft-ngram": getattr(a, "draft_ngram", False) and kind != "ngram",
             "--no-draft": getattr(a, "no_draft", False) and kind != "none",
             "--draft-url": bool(getattr(a, "draft_url", None)) and kind != "model",
             "-md": bool(getattr(a, "model_draft", None)) and kind != "model"}
    for flag, bad in clash.items():
        if bad:
            raise CliError(f"--spec-type {value} contradicts {flag}")
    return kind


#: settings field -> the flag that sets it, for error messages users can act on.
FLAG_OF = {
    "temperature": "--temp",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repeat_penalty": "--repeat-penalty",
    "repeat_last_n": "--repeat-last-n",
    "seed": "--seed",
    "draft_max": "--draft-max",
    "draft_min": "--draft-min",
    "draft_p_min": "--draft-p-min",
    "draft_top_k": "--draft-top-k",
    "ctx_size": "-c",
    "threads": "-t",
    "threads_batch": "-tb",
    "n_gpu_layers": "-ngl",
    "batch_size": "-b",
    "cache_type_k": "-ctk",
    "cache_type_v": "-ctv",
    "ubatch_size": "-ub",
    "flash_attn": "-fa",
    "numa": "--numa",
    "split_mode": "-sm",
    "main_gpu": "-mg",
    "tensor_split": "-ts",
}
#: the same for the draft model's settings.
DRAFT_FLAG_OF = FLAG_OF | {
    "ctx_size": "-cd",
    "threads": "-td",
    "threads_batch": "-tbd",
    "n_gpu_layers": "-ngld",
    "cache_type_k": "-ctkd",
    "cache_type_v": "-ctvd",
    "flash_attn": "-fad",
}


def _build(cls, flags: dict[str, str] = FLAG_OF, **kw):
    try:
        return cls(**kw)
    except ConfigError as e:
        field, _, rest = str(e).partition(": ")
        raise CliError(f"{flags.get(field, field)}: {rest}") from None


def _branch_count(text: str) -> int:
    """--draft-branches: alternates per chunk, 0..MAX_ALTERNATES (the protocol's limit)."""
    from specwire.link.messages import MAX_ALTERNATES

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 0 <= n <= MAX_ALTERNATES:
        raise argparse.ArgumentTypeError(f"{n} outside 0..{MAX_ALTERNATES}")
    return n


# --------------------------------------------------------------------------- emulation


def add_emulation_args(p: argparse.ArgumentParser, node: bool = False) -> None:
    """--emulate and its figures, named as `plan`'s (backend/regimes.py has the presets).

    node (specwire draft): only the draft's figures and the scale the target printed.
    """
    from specwire.backend.regimes import PRESETS, preset_help

    g = p.add_argument_group(
        "emulation", "hold every real decode until an emulated model would finish it: the "
        "real models compute every token, only time is emulated (docs/benchmarks.md). "
        f"Presets: {preset_help()}")
    g.add_argument("--emulate", choices=sorted(PRESETS), metavar="PRESET",
                   help=f"emulate a deployment: {', '.join(PRESETS)}")
    if not node:
        g.add_argument("--target-tps", type=float, metavar="TPS",
                       help="the emulated target's plain tokens/s (default: the preset's)")
        g.add_argument("--prompt-tps", type=float, metavar="TPS",
                       help="the emulated target's prompt tokens/s (default: the preset's)")
    g.add_argument("--verify-cost", metavar="N:COST,...",
                   help="a batch of N tokens in plain steps, interpolated, e.g. 1:1,8:3 "
                   "(default: the preset's)")
    g.add_argument("--draft-tps", type=float, metavar="TPS",
                   help="the emulated draft's tokens/s (default: the preset's)")
    g.add_argument("--emulate-scale", default=None if node else "auto", metavar="auto|X",
                   help="wall time = emulated time x X; "
                   + ("required with --emulate: the scale the target printed"
                      if node else "auto (default): the smallest that fits this machine's "
                      "real decodes under the emulated times, measured at start-up"))


def emulation_args(a: argparse.Namespace):
    """(Emulation or None, scale or None for auto) from the flags; CliError names the flag."""
    from specwire.backend.regimes import resolve

    target_tps = getattr(a, "target_tps", None)
    given = [f for f, v in (("--verify-cost", a.verify_cost), ("--draft-tps", a.draft_tps),
                            ("--prompt-tps", getattr(a, "prompt_tps", None)))
             if v is not None]
    if a.emulate is None and target_tps is None:
        if given:
            raise CliError(f"{given[0]}: emulates a model; give --emulate PRESET or "
                           "--target-tps")
        return None, None
    try:
        emu = resolve(a.emulate, target_tps, a.verify_cost, getattr(a, "prompt_tps", None),
                      a.draft_tps)
    except ValueError as e:
        raise CliError(str(e)) from None
    scale = a.emulate_scale
    if scale in (None, "auto"):
        return emu, None
    try:
        value = float(scale)
    except ValueError:
        raise CliError(f"--emulate-scale: expected auto or a number, got {scale!r}") from None
    if not 0 < value < 1e4:
        raise CliError(f"--emulate-scale: must be > 0, got {scale}")
    return emu.with_scale(value), value
