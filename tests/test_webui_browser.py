"""The live page in a real browser: headless Chromium against `specwire serve` on the bundled pair.

The page must ask for the API key and show nothing before it has it, then show
the server's figures, and show them change after a request (one made by the
test, one typed into the page's chat box). The screenshot is kept as a test
artefact: $PYTEST_ARTIFACTS/webui.png, else tests/artifacts/webui.png.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from browser_helpers import Browser, find_chromium
from test_server import _free_port, _wait_healthy

ROOT = Path(__file__).resolve().parents[1]
KEY = "browser-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TILES = ("tps", "plain", "speedup", "acceptance", "mean-accepted", "served")

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(find_chromium() is None,
                                 reason="needs Debian's chromium (.ci/run installs it)")]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    from specwire import models
    models.default_target()
    models.default_draft()
    port = _free_port()
    cmd = [sys.executable, "-m", "specwire", "serve", "--port", str(port), "-t", "1", "-td", "1",
           "-c", "1024", "--api-key", KEY]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _wait_healthy(proc, url, log)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
        assert "gemma-3-270m-f32.gguf" in _text(b, "about")
        assert _tiles(b)["served"] == "0" and _tiles(b)["tps"] == "—"
        assert b.js("document.querySelectorAll('#recent tr').length") == 0

        r = httpx.post(server + "/completion", headers=AUTH, timeout=120,
                       json={"prompt": "def fibonacci(n):", "n_predict": 32, "temperature": 0})
        timings = r.json()["timings"]
        b.wait_for("document.getElementById('served').textContent === '1'")
        b.wait_for("document.querySelectorAll('#recent tr').length === 1")
        tiles = _tiles(b)
        assert float(tiles["tps"]) > 0
        assert float(tiles["plain"]) > 0 and tiles["speedup"].endswith("×")
        kept = timings["draft_n_accepted"] / timings["draft_n"]
        assert tiles["acceptance"] == f"{100 * kept:.1f}%"
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
