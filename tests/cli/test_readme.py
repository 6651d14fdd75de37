"""The README's commands work, so that the documentation cannot drift from the code.

Every fenced ```bash block of README.md is read as a user would type it
(continuation lines joined, comments dropped, `a && b` as two commands), and
each command is treated by what it needs:

* `pip install ...` made the environment this test runs in: not repeated;
* `python -m pytest` is the suite this test belongs to: not repeated;
* a command that needs what only the user has (a GGUF that is not here, another
  machine's address) or minutes of benchmarking: its program's `--help` must
  list every flag the command names;
* anything else runs (on the bundled models: slow) and must exit 0. A command
  ending in `&` starts a server in the background; the block's later commands
  talk to it, and its port is swapped for a free one throughout the block so
  that the test never meets a server already running there.

The specwire and benchmarks commands of docs/ and benchmarks/*.md get the `--help` check.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import runpy
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx
import pytest
from serve_process import stop_process

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LOCAL_HOSTS = {"localhost", "127.0.0.1", "[::1]"}
@dataclass(frozen=True, slots=True)
class Command:
    text: str
    background: bool = False

    @property
    def words(self) -> list[str]:
        """The command's own words: leading VAR=value settings dropped, and anything after a
        pipe, redirection or list operator, which belongs to another command."""
        words = shlex.split(self.text)
        while words and re.fullmatch(r"[A-Za-z_]\w*=.*", words[0]):
            words.pop(0)
        for i, w in enumerate(words):
            if w in {"|", "||", ";", "&&"} or re.match(r"\d?[<>]", w):
                return words[:i]
        return words

    @property
    def program(self) -> list[str]:
        """How to ask this command's program for --help (empty: not ours)."""
        w = self.words
        if w[0] == "specwire":
            return ["specwire", w[1]] if len(w) > 1 and not w[1].startswith("-") else ["specwire"]
        if len(w) > 2 and w[:2] == ["python", "-m"] and w[2].startswith(("specwire",
                                                                          "benchmarks.")):
            return w[:3]
        return []

    @property
    def flags(self) -> list[str]:
        """The flags after the program's own words (`python -m`'s `-m` is not one)."""
        return [w.split("=", 1)[0] for w in self.words[len(self.program):]
                if w.startswith("-") and len(w) > 1 and not re.fullmatch(r"-[\d.]+", w)]

    def kind(self) -> str:
        w = self.words
        if w[:2] == ["pip", "install"]:
            return "installed"
        if w[:3] == ["python", "-m", "pytest"]:
            return "the suite"
        if self.program[:2] == ["specwire", "bench"] or self.elsewhere():
            return "help"
        return "run"

    def elsewhere(self) -> bool:
        """Names a model file that is not here, or another machine."""
        w = self.words
        missing = any(x.endswith(".gguf") and not (ROOT / x).exists() for x in w)
        hosts = [_host(w[i + 1]) for i, x in enumerate(w[:-1]) if x == "--draft-url"]
        return missing or any(h not in LOCAL_HOSTS for h in hosts)


def _host(url: str) -> str:
    return re.sub(r"^\w+://", "", url).rsplit(":", 1)[0]


def bash_blocks(path: Path) -> list[list[Command]]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S):
        body = m.group(1).replace("\\\n", " ")
        cmds = []
        for line in body.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            background = line.endswith("&") and not line.endswith("&&")
            for part in line.rstrip("&").split(" && "):
                cmds.append(Command(part.strip(), background))
        out.append(cmds)
    return out


BLOCKS = bash_blocks(README)


def _help_cases(blocks: list[list[Command]], where: str) -> list:
    cases = []
    for cmd in (c for b in blocks for c in b):
        if not cmd.program or (where == "README" and cmd.kind() != "help"):
            continue
        for flag in dict.fromkeys(cmd.flags):
            cases.append(pytest.param(cmd.program, flag,
                                      id=f"{where}:{' '.join(cmd.program)} {flag}"))
    return cases


def _docs_blocks() -> list[list[Command]]:
    pages = [*sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
    return [b for page in pages for b in bash_blocks(page)]


def _argv(words: list[str]) -> list[str]:
    """Run `specwire` and `python` as this interpreter, so the tree under test is used."""
    if words[0] == "specwire":
        return [sys.executable, "-m", "specwire", *words[1:]]
    if words[0] == "python":
        return [sys.executable, *words[1:]]
    return words


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@functools.cache
def _help(program: tuple[str, ...]) -> str:
    """`PROGRAM --help`, in this process (argparse prints the same text; a start-up each
    would cost the fast suite seconds)."""
    argv = _argv([*program, "--help"])
    assert argv[0] == sys.executable and argv[1] == "-m", argv
    out = io.StringIO()
    with (contextlib.redirect_stdout(out), mock.patch.object(sys, "argv", argv[2:]),
          pytest.raises(SystemExit) as end):
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    assert end.value.code in (0, None), out.getvalue()
    return out.getvalue()


# -------------------------------------------------------------------------------- the tests


def test_readme_starts_with_the_commands_ci_runs() -> None:
    first = [c.text for c in BLOCKS[0]]
    assert first[:2] == ["pip install -e .", 'specwire generate "def fibonacci(n):"']
    assert first[2:] == ["pip install -e '.[test]'", "python -m pytest -q"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -e '.[test]' && python -m pytest -q" in ci


def test_every_readme_command_is_checked_somehow() -> None:
    kinds = {c.text: c.kind() for b in BLOCKS for c in b}
    assert set(kinds.values()) <= {"installed", "the suite", "help", "run"}
    assert "help" in kinds.values() and "run" in kinds.values()
    two_box = [t for t, k in kinds.items() if k == "help" and "draft" in t]
    assert two_box, "the two-box deployment is not in a bash block"


@pytest.mark.parametrize(("program", "flag"), _help_cases(BLOCKS, "README")
                         + _help_cases(_docs_blocks(), "docs"))
def test_named_flag_is_in_help(program: list[str], flag: str) -> None:
    text = _help(tuple(program))
    assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), \
        f"{' '.join(program)} --help does not list {flag}"


def _runnable() -> list:
    cases = []
    for i, block in enumerate(BLOCKS):
        cmds = [c for c in block if c.kind() == "run"]
        if cmds:
            cases.append(pytest.param(cmds, id=f"block{i}:{cmds[0].text[:40]}",
                                      marks=pytest.mark.slow))
    return cases


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _with_port(cmds: list[Command]) -> list[Command]:
    servers = [c for c in cmds if c.background]
    if not servers:
        return cmds
    w = servers[0].words
    old = w[w.index("--port") + 1] if "--port" in w else "8080"
    new = str(_free_port())
    return [Command(re.sub(rf"(--port |:){old}\b", rf"\g<1>{new}", c.text), c.background)
            for c in cmds]


def _wait_healthy(proc: subprocess.Popen, port: str, log: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    pytest.fail("server did not become healthy")


@pytest.mark.parametrize("cmds", _runnable())
def test_readme_block_runs(cmds: list[Command], tmp_path: Path) -> None:
    """Run in a scratch directory, so that nothing lands in the checkout."""
    cmds = _with_port(cmds)
    servers: list[subprocess.Popen] = []
    try:
        for cmd in cmds:
            if cmd.background:
                log = tmp_path / "server.log"
                with open(log, "wb") as out:
                    proc = subprocess.Popen(_argv(cmd.words), cwd=tmp_path, env=_env(),
                                            stdout=out, stderr=subprocess.STDOUT)
                servers.append(proc)
                w = cmd.words
                _wait_healthy(proc, w[w.index("--port") + 1] if "--port" in w else "8080", log)
                continue
            r = subprocess.run(_argv(cmd.words), cwd=tmp_path, env=_env(), capture_output=True,
                               text=True, timeout=600)
            assert r.returncode == 0, f"{cmd.text}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
            assert r.stdout.strip(), f"{cmd.text} printed nothing"
            assert '"error"' not in r.stdout, f"{cmd.text}\n{r.stdout[-2000:]}"
    finally:
        for proc in servers:
            stop_process(proc)
