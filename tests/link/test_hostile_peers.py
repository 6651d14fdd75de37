"""Hostile draft nodes: whatever a node does, the request completes in bounded time with
plain decoding's tokens.

Each test runs the bundled target over real sockets against a scripted node
(tests/support/hostile_node.py: h2 on a raw socket, misbehaving on cue) for one finding of
the security review (issue 15): flow control withheld (a window of 0, never a
WINDOW_UPDATE), frames that carry nothing streamed without end, endless stale chunks,
a DATA flood, a malformed grpc-status, valid chunks that extend nothing, RST_STREAM,
a CONTINUATION flood, zero or overflowing WINDOW_UPDATEs, PING and SETTINGS floods;
then rejection mode (a node without q, a node lying in q under coupled verification,
`generate --verify rejection` with a llama-server drafter) and drafters that raise.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hostile_node import FILLER, Peer, Script, block, frame, hostile_node
from wire_helpers import CODE, GREEDY, ROOT, SEEDED, request, run_to_end, wait_for

from specwire.config import ConfigError, VerifyMode
from specwire.drafters.base import Capabilities, Draft, StatelessDrafter
from specwire.engine.engine import Engine
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import LinkSettings

pytestmark = pytest.mark.slow

N = 24
SYNC_TIMEOUT_S = 0.3
#: Realistic backoff (the CLI's), so a node that misbehaves after drafting a little is not
#: retried every few milliseconds.
BACKOFF = LinkSettings(backoff_min_s=0.25, backoff_max_s=5.0)


@pytest.fixture(scope="module", name="plain_s")
def plain_s_fixture(target) -> float:
    """Seconds plain decoding of N tokens takes here (the machine is shared: measured)."""
    prompt = target.tokens(CODE)
    target.plain(prompt, GREEDY, N)
    t0 = time.monotonic()
    Engine(target.backend).generate(request(prompt, N, GREEDY, 4, enabled=False)).run()
    return time.monotonic() - t0


def _run(target, script: Script, sampling=GREEDY, settle: str | None = None, **draft):
    """A synchronous request of N tokens against the scripted node: (tokens, seconds,
    drafter counters, generation, port). settle: a counter that a session thread moves
    after the request may have ended; its first count is waited for (up to 10 s)."""
    prompt = target.tokens(CODE)
    with hostile_node(target, script) as (fake, port):
        rd = target.drafter(fake.url, pipelined=False, settings=BACKOFF,
                            sync_timeout_s=SYNC_TIMEOUT_S)
        try:
            t0 = time.monotonic()
            g = Engine(target.backend, rd).generate(request(prompt, N, sampling, 4, **draft))
            got = run_to_end(g, timeout=60)
            elapsed = time.monotonic() - t0
            if settle is not None:
                wait_for(lambda: getattr(rd.counters, settle) > 0, 10, settle)
            return got, elapsed, rd.counters.as_dict(), g, rd.links[0], port
        finally:
            rd.close()


def _bounded(target, plain_s: float, script: Script, deadlines: int = 4, **kw):
    """Run the script; assert plain decoding's tokens within plain time, a few deadlines
    and a margin for the shared machine; return the rest of _run's results."""
    got, elapsed, counters, g, link, port = _run(target, script, **kw)
    sampling = kw.get("sampling", GREEDY)
    assert got == target.plain(target.tokens(CODE), sampling, N)
    limit = 2 * plain_s + deadlines * SYNC_TIMEOUT_S + 2.0
    assert elapsed < limit, f"{elapsed:.2f} s, limit {limit:.2f} s; {counters}"
    assert port.sessions >= 1, "the scripted node never saw a session"
    return counters, g, link


def _settings(key: int, value: int) -> bytes:
    return frame(4, 0, 0, key.to_bytes(2, "big") + value.to_bytes(4, "big"))


# ============================================================================ flow control


class WindowZero(Script):
    """SETTINGS_INITIAL_WINDOW_SIZE = 0: the target can never send another verdict."""

    settings = {4: 0}


class NoWindowUpdate(Script):
    """A small window that is never credited back: verdicts stop after a few rounds."""

    credit = False

    def on_open(self, peer: Peer, o: pb.Open) -> None:
        peer.raw(_settings(4, peer.received + 60))  # room for a few verdicts after the Open
        peer.answer()


@pytest.mark.parametrize("script", [WindowZero(), NoWindowUpdate()],
                         ids=["window-0", "no-window-update"])
def test_withheld_credit_costs_one_deadline_per_session(target, plain_s, script) -> None:
    """The message that finds no credit gives up at its deadline (a verdict at the round's,
    not the old 10 s; with a window of 0 from the start, the Open, on the session thread),
    the node is dropped, and the request decodes plainly meanwhile."""
    counters, g, link = _bounded(target, plain_s, script, settle="dropped_peers")
    assert counters["dropped_peers"] >= 1 and "credit" in link.last_error
    if isinstance(script, NoWindowUpdate):
        assert g.stats.draft_n > 0  # it did draft until the window ran out


# ====================================================================== frames that keep coming


class Streamer(Script):
    """Never answers a verdict; from the Open on, sends `data` every `every_s`."""

    def __init__(self, data, every_s: float) -> None:
        self.data, self.every_s = data, every_s

    def on_verdict(self, peer: Peer, v: pb.Verdict) -> None:
        pass

    def background(self, peer: Peer) -> None:
        while not peer.stopped.wait(self.every_s):
            try:
                peer.raw(self.data(peer) if callable(self.data) else self.data)
            except OSError:
                return


def _stale(peer: Peer) -> bytes:
    """A chunk of branch 0 (the Open's answer opened branch 1): stale forever."""
    msg = pb.DraftMessage(chunk=pb.DraftChunk(gen=0, start=peer.position, tokens=[FILLER]))
    data = msg.SerializeToString()
    return frame(0, 0, peer.sid, b"\0" + len(data).to_bytes(4, "big") + data)


@pytest.mark.parametrize("script", [
    Streamer(frame(0xEE, 0, 0, b"unknown"), 0.005),
    Streamer(frame(2, 0, 1, b"\0\0\0\3\x10"), 0.005),
    Streamer(frame(4, 1, 0), 0.025),
    Streamer(frame(6, 1, 0, b"12345678"), 0.02),
], ids=["unknown-type", "priority", "settings-ack", "ping-ack"])
def test_ignored_frames_cannot_pin_a_round(target, plain_s, script) -> None:
    """A node streaming frames HTTP/2 says to ignore, under the flood limits, and never
    answering: the round waits one deadline, then the target stops waiting for it."""
    counters, _, _ = _bounded(target, plain_s, script)
    assert counters["sync_timeouts"] >= 1
    assert counters["wait_ms"] < 1000 * SYNC_TIMEOUT_S * 3, counters


def test_endless_stale_chunks_cannot_pin_a_round(target, plain_s) -> None:
    """Stale chunks, one a millisecond: a wait ends at its deadline, and a round that finds
    a pile of them waiting drops the node."""
    counters, _, link = _bounded(target, plain_s, Streamer(_stale, 0.001))
    assert counters["stale_chunks"] > 0 and counters["dropped_peers"] >= 1
    assert "messages waiting" in link.last_error or "extend nothing" in link.last_error


def test_data_flood_is_bounded(target, plain_s) -> None:
    """A node writing DATA as fast as the socket takes it (200 stale chunks a frame): the
    target reads at most what it credits, never waits past a deadline, and drops it."""
    def flood(peer: Peer) -> bytes:
        one = _stale(peer)[9:]
        return frame(0, 0, peer.sid, one * (16000 // len(one)))

    counters, _, link = _bounded(target, plain_s, Streamer(flood, 0.0))
    assert counters["dropped_peers"] >= 1 or "unread messages" in link.last_error


# ============================================================== answers that end or say nothing


class EndsWith(Script):
    """Answers the Open, then meets the first verdict with `act(peer)`."""

    def __init__(self, act) -> None:
        self.act = act

    def on_verdict(self, peer: Peer, v: pb.Verdict) -> None:
        self.act(peer)


@pytest.mark.parametrize("status, why", [("\u00b2", "malformed grpc-status"),
                                         ("999", "malformed grpc-status"),
                                         ("13", "gRPC status 13")],
                         ids=["superscript-two", "999", "internal"])
def test_a_bad_grpc_status_is_a_clean_failure(target, plain_s, status, why) -> None:
    """A trailer whose grpc-status passes str.isdigit but not int() (or is no code): the
    session fails cleanly, the link backs off, the request goes on."""
    trailers = [("grpc-status", status), ("grpc-message", "bye")]
    _, _, link = _bounded(target, plain_s, EndsWith(lambda p: p.end(trailers)))
    assert why in link.last_error


def test_rst_stream_ends_the_session_not_the_request(target, plain_s) -> None:
    counters, _, link = _bounded(target, plain_s, EndsWith(lambda p: p.reset()))
    assert "reset" in link.last_error


def _continuation_flood(peer: Peer) -> None:
    head = block([("grpc-status", "0")])
    peer.raw(frame(1, 0, peer.sid, head) + frame(9, 0, peer.sid) * 100)


@pytest.mark.parametrize("act, why", [
    (_continuation_flood, "continuation"),
    (lambda p: p.raw(frame(8, 0, 0, b"\0\0\0\0")), "non-compliant"),
    (lambda p: p.raw(frame(8, 0, 0, (2**31 - 1).to_bytes(4, "big"))), "2147483647"),
], ids=["continuation-flood", "zero-window-update", "overflowing-window-update"])
def test_protocol_violations_end_the_connection(target, plain_s, act, why) -> None:
    _, _, link = _bounded(target, plain_s, EndsWith(act))
    assert why in link.last_error.lower() or why in link.last_error


@pytest.mark.parametrize("script, why", [
    (Streamer(frame(6, 0, 0, b"12345678"), 0.001), "PING"),
    (Streamer(frame(4, 0, 0), 0.001), "SETTINGS"),
], ids=["ping-flood", "settings-flood"])
def test_floods_end_the_connection(target, plain_s, script, why) -> None:
    _, _, link = _bounded(target, plain_s, script)
    assert "flood" in link.last_error and why in link.last_error


class Useless(Script):
    """Answers every message at once with a valid chunk that extends nothing: a fresh
    branch starting past the history's end."""

    def on_open(self, peer: Peer, o: pb.Open) -> None:
        peer.gen += 1
        peer.chunk(peer.gen, peer.position + 50, [FILLER])

    on_verdict = on_open


def test_useless_answers_get_the_node_dropped(target, plain_s) -> None:
    """Each useless answer ends its round's wait at once (not a deadline per round), and
    three in a row drop the node."""
    counters, g, _ = _bounded(target, plain_s, Useless(), deadlines=1)
    assert counters["useless_answers"] >= 3 and counters["dropped_peers"] >= 1
    assert counters["sync_timeouts"] == 0
    assert counters["wait_ms"] < 1000 * SYNC_TIMEOUT_S, counters
    assert g.stats.draft_n == 0


# ============================================================================ rejection mode


class NoQ(Script):
    """A node that sends tokens without their q although the target is in rejection mode."""


def test_rejection_mode_without_q_decodes_plainly(target, plain_s) -> None:
    """No q where rejection mode needs one: the drafter's failure is caught at the engine's
    boundary (guard_failures), and the request samples exactly what plain decoding does."""
    counters, g, _ = _bounded(target, plain_s, NoQ(), sampling=SEEDED, mode="rejection")
    assert g.stats.draft_n == 0 and g.stats.drafter.get("guard_failures", 0) >= 1


class LyingQ(Script):
    """Proposes FILLER claiming q(FILLER) = 1e-6, the lie that buys acceptance in rejection
    mode wherever the target gives FILLER any probability."""

    def on_open(self, peer: Peer, o: pb.Open) -> None:
        peer.answer([FILLER], q_k=2, q_ids=[FILLER, FILLER + 1], q_probs=[1e-6, 1 - 1e-6])

    on_verdict = on_open


def test_coupled_mode_cannot_be_steered_by_a_lying_node(target, plain_s) -> None:
    """Coupled verification (the default at T > 0) ignores q: the output is the target's
    own sample sequence whatever the node claims."""
    _bounded(target, plain_s, LyingQ(), sampling=SEEDED, mode="coupled")


class _Raising(StatelessDrafter):
    """A drafter that raises `error` from `where` (after a first good round)."""

    name = "raising"
    capabilities = Capabilities(deterministic=True)

    def __init__(self, where: str, error: Exception) -> None:
        self.where, self.error, self.calls = where, error, 0

    def begin(self, prompt, sampling, params, **guide) -> None:
        if self.where == "begin":
            raise self.error

    def propose(self, history, k: int) -> Draft:
        self.calls += 1
        if self.where == "propose" and self.calls > 1:
            raise self.error
        if self.where == "garbage" and self.calls > 1:
            return Draft([10**9])
        return Draft([FILLER] * k)

    def learn(self, history, accepted: int, appended: int) -> None:
        if self.where == "learn":
            raise self.error


@pytest.mark.parametrize("where, error", [
    ("begin", RuntimeError("boom")), ("propose", ZeroDivisionError()),
    ("learn", KeyError("x")), ("garbage", None), ("propose", MemoryError()),
], ids=["begin", "propose", "learn", "out-of-vocabulary", "memory-error"])
def test_any_drafter_failure_is_plain_decoding(target, where, error) -> None:
    """Whatever a drafter raises, from whichever method, or whatever garbage it proposes:
    the request completes with plain decoding's tokens, the failure counted."""
    prompt = target.tokens(CODE)
    g = Engine(target.backend, _Raising(where, error)).generate(request(prompt, 12, GREEDY, 4))
    assert run_to_end(g, timeout=60) == target.plain(prompt, GREEDY, 12)
    assert g.stats.drafter.get("guard_failures", 0) >= 1


class _Sampler(StatelessDrafter):
    name = "sampler-without-q"

    def propose(self, history, k: int) -> Draft:
        return Draft([FILLER])


def test_rejection_mode_refuses_a_drafter_without_q_that_is_not_deterministic(target) -> None:
    with pytest.raises(ConfigError, match="no draft distribution q"):
        Engine(target.backend, _Sampler(), verify=VerifyMode.REJECTION)
    Engine(target.backend, _Raising("none", None), verify=VerifyMode.REJECTION)  # one-hot q


class _LlamaServer(BaseHTTPRequestHandler):
    """/completion as llama-server answers it: n_predict greedy tokens (here: FILLER)."""

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        out = json.dumps({"tokens": [FILLER] * body["n_predict"], "content": ""}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args) -> None:
        pass


def test_generate_with_a_llama_server_drafter_in_rejection_mode() -> None:
    """`specwire generate --draft-url http://HOST:PORT --verify rejection --temp 0.8`: the
    llama-server drafter is greedy, so it drafts with a point-mass q; no traceback, and
    the log says once that rejection mode trusts a remote drafter's q."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _LlamaServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        r = subprocess.run(
            [sys.executable, "-m", "specwire", "generate", "def mean(xs):", "-n", "12",
             "--draft-url", f"http://127.0.0.1:{server.server_address[1]}",
             "--verify", "rejection", "--temp", "0.8", "--seed", "7", "--json",
             "--draft-policy", "fixed", "--draft-p-min", "0"],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    finally:
        server.shutdown()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.count("trusts the q") == 1
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 12 and out["stats"]["draft_n"] > 0
