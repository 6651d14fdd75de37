"""--rpc: a target spread over llama.cpp rpc-servers, with and without a draft.

The default llama-cpp-python build has no RPC backend (test_serve_flags checks the one line
that says so). Where it has one and llama.cpp's rpc-server is at hand (SPECWIRE_RPC_SERVER,
or ggml-rpc-server / rpc-server on the PATH), the target's layers go to an rpc-server on
this machine, and the output must be the same with the draft as without it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PROMPT = "def fibonacci(n):\n    "


def _rpc_server() -> str | None:
    return (os.environ.get("SPECWIRE_RPC_SERVER") or shutil.which("ggml-rpc-server")
            or shutil.which("rpc-server"))


def _supports_rpc() -> bool:
    from llama_cpp import llama_supports_rpc
    return bool(llama_supports_rpc())


needs_rpc = pytest.mark.skipif(not (_rpc_server() and _supports_rpc()),
                               reason="needs llama-cpp-python built with GGML_RPC and an "
                               "rpc-server (SPECWIRE_RPC_SERVER)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def rpc_endpoint(tmp_path):
    port = _free_port()
    log = open(tmp_path / "rpc-server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([_rpc_server(), "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    try:
        yield f"127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def _generate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specwire", "generate", *flags, "-n", "24",
                           "--temp", "0", "-t", "1", "-td", "1", PROMPT],
                          capture_output=True, text=True, timeout=600)


@needs_rpc
def test_a_target_on_an_rpc_server_gives_the_same_tokens_with_and_without_a_draft(
        rpc_endpoint) -> None:
    endpoint, pid = rpc_endpoint
    plain = _generate("--rpc", endpoint, "-ngl", "99", "--no-draft")
    drafted = _generate("--rpc", endpoint, "-ngl", "99", "--draft-max", "4")
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert drafted.returncode == 0, drafted.stderr[-2000:]
    assert drafted.stdout == plain.stdout and plain.stdout.strip()
    # the target's weights (the bundled F32 model, 1.08 GB) were on the rpc-server
    status = Path(f"/proc/{pid}/status").read_text()
    peak_kb = int(next(line.split()[1] for line in status.splitlines()
                       if line.startswith("VmHWM:")))
    assert peak_kb > 800_000, f"the rpc-server peaked at {peak_kb} kB: no weights on it"


@needs_rpc
def test_an_endpoint_that_is_no_rpc_server_is_one_line_and_no_abort() -> None:
    with socket.socket() as s:      # listens, never speaks the RPC protocol
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "specwire", "generate", "--rpc",
                            f"127.0.0.1:{port}", "-n", "2", "x"], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"--rpc 127.0.0.1:{port}: " in r.stderr
