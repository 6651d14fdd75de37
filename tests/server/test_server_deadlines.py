"""What a client may hold on `serve`, and shutdown (server/deadlines.py, server/drain.py).

The toy app (support/toy_server.py's engine, no model) under uvicorn with serve's protocol
and server, over real sockets: a connection that sends no request, or half of its headers,
is closed at its header deadline; one over --max-connections is closed at once; a body
that does not arrive in time is a 408; bodies in reading past --max-reading are a 503
with Retry-After. On shutdown, a waiting request gets a 503 with Retry-After at once, a
running one finishes within the drain, one that outlasts it ends with a 503 (a stream:
an SSE error event), and nothing logs a traceback. Waits are bounded (liveness), never
compared with each other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from toy_server import SpyDrafter, ToyBackend, _sse

from specwire.config import SamplingParams
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app, deadlines
from specwire.server.drain import DrainingServer

HEADER_S = 0.3


@contextlib.contextmanager
def serving(delay: float = 0.0, shutdown_s: float = 5.0, max_connections: int = 64,
            **settings) -> Iterator[tuple[str, DrainingServer]]:
    s = ServerSettings(sampling=SamplingParams(temperature=0.0), **settings)
    app = create_app(Engine(ToyBackend(delay=delay), SpyDrafter()), s)
    sock = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning",
                            http=deadlines.protocol(HEADER_S, max_connections),
                            limit_concurrency=max_connections + 1)
    server = DrainingServer(config, app.state.scheduler, shutdown_s)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes conn (recv gives b"" or a reset) within seconds."""
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)))


def test_silent_and_half_sent_headers_are_closed_at_the_deadline() -> None:
    with serving() as (url, _):
        idle, half = _connect(url), _connect(url)
        half.sendall(b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Ty")
        assert _closed_within(idle, 10) and _closed_within(half, 10)
        kept = httpx.Client(base_url=url)           # a kept connection, then half a request
        assert kept.get("/health").status_code == 200
        assert httpx.get(url + "/health").status_code == 200     # the server is fine


def test_connections_over_the_cap_are_closed_at_once() -> None:
    with serving(max_connections=3) as (url, _):
        held = [_connect(url) for _ in range(3)]
        time.sleep(0.05)
        extra = _connect(url)
        assert _closed_within(extra, 2)
        for c in held:
            c.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:      # the slots free as the server sees the closes
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 200


def _slow_body(url: str, sent: bytes, declared: int) -> socket.socket:
    c = _connect(url)
    c.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
              b"\r\nContent-Length: " + str(declared).encode() + b"\r\n\r\n" + sent)
    return c


def _response(c: socket.socket, seconds: float = 10) -> tuple[int, dict, bytes]:
    c.settimeout(seconds)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = c.recv(4096)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in
               (line.split(": ", 1) for line in lines[1:] if ": " in line)}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = c.recv(4096)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def test_a_body_that_does_not_arrive_in_time_is_a_408() -> None:
    with serving(body_timeout_s=0.5) as (url, _):
        c = _slow_body(url, b'{"prompt": ', 100)
        status, _, body = _response(c)
        assert status == 408 and b"--body-timeout" in body
        assert httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 1}
                          ).status_code == 200


def test_a_client_that_leaves_mid_body_logs_no_traceback(caplog) -> None:
    """A stalled upload whose client closes the connection (the soak's slowloris at its
    end): no "unexpected error", no traceback; its bytes are given back and the server
    answers the next request."""
    caplog.set_level(logging.INFO)
    with serving(body_timeout_s=30, max_reading=6000, max_body=5000) as (url, _):
        for _ in range(3):
            c = _slow_body(url, b" " * 4000, 5000)
            time.sleep(0.3)
            c.close()
        time.sleep(0.5)
        assert httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 1}
                          ).status_code == 200
        second = _slow_body(url, b" " * 4000, 5000)   # the budget was given back
        time.sleep(0.3)
        second.close()
    assert "Traceback" not in caplog.text and "unexpected error" not in caplog.text, caplog.text


def test_bodies_in_reading_are_capped_together() -> None:
    """Two uploads that stall: the first holds its bytes, the second would pass the total
    and gets a 503 with Retry-After; the first's bytes are given back when it ends."""
    with serving(body_timeout_s=3, max_reading=6000, max_body=5000) as (url, _):
        first = _slow_body(url, b" " * 4000, 5000)
        time.sleep(0.3)
        second = _slow_body(url, b" " * 4000, 5000)
        status, headers, body = _response(second)
        assert status == 503 and headers.get("retry-after") == "1" and b"--max-reading" in body
        assert _response(first)[0] == 408
        assert httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 1}
                          ).status_code == 200


def test_shutdown_drains(caplog) -> None:
    """One slot: a short generation finishes inside the drain, a queued request gets a 503
    with Retry-After at once, a new one too; a long stream ends with an error event."""
    caplog.set_level(logging.INFO)
    with serving(delay=0.02, shutdown_s=1.0, queue_size=4) as (url, server):
        out: dict[str, object] = {}

        def stream() -> None:
            with httpx.stream("POST", url + "/completion", timeout=30,
                              json={"prompt": "z", "n_predict": 100000, "stream": True}) as r:
                out["stream"] = list(_sse(r.iter_lines()))

        def queued() -> None:
            out["queued"] = httpx.post(url + "/completion", timeout=30,
                                       json={"prompt": "z", "n_predict": 3})

        t1 = threading.Thread(target=stream)
        t1.start()
        deadline = time.monotonic() + 10
        while server.scheduler.running() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        t2 = threading.Thread(target=queued)
        t2.start()
        while len(server.scheduler.queue) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.should_exit = True
        t2.join(10)
        r = out["queued"]
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert "shutting down" in r.json()["error"]["message"]
        t1.join(20)
        events = out["stream"]
        assert any(isinstance(e, dict) and "content" in e for e in events)   # it was running
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert errors and errors[-1]["error"]["code"] == 503
    assert "Traceback" not in caplog.text and "Cancel" not in caplog.text


def test_a_generation_that_fits_in_the_drain_finishes() -> None:
    with serving(delay=0.02, shutdown_s=10.0) as (url, server):
        out = {}

        def run() -> None:
            out["r"] = httpx.post(url + "/completion", timeout=30,
                                  json={"prompt": "z", "n_predict": 20})

        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 10
        while server.scheduler.running() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        server.should_exit = True
        t.join(30)
        r = out["r"]
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 20
        with pytest.raises(httpx.HTTPError):      # no longer accepting
            httpx.get(url + "/health", timeout=2)


def test_serve_flags_for_deadlines_are_checked() -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    for flags, name in ((["--header-timeout", "0"], "--header-timeout"),
                        (["--body-timeout", "-1"], "--body-timeout"),
                        (["--shutdown-timeout", "-1"], "--shutdown-timeout"),
                        (["--max-connections", "0"], "--max-connections"),
                        (["--max-reading", "10"], "--max-reading")):
        args = parser.parse_args(["serve", "-m", "/nonexistent.gguf", *flags])
        with pytest.raises(CliError, match=name):
            args.func(args)
    a = parser.parse_args(["serve"])
    assert (a.header_timeout, a.body_timeout, a.max_connections, a.shutdown_timeout) == \
        (10.0, 60.0, 256, 30.0)
    assert json.dumps(a.max_reading) == str(64 << 20)
