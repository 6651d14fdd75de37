"""The cross-tenant probe against a real draft node: two targets, two tokens of one
--token-file, the bundled pair.

A victim (token alice) has a private conversation on the node. An attacker who
knows its opening sends [known prefix, recovered tokens, guess, filler] through
its own target, for four guesses per position (the true next token and three
others), and reads draft_cache_n: a guess that makes the node reuse one token
more than the others is the victim's. With the attacker's own token (mallory)
it distinguishes no position; the same probe afterwards in the victim's own scope
(the control: the victim's entries were there all along, and the probe works)
distinguishes every one. The victim still
reuses its own conversation, a cache_salt of its own is a scope apart, output
equals plain decoding, and SIGHUP empties the node's memory. The node's own time to
the first draft is measured for the same probe on a raw gRPC stream (printed; the
equal work is asserted), and a client certificate is one identity on both ports.
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Iterator

import grpc
import pytest
import specwire_pb2_grpc as pbg
from node_calls import Stream, _open
from wire_helpers import (
    GREEDY,
    N_CTX,
    NodeProcess,
    draft_model_path,
    make_certs,
    node_process,
    request,
    run_to_end,
    wait_for,
)

from specwire.config import ModelParams
from specwire.engine.engine import Engine
from specwire.link.transport import protocol
from specwire.link.transport.channel import LinkSettings
from specwire.link.transport.h2 import mux as sync_mux
from specwire.node import server as node_mod
from specwire.node.server import NodeSettings

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]   # one sequence: tests/support/bundled.py
ALICE, MALLORY = "alice-token-0123456789", "mallory-token-0123456789"
KNOWN = "<start_of_turn>user\nKeep this private.\n"
PRIVATE = "My account password is tulip-4817 and my PIN is 2093, never share them."
POSITIONS = 8


@pytest.fixture(scope="module")
def node(tmp_path_factory) -> Iterator[NodeProcess]:
    d = tmp_path_factory.mktemp("tenants")
    (d / "tokens").write_text(f"alice {ALICE}\nmallory {MALLORY}\n")
    # Room for every probe's sequence: the victim's stays cached throughout (the budget is
    # shared, and evicting the victim would close the oracle for the wrong reason).
    args = ["--token-file", str(d / "tokens"), "--max-sessions", "4", "--cache-sessions", "512"]
    with node_process(d, args) as n:
        yield n


def _turn(target, url: str, token: str, prompt: list[int], n: int = 6, **draft):
    """One request of n tokens through a synchronous drafter with this token (a target of
    its own); returns (tokens, stats, seconds)."""
    rd = target.drafter(url, pipelined=False, settings=LinkSettings(token=token),
                        sync_timeout_s=30.0)
    try:
        t0 = time.perf_counter()
        g = Engine(target.backend, rd).generate(request(prompt, n, GREEDY, 4, **draft))
        tokens = run_to_end(g)
        return tokens, g.stats, time.perf_counter() - t0
    finally:
        rd.close()


def _probe(target, url: str, token: str, known: list[int], secret: list[int],
           filler: list[int]) -> tuple[int, list[dict], int]:
    """Positions where the true guess stood out by its draft_cache_n; what each saw; what
    a first request of the known prefix alone found cached (it puts the prefix in the
    prober's own scope)."""
    _, first, _ = _turn(target, url, token, known + filler, n=3)
    distinguished, seen = 0, []
    for i in range(POSITIONS):
        true = secret[i]
        guesses = [true] + [(true + k * 7919) % target.n_vocab for k in (1, 2, 3)]
        row = {}
        for g in guesses:
            # three tokens, the fewest that open a node session (the prompt's token, then a
            # round that drafts one fewer than are left): its answer carries draft_cache_n
            _, st, s = _turn(target, url, token, known + secret[:i] + [g] + filler, n=3)
            row[g] = (st.draft_cache_n, st.draft_prompt_n, s)
        others = [row[g][0] for g in guesses[1:]]
        distinguished += row[true][0] > max(others)
        seen.append({"true": row[true], "others": [row[g] for g in guesses[1:]]})
    return distinguished, seen, first.draft_cache_n


def test_a_tenant_cannot_read_another_tenants_conversation(target, node) -> None:
    known = target.tokens(KNOWN)
    victim = target.tokens(KNOWN + PRIVATE)
    assert victim[:len(known)] == known
    secret = victim[len(known):len(known) + POSITIONS]
    filler = target.tokens(" Unrelated filler words follow here.")[1:]

    out, st, _ = _turn(target, node.url, ALICE, victim, n=8)
    assert out == target.plain(victim, GREEDY, 8)

    cross, seen_cross, first_cross = _probe(target, node.url, MALLORY, known, secret, filler)
    same, seen_same, first_same = _probe(target, node.url, ALICE, known, secret, filler)
    print(f"the opening alone found cached: {first_cross} (mallory), {first_same} (alice)")
    assert first_cross == 0 and first_same >= len(known) - 1   # alice's opening: hers only
    for label, seen in (("cross-tenant", seen_cross), ("same tenant", seen_same)):
        t_true = statistics.mean(r["true"][2] for r in seen)
        t_other = statistics.mean(o[2] for r in seen for o in r["others"])
        print(f"{label}: cache_n of the true guess {[r['true'][0] for r in seen]}, of the "
              f"others {[[o[0] for o in r['others']] for r in seen]}; mean request "
              f"{t_true * 1000:.0f} ms (true) vs {t_other * 1000:.0f} ms (others)")
    assert cross == 0, seen_cross
    # The node did the same work for every guess outside the victim's scope: it reused
    # what the prober's own earlier requests left, the known prefix and the tokens before.
    for i, r in enumerate(seen_cross):
        assert {o[:2] for o in r["others"]} == {r["true"][:2]}
        assert r["true"][0] == len(known) + i
    assert same == POSITIONS, seen_same    # the control: the probe works within a scope

    # The victim still reuses its own conversation, on its next turn.
    nxt = victim + out + target.tokens(" And then?")[1:]
    out2, st2, _ = _turn(target, node.url, ALICE, nxt, n=4)
    assert st2.draft_cache_n >= len(victim)
    assert out2 == target.plain(nxt, GREEDY, 4)
    # The victim's token with a cache_salt of its own is another scope; cache_prompt false
    # reuses nothing either. Both give the same tokens.
    o3, st3, _ = _turn(target, node.url, ALICE, nxt, n=4, cache_scope="digest-of-salt")
    assert st3.draft_cache_n == 0 and o3 == out2
    o4, st4, _ = _turn(target, node.url, ALICE, nxt, n=4, cache_store=False)
    assert st4.draft_cache_n == 0 and o4 == out2

    # SIGHUP: every finished conversation dropped.
    os.kill(node.proc.pid, signal.SIGHUP)
    wait_for(lambda: "cached entries purged" in node.log(), 10, "the purge")
    _, st5, _ = _turn(target, node.url, ALICE, nxt, n=4)
    assert st5.draft_cache_n == 0


def test_a_client_certificate_is_the_same_identity_on_both_ports(target, tmp_path) -> None:
    """With mutual TLS the peer's identity is its certificate's subject, spelt alike on
    the main port and on the synchronous port: one target, one scope."""
    c = make_certs(tmp_path)
    settings = NodeSettings(model=ModelParams(draft_model_path(), n_ctx=N_CTX), port=0,
                            sync_port=0, tls_cert=c["server_cert"], tls_key=c["server_key"],
                            tls_client_ca=c["ca"])
    node = node_mod.start(settings)
    seen: list[tuple[int, str]] = []   # (the node's port, the identity)
    identity = node.service.identity

    def recording(ctx) -> str:
        assert isinstance(ctx, sync_mux.Context)
        seen.append((ctx.port, identity(ctx)))
        return seen[-1][1]

    node.service.identity = recording
    try:
        url = f"127.0.0.1:{node.port}"
        good = LinkSettings(tls_ca=c["ca"], tls_cert=c["client_cert"], tls_key=c["client_key"])
        prompt = target.tokens(KNOWN + PRIVATE)
        for pipelined in (True, False):
            rd = target.drafter(url, pipelined=pipelined, settings=good, sync_timeout_s=30.0)
            try:
                g = Engine(target.backend, rd).generate(request(prompt, 6, GREEDY, 4))
                assert run_to_end(g) == target.plain(prompt, GREEDY, 6)
            finally:
                rd.close()
    finally:
        node.stop()
    assert set(seen) == {(node.port, "cert:CN=target"), (node.sync.port, "cert:CN=target")}, seen


def test_the_time_to_the_first_draft_tells_nothing_across_tenants(target) -> None:
    """The node's own timing, without a target in between: the time from an Open of
    [opening, tokens before, guess, filler] to its first draft, for the true guess and
    three others at each of the 8 positions, from mallory and then (the control) from
    alice. Printed for benchmarks/NOTES.md (section 12); the test asserts that at each
    position mallory's cache_n is the same for every guess (the node's work is the same)
    and alice's is not."""
    settings = NodeSettings(model=ModelParams(draft_model_path(), n_ctx=N_CTX), port=0,
                            tokens={ALICE: "alice", MALLORY: "mallory"}, cache_sessions=512)
    node = node_mod.start(settings)
    known = target.tokens(KNOWN)
    victim = target.tokens(KNOWN + PRIVATE)
    secret = victim[len(known):len(known) + POSITIONS]
    filler = target.tokens(" Unrelated filler words follow here.")[1:]

    def first_draft(token: str, history: list[int]) -> tuple[int, float]:
        s = Stream(pbg.DraftNodeStub(ch).Session,
                   metadata=((protocol.AUTH_HEADER, f"Bearer {token}"),))
        t0 = time.perf_counter()
        s.send(_open(history, want=4))
        chunk = s.next().chunk
        dt = time.perf_counter() - t0
        s.close()   # and its context back in the memory before the next Open:
        wait_for(lambda: node.service._in_use == 0, 10, "the session's end")
        return chunk.cache_n, dt

    rows: dict[str, list[tuple[int, list[int], float, list[float]]]] = {}
    try:
        with grpc.insecure_channel(f"127.0.0.1:{node.port}") as ch:
            first_draft(ALICE, victim)
            for who, token in (("cross-tenant", MALLORY), ("same tenant", ALICE)):
                first_draft(token, known + filler)   # the opening in the prober's scope
                rows[who] = []
                for i in range(POSITIONS):
                    true = secret[i]
                    guesses = [true] + [(true + k * 7919) % target.n_vocab for k in (1, 2, 3)]
                    got = {g: first_draft(token, known + secret[:i] + [g] + filler)
                           for g in guesses[i % 4:] + guesses[:i % 4]}
                    rows[who].append((got[true][0], [got[g][0] for g in guesses[1:]],
                                      got[true][1], [got[g][1] for g in guesses[1:]]))
    finally:
        node.stop()
    for who, r in rows.items():
        t_true = statistics.median(x[2] for x in r) * 1000
        t_other = statistics.median(t for x in r for t in x[3]) * 1000
        print(f"{who}: cache_n of the true guess {[x[0] for x in r]}, of the others "
              f"{[x[1] for x in r]}; median time to the first draft {t_true:.1f} ms (true), "
              f"{t_other:.1f} ms (others)")
    for i, (true_n, others, _, _) in enumerate(rows["cross-tenant"]):
        assert true_n == len(known) + i and set(others) == {true_n}
    for i, (true_n, others, _, _) in enumerate(rows["same tenant"]):
        assert true_n == len(known) + i + 1 and set(others) == {len(known) + i}
