"""`specwire` entry point: one sub-command per module under specwire.cli.commands.

User errors (bad flags, missing files, incompatible models) print one line
naming the problem and exit with status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from specwire.backend.base import BackendError
from specwire.cli.args import CliError
from specwire.config import ConfigError

COMMANDS = ("generate", "models", "draft", "serve", "bench", "plan")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specwire", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"specwire.cli.commands.{name}").register(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (CliError, ConfigError, BackendError) as e:
        print(f"specwire {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
