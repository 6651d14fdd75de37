"""The live page in a real browser: headless Chromium against `specwire serve` on the bundled
pair, its draft on a `specwire draft` node in another process (as on two boxes).

The page must ask for the API key and show nothing before it has it, then show
the server's figures and its draft node, and show the figures change after a
request (one made by the test, one typed into the page's chat box). The
screenshot is kept as a test artefact: $PYTEST_ARTIFACTS/webui.png, else
tests/artifacts/webui.png.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import bundled
import httpx
import pytest
from browser_helpers import Browser, find_chromium
from serve_process import _free_port, _wait_healthy, stop_process

ROOT = Path(__file__).resolve().parents[2]
KEY = "browser-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TILES = ("tps", "plain", "speedup", "acceptance", "mean-accepted", "served")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_chromium() is None,
                                 reason="needs Debian's chromium (.ci/run installs it)")]


def _start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specwire", *args], cwd=ROOT, stdout=log,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def _wait_listening(proc: subprocess.Popen, port: int, log, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            pytest.fail(f"draft node exited ({proc.returncode}):\n{log.read().decode()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        time.sleep(0.2)
    pytest.fail("the draft node did not listen")


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    from specwire.assets import models
    bundled.target()
    models.default_draft()
    node_port, port = _free_port(), _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as node_log, tempfile.TemporaryFile() as log:
        node = _start(["draft", "--port", str(node_port), "--sync-port", "0", "-td", "1",
                       "-c", "1024"], node_log)
        try:
            _wait_listening(node, node_port, node_log)
            proc = _start(["serve", "--port", str(port), "-t", "1", "-c", "1024",
                           "--api-key", KEY, "--draft-url", f"127.0.0.1:{node_port}"], log)
            try:
                _wait_healthy(proc, url, log)
                yield url
            finally:
                stop_process(proc)
        finally:
            stop_process(node)


def _text(b: Browser, element_id: str) -> str:
    return str(b.js(f"document.getElementById('{element_id}').textContent"))


def _tiles(b: Browser) -> dict[str, str]:
    return {t: _text(b, t) for t in TILES}


def _artifact() -> Path:
    return Path(os.environ.get("PYTEST_ARTIFACTS", ROOT / "tests" / "artifacts")) / "webui.png"


def test_live_page_asks_for_the_key_then_shows_figures_that_change(server: str) -> None:
    with Browser() as b:
        b.open(server + "/")
        b.wait_for("document.getElementById('status').textContent === 'needs the API key'")
        assert b.js("getComputedStyle(document.getElementById('key-panel')).display") == "block"
        assert set(_tiles(b).values()) == {"—"}
        assert "gemma" not in str(b.js("document.body.innerText"))

        b.js(f"document.getElementById('key-input').value = '{KEY}';"
             "document.getElementById('key-panel').requestSubmit(); true")
        b.wait_for("document.getElementById('status').textContent === 'live'")
        assert b.js("getComputedStyle(document.getElementById('key-panel')).display") == "none"
        assert bundled.target().name in _text(b, "about")
        assert _tiles(b)["served"] == "0" and _tiles(b)["tps"] == "—"
        assert b.js("document.querySelectorAll('#recent tr').length") == 0
        node = str(b.wait_for("document.querySelector('#nodes .node') && "
                              "document.querySelector('#nodes .node').innerText"))
        assert " · up · slot 0" in node and "gemma-3-270m-q2_k-q4e.gguf" in node
        assert re.search(r"handshake round trip\s+[\d.]+ ms", node), node

        r = httpx.post(server + "/completion", headers=AUTH, timeout=120,
                       json={"prompt": "def fibonacci(n):", "n_predict": 32, "temperature": 0})
        timings = r.json()["timings"]
        b.wait_for("document.getElementById('served').textContent === '1'")
        b.wait_for("document.querySelectorAll('#recent tr').length === 1")
        kept = timings["draft_n_accepted"] / timings["draft_n"]
        b.wait_for(f"document.getElementById('acceptance').textContent === '{100 * kept:.1f}%'")
        tiles = _tiles(b)
        assert float(tiles["tps"]) > 0
        if tiles["plain"] == "—":      # every round had a draft: nothing timed plain decoding
            assert _text(b, "plain-s") == "no round without a draft yet"
        else:
            assert float(tiles["plain"]) > 0 and tiles["speedup"].endswith("×")
        assert float(tiles["mean-accepted"]) > 0
        row = b.js("[...document.querySelectorAll('#recent tr td')].map(td => td.textContent)")
        assert row[1:5] == ["/completion", "0", str(timings["prompt_n"]), "32"]
        assert row[6:8] == [str(timings["draft_n"]), str(timings["draft_n_accepted"])]
        assert b.js("document.querySelectorAll('#position-chart rect').length") >= 1
        assert b.js("document.querySelectorAll('#speed-chart rect').length") == 1
        assert b.js("document.querySelectorAll('#split-legend span').length") == 3

        generated = _text(b, "tokens-s")
        b.js("document.getElementById('chat-max').value = '24';"
             "document.getElementById('chat-input').value = 'Say hello in five words.';"
             "document.getElementById('chat-form').requestSubmit(); true")
        note = b.wait_for("(document.querySelector('.msg.assistant .t') || {}).textContent",
                          timeout=120)
        assert "tokens/s" in str(note)
        reply = b.js("document.querySelector('.msg.assistant').firstChild.textContent")
        assert str(reply).strip()
        b.wait_for("document.getElementById('served').textContent === '2'")
        b.wait_for("document.querySelectorAll('#recent tr').length === 2")
        assert b.js("document.querySelectorAll('#speed-chart rect').length") == 2
        assert _text(b, "tokens-s") != generated
        shot = b.screenshot(_artifact())
    assert shot.stat().st_size > 10_000
