"""Command-line flags shared by generate, serve, draft and bench, with llama.cpp's names.

Each group adds its flags to a parser and builds the matching settings object
from the parsed namespace, so a bad value is refused with the flag's name.
"""

from __future__ import annotations

import argparse
import logging
import os

from specwire.cli import placement as cliplacement
from specwire.config import (
    ROPE_SCALINGS,
    ConfigError,
    DraftParams,
    ModelParams,
    Rope,
    SamplingParams,
    VerifyMode,
)


class CliError(ConfigError):
    """A user error in the flags: printed as one line, exit status 2, no traceback (the
    code below the commands raises ConfigError, which main prints the same way)."""


def add_model_args(p: argparse.ArgumentParser, draft: bool = True) -> None:
    g = p.add_argument_group("target model")
    g.add_argument("-m", "--model", help="target GGUF (default: $LLAMA_ARG_MODEL, else the "
                   "bundled F32 Gemma-3-270M)")
    g.add_argument("-c", "--ctx-size", type=int, default=4096, help="target context size")
    g.add_argument("-t", "--threads", type=int, default=1, help="target threads")
    g.add_argument(
        "-tb", "--threads-batch", type=int, default=0, help="target batch threads (0: = -t)"
    )
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=0,
                   help="target layers on the GPU")
    g.add_argument("-b", "--batch-size", type=int, default=512)
    g.add_argument("-ub", "--ubatch-size", type=int, default=512,
                   help="physical batch size (at most -b)")
    g.add_argument("-ctk", "--cache-type-k", default="f16")
    g.add_argument("-ctv", "--cache-type-v", default="f16")
    cliplacement.add_target_placement_args(g)
    add_rope_args(g)
    g.add_argument("--lora", action="append", default=[], metavar="FNAME[,...]",
                   help="LoRA adapter GGUF applied to the target (scale 1); repeatable, or a "
                   "comma list")
    g.add_argument("--lora-scaled", action="append", default=[], metavar="FNAME:SCALE[,...]",
                   help="LoRA adapter with its scale; repeatable, or a comma list")
    g.add_argument("--lora-init-without-apply", action="store_true",
                   help="load the adapters at scale 0 (POST /lora-adapters sets them)")
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
    if plain:
        add_rope_args(d)
    d.add_argument(
        "--seed-draft", type=int, default=None,
        help="the draft's own sampling seed (default: --seed, which couples draft and target "
        "for the most accepted tokens; output is the target's either way)"
    )


def add_rope_args(g: argparse._ActionsContainer) -> None:
    """llama.cpp's RoPE/YaRN overrides; the in-process draft model gets them too."""
    g.add_argument("--rope-scaling", choices=sorted(ROPE_SCALINGS), default=None,
                   help="RoPE frequency scaling (default: the model's)")
    g.add_argument("--rope-scale", type=float, default=None, metavar="N",
                   help="RoPE context scaling factor: the context grows N times "
                   "(--rope-freq-scale 1/N)")
    g.add_argument("--rope-freq-base", type=float, default=0.0, metavar="N",
                   help="RoPE base frequency (default: the model's)")
    g.add_argument("--rope-freq-scale", type=float, default=0.0, metavar="N",
                   help="RoPE frequency scaling factor: the context grows 1/N times")
    g.add_argument("--yarn-orig-ctx", type=int, default=0, metavar="N",
                   help="YaRN: the model's original context (0: its training context)")
    for name, what in (("ext-factor", "extrapolation mix factor (0.0: full interpolation)"),
                       ("attn-factor", "scale of sqrt(t), the attention magnitude"),
                       ("beta-slow", "high correction dim, or alpha"),
                       ("beta-fast", "low correction dim, or beta")):
        g.add_argument(f"--yarn-{name}", type=float, default=-1.0, metavar="N",
                       help=f"YaRN: {what} (default -1: the model's)")


def lora_params(a: argparse.Namespace) -> tuple[tuple[str, float], ...]:
    """--lora FNAME[,...] (scale 1) and --lora-scaled FNAME:SCALE[,...], in order given."""
    out = [(path, 1.0) for value in getattr(a, "lora", []) or [] for path in value.split(",")
           if path]
    for value in getattr(a, "lora_scaled", []) or []:
        for item in value.split(","):
            path, sep, scale = item.rpartition(":")
            try:
                if not sep or not path:
                    raise ValueError
                out.append((path, float(scale)))
            except ValueError:
                raise CliError(f"--lora-scaled: expected FNAME:SCALE, got {item!r}") from None
    if getattr(a, "lora_init_without_apply", False):
        out = [(path, 0.0) for path, _ in out]
    return tuple(out)


def rope_params(a: argparse.Namespace) -> Rope:
    """--rope-* and --yarn-* -> Rope; --rope-scale N is --rope-freq-scale 1/N."""
    scale = getattr(a, "rope_freq_scale", 0.0)
    rope_scale = getattr(a, "rope_scale", None)
    if rope_scale is not None:
        if not rope_scale > 0:
            raise CliError(f"--rope-scale: must be > 0, got {rope_scale}")
        scale = 1.0 / rope_scale
    return _build(Rope, flags=ROPE_FLAG_OF, scaling=getattr(a, "rope_scaling", None),
                  freq_base=getattr(a, "rope_freq_base", 0.0), freq_scale=scale,
                  yarn_orig_ctx=getattr(a, "yarn_orig_ctx", 0),
                  yarn_ext_factor=getattr(a, "yarn_ext_factor", -1.0),
                  yarn_attn_factor=getattr(a, "yarn_attn_factor", -1.0),
                  yarn_beta_slow=getattr(a, "yarn_beta_slow", -1.0),
                  yarn_beta_fast=getattr(a, "yarn_beta_fast", -1.0))


def add_lookup_cache_arg(p: argparse.ArgumentParser) -> None:
    """--lookup-cache-dynamic (generate, serve): the n-gram drafter's cache as a file;
    --lookup-cache-per-identity: each cache scope's share of it."""
    from specwire.drafters.ngram.cache import DEFAULT_TOKENS as LOOKUP_TOKENS
    p.add_argument("-lcd", "--lookup-cache-dynamic", metavar="FNAME", default=None,
                   help="the n-gram drafter's cache of earlier requests (--draft-ngram, "
                   "--draft-hybrid), kept in FNAME across restarts: loaded at start (none "
                   "yet: an empty cache), saved at the end (serve: also every few requests)")
    p.add_argument("--lookup-cache-per-identity", type=int, default=None, metavar="TOKENS",
                   help="tokens of the n-gram drafter's cache of earlier requests that each "
                   "cache scope (API key and cache_salt) is sure to keep: once the cache is "
                   "full, a scope above it evicts its own oldest requests, then the least "
                   "recently used scope's go (default: a quarter of the cache's "
                   f"{LOOKUP_TOKENS} tokens)")


def add_draft_args(d: argparse._ActionsContainer) -> None:
    """The draft flags: the draft length and verification, pipelining, the link's secrets."""
    _add_draft_length_args(d)
    _add_pipeline_args(d)
    _add_draft_link_args(d)


def _add_draft_length_args(d: argparse._ActionsContainer) -> None:
    """How many tokens a round drafts (--draft-max/-min/-p-min, --draft-policy) and how
    they are verified (--verify, --draft-top-k)."""
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


def _add_pipeline_args(d: argparse._ActionsContainer) -> None:
    """Whether the drafter works ahead of the target, its second choices, and polling."""
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
        "--draft-tree",
        type=_branch_count,
        default=4,
        metavar="N",
        help="pipelined drafting: verify up to N of those second choices beside the draft in "
        "the same target decode (a tree), where the measured verification cost says the "
        "extra tokens pay; the round then keeps whichever path the target takes; with "
        "--draft-hybrid, also its lookup's copy and the model's draft where they differ (0: "
        "chains only; at most 4; one sequence, -np 1)",
    )
    d.add_argument(
        "--draft-no-poll",
        action="store_true",
        help="with a synchronous draft node, sleep until each draft arrives instead of "
        "busy-polling the socket across its forecast arrival (costs about 0.1 ms a round, "
        "saves a core for a few ms of it)",
    )


def _add_draft_link_args(d: argparse._ActionsContainer) -> None:
    """The draft node's shared secret and TLS files."""
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
    g.add_argument("--temp", "--temperature", dest="temp", type=float, default=0.8,
                   help="temperature (0 = greedy)")
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
        rope=rope_params(a),
        loras=lora_params(a),
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
        rope=rope_params(a),
    )


#: llama.cpp's and ik_llama.cpp's drafters that specwire has no counterpart for: the draft
#: model (draft-simple) drafts in their place, with a warning.
OTHER_DRAFT_TYPES = ("draft-eagle3", "draft-mtp", "draft-dflash", "draft-dspark", "mtp",
                     "eagle3")


def spec_type(a: argparse.Namespace) -> str | None:
    """--spec-type -> "model", "ngram" or "none" (None: not given); conflicts refused.

    llama.cpp takes a comma list (ik_llama.cpp: `type:key=value,...`, repeated): the
    first entry decides. A llama.cpp drafter specwire lacks (EAGLE-3, MTP...) drafts with
    the draft model instead, and says so: speculation stays lossless either way."""
    value = getattr(a, "spec_type", None)
    if value is None:
        return None
    first = value.split(",")[0].split(":")[0].strip()
    if first in ("draft", "draft-simple"):
        kind = "model"
    elif first.startswith("ngram") or first == "suffix":
        kind = "ngram"
    elif first == "none":
        kind = "none"
    elif first in OTHER_DRAFT_TYPES:
        kind = "model"
        logging.getLogger("specwire.flags").warning(
            "--spec-type %s: specwire has no such drafter; speculation runs with the draft "
            "model instead (draft-simple: -md, or --draft-url)", first)
    else:
        raise CliError(f"--spec-type: {value!r} is not supported; specwire drafts with "
                       "draft-simple (a draft model), ngram-* (prompt lookup) or none")
    given = [flag for flag, on in (("-md", getattr(a, "model_draft", None)),
                                   ("--draft-url", getattr(a, "draft_url", None)),
                                   ("--draft-ngram", getattr(a, "draft_ngram", False))) if on]
    if kind == "none" and given:
        logging.getLogger("specwire.flags").warning(
            "--spec-type none: %s configured but not used: speculation is off (plain "
            "decoding, as llama.cpp does)", " and ".join(given))
        return kind
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


#: Rope's fields -> their flags.
ROPE_FLAG_OF = {"rope_scaling": "--rope-scaling", "rope_freq_base": "--rope-freq-base",
                "rope_freq_scale": "--rope-freq-scale", "yarn_orig_ctx": "--yarn-orig-ctx"}


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
    """--emulate and its figures, named as `plan`'s (emulate/regimes.py has the presets).

    node (specwire draft): only the draft's figures and the scale the target printed.
    """
    from specwire.emulate.regimes import PRESETS, preset_help

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
    from specwire.emulate.regimes import resolve

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
