"""SIGTERM on a real `specwire serve` (bundled pair): the drain loses nothing.

A long stream runs and a request waits for the one slot when the server gets SIGTERM:
the waiting request is answered 503 with Retry-After at once, the stream ends with an
SSE error event (503) once --shutdown-timeout passes, the process exits, and its log
holds no traceback.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from serve_process import ROOT, _free_port, _wait_healthy
from toy_server import _metric, _sse

pytestmark = pytest.mark.slow


def test_sigterm_drains_the_queue_and_ends_streams_with_an_error_event() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specwire", "serve", "--port", str(port), "-t", "1", "-td",
           "1", "-c", "512", "--queue-size", "4", "--shutdown-timeout", "2"]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            _wait_healthy(proc, url, log)
            out: dict = {}
            started = threading.Event()

            def stream() -> None:
                with httpx.stream("POST", url + "/completion", timeout=60, json={
                        "prompt": "Once upon a time", "n_predict": 400, "stream": True,
                        "ignore_eos": True, "temperature": 0}) as r:
                    events = []
                    for e in _sse(r.iter_lines()):
                        events.append(e)
                        started.set()
                    out["stream"] = events

            def queued() -> None:
                out["queued"] = httpx.post(url + "/completion", timeout=60, json={
                    "prompt": "Hi", "n_predict": 4})

            t1 = threading.Thread(target=stream)
            t1.start()
            assert started.wait(60)
            t2 = threading.Thread(target=queued)
            t2.start()
            deadline = time.monotonic() + 10
            while _metric(url, "requests_deferred") < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            t2.join(30)
            t1.join(60)
            # uvicorn re-raises the signal once it has shut down: killed by SIGTERM, as
            # systemd and shells expect of a process that honoured it
            assert proc.wait(30) in (0, -signal.SIGTERM)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        log.seek(0)
        text = log.read().decode(errors="replace")
    r = out["queued"]
    assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
    events = out["stream"]
    assert any(isinstance(e, dict) and e.get("content") for e in events)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert errors and errors[-1]["error"]["code"] == 503, events[-3:]
    assert "Traceback" not in text, text[-3000:]
