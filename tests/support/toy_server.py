"""The HTTP app in-process over a toy engine (uvicorn on a thread), and readers of its answers:
server-sent events, a /metrics figure."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import numpy as np

from specwire.drafters.base import NoDrafter


class ToyBackend:
    """A 128-token "model" that writes the alphabet after any token, one char a token.

    Slow on purpose (`delay` per evaluation) so that streams can be caught mid-way.
    """

    name, n_vocab, n_ctx = "toy.gguf", 128, 4096

    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self._tokens: list[int] = []

    @property
    def n_past(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def eval(self, tokens, logits: str = "last") -> np.ndarray:
        time.sleep(self.delay)
        self._tokens.extend(tokens)
        at = {"all": list(range(len(tokens))), "last": [len(tokens) - 1], "none": []}[logits]
        rows = np.zeros((len(at), self.n_vocab), dtype=np.float32)
        for r, i in enumerate(at):
            t = tokens[i]
            rows[r, t + 1 if 97 <= t < 122 else 97] = 20.0
        return rows

    def truncate(self, n: int) -> None:
        del self._tokens[n:]

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list:
        return [min(ord(c), 127) for c in text]

    def detokenize(self, tokens) -> bytes:
        return bytes(tokens)

    def is_eog(self, token: int) -> bool:
        return token == 0

    def vocab_fingerprint(self) -> str:
        return "toy"

    def chat_template(self) -> str | None:
        return None


class SpyDrafter(NoDrafter):
    name = "spy"

    def __init__(self) -> None:
        self.begun, self.ended = 0, threading.Event()

    def begin(self, prompt, sampling, params, **guide) -> None:
        self.begun += 1
        self.ended.clear()

    def end(self) -> None:
        self.ended.set()


@contextlib.contextmanager
def serve_app(app) -> Iterator[str]:
    """Run an app with uvicorn on a thread; yield its base URL."""
    import uvicorn

    sock = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _sse(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[6:]
            yield data if data == "[DONE]" else json.loads(data)


def _metric(url: str, name: str, headers: dict | None = None) -> float:
    text = httpx.get(url + "/metrics", headers=headers).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("specwire:" + name) and not line.startswith("#"))


def _ignore(fn, *a, **kw) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn(*a, **kw)
