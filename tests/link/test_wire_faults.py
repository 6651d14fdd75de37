"""The target when its draft node fails or lies: the node SIGKILLed and restarted
mid-use, the link stalled, and hostile nodes (an in-process fake node sending
malformed, stale and wrong frames, one with another vocabulary)."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time

import pytest
from wire_helpers import (
    CODE,
    GREEDY,
    FakeNode,
    NodeProcess,
    _random_chunk,
    chunk,
    error,
    ref,
    request,
    run_to_end,
    wait_for,
)

from specwire.config import ConfigError
from specwire.engine.engine import Engine
from specwire.link.remote import make_remote_drafter
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import LinkError, LinkSettings
from specwire.settings import RemoteSettings

FAST_RETRY = LinkSettings(backoff_min_s=0.01, backoff_max_s=0.05)


# ============================================================================ faults


def _kill_once(node: NodeProcess, after_tokens: int, state: dict):
    def on_step(g) -> None:
        if "killed_at" not in state and len(g.tokens) >= after_tokens and g.stats.draft_n > 0:
            node.kill()
            state["killed_at"] = len(g.tokens)
    return on_step


def _request_readers() -> int:
    """grpcio's threads that read a streaming call's request iterator (found by the
    function they run: grpcio names them only "Thread-N (_run)")."""
    def reading(frame) -> bool:
        while frame is not None:
            if frame.f_code.co_name == "consume_request_iterator":
                return True
            frame = frame.f_back
        return False

    return sum(map(reading, sys._current_frames().values()))


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
def test_node_killed_mid_generation_then_restarted(target, node, pipelined) -> None:
    """SIGKILL the node while a request is drafting: the request completes with the same
    tokens. Restart it on the same port: the same RemoteDrafter reconnects (counter
    `reconnects`) and drafts again in the next request, with the same output again. The
    failed call leaves no thread behind (grpcio's reader of its request iterator)."""
    before = _request_readers()
    prompt, n = target.tokens(CODE), 32
    want = ref(target, GREEDY, n)
    rd = target.drafter(node.url, pipelined=pipelined,
                        settings=LinkSettings(backoff_min_s=0.05, backoff_max_s=0.2))
    try:
        state: dict = {}
        g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
        assert run_to_end(g, on_step=_kill_once(node, 6, state)) == want
        assert state.get("killed_at", n) < n - 8, "the node was not killed mid-generation"
        assert not node.alive and not rd.links[0].up
        assert rd.counters.dropped_peers == 0        # a dead node is not a hostile one
        wait_for(lambda: _request_readers() <= before, 5, "the failed call's threads to end")

        node.start()
        chunks = rd.counters.chunks

        def patient(g) -> None:                         # give the channel time to come back
            if rd.counters.chunks == chunks and len(g.tokens) < 12:
                time.sleep(0.25)

        g2 = Engine(target.backend, rd).generate(request(prompt, 24, GREEDY, 4))
        assert run_to_end(g2, on_step=patient) == want[:24]
        assert rd.counters.reconnects >= 1
        assert rd.counters.sync_port_sessions >= (0 if pipelined else 2)
        assert rd.counters.chunks > chunks
        assert g2.stats.draft_n > 0 and g2.stats.draft_n_accepted > 0
        assert rd.links[0].up
    finally:
        rd.close()


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
def test_stalled_node_costs_at_most_one_deadline(target, node, pipelined) -> None:
    """The link goes silent (blackhole) mid-generation: the request completes with the same
    tokens; pipelined rounds never wait (not even one deadline), synchronous ones wait for
    one sync_timeout_s deadline and then stop waiting (not one deadline per round)."""
    prompt, n = target.tokens(CODE), 24
    want = ref(target, GREEDY, n)
    deadline_ms = 1000 if pipelined else 300
    with node.emulator() as emu:
        rd = target.drafter(f"127.0.0.2:{emu.port}", pipelined=pipelined,
                            sync_timeout_s=deadline_ms / 1000)
        state: dict = {}

        def on_step(g) -> None:
            if "at" not in state and len(g.tokens) >= 4 and rd.counters.chunks > 0:
                emu.blackhole = True
                state.update(at=len(g.tokens), rounds=g.stats.rounds,
                             wait_ms=rd.counters.wait_ms)
        try:
            g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
            assert run_to_end(g, on_step=on_step) == want
            assert "at" in state, "the link was never stalled"
            rounds_stalled = g.stats.rounds - state["rounds"]
            waited_ms = rd.counters.wait_ms - state["wait_ms"]
            assert rounds_stalled >= 5, state
            detail = f"{waited_ms:.0f} ms waited over {rounds_stalled} stalled rounds"
            if pipelined:
                assert waited_ms < deadline_ms, detail
            else:
                assert rd.counters.sync_timeouts >= 1, detail
                assert waited_ms < deadline_ms * min(4, rounds_stalled - 1), detail
        finally:
            emu.blackhole = False
            rd.close()


# ============================================================================ hostile nodes


def _undecodable(rng: random.Random) -> bytes:
    while True:
        data = rng.randbytes(rng.randrange(3, 40))
        try:
            pb.DraftMessage.FromString(data)
        except Exception:  # noqa: BLE001 - DecodeError; any failure to parse will do
            return data


def _violations(n_vocab: int, seed: int = 7) -> list[tuple[str, object]]:
    """(name, script) pairs; each script answers the Open with frames that break the
    protocol once (after zero or more valid frames)."""
    rng = random.Random(seed)
    rand_tokens = [rng.randrange(-2**31, 2**31) for _ in range(8)] + [n_vocab + 1]
    garbage = _undecodable(rng)
    randoms = [_random_chunk(rng, n_vocab) for _ in range(6)]

    def once(frames_of):
        def script(o, v, state):
            return [] if v is not None else frames_of(len(o.history), o.history[-1])
        return script

    return [
        ("token id = n_vocab", once(lambda p, t: [chunk(0, p, [n_vocab])])),
        ("negative token id", once(lambda p, t: [chunk(0, p, [t, -1])])),
        ("random int32 token ids", once(lambda p, t: [chunk(0, p, rand_tokens)])),
        ("start 2^32-1 (-1 as uint32)", once(lambda p, t: [chunk(0, 2**32 - 1, [t])])),
        ("start far past the history", once(lambda p, t: [chunk(0, p + 100_000, [t])])),
        ("gap inside a gen", once(lambda p, t: [chunk(0, p, [t]), chunk(0, p + 3, [t])])),
        ("rewind inside a gen", once(lambda p, t: [chunk(0, p, [t, t]), chunk(0, p, [t])])),
        ("absurd chunk size", once(lambda p, t: [chunk(0, p, [t] * 5000)])),
        ("q arrays of the wrong size",
         once(lambda p, t: [chunk(0, p, [t], q_k=2, q_ids=[t], q_probs=[1.0])])),
        ("NaN q probability",
         once(lambda p, t: [chunk(0, p, [t], q_k=2, q_ids=[t, t + 1], q_probs=[math.nan, 1])])),
        ("q_k of a million",
         once(lambda p, t: [chunk(0, p, [t], q_k=10**6, q_ids=[t], q_probs=[1.0])])),
        ("error message", once(lambda p, t: [error("CUDA out of memory")])),
        ("undecodable bytes", once(lambda p, t: [garbage])),
        ("empty message", once(lambda p, t: [pb.DraftMessage()])),
        ("random chunks, then a bad one", once(lambda p, t: [
            pb.DraftMessage(chunk=c) for c in randoms] + [chunk(0, p, [-3])])),
    ]


@pytest.mark.slow
def test_malformed_frames_drop_the_peer_and_leave_the_output_alone(target) -> None:
    """A fake node answers each session with one kind of malformed frame (fixed seeds):
    the RemoteDrafter drops it every time (dropped_peers counts each), reconnects, and
    the request's output equals plain decoding."""
    prompt, n = target.tokens(CODE), 48  # room for every violation at one per round or two
    want = ref(target, GREEDY, n)
    violations = _violations(target.n_vocab)
    quiet = lambda o, v, state: []  # noqa: E731 - the last script repeats: a silent node
    scripts = [s for _, s in violations] + [quiet]
    with FakeNode(target.fingerprint, target.n_vocab, scripts=scripts) as fake:
        rd = target.drafter(fake.url, pipelined=True, settings=FAST_RETRY)

        def in_step(g) -> None:      # each opened session must be answered before going on
            k = min(len(fake.sessions), len(violations))
            wait_for(lambda: rd.counters.dropped_peers >= k, 10,
                     f"the drop of {violations[k - 1][0]!r}")
            wait_for(lambda: all(s["ended"] for s in fake.sessions[:k]), 10, "the stream's end")

        try:
            g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
            assert run_to_end(g, on_step=in_step) == want
            served = [s["script"] for s in fake.sessions]
            assert served[:len(violations)] == list(range(len(violations))), served
            assert rd.counters.dropped_peers == len(violations)
        finally:
            rd.close()


@pytest.mark.slow
def test_a_node_that_ends_every_session_is_backed_off(target) -> None:
    """A node that greets, then ends each session right after the Open: the target backs
    off longer each time instead of reopening every round, and decodes plainly."""
    prompt, n = target.tokens(CODE), 24
    hang_up = lambda o, v, state: None  # noqa: E731
    with FakeNode(target.fingerprint, target.n_vocab, scripts=[hang_up]) as fake:
        settings = LinkSettings(backoff_min_s=0.05, backoff_max_s=60.0)
        rd = target.drafter(fake.url, pipelined=False, settings=settings)
        try:
            g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
            assert run_to_end(g) == ref(target, GREEDY, n)
            assert g.stats.draft_n == 0
            # The pause doubles after each session, so sessions grow like log(time).
            elapsed = g.stats.predicted_ms / 1000
            most = 2 + math.log2(1 + elapsed / settings.backoff_min_s)
            assert 1 <= len(fake.sessions) <= most, (len(fake.sessions), g.stats.rounds)
            assert rd.links[0].failures >= len(fake.sessions) - 1
        finally:
            rd.close()


def _continuation(target, wrong: bool, stale: bool):
    """Script: after each verdict, a fresh gen of 4 tokens from the committed position,
    either the plain continuation (right) or each token shifted by one (valid, wrong);
    with stale, followed by a chunk of the previous gen carrying the right tokens."""
    full = target.tokens(CODE) + ref(target, GREEDY, 32)

    def tokens_at(start: int) -> list[int]:
        out = [full[p] if p < len(full) else 0 for p in range(start, start + 4)]
        return [(t + 1) % target.n_vocab for t in out] if wrong else out

    def script(o, v, state):
        if v is None:
            return []
        state["gen"] = state.get("gen", 0) + 2
        start = v.position + v.accepted + len(v.tokens)
        frames = [chunk(state["gen"], start, tokens_at(start), done=True)]
        if stale:
            frames.append(chunk(state["gen"] - 1, start, full[start:start + 4], done=True))
        return frames
    return script


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["right", "wrong", "stale"])
def test_fake_node_drafts_are_verified(target, kind) -> None:
    """Well-formed drafts from a fake node go through verification: the right tokens are
    accepted (so the fake really drafts), valid but wrong ones are all rejected, and
    chunks of a decreasing gen (carrying the right tokens) are ignored as stale. None of
    it drops the peer, and the output equals plain decoding every time."""
    prompt, n = target.tokens(CODE), 16
    script = _continuation(target, wrong=kind != "right", stale=kind == "stale")
    with FakeNode(target.fingerprint, target.n_vocab, scripts=[script]) as fake:
        rd = target.drafter(fake.url, pipelined=False, sync_timeout_s=5.0)
        try:
            g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4))
            assert run_to_end(g) == ref(target, GREEDY, n)
            assert g.stats.draft_n > 0
            if kind == "right":
                assert g.stats.draft_n_accepted > 0
            else:
                assert g.stats.draft_n_accepted == 0
            if kind == "stale":
                assert rd.counters.stale_chunks > 0
            assert rd.counters.dropped_peers == 0 and rd.counters.sync_timeouts == 0
            assert len(fake.sessions) == 1
        finally:
            rd.close()


@pytest.mark.slow
def test_incompatible_node_is_refused_at_connect(target) -> None:
    """A node with another vocabulary (or protocol) fails the handshake: Link.connect and
    make_remote_drafter raise an error naming both models and saying 'incompatible'."""
    with FakeNode("0" * 32, 32000, model="llama-2-7b-draft.gguf") as fake:
        link = target.link(fake.url)
        with pytest.raises(LinkError, match="incompatible models") as e:
            asyncio.run(link.connect())
        assert target.backend.name in str(e.value) and "llama-2-7b-draft.gguf" in str(e.value)
        assert "32000" in str(e.value) and not link.up and not link.ready_to_try()
        with pytest.raises(ConfigError, match="incompatible models") as e:
            make_remote_drafter([fake.url], RemoteSettings(pipelined=True), target.backend)
        assert target.backend.name in str(e.value) and "llama-2-7b-draft.gguf" in str(e.value)
    other = protocol.PROTOCOL_VERSION + 1
    with (FakeNode(target.fingerprint, target.n_vocab, protocol_version=other) as fake,
          pytest.raises(LinkError, match=f"incompatible draft node .*protocol {other}")):
        asyncio.run(target.link(fake.url).connect())
