"""Soak: hours of hostile traffic in minutes, and whether the server stays whole.

`specwire serve` on the bundled pair drafts through a draft node (its own
process) that is SIGKILLed and restarted every --restart-every seconds, while
--clients threads send a mix of requests as fast as they are answered:

  complete  /completion or /v1/completions, greedy or seeded, 8-40 tokens
  chat      /v1/chat/completions
  cut       a stream read for a few events, then the connection dropped
  long      a prompt of most of the context (sometimes more: a 400 is expected)
  bad       a hostile body (invalid JSON, lone surrogates, deep nesting, huge numbers,
            wrong types, too many stops): a 4xx is expected

With --attackers, issue 23's attackers run beside them for the whole soak
(benchmarks/soak_attacks.py): slowloris connections to serve, silent peers of the
node's two ports, a second serve whose node greets and then never answers (with a
client of its own), and a client kind `constraint` (schemas and grammars past
llama.cpp's limits: a 400 is expected); and issue 40's: serve then runs over TLS (a
self-signed certificate), with a LoRA adapter (soak_attacks.write_lora: small, seeded,
on the target's attention), --slot-save-path and two API keys, the honest clients'
and the attackers', and beside slowloris (now over TLS) run a LoRA-scale attacker, idle
keep-alive connections, a slot-file spoiler and TLS-handshake stallers (the idle and
stalled connections from their own 127.0.0.x addresses, so that --conn-per-address
counts them apart from the honest clients). Each attacker's counts are in the
report's "attackers"; what none of them may see (a deadline missed, a restore of a
spoiled file not refused, a scale changed, a probe refused, an unexpected answer) is
in "attacker_faults", and fails the soak.
Every greedy /completion answer's tokens are then checked against plain decoding (the
same prompt with speculative false, at the end), and the serving process's and the
node's threads, descriptors and memory are read from /proc every 30 s.

Both processes' threads by name and descriptors by kind (a socket by its port and
state) are read at the start and at the end, each after --settle-s idle seconds; the
soak fails, naming what differs, if the target's are not the same at the end.

What it reports is read from the target's and the node's /metrics
(prometheus_client): resident memory and open files cold (before any request),
at the start (after a warm-up: each kind of request once on every slot, so
that the pages of the weights and of every slot's KV cache, the request
thread pool and the first request's allocations are in place, as servers are
measured in the field), after the first interval (one full node restart cycle)
and at the end; open requests and contexts at the end. Client-side it counts
answers by status and times each successful request end to end. Goals: no
5xx, no transport error outside a cut stream, memory growth from the start
(after warm-up) under 5%, nothing left open at the end, every greedy answer
equal to plain decoding's, the target's threads and descriptors at the end
those of the start; growth from cold and from the first interval are reported
beside it.

    python -m benchmarks.soak --minutes 10 --clients 8 [--restart-every 60]
        [--ctx 1024] [-np 2] [--draft-mode auto|sync|pipelined] [--attackers]
        [--lora-scale-max 4] [--settle-s 16] [--out soak.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from benchmarks import soak_attacks as attacks
from specwire.assets import models
from specwire.server import deadlines, limits
from specwire.server.metrics import parse_figures

LONG_TEXT = ("The committee met on Tuesday to review the budget, the schedule and the list of "
             "open questions from the previous meeting. ")
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about rain.",
           "import numpy as np\n\ndef normalize(x):", "Once upon a time, in a small village,"]
BAD_BODIES = [b"{not json", b"", b"[1, 2]", b'{"prompt": "\\ud800"}', b"[" * 20_000,
              b'{"prompt": "hi", "n_predict": ' + b"9" * 5000 + b"}",
              b'{"prompt": "hi", "top_k": 4294967296}', b'{"prompt": "hi", "temperature": NaN}',
              b'{"prompt": 5}', b'{"messages": [{"role": "robot", "content": "x"}]}',
              json.dumps({"prompt": "hi", "stop": ["x"] * 50}).encode(),
              b'{"prompt": "hi", "seed": 1' + b"0" * 400 + b"}"]
KINDS = {"complete": 40, "chat": 15, "cut": 15, "long": 10, "bad": 20}
#: With --attackers: serve's API keys, the honest clients' and the attackers'.
HONEST_KEY, ATTACKER_KEY = "soak-honest", "soak-attacker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A specwire subprocess whose log goes to a file; started again on the same command."""

    def __init__(self, name: str, args: list[str], banner: str, log_dir: Path) -> None:
        self.cmd = [sys.executable, "-m", "specwire", *args]
        self.banner, self.log_path = banner, log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300.0) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while self.banner not in self.log()[offset:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.cmd} did not start:\n{self.log()[-3000:]}")
            time.sleep(0.1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass(slots=True)
class Tally:
    """What the clients saw; one lock for all of them."""

    statuses: Counter = field(default_factory=Counter)       # "kind:status" -> count
    errors: Counter = field(default_factory=Counter)         # "kind:ExceptionName" -> count
    latency: dict = field(default_factory=dict)              # kind -> [seconds]
    five_xx: list = field(default_factory=list)              # the first few, for the report
    greedy: dict = field(default_factory=dict)               # prompt -> [tokens answered]
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, status: int, seconds: float, text: str = "") -> None:
        with self.lock:
            self.statuses[f"{kind}:{status}"] += 1
            if status == 200 and kind not in ("bad", "cut"):
                self.latency.setdefault(kind, []).append(seconds)
            if status >= 500 and len(self.five_xx) < 10:
                self.five_xx.append(f"{kind} {status}: {text[:300]}")

    def error(self, kind: str, e: Exception) -> None:
        with self.lock:
            self.errors[f"{kind}:{type(e).__name__}"] += 1


class Client(threading.Thread):
    def __init__(self, index: int, url: str, until: float, tally: Tally, ctx: int,
                 kinds: dict[str, int] | None = None, http: dict | None = None) -> None:
        super().__init__(name=f"soak-client-{index}", daemon=True)
        self.rng = random.Random(index)
        self.url, self.until, self.tally, self.ctx = url, until, tally, ctx
        self.kinds = kinds or KINDS
        self.http = httpx.Client(base_url=url, timeout=300, **(http or {}))

    def run(self) -> None:
        kinds, weights = zip(*self.kinds.items(), strict=True)
        while time.monotonic() < self.until:
            kind = self.rng.choices(kinds, weights)[0]
            t0 = time.perf_counter()
            try:
                status, text = getattr(self, kind)()
            except httpx.HTTPError as e:
                self.tally.error(kind, e)
                time.sleep(0.05)
                continue
            self.tally.add(kind, status, time.perf_counter() - t0, text)
        self.http.close()

    def _sampling(self) -> dict:
        if self.rng.random() < 0.5:
            return {"temperature": 0}
        return {"temperature": 0.8, "seed": self.rng.randrange(1 << 32)}

    def complete(self) -> tuple[int, str]:
        path = self.rng.choice(["/completion", "/v1/completions"])
        prompt, sampling = self.rng.choice(PROMPTS), self._sampling()
        body = {"prompt": prompt, "max_tokens": self.rng.randint(8, 40), **sampling}
        greedy = path == "/completion" and sampling["temperature"] == 0
        if greedy:
            body["return_tokens"] = True
        r = self.http.post(path, json=body)
        if greedy and r.status_code == 200:
            with self.tally.lock:
                self.tally.greedy.setdefault(prompt, []).append(r.json()["tokens"])
        return r.status_code, r.text

    def constraint(self) -> tuple[int, str]:
        body = self.rng.choice(attacks.CONSTRAINT_BODIES)
        path = "/v1/chat/completions" if b'"messages"' in body else "/completion"
        r = self.http.post(path, content=body, headers={"Content-Type": "application/json"})
        return r.status_code, r.text

    def chat(self) -> tuple[int, str]:
        body = {"messages": [{"role": "user", "content": self.rng.choice(PROMPTS)}],
                "max_tokens": self.rng.randint(8, 32), **self._sampling()}
        r = self.http.post("/v1/chat/completions", json=body)
        return r.status_code, r.text

    def cut(self) -> tuple[int, str]:
        body = {"prompt": self.rng.choice(PROMPTS), "n_predict": 200, "stream": True,
                **self._sampling()}
        keep = self.rng.randint(1, 6)
        with self.http.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                return r.status_code, r.read().decode(errors="replace")
            for i, _ in enumerate(r.iter_lines()):
                if i >= keep:
                    break
        return 200, ""       # the connection is dropped mid-stream here

    def long(self) -> tuple[int, str]:
        # ~25 tokens per sentence: most of the context, or past it one time in five
        sentences = int(self.ctx * (1.3 if self.rng.random() < 0.2 else 0.6) / 25)
        body = {"prompt": LONG_TEXT * sentences, "n_predict": 8, **self._sampling()}
        r = self.http.post("/completion", json=body)
        return r.status_code, r.text

    def bad(self) -> tuple[int, str]:
        path = self.rng.choice(["/completion", "/v1/chat/completions", "/tokenize"])
        r = self.http.post(path, content=self.rng.choice(BAD_BODIES),
                           headers={"Content-Type": "application/json"})
        return r.status_code, r.text


def _warm_up(url: str, a: argparse.Namespace, http: dict | None = None) -> None:
    """Each kind of request once per slot, the slots busy at once (answers not counted)."""
    tally = Tally()
    clients = [Client(1000 + i, url, 0.0, tally, a.ctx, _kinds(a), http)
               for i in range(a.parallel)]

    def every_kind(c: Client) -> None:
        for kind in [*c.kinds, "long"]:  # a long prompt may be the one in five past the context
            with contextlib.suppress(httpx.HTTPError):
                getattr(c, kind)()
        c.http.close()

    threads = [threading.Thread(target=every_kind, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)


def _kinds(a: argparse.Namespace) -> dict[str, int]:
    return {**KINDS, "constraint": 10} if a.attackers else KINDS


def _plain_check(url: str, greedy: dict[str, list[list[int]]], http: dict | None = None
                 ) -> dict:
    """Each greedy answer against plain decoding: the prompt once more, speculative false,
    as long as the longest answer; an answer must be a prefix of it. The first few that
    are not are kept: the prompt, where they part, and both continuations from there."""
    checked = differ = 0
    unlike: list[dict] = []
    with httpx.Client(base_url=url, timeout=600, **(http or {})) as c:
        for prompt, answers in greedy.items():
            n = max(len(t) for t in answers)
            r = c.post("/completion", json={"prompt": prompt, "n_predict": n, "temperature": 0,
                                             "return_tokens": True, "speculative": False})
            plain = r.json()["tokens"]
            for t in answers:
                checked += 1
                if plain[:len(t)] != t:
                    differ += 1
                    at = next(i for i, (a, b) in enumerate(zip(t, plain, strict=False))
                              if a != b) if any(
                        a != b for a, b in zip(t, plain, strict=False)) else min(len(t),
                                                                                  len(plain))
                    if len(unlike) < 5:
                        unlike.append({"prompt": prompt, "at": at, "answer": t[at:at + 8],
                                       "plain": plain[at:at + 8]})
    return {"greedy_answers_checked": checked, "greedy_answers_unlike_plain": differ,
            "greedy_unlike": unlike}


def _scrape(url: str, http: dict | None = None) -> dict[str, float]:
    return parse_figures(httpx.get(url + "/metrics", timeout=30, **(http or {})).text)


def _resources(target: dict[str, float], node: dict[str, float] | None) -> dict:
    out = {"target_rss_mb": target["process_resident_memory_bytes"] / 2**20,
           "target_open_fds": target["process_open_fds"],
           "target_contexts_open": target.get('specwire:contexts_open{side="target"}', 0.0),
           "requests_processing": target.get("specwire:requests_processing", 0.0),
           "requests_deferred": target.get("specwire:requests_deferred", 0.0),
           "draft_tokens": target.get("specwire:draft_tokens_total", 0.0),
           "draft_tokens_accepted": target.get("specwire:draft_tokens_accepted_total", 0.0)}
    if node is not None:
        out |= {"node_rss_mb": node["process_resident_memory_bytes"] / 2**20,
                "node_open_fds": node["process_open_fds"],
                "node_contexts_open": node.get('specwire:contexts_open{side="node"}', 0.0),
                "node_slots_in_use": node.get("specwire:node_slots_in_use", 0.0),
                "node_sessions_since_restart": node.get(
                    'specwire:node_calls_total{method="Session"}', 0.0)}
    return out


def _percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(a: argparse.Namespace) -> dict:
    models.default_target()
    models.default_draft()
    log_dir = Path(a.log_dir or tempfile.mkdtemp(prefix="specwire-soak-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    node_port, sync_port, node_metrics, http_port = (_free_port() for _ in range(4))
    node = Process("draft-node", ["draft", "--port", str(node_port), "--sync-port",
                                  str(sync_port), "--metrics-port", str(node_metrics), "-td", "1",
                                  "-c", str(a.ctx), "--max-sessions", "8"],
                   f"listening on 127.0.0.1:{node_port}", log_dir)
    secure = _Secure(log_dir) if a.attackers else None
    scheme = "https" if secure else "http"
    serve = Process("serve", ["serve", "--port", str(http_port), "-t", "1", "-c", str(a.ctx),
                              "-np", str(a.parallel), "--queue-size", "32", "--draft-url",
                              f"127.0.0.1:{node_port}", "--draft-mode", a.draft_mode,
                              *(secure.serve_args(a) if secure else [])],
                    f"listening on {scheme}://127.0.0.1:{http_port}", log_dir)
    url, node_url = f"{scheme}://127.0.0.1:{http_port}", f"http://127.0.0.1:{node_metrics}"
    http = secure.http(HONEST_KEY) if secure else None
    node.start()
    serve.start()
    silent: _SilentTarget | None = None
    report: dict = {"command": " ".join(sys.argv), "minutes": a.minutes, "clients": a.clients,
                    "restart_every_s": a.restart_every, "ctx": a.ctx, "parallel": a.parallel,
                    "draft_mode": a.draft_mode, "logs": str(log_dir)}
    try:
        if a.attackers:
            silent = _SilentTarget(node_port, a, log_dir)
        report["cold"] = _resources(_scrape(url, http), _scrape(node_url))
        _warm_up(url, a, http)
        time.sleep(a.settle_s)   # idle, as at the end: the request threads' pool shrinks
        report["start"] = _resources(_scrape(url, http), _scrape(node_url))
        tally = Tally()
        t0 = time.monotonic()
        until = t0 + 60 * a.minutes
        clients = [Client(i, url, until, tally, a.ctx, _kinds(a), http)
                   for i in range(a.clients)]
        hostile: list[attacks.Attacker] = []
        if a.attackers:
            hostile = [attacks.Slowloris("127.0.0.1", http_port, tls=secure.tls),
                       attacks.SilentPeers("127.0.0.1", node_port, sync_port),
                       *secure.attackers(url, http_port, a)]
            clients.append(Client(a.clients, silent.url, until, silent.tally, a.ctx,
                                  {"complete": 1}))
        over_time: list[dict] = []

        def sample() -> None:
            over_time.append({"t_s": round(time.monotonic() - t0),
                              "serve": attacks.proc_figures(serve.proc.pid),
                              "node": attacks.proc_figures(node.proc.pid)})

        sample()
        report["names_start"] = _names(serve, node, url, http)
        if silent is not None:
            silent.begin()
        for c in [*clients, *hostile]:
            c.start()
        restarts, warm, by_interval = 0, None, []
        next_kill = time.monotonic() + a.restart_every
        next_sample = time.monotonic() + 30.0
        while time.monotonic() < until:
            time.sleep(min(1.0, max(0.0, until - time.monotonic())))
            if time.monotonic() >= next_sample:
                sample()
                next_sample += 30.0
            if time.monotonic() >= next_kill and time.monotonic() < until - 5:
                figures = _resources(_scrape(url, http), _scrape(node_url))
                warm = warm or figures   # the end of the first interval
                by_interval.append(round(figures["target_rss_mb"], 1))
                node.kill()
                time.sleep(a.down_s)
                node.start()
                restarts += 1
                next_kill += a.restart_every
                print(f"[soak] {time.strftime('%H:%M:%S')} node restarted ({restarts}); "
                      f"answers so far: {sum(tally.statuses.values())}", flush=True)
        for c in clients:
            c.join(600)
        for h in hostile:
            h.stop()
        for h in hostile:
            h.join(30)
        time.sleep(2.0)       # let cancelled streams and closing sessions settle
        if a.attackers:
            time.sleep(12.0)  # the node's 10 s deadline for the last silent call
            report["attackers"] = {h.name: h.report() for h in hostile}
            report["attacker_faults"] = attacker_faults(report["attackers"])
            report |= _plain_check(url, tally.greedy, http)
            report["silent_node"] = silent.finish()
        time.sleep(a.settle_s)   # idle, as the start was read
        sample()
        report["names_end"] = _names(serve, node, url, http)
        report["serve_names_differ"] = attacks.names_differ(report["names_start"]["serve"],
                                                            report["names_end"]["serve"])
        report["over_time"] = over_time
        end = _resources(_scrape(url, http), _scrape(node_url))
        report |= {"warm": warm, "end": end, "node_restarts": restarts,
                   "target_rss_mb_before_each_restart": by_interval}
        report |= _summary(tally, report["cold"], report["start"], warm, end)
    finally:
        serve.stop()
        node.stop()
        if silent is not None:
            silent.stop()
    report["target_tracebacks"] = serve.log().count("Traceback")
    report["node_tracebacks"] = node.log().count("Traceback")
    return report


class _Secure:
    """What --attackers adds to serve (issue 40): TLS with a self-signed certificate, a
    LoRA adapter, a slot folder and two API keys; and the attackers that use them."""

    def __init__(self, log_dir: Path) -> None:
        tls_dir = log_dir / "tls"
        tls_dir.mkdir(exist_ok=True)
        self.key_file, self.cert_file = attacks.self_signed(tls_dir)
        self.tls = attacks.tls_client(self.cert_file)
        self.slot_dir = log_dir / "slots"
        self.slot_dir.mkdir(exist_ok=True)
        target = models.default_target()
        self.adapter = attacks.write_lora(target, models.home() /
                                          f"{target.stem}-soak-lora-r4.gguf")

    def serve_args(self, a: argparse.Namespace) -> list[str]:
        return ["--lora", str(self.adapter), "--lora-scale-max", str(a.lora_scale_max),
                "--slot-save-path", str(self.slot_dir), "--ssl-key-file", self.key_file,
                "--ssl-cert-file", self.cert_file, "--api-key", f"{HONEST_KEY},{ATTACKER_KEY}",
                "--keep-alive", str(deadlines.KEEP_ALIVE_S),
                "--header-timeout", str(deadlines.HEADER_TIMEOUT_S)]

    def http(self, key: str) -> dict:
        return {"verify": self.tls, "headers": {"Authorization": f"Bearer {key}"}}

    def attackers(self, url: str, port: int, a: argparse.Namespace) -> list[attacks.Attacker]:
        mine = self.http(ATTACKER_KEY)
        return [attacks.LoraScales(url, mine, a.lora_scale_max),
                attacks.IdleKeepAlive("127.0.0.1", port, self.tls, deadlines.KEEP_ALIVE_S),
                attacks.SlotFiles(url, mine, self.slot_dir, a.parallel),
                attacks.TlsStall("127.0.0.1", port, self.tls, deadlines.HEADER_TIMEOUT_S)]


def attacker_faults(reports: dict[str, dict]) -> dict[str, int]:
    """What no attacker may see, by "attacker:what": a connection held past its deadline,
    a deadline that never closed one, an unexpected answer to a hostile request, a scale
    changed, a spoiled slot file not refused, serve down, a TLS probe refused."""
    faults = {}
    for name, counts in reports.items():
        for what in ("held_past_deadline", "unexpected", "scale_changed", "restore_not_400",
                     "health_failed", "probe_failed", "saved_file_not_found"):
            if counts.get(what):
                faults[f"{name}:{what}"] = counts[what]
        timed = name.endswith(("idle-keep-alive", "tls-stall"))
        if timed and counts.get("closed_by_server", 0) == 0:
            faults[f"{name}:never_closed_by_server"] = 1
    return faults


def _attacker_line(name: str, counts: dict) -> str:
    parts = [f"{k}={v}" for k, v in counts.items() if not isinstance(v, (dict, list))]
    if counts.get("close_s"):
        parts.append(f"close_s p50 {counts['close_s']['p50']} max {counts['close_s']['max']}")
    return f"[soak] attacker {name.removeprefix('soak-attack-')}: " + ", ".join(parts)


class _SilentTarget:
    """A second `serve` drafting through attacks.SilentNode (a node that greets as the
    real one, then never answers), with a client of its own: it must answer every
    request as plain decoding would, and hold nothing more at the end than at the start."""

    def __init__(self, node_port: int, a: argparse.Namespace, log_dir: Path) -> None:
        self.node = attacks.SilentNode(attacks.node_hello("127.0.0.1", node_port))
        self.node.start()
        port = _free_port()
        self.serve = Process("serve-silent-node", [
            "serve", "--port", str(port), "-t", "1", "-c", str(a.ctx), "-np", "1",
            "--draft-url", f"127.0.0.1:{self.node.port}", "--draft-mode", "pipelined"],
            f"listening on http://127.0.0.1:{port}", log_dir)
        self.url, self.tally, self.settle_s = f"http://127.0.0.1:{port}", Tally(), a.settle_s
        self.serve.start()

    def begin(self) -> None:
        """Warm up (four completions, greedy or seeded), settle, then read the start."""
        warm = Client(2000, self.url, 0.0, Tally(), 0, {"complete": 1})
        for _ in range(4):
            with contextlib.suppress(httpx.HTTPError):
                warm.complete()
        warm.http.close()
        time.sleep(self.settle_s)
        self.start = self._names()

    def _names(self) -> dict:
        time.sleep(0.5)
        return attacks.proc_names(self.serve.proc.pid)

    def finish(self) -> dict:
        """What its client saw, its greedy answers against its own plain decoding, and its
        threads and descriptors at the end against the start (after the same settling)."""
        out = _summary_counts(self.tally) | {"node": self.node.report()}
        out |= _plain_check(self.url, self.tally.greedy)
        time.sleep(self.settle_s)
        end = self._names()
        out |= {"names_start": self.start, "names_end": end,
                "names_differ": attacks.names_differ(self.start, end),
                "tracebacks": self.serve.log().count("Traceback")}
        return out

    def stop(self) -> None:
        self.serve.stop()
        self.node.stop()


def _summary_counts(t: Tally) -> dict:
    by_status = Counter()
    for key, n in t.statuses.items():
        by_status[int(key.rsplit(":", 1)[1])] += n
    return {"answers": sum(t.statuses.values()),
            "served_2xx": sum(n for s, n in by_status.items() if 200 <= s < 300),
            "status_counts": dict(sorted(t.statuses.items())),
            "count_5xx": sum(n for s, n in by_status.items() if s >= 500),
            "first_5xx": t.five_xx, "transport_errors": dict(t.errors)}


def _names(serve: Process, node: Process, url: str, http: dict | None = None) -> dict:
    """Both processes' threads by name and descriptors by kind (soak_attacks.proc_names),
    and the target's Python threads by name (its /metrics: /proc names them all python)."""
    time.sleep(0.5)      # the last scrape's connection closed on the server's side too
    out = {"serve": attacks.proc_names(serve.proc.pid), "node": attacks.proc_names(node.proc.pid)}
    # read after /proc: the scrape's own connection is not among the descriptors
    out["serve"]["python_threads"] = {
        k[len('specwire:threads{name="'):-2]: int(v) for k, v in _scrape(url, http).items()
        if k.startswith('specwire:threads{name="')}
    return out


def _counts(names: dict) -> str:
    serve = names["serve"]
    return f"{sum(serve['threads'].values())}/{sum(serve['fds'].values())}"


def _summary(t: Tally, cold: dict, start: dict, warm: dict | None, end: dict) -> dict:
    ok = [s for kind, xs in t.latency.items() for s in xs]
    return _summary_counts(t) | {
        "latency_s": {"p50": _percentile(ok, 0.5), "p99": _percentile(ok, 0.99),
                      "max": max(ok) if ok else float("nan"), "n": len(ok),
                      **{f"p99_{k}": _percentile(v, 0.99) for k, v in sorted(t.latency.items())}},
        "target_rss_growth_pct": 100 * (end["target_rss_mb"] / start["target_rss_mb"] - 1),
        "target_rss_growth_from_cold_pct": 100 * (end["target_rss_mb"] / cold["target_rss_mb"]
                                                  - 1),
        "target_rss_growth_after_first_interval_pct": 100 * (
            end["target_rss_mb"] / (warm or start)["target_rss_mb"] - 1),
        "open_at_end": {k: end[k] for k in ("requests_processing", "requests_deferred",
                                            "node_contexts_open", "node_slots_in_use")},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--restart-every", type=float, default=60.0,
                   help="seconds between SIGKILLs of the draft node")
    p.add_argument("--down-s", type=float, default=1.0, help="seconds the node stays dead")
    p.add_argument("--ctx", type=int, default=1024, help="context size of target and node")
    p.add_argument("-np", "--parallel", type=int, default=2, help="the server's slots")
    p.add_argument("--draft-mode", choices=["auto", "sync", "pipelined"], default="auto")
    p.add_argument("--attackers", action="store_true",
                   help="issue 23's attackers beside the clients (soak_attacks.py)")
    p.add_argument("--lora-scale-max", type=float, default=limits.LORA_SCALE_MAX,
                   help="serve's --lora-scale-max with --attackers: 1e5 or more lets the "
                   "LoRA attacker's scale 1e5 through, to exercise the NaN defence (its own "
                   "request may then fail; never an honest one)")
    p.add_argument("--settle-s", type=float, default=16.0,
                   help="idle seconds before the start's and the end's readings (anyio "
                   "retires a request thread idle for 10 s; serve asks it every 5 s)")
    p.add_argument("--log-dir", help="where the server's and the node's logs go")
    p.add_argument("--out", help="write the report as JSON here too")
    a = p.parse_args(argv)
    report = run(a)
    text = json.dumps(report, indent=2, default=float)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    differ = report["serve_names_differ"]
    ok = report["count_5xx"] == 0 and report["target_rss_growth_pct"] < 5 and \
        not any(report["open_at_end"].values()) and report["target_tracebacks"] == 0 and \
        not report.get("greedy_answers_unlike_plain", 0) and not differ
    for name, counts in report.get("attackers", {}).items():
        print(_attacker_line(name, counts), flush=True)
    if report.get("attacker_faults"):
        ok = False
        print(f"[soak] attacker faults: {report['attacker_faults']}", flush=True)
    honest_errors = {k: v for k, v in report["transport_errors"].items()
                     if not k.startswith("cut:")}
    if honest_errors:
        print(f"[soak] transport errors of honest requests (outside a cut stream): "
              f"{honest_errors}", flush=True)
    if "greedy_answers_checked" in report:
        print(f"[soak] greedy answers equal to plain decoding: "
              f"{report['greedy_answers_checked'] - report['greedy_answers_unlike_plain']}/"
              f"{report['greedy_answers_checked']}", flush=True)
    if "silent_node" in report:
        quiet = report["silent_node"]
        ok = ok and quiet["count_5xx"] == 0 and not quiet["greedy_answers_unlike_plain"] \
            and not quiet["names_differ"] and quiet["tracebacks"] == 0
        print(f"[soak] the target of a silent node: {quiet['served_2xx']} served, "
              f"{quiet['count_5xx']} 5xx, {quiet['greedy_answers_unlike_plain']} of "
              f"{quiet['greedy_answers_checked']} greedy answers unlike plain decoding, "
              f"calls {quiet['node']}, threads and descriptors end minus start "
              f"{quiet['names_differ'] or 'none'}", flush=True)
    if differ:
        print(f"[soak] the target's threads or descriptors at the end differ from the "
              f"start's (end minus start, by name): {differ}", flush=True)
    print(f"[soak] {'PASS' if ok else 'FAIL'}: {report['served_2xx']} served, "
          f"{report['count_5xx']} 5xx, p99 {report['latency_s']['p99']:.2f} s, target RSS "
          f"{report['target_rss_growth_pct']:+.1f}% from the start after warm-up "
          f"({report['target_rss_growth_from_cold_pct']:+.1f}% from cold, "
          f"{report['target_rss_growth_after_first_interval_pct']:+.1f}% after the first "
          f"interval), open at end "
          f"{report['open_at_end']}, threads/fds start {_counts(report['names_start'])} "
          f"end {_counts(report['names_end'])}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
