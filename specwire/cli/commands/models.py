"""`specwire models`: prepare and locate the bundled GGUF pair, or quantize a draft.

    specwire models                      prepare the bundled pair, list paths and sizes
    specwire models --verify             same, re-hashing every file (rebuilds bad ones)
    specwire models path target|draft|base|f16      print one path (prepared if needed)
    specwire models make-draft --from X.gguf --type Q2_K [--embedding-type Q4_0|none] -o Y.gguf
    specwire models make-moe             build the tiny MoE target and its Q5_0 draft (cached)
    specwire models path moe|moe-draft   print one of those paths (built if needed)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specwire.assets import models
from specwire.assets import moe as moe_fixture
from specwire.backend.base import BackendError
from specwire.cli.args import CliError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="prepare the bundled models, or quantize a draft",
                       description=__doc__.splitlines()[0],
                       epilog=f"cache folder: $SPECWIRE_HOME or ~/.cache/specwire "
                       f"(now {models.home()}); files are checked by size and recipe "
                       "against the cache's manifest.json, by sha256 with --verify.")
    p.add_argument("--verify", action="store_true",
                   help="re-hash every cached file against the manifest (rebuild mismatches)")
    p.add_argument("--f16", action="store_true", help="also prepare the F16 variant")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    sp = p.add_subparsers(dest="models_cmd", metavar="ACTION")
    path = sp.add_parser("path", help="print the path of one bundled model")
    path.add_argument("role", choices=[*models.RECIPES, *MOE_ROLES])
    md = sp.add_parser("make-draft", help="quantize a GGUF with llama.cpp's quantizer",
                       description="Requantize a GGUF (already quantized inputs allowed). "
                       f"Types: {', '.join(models.valid_qtypes())}.")
    md.add_argument("--from", dest="src", required=True, metavar="X.gguf", help="input GGUF")
    md.add_argument("--type", dest="qtype", default="Q2_K", help="quantization (default Q2_K)")
    md.add_argument("--embedding-type", default="Q4_0",
                    help="token-embedding tensor type, or 'none' for llama.cpp's choice "
                    "(default Q4_0: a K-quant cannot hold Gemma's 640-wide rows)")
    md.add_argument("-o", "--output", required=True, metavar="Y.gguf", help="output GGUF")
    md.add_argument("-t", "--threads", type=int, default=None, help="default: all CPUs")
    sp.add_parser("make-moe", help="build the tiny MoE test model (Gemma tokenizer) and its "
                  "quantized draft", description=moe_fixture.__doc__.splitlines()[0])
    p.set_defaults(func=run)


MOE_ROLES = ("moe", "moe-draft")


def run(args: argparse.Namespace) -> int:
    progress = not args.no_progress
    try:
        if args.models_cmd == "path" and args.role in MOE_ROLES:
            pair = moe_fixture.ensure_moe(progress=progress)
            print(pair.target if args.role == "moe" else pair.draft)
        elif args.models_cmd == "path":
            print(models.ensure_model(args.role, progress))
        elif args.models_cmd == "make-moe":
            pair = moe_fixture.ensure_moe(progress=progress)
            for role, path in (("moe", pair.target), ("moe-draft", pair.draft)):
                print(f"{role:<9} {path}  {models.human_size(path.stat().st_size):>10}")
        elif args.models_cmd == "make-draft":
            _make_draft(args, progress)
        else:
            _prepare(args.verify, args.f16, progress)
    except (BackendError, ValueError) as e:
        raise CliError(str(e)) from None
    return 0


def _prepare(verify: bool, f16: bool, progress: bool) -> None:
    roles = ["target", "draft", "base"] + (["f16"] if f16 else [])
    paths = models.ensure_models(roles, progress, verify)
    width = max(len(str(p)) for p in paths.values())
    for role, path in paths.items():
        print(f"{role:<7} {str(path):<{width}}  {models.human_size(path.stat().st_size):>10}")
    if verify:
        print("sha256 verified", file=sys.stderr)


def _make_draft(args: argparse.Namespace, progress: bool) -> None:
    etype = None if args.embedding_type.lower() == "none" else args.embedding_type
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be at least 1")
    out = models.make_draft(Path(args.src), Path(args.output), args.qtype, etype,
                            args.threads, progress=progress)
    print(f"{out}  {models.human_size(out.stat().st_size)}")
