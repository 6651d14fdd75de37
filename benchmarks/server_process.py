"""One benchmark server as its own process: `specwire serve` or llama.cpp's `llama-server`.

The concurrency benchmark compares servers through the same HTTP API, so each
runs as a separate process started the same way (same model, slots, threads and
draft length), is used only once /health answers 200, and ends with its whole
process group: a benchmark that leaves a server behind loads the machine the next
figure is measured on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True, slots=True)
class ServerFlags:
    """What both servers get, in llama.cpp's terms: -m, -md, -np, -t, -td, -c, --draft-max.

    ctx is per slot: specwire gives every slot its own context of -c tokens, llama-server
    splits -c among its slots, so it is passed -c ctx * parallel."""

    target: str
    draft: str | None
    parallel: int
    threads: int
    threads_draft: int
    ctx: int
    draft_max: int


def specwire_command(flags: ServerFlags, port: int, extra: list[str]) -> list[str]:
    """`specwire serve` with these flags. `-P`: `python -m` puts the working directory
    ahead of PYTHONPATH, so without it a run started inside one tree would serve that
    tree's code under every --specwire-root."""
    cmd = [sys.executable, "-P", "-m", "specwire", "serve", "--host", "127.0.0.1",
           "--port", str(port), "-m", flags.target, "-c", str(flags.ctx), "-t", str(flags.threads),
           "-np", str(flags.parallel), "--queue-size", "256", "--no-webui"]
    if flags.draft is None:
        return [*cmd, "--no-draft", *extra]
    return [*cmd, "-md", flags.draft, "-td", str(flags.threads_draft),
            "--draft-max", str(flags.draft_max), *extra]


def llama_server_command(binary: str, flags: ServerFlags, port: int,
                         extra: list[str]) -> list[str]:
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "-m", flags.target,
           "-c", str(flags.ctx * flags.parallel), "-t", str(flags.threads),
           "-np", str(flags.parallel), "--no-webui"]
    if flags.draft is None:
        return [*cmd, *extra]
    # this llama.cpp drafts only with a --spec-type, and removed --draft-max
    return [*cmd, "-md", flags.draft, "--spec-type", "draft-simple",
            "-td", str(flags.threads_draft), "--spec-draft-n-max", str(flags.draft_max), *extra]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy; the message ends with its log's tail."""


class ServerProcess:
    """A server subprocess in its own session, its output in a log file."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path,
                 env: dict[str, str] | None = None, health: str = "/health") -> None:
        """health: the path that answers 200 once it serves (a draft node's metrics port
        has /metrics only)."""
        self.name, self.cmd, self.log_path, self.health = name, cmd, log_path, health
        self.url = f"http://127.0.0.1:{port}"
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> None:
        """Start it and wait until GET health answers 200 (llama-server: 503 while loading)."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=self.env,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerStartError(f"{self.name} exited with {self.proc.returncode}: "
                                       f"{' '.join(self.cmd)}\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.health, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(f"{self.name} not healthy after {timeout:.0f} s: "
                                       f"{' '.join(self.cmd)}\n{self.log_tail()}")
            time.sleep(0.25)

    def cpu_s(self) -> float | None:
        """CPU seconds (user + system, every thread) the server process has used so far,
        from /proc; None where that cannot be read."""
        if self.proc is None:
            return None
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace` seconds; idempotent."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(10)

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)      # its own session: only what it started
