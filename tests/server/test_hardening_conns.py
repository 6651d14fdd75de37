"""A hostile client of a shared `serve` (issue 40): connections, TLS handshakes, a stalled
stream, /infill's extra context, binding every address without a key.

The toy app (support/toy_server.py's engine, no model) under the uvicorn server that
serve.py's _http_server builds from serve's own flags, over real sockets. Client addresses
other than 127.0.0.1 are other loopback addresses (127.0.0.2, ...), which Linux routes to
the same listener. Waits are bounded (liveness) polls, never fixed sleeps.

* An idle kept-alive connection was held for --timeout (600 s) after its response; now
  it is closed after --keep-alive (5 s by default), and the next request's headers are due
  within --header-timeout of the response's end.
* One address could hold every one of --max-connections; now at most --conn-per-address
  (a quarter of them by default), so a client elsewhere still gets in.
* TLS handshakes that never finish were neither counted nor timed out (60 s, asyncio's);
  now they count against --max-connections and are cut at the header deadline.
* A client that stops reading an endless stream held its slot for ever; now the
  connection is cut after --body-timeout without a read, and the generation ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest
from toy_server import SpyDrafter, ToyBackend

from specwire.cli.commands import serve
from specwire.config import SamplingParams
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app, schemas
from specwire.server import infill as infill_prompt


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    a = parser.parse_args(["serve", *flags])
    serve._check_limits(a)
    return a


class _Endless(ToyBackend):
    """A toy whose context never ends (as --context-shift with n_predict -1)."""

    n_ctx = 1 << 24


@contextlib.contextmanager
def serving(*flags: str, backend: ToyBackend | None = None, sndbuf: int | None = None,
            **settings) -> Iterator[tuple[int, object]]:
    """serve's HTTP server (its flags) over the toy app on 127.0.0.1; yields the port and
    the server."""
    a = _args(*flags)
    s = ServerSettings(sampling=SamplingParams(temperature=0.0), body_timeout_s=a.body_timeout,
                       **settings)
    app = create_app(Engine(backend or ToyBackend(delay=0.0), SpyDrafter()), s)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if sndbuf is not None:          # inherited by accepted sockets
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = serve._http_server(app, a, serve.ssl_files(a))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _connect(port: int, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10,
                                    source_address=(source, 0))


def _closed_within(conn: socket.socket, seconds: float) -> bool:
    """Whether the server closes conn (EOF or a reset) within seconds."""
    conn.settimeout(seconds)
    try:
        while conn.recv(4096):
            pass
        return True
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def _health(conn: socket.socket) -> None:
    """One GET /health on a kept-alive connection, its answer read whole; a connection the
    server closed first raises ConnectionError (recv's b"" would otherwise loop forever)."""
    def more() -> bytes:
        chunk = conn.recv(4096)
        if not chunk:
            raise ConnectionError("the server closed the connection before its answer")
        return chunk

    conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += more()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        body += more()


def _get_health(port: int, source: str = "127.0.0.1", timeout: float = 5) -> int:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source)) as c:
        return c.get(f"http://127.0.0.1:{port}/health", timeout=timeout).status_code


def test_a_kept_connection_must_send_its_next_headers_within_the_deadline() -> None:
    """After its response, a kept connection that says nothing more is closed at the
    header deadline (before: held for --timeout, 600 s)."""
    with serving("--header-timeout", "0.5") as (port, _):
        c = _connect(port)
        _health(c)
        start = time.monotonic()
        assert _closed_within(c, 5), "an idle kept connection outlived the header deadline"
        assert time.monotonic() - start < 5
        half = _connect(port)          # the next request's headers, half sent, then nothing
        _health(half)
        half.sendall(b"GET /health HTTP/1.1\r\nHo")
        assert _closed_within(half, 5)
        assert _get_health(port) == 200


def test_keep_alive_is_a_few_seconds_by_default_and_its_own_flag() -> None:
    a = _args()
    assert a.keep_alive == 5.0 and a.timeout == 600
    app = SimpleNamespace(state=SimpleNamespace(scheduler=None))
    assert serve._http_server(app, a, {}).config.timeout_keep_alive == 5.0
    assert serve._http_server(app, _args("--timeout", "2"), {}).config \
        .timeout_keep_alive == 2          # --timeout (llama-server's) still bounds it
    with serving("--keep-alive", "0.3", "--header-timeout", "30") as (port, _):
        c = _connect(port)
        _health(c)
        assert _closed_within(c, 5), "an idle kept connection outlived --keep-alive"


def test_one_address_cannot_hold_every_connection() -> None:
    """The attack: connections that each send one GET /health (no key) and idle. With
    --max-connections 8, one address gets its quarter (2); a client elsewhere is served."""
    with serving("--max-connections", "8", "--header-timeout", "30") as (port, _):
        held = []
        for _ in range(8):
            c = _connect(port)
            with contextlib.suppress(OSError, StopIteration, AssertionError):
                _health(c)
            held.append(c)
        assert sum(not _closed_within(c, 0.3) for c in held) <= 2
        assert _get_health(port, "127.0.0.2") == 200


def test_conn_per_address_sets_the_share() -> None:
    with serving("--max-connections", "16", "--conn-per-address", "3",
                 "--header-timeout", "30") as (port, _):
        held = [_connect(port) for _ in range(3)]
        for c in held:
            _health(c)
        extra = _connect(port)
        assert _closed_within(extra, 2)
        assert _get_health(port, "127.0.0.2") == 200
        held[0].close()
        deadline = time.monotonic() + 5        # its place frees as the server sees the close
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if _get_health(port, timeout=1) == 200:
                    break
            time.sleep(0.05)
        assert _get_health(port) == 200
    with pytest.raises(Exception, match="--conn-per-address"):
        _args("--max-connections", "4", "--conn-per-address", "5")


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    from wire_helpers import make_certs
    return make_certs(tmp_path_factory.mktemp("serve-certs"))


def _tls_client(port: int, ca: str, source: str) -> ssl.SSLSocket:
    ctx = ssl.create_default_context(cafile=ca)
    return ctx.wrap_socket(_connect(port, source), server_hostname="127.0.0.1")


def test_tls_handshakes_are_counted_and_cut_at_the_header_deadline(certs) -> None:
    """Three connections (three addresses) that never start their handshake fill
    --max-connections 3: a fourth client is refused at once; the three are closed at the
    header deadline (before: uncounted, and held 60 s); then the fourth gets in."""
    with serving("--ssl-key-file", certs["server_key"], "--ssl-cert-file",
                 certs["server_cert"], "--max-connections", "3",
                 "--header-timeout", "0.5") as (port, _):
        mute = [_connect(port, f"127.0.0.{i}") for i in (1, 2, 3)]
        time.sleep(0.1)               # (the accepts: nothing to poll from outside)
        with pytest.raises((OSError, ssl.SSLError)):
            c = _tls_client(port, certs["ca"], "127.0.0.4")
            c.settimeout(3)
            _health(c)
        for m in mute:
            assert _closed_within(m, 5), "a handshake outlived the header deadline"
        c = _tls_client(port, certs["ca"], "127.0.0.4")
        _health(c)
        c.close()


def test_a_tls_peer_that_never_answers_the_close_is_let_go_at_the_deadline(certs) -> None:
    """The close of a TLS connection waits for the peer's close_notify: a peer that never
    sends it held its connection 30 s (asyncio's default) after serve closed it; now
    --header-timeout at most."""
    with serving("--ssl-key-file", certs["server_key"], "--ssl-cert-file",
                 certs["server_cert"], "--keep-alive", "0.3",
                 "--header-timeout", "0.5") as (port, server):
        c = _tls_client(port, certs["ca"], "127.0.0.1")
        _health(c)                     # then it reads nothing: no close_notify back
        deadline = time.monotonic() + 5
        while server.server_state.connections and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not server.server_state.connections, "a closed TLS connection still held"
        c.close()


def test_a_client_that_stops_reading_a_stream_is_cut_and_its_slot_freed() -> None:
    """An endless stream whose client reads nothing: past --body-timeout the connection
    is cut and the generation ends (before: it held the slot for ever)."""
    backend = _Endless(delay=0.001)
    with serving("--body-timeout", "0.5", backend=backend, sndbuf=4096) as (port, server):
        c = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.connect(("127.0.0.1", port))
        body = json.dumps({"prompt": "z", "n_predict": 1_000_000, "stream": True}).encode()
        c.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                  b"application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        assert c.recv(100).startswith(b"HTTP/1.1 200")    # then it reads nothing more
        deadline = time.monotonic() + 10
        while server.scheduler.running() == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        deadline = time.monotonic() + 30
        while server.scheduler.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.scheduler.running() == 0, "a stalled reader holds its slot"
        assert backend.n_past < 200_000
        c.close()
        assert _get_health(port) == 200


class _Fim(ToyBackend):
    """The toy with FIM tokens, counting the characters it is asked to tokenize."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.tokenized = 0

    def fim_tokens(self) -> dict[str, int]:
        return {"pre": 1, "suf": 2, "mid": 3}

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list:
        self.tokenized += len(text)
        return super().tokenize(text, add_special, parse_special)


def test_infill_bounds_its_extra_context_before_tokenizing() -> None:
    """Megabytes of input_extra (and of prefix and suffix) are cut to what the context could
    keep before they are tokenized (before: all of it tokenized; 7 MiB took 3.3 s on a real
    model); the prompt is the same as from the whole texts."""
    b = _Fim()
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0))
    big = "abcdefghij" * (100 << 10)
    body = {"input_prefix": big, "input_suffix": big, "n_predict": 8,
            "input_extra": [{"filename": "a.py", "text": big}, {"text": big}]}
    spec = schemas.infill(body, b, settings, ["toy.gguf"])
    assert b.tokenized < 4 * b.n_ctx * 8, b.tokenized
    want = _infill_untrimmed(body, b)
    assert list(spec.request.prompt) == want
    small = {"input_prefix": "def f(", "input_suffix": "):\n", "input_extra":
             [{"filename": "x.py", "text": "import os\n"}]}
    assert list(schemas.infill(small, b, settings, ["toy.gguf"]).request.prompt) == \
        _infill_untrimmed(small, b)


def _infill_untrimmed(body: dict, b: _Fim) -> list[int]:
    """The FIM prompt from the whole texts (the toy: one token a character)."""
    tok = lambda t: [min(ord(c), 127) for c in t]  # noqa: E731
    context: list[int] = []
    for x in infill_prompt.parse_extra(body.get("input_extra")):
        context += tok(infill_prompt.SNIPPET) + tok(x.text)
    before, after = tok(body["input_prefix"]), tok(body["input_suffix"])
    n_batch, n_predict = 512, body.get("n_predict", b.n_ctx)
    keep_context = min(len(context), max(0, b.n_ctx - n_batch - 2 * min(b.n_ctx, n_predict)))
    keep_before = min(len(before), 3 * (n_batch // 4))
    keep_after = min(len(after), max(0, n_batch // 4 - 2))
    return [*context[len(context) - keep_context:], 1, *before[len(before) - keep_before:],
            2, *after[:keep_after], 3]


def test_binding_every_address_without_a_key_logs_a_warning(caplog) -> None:
    caplog.set_level(logging.WARNING, "specwire.serve")
    engines = [SimpleNamespace(target=SimpleNamespace(name="t", n_ctx=1),
                               drafter=SimpleNamespace(name="d"))]
    sock = SimpleNamespace(getsockname=lambda: ("0.0.0.0", 8080))
    for host, key, warned in (("0.0.0.0", None, True), ("::", None, True),
                              ("192.168.1.5", None, True), ("0.0.0.0", "k", False),
                              ("127.0.0.1", None, False), ("localhost", None, False)):
        caplog.clear()
        a = _args("--host", host, *(["--api-key", key] if key else []))
        serve._log_listening(a, sock, engines, {})
        assert ("without --api-key" in caplog.text) == warned, (host, key)
