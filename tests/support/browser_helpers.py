"""Headless Chromium driven over the DevTools protocol, for tests/server/test_webui_browser.py.

Debian's `chromium` package (`.ci/run` installs it), started with a fresh
profile and nothing that reaches the network, and one page driven through its
DevTools websocket: navigate, evaluate JavaScript, take a screenshot. No
browser-automation package is needed, only `websockets`.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run",
         "--disable-dev-shm-usage", "--remote-debugging-port=0")


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    """One headless Chromium with one page; a context manager that always ends it."""

    def __init__(self, width: int = 1280, height: int = 1500, timeout: float = 60) -> None:
        exe = find_chromium()
        if exe is None:
            raise RuntimeError("chromium not found (apt-get install chromium)")
        self.profile = tempfile.TemporaryDirectory(prefix="specwire-chromium-")
        self.proc = subprocess.Popen(
            [exe, *FLAGS, f"--user-data-dir={self.profile.name}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.size = (width, height)
        self._id = 0
        self._exit = contextlib.ExitStack()
        try:
            port = self._devtools_port(timeout)
            pages = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
            url = next(p["webSocketDebuggerUrl"] for p in pages if p["type"] == "page")
            self.ws = self._exit.enter_context(connect(url, max_size=None, open_timeout=timeout))
        except BaseException:
            self.close()
            raise

    def _devtools_port(self, timeout: float) -> int:
        """Chromium writes the port it picked to DevToolsActivePort in its profile."""
        path = Path(self.profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode}")
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._exit.close()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.profile.cleanup()

    def call(self, method: str, timeout: float = 30, **params: object) -> dict:
        """One DevTools command; its result (events that arrive meanwhile are skipped)."""
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.01, deadline - time.monotonic())))
            if msg.get("id") != self._id:
                continue
            if "error" in msg:
                raise RuntimeError(f"{method}: {msg['error']}")
            return msg["result"]

    def open(self, url: str) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=self.size[0], height=self.size[1],
                  deviceScaleFactor=1, mobile=False)
        self.call("Page.navigate", url=url)

    def js(self, expression: str) -> object:
        """The value of a JavaScript expression in the page (awaited if it is a promise)."""
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                      awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> object:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.js(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            time.sleep(0.2)
        raise TimeoutError(f"still false after {timeout:.0f} s: {expression} (last: {value!r})")

    def screenshot(self, path: Path) -> Path:
        """The whole page as PNG."""
        height = int(self.js("Math.ceil(document.body.getBoundingClientRect().height)")
                     or self.size[1])
        r = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                      clip={"x": 0, "y": 0, "width": self.size[0], "height": height, "scale": 1})
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(r["data"]))
        return path
