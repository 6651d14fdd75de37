"""An unmodified llama-server as a drafter: POST /completion with the token history.

For users whose draft box already runs llama.cpp (a Mac with Metal, say).
Synchronous and greedy: each round sends the whole history as token ids with
`cache_prompt`, so the server evaluates only the new suffix, and reads back
`n_predict` greedy tokens. Any failure makes the round a plain decoding step
and pauses the drafter with backoff.
"""

from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.base import Capabilities, Draft, DrafterBase, LinkStatus, counter_values

log = logging.getLogger("specwire.remote")


@dataclass(slots=True)
class HttpCounters:
    """A llama-server drafter's counters, cumulative over its life (Drafter.stats)."""

    bytes_up: float = 0
    bytes_down: float = 0
    requests: float = 0
    errors: float = 0
    wait_ms: float = 0.0  # time propose spent on the HTTP round trip

    def as_dict(self) -> dict[str, float]:
        return counter_values(self)


class LlamaServerDrafter(DrafterBase):
    # greedy (top_k 1): a point mass is its q in rejection mode; status: up or resting
    capabilities = Capabilities(deterministic=True, remote=True, links=True)

    def __init__(self, url: str, timeout_s: float = 5.0, n_vocab: int | None = None) -> None:
        u = urllib.parse.urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"--draft-url {url}: expected http://HOST:PORT")
        self.url, self.timeout_s, self.n_vocab = url, timeout_s, n_vocab
        self._https = u.scheme == "https"
        self._host, self._port = u.hostname, u.port or (443 if self._https else 80)
        self._path = (u.path.rstrip("/") or "") + "/completion"
        self._conn: http.client.HTTPConnection | None = None
        self._retry_at = 0.0
        self._failures = 0
        self.name = f"llama-server:{url}"
        self.counters = HttpCounters()

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar=None) -> None:
        self._p_min = params.p_min

    def propose(self, history: Sequence[int], k: int) -> Draft:
        if time.monotonic() < self._retry_at or k <= 0:
            return Draft()
        body = json.dumps(
            {
                "prompt": list(history),
                "n_predict": k,
                "temperature": 0.0,
                "top_k": 1,
                "cache_prompt": True,
                "return_tokens": True,
                "stream": False,
                "samplers": ["top_k"],
            }
        ).encode()
        t0 = time.perf_counter()
        try:
            tokens = self._post(body)
        except (OSError, http.client.HTTPException, ValueError) as e:
            self._fail(str(e))
            return Draft()
        finally:
            self.counters.wait_ms += 1000 * (time.perf_counter() - t0)
        self._failures = 0
        return Draft(tokens[:k])

    def _post(self, body: bytes) -> list[int]:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout_s)
        self._conn.request("POST", self._path, body, {"Content-Type": "application/json"})
        resp = self._conn.getresponse()
        data = resp.read(1 << 20)
        self.counters.requests += 1
        self.counters.bytes_up += len(body)
        self.counters.bytes_down += len(data)
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}: {data[:200]!r}")
        tokens = json.loads(data).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError("response has no integer `tokens` list (needs return_tokens)")
        if self.n_vocab is not None and any(not 0 <= t < self.n_vocab for t in tokens):
            raise ValueError("response has token ids outside the vocabulary")
        return tokens

    def _fail(self, reason: str) -> None:
        self.counters.errors += 1
        self._failures += 1
        pause = min(5.0, 0.25 * 2 ** (self._failures - 1))
        self._retry_at = time.monotonic() + pause
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        log.warning("llama-server drafter %s failed (%s); retry in %.2f s", self.url, reason, pause)

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()

    def status(self) -> tuple[LinkStatus, ...]:
        """Up unless resting after a failure; a llama-server has no node details to give."""
        return (LinkStatus(self.url, time.monotonic() >= self._retry_at),)
