"""`python -m specwire serve` as a real process: on a free port, waited for until healthy,
stopped at the end."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def run_serve(*flags: str, no_traceback: bool = False,
              https: str | None = None) -> Iterator[tuple[str, Callable]]:
    """`python -m specwire serve` on a free port with these flags, once healthy: yields its
    URL and a reader of its log so far. no_traceback: its log, once stopped, has none.
    https: the CA file to trust, for a server started with --ssl-*-file."""
    port = _free_port()
    cmd = [sys.executable, "-m", "specwire", "serve", "--port", str(port), *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    url = f"{'https' if https else 'http'}://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        def text() -> str:
            log.seek(0)
            return log.read().decode(errors="replace")

        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            _wait_healthy(proc, url, log,
                          verify=ssl.create_default_context(cafile=https) if https else True)
            yield url, text
        finally:
            stop_process(proc)
        if no_traceback:
            assert "Traceback" not in text(), text()[-3000:]


def stop_process(proc: subprocess.Popen) -> None:
    """Ask a server process to end; kill it if it has not within 15 s."""
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log, timeout: float = 180,
                  verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"server exited ({proc.returncode}):\n{log.read().decode()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=1, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail("server did not become healthy")
        time.sleep(0.2)
