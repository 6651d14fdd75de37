"""Shared test set-up: the import path, the fast-suite guard (tests/support/fast_guard.py),
pytester for its own test, the draft link's fixtures (tests/support/wire_helpers.py:
"target", "node", "node_proc"), and `specwire_cli`, which runs `specwire ...` twice over: in
this process (fast) and as a real process (slow).

The tests mirror specwire/'s packages, one folder each, with no __init__.py (pytest's
default import mode: a module is imported by its basename, unique across the tree). Code
that tests share lives in tests/support/, which goes on sys.path before pytest_plugins is
read, so `from fakes import ...` resolves from any folder; a test file imports no other
test file."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

SUPPORT = Path(__file__).resolve().parent / "support"
if str(SUPPORT) not in sys.path:
    sys.path.insert(0, str(SUPPORT))

pytest_plugins = ("fast_guard", "pytester", "wire_helpers")

CliRun = Callable[..., subprocess.CompletedProcess]
for _name in ("LLAMA_ARG_MODEL", "LLAMA_ARG_MODEL_DRAFT"):   # the tests name their own models
    os.environ.pop(_name, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a slow test's fixtures start anything: its target (bundled.py: the F32 file,
    or its Q8_0 copy where marked q8_0) becomes every `specwire` command's default. Fast
    tests load no model and leave it unset."""
    if item.get_closest_marker("slow"):
        import bundled
        bundled.name_target(q8_0=item.get_closest_marker("q8_0") is not None)


def run_in_process(*args: str) -> subprocess.CompletedProcess:
    """`specwire ARGS` through specwire.cli.main in this process, answered as subprocess.run
    answers: an error that escapes main (a traceback in a real process) fails the test."""
    import specwire.cli.main as cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:          # argparse's own errors, --help
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return subprocess.CompletedProcess(["specwire", *args], code, out.getvalue(), err.getvalue())


def run_process(*args: str) -> subprocess.CompletedProcess:
    """`python -m specwire ARGS` as a real process: what the user sees, llama.cpp's own
    writes to stderr included."""
    return subprocess.run([sys.executable, "-m", "specwire", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(params=[pytest.param(run_in_process, id="in-process"),
                        pytest.param(run_process, id="process", marks=pytest.mark.slow)])
def specwire_cli(request: pytest.FixtureRequest) -> CliRun:
    """For command-line errors, which are decided before a model loads: the fast suite
    checks them in this process in milliseconds, the full suite also as real processes
    (a Python start-up each)."""
    return request.param
