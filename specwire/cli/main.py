"""`specwire` entry point: one sub-command per module under specwire.cli.commands.

User errors (bad flags, missing files, incompatible models) print one line
naming the problem and exit with status 2; tracebacks are for bugs only.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# llama.cpp's libraries (a CUDA build's included) are loaded before numpy's: with numpy
# imported first, loading an F16 model at -ngl 99 crashed (SIGSEGV) on an H200, and the
# same load in the other order worked (issue 36; docs/deployment.md). llama_cpp's package
# loads its libraries, then imports numpy itself.
import llama_cpp.llama_cpp  # noqa: F401

from specwire.backend.base import BackendError
from specwire.cli.args import CliError
from specwire.config import ConfigError

COMMANDS = ("generate", "models", "draft", "serve", "bench", "plan")


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser with llama.cpp's reading of flags: a flag is a whole word.

    argparse would read `-no-ooae` as `-n o-ooae` (a short flag with its value attached)
    and `--meta` as `--metrics` (an abbreviation); llama.cpp does neither, so neither is
    done here: an unknown single-dash word is refused by name.
    """

    def __init__(self, *a, **kw) -> None:
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)

    def _parse_optional(self, arg_string: str):  # noqa: ANN202 - argparse's own hook
        if (len(arg_string) > 2 and arg_string[0] == "-" and arg_string[1] != "-"
                and "=" not in arg_string and " " not in arg_string
                and arg_string not in self._option_string_actions
                and not self._negative_number_matcher.match(arg_string)):
            self.error(f"unrecognized argument: {arg_string} (a single-dash flag is one "
                       f"word, as in llama.cpp; {arg_string[:2]} does not take a value "
                       "attached to it)")
        return super()._parse_optional(arg_string)

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201 - argparse's
        return super().parse_known_args(
            None if args is None else self.dashed(args), namespace)

    def dashed(self, args: list[str]) -> list[str]:
        """llama.cpp's reading of a long flag: `_` for `-` (`--backend_sampling`,
        `--ctx_size=512`). Only an unknown spelling whose dashed form is a flag of this
        command is rewritten; a value after `--` is left alone."""
        out = list(args)
        for i, arg in enumerate(out):
            if arg == "--":
                break
            name, eq, value = arg.partition("=")
            if (name.startswith("--") and "_" in name
                    and name not in self._option_string_actions):
                dashed = "--" + name[2:].replace("_", "-")
                if dashed in self._option_string_actions:
                    out[i] = dashed + eq + value
        return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specwire", description=__doc__.splitlines()[0],
                                allow_abbrev=False)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           parser_class=CommandParser)
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
