"""Keeps the fast suite fast: a test not marked `slow` may not load a GGUF model.

`pytest -m "not slow"` runs on tests/support/fakes.py's fakes in under a minute; loading the
bundled 1 GB target alone takes seconds. So while a test that is not marked slow runs
(its fixtures included), this plugin fails it if it

* loads a model in this process (llama.cpp's model loader, which `load_model`,
  `LlamaBackend` and llama-cpp-python's `Llama` all reach), even where the code
  under test catches the error, or from another thread; or
* starts a process that loads one: `specwire generate|serve|draft|bench` (--help aside)
  or a llama.cpp binary (`llama-*`); the process is never started.

A test marked slow, or in a module with `pytestmark = pytest.mark.slow`, is let through.
Registered by tests/conftest.py; `-p fast_guard` adds it to another pytest run.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import threading
from collections.abc import Callable, Sequence

import llama_cpp
import llama_cpp.llama_cpp as llama_low
import pytest

#: `specwire` sub-commands that load a model (unless asked for --help).
MODEL_COMMANDS = frozenset({"generate", "serve", "draft", "bench"})
#: llama.cpp's model loaders, as llama-cpp-python exports them (module, name).
LOADERS = tuple((module, name) for module in (llama_low, llama_cpp)
                for name in ("llama_model_load_from_file", "llama_load_model_from_file")
                if hasattr(module, name))

_running: list[pytest.Item] = []       # the test being run (a stack: pytester nests runs)
_violations: dict[str, list[str]] = {}  # nodeid -> what it did, until reported
_lock = threading.Lock()
_installed: list[tuple[object, str, object]] = []
_users = 0


def model_command(args: str | bytes | os.PathLike | Sequence) -> str | None:
    """What in a command line loads a model: 'specwire serve', 'llama-server'... or None."""
    if isinstance(args, (str, bytes, os.PathLike)):
        argv = shlex.split(os.fsdecode(args))
    else:
        argv = [os.fsdecode(a) for a in args]
    for i, arg in enumerate(argv):
        name = os.path.basename(arg)
        if name.startswith("llama-") and not _script(arg):
            return name
        if name == "specwire" and (i == 0 or argv[i - 1] == "-m"):
            rest = argv[i + 1:]
            command = next((a for a in rest if not a.startswith("-")), None)
            if command in MODEL_COMMANDS and not {"-h", "--help"} & set(rest):
                return f"specwire {command}"
    return None


def _script(path: str) -> bool:
    """A stand-in written as a script (#!), as tests write for llama.cpp's binaries: it
    loads no model. Real llama.cpp binaries are compiled."""
    try:
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def _check(what: str) -> None:
    """Fail the running test if it is not marked slow; record it so it fails even if
    the code under test swallows the error."""
    with _lock:
        item = _running[-1] if _running else None
        if item is None or item.get_closest_marker("slow") is not None:
            return
        message = (f"{item.nodeid} is not marked slow but {what}: mark it slow "
                   "(@pytest.mark.slow, or pytestmark = pytest.mark.slow for a whole module), "
                   "or test it on tests/support/fakes.py's fakes")
        _violations.setdefault(item.nodeid, []).append(message)
    pytest.fail(message, pytrace=False)


def _guard_loader(load: Callable) -> Callable:
    def guarded(path, *args, **kw):
        _check(f"loads a GGUF model ({os.fsdecode(path)})")
        return load(path, *args, **kw)
    guarded.__wrapped__ = load
    return guarded


def _guard_popen(init: Callable) -> Callable:
    def guarded(self, args, *rest, **kw):
        command = model_command(args)
        if command is not None:
            _check(f"starts `{command}`, which loads a model")
        init(self, args, *rest, **kw)
    guarded.__wrapped__ = init
    return guarded


def _install() -> None:
    global _users
    _users += 1
    if _users > 1:
        return
    targets = [(module, name, _guard_loader) for module, name in LOADERS]
    targets.append((subprocess.Popen, "__init__", _guard_popen))
    for owner, name, wrap in targets:
        original = getattr(owner, name)
        _installed.append((owner, name, original))
        setattr(owner, name, wrap(original))


def _uninstall() -> None:
    global _users
    _users -= 1
    if _users > 0:
        return
    while _installed:
        owner, name, original = _installed.pop()
        setattr(owner, name, original)


def pytest_configure(config: pytest.Config) -> None:
    _install()


def pytest_unconfigure(config: pytest.Config) -> None:
    _uninstall()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    with _lock:
        _running.append(item)
    try:
        yield
    finally:
        with _lock:
            _running.remove(item)
            _violations.pop(item.nodeid, None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    with _lock:
        messages = _violations.pop(item.nodeid, None)
    if messages and not report.failed:
        report.outcome = "failed"
        report.longrepr = "\n".join(messages)
