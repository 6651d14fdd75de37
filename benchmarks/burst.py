"""A burst: N greedy completion requests sent at the same instant, and what came back.

Aggregate throughput is the burst's generated tokens over its wall time (first
send to last answer), which is what a client with N requests in flight sees;
each request's own end-to-end tokens/s and the server's `timings` (decode
tokens/s, draft_n, draft_n_accepted: llama-server's names, which specwire keeps)
are kept alongside. Requests set ignore_eos so that every request generates
exactly n_predict tokens on every server.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import httpx

ENDPOINTS = ("/completion", "/v1/completions")


@dataclass(frozen=True, slots=True)
class Reply:
    """One request's answer; error is set (and the figures zero) when it failed."""

    prompt_id: str
    tokens: int
    seconds: float
    text: str = ""
    decode_tps: float | None = None
    draft_n: int | None = None
    draft_accepted: int | None = None
    error: str | None = None

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Burst:
    level: int
    wall_s: float
    replies: tuple[Reply, ...]
    load: float | None = None         # 1-minute load average when the burst ended
    #: CPU seconds the server process used during the burst (None: not measured). On a
    #: loaded machine wall time swings with the other work, CPU time much less.
    cpu_s: float | None = None

    @property
    def cpu_tps(self) -> float | None:
        """Tokens per CPU second of the server."""
        return self.tokens / self.cpu_s if self.cpu_s else None

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.replies)

    @property
    def aggregate_tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def errors(self) -> list[str]:
        return [r.error for r in self.replies if r.error]


def request_body(endpoint: str, prompt: str, n_predict: int) -> dict:
    """A greedy request of exactly n_predict tokens, in the endpoint's own field names."""
    if endpoint == "/completion":
        return {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0,
                "ignore_eos": True, "stream": False}
    return {"prompt": prompt, "max_tokens": n_predict, "temperature": 0.0,
            "ignore_eos": True, "stream": False}


def parse_reply(prompt_id: str, endpoint: str, body: object, seconds: float) -> Reply:
    """A server's JSON answer -> Reply; a body without the expected fields is an error."""
    if not isinstance(body, dict):
        return Reply(prompt_id, 0, seconds, error=f"answer is not a JSON object: {body!r:.200}")
    try:
        if endpoint == "/completion":
            text, tokens = body["content"], int(body["tokens_predicted"])
        else:
            text, tokens = body["choices"][0]["text"], int(body["usage"]["completion_tokens"])
    except (KeyError, IndexError, TypeError, ValueError) as e:
        return Reply(prompt_id, 0, seconds, error=f"answer lacks {e}: {str(body)[:200]}")
    t = body.get("timings") if isinstance(body.get("timings"), dict) else {}
    return Reply(prompt_id, tokens, seconds, text=str(text),
                 decode_tps=_num(t.get("predicted_per_second")),
                 draft_n=_int(t.get("draft_n")), draft_accepted=_int(t.get("draft_n_accepted")))


def _num(x: object) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def _int(x: object) -> int | None:
    return int(x) if isinstance(x, int) and not isinstance(x, bool) else None


def fire(url: str, endpoint: str, prompts: list[tuple[str, str]], n_predict: int,
         timeout: float) -> Burst:
    """Send one request per (id, text) at once, each on its own connection; wait for all."""
    barrier = threading.Barrier(len(prompts) + 1)
    replies: list[Reply | None] = [None] * len(prompts)
    ends = [0.0] * len(prompts)

    def one(i: int, pid: str, text: str) -> None:
        body = request_body(endpoint, text, n_predict)
        with httpx.Client(base_url=url, timeout=timeout) as http:
            barrier.wait()
            t0 = time.perf_counter()
            try:
                r = http.post(endpoint, json=body)
                seconds = time.perf_counter() - t0
                replies[i] = (parse_reply(pid, endpoint, r.json(), seconds)
                              if r.status_code == 200 else
                              Reply(pid, 0, seconds, error=f"HTTP {r.status_code}: "
                                    f"{r.text[:200]}"))
            except (httpx.HTTPError, ValueError) as e:
                replies[i] = Reply(pid, 0, time.perf_counter() - t0,
                                   error=f"{type(e).__name__}: {e}")
            ends[i] = time.perf_counter()

    threads = [threading.Thread(target=one, args=(i, pid, text), daemon=True)
               for i, (pid, text) in enumerate(prompts)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join(timeout + 30)
    done = [r if r is not None else Reply(pid, 0, timeout, error="no answer (thread hung)")
            for r, (pid, _) in zip(replies, prompts, strict=True)]
    wall = max((e for e in ends if e), default=time.perf_counter()) - start
    return Burst(len(prompts), wall, tuple(done), _load())


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
