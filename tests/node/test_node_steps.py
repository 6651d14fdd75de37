"""The draft node's step loop (node/steps.py): every drafting session in one decode.

* the loop over a fake multi-sequence backend: the parts of every drafting sequence go
  into one decode, one waiting for its verdict is not waited for, a sequence's parts
  never share a decode, a step keeps to the batch's size, and a failed decode fails
  only its own parts;
* a real node and real models: four synchronous sessions asked at once draft in about
  one decode per token for all four, and four targets drafting from one node at once
  (pipelined, with alternates) each get exactly plain decoding's tokens while the node's
  decodes hold several sessions each.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np
import pytest
import specwire_pb2_grpc as pbg
from wire_helpers import (
    CODE,
    GREEDY,
    N_CTX,
    PROSE,
    RawSession,
    _sync_open,
    draft_model_path,
    request,
    run_to_end,
    settled,
    wait_for,
)

from specwire.backend.base import BackendError
from specwire.backend.batch import Part
from specwire.config import ModelParams
from specwire.engine.engine import Engine
from specwire.link.transport import specwire_pb2 as pb
from specwire.node import server as node_mod
from specwire.node.server import NodeSettings
from specwire.node.steps import StepLoop

# ======================================================================== the loop alone


class FakeShared:
    """A multi-sequence backend that records its decodes; row i of a part is its last
    token's id (a one-hot row), so a caller can tell its rows from another's."""

    n_batch = 8
    n_vocab = 64

    def __init__(self, n_seq: int = 4, fail: bool = False) -> None:
        self.n_seq, self.fail = n_seq, fail
        self.decodes: list[list[tuple[int, int]]] = []   # per decode: (seq, tokens)
        self.held: list[list[int]] = [[] for _ in range(n_seq)]
        self.decode_s = 0.0
        self.closed = False

    def seq(self, i: int) -> FakeSeq:
        return FakeSeq(self, i)

    def seq_decode_s(self, i: int) -> float:
        return 0.0

    def decode(self, parts: Sequence[Part]) -> list[np.ndarray]:
        self.decodes.append([(p.seq, len(p.tokens)) for p in parts])
        assert len({p.seq for p in parts}) == len(parts), "a sequence twice in one decode"
        assert sum(len(p.tokens) for p in parts) <= self.n_batch
        if self.fail:
            raise BackendError("decode failed")
        out = []
        for p in parts:
            self.held[p.seq] += p.tokens
            rows = np.zeros((p.n_rows, self.n_vocab), dtype=np.float32)
            if p.n_rows:
                rows[-1, p.tokens[-1]] = 1.0
            out.append(rows)
        return out

    def close(self) -> None:
        self.closed = True


class FakeSeq:
    def __init__(self, owner: FakeShared, i: int) -> None:
        self.owner, self.i = owner, i
        self.model = self.name = self.params = None
        self.n_vocab, self.n_ctx = owner.n_vocab, 1000

    @property
    def tokens(self) -> list[int]:
        return self.owner.held[self.i]

    def truncate(self, n: int) -> None:
        del self.owner.held[self.i][n:]


def _draft(seq, first: int, n: int, results: dict, start: threading.Barrier) -> None:
    """A session's draft: n tokens, each the argmax of the last row."""
    with seq.drafting():
        start.wait(5)
        tok = first
        for _ in range(n):
            tok = int(np.argmax(seq.eval([tok])[-1])) + 1
        results[seq.seq_id] = tok


def test_drafting_sequences_share_each_decode_and_get_their_own_rows() -> None:
    shared = FakeShared()
    loop = StepLoop(shared, gather_s=30.0)
    try:
        seqs = [loop.take() for _ in range(3)]
        idle = loop.take()              # taken, but waiting for its verdict: not waited for
        results: dict = {}
        start = threading.Barrier(3)
        threads = [threading.Thread(target=_draft, args=(s, 10 * (s.seq_id + 1), 5, results,
                                                          start)) for s in seqs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert time.perf_counter() - t0 < 10.0   # never waited out gather_s for `idle`
        # each sequence's rows were its own: 5 steps of +1 from where it started
        assert results == {s.seq_id: 10 * (s.seq_id + 1) + 5 for s in seqs}
        assert len(shared.decodes) == 5 and all(len(d) == 3 for d in shared.decodes)
        c = loop.snapshot()
        assert (c.decodes, c.branches, c.alternates) == (5, 15, 0)
        assert c.per_decode() == (3.0, 0.0)
        assert idle.tokens == []
    finally:
        loop.close()
    assert shared.closed


def test_a_step_keeps_to_the_batch_and_counts_alternates() -> None:
    shared = FakeShared(n_seq=2)
    loop = StepLoop(shared, gather_s=1.0)
    try:
        a, b = loop.take(), loop.take()
        done = threading.Barrier(3)

        def catch_up() -> None:
            with a.drafting():
                a.eval(list(range(20)), "none")   # 8 + 8 + 4: three steps of its own
            done.wait(5)

        def alternate() -> None:
            with b.drafting(alternate=True):
                b.eval([3])
            done.wait(5)

        for fn in (catch_up, alternate):
            threading.Thread(target=fn).start()
        done.wait(5)
        assert len(a.tokens) == 20 and b.tokens == [3]
        assert all(sum(n for _, n in d) <= FakeShared.n_batch for d in shared.decodes)
        assert [n for d in shared.decodes for s, n in d if s == a.seq_id] == [8, 8, 4]
        c = loop.snapshot()
        assert c.alternates == 1 and c.branches == 3
        with pytest.raises(BackendError, match="all 2 sequences"):
            loop.take()
        a.close()
        assert loop.taken() == 1 and shared.held[a.seq_id] == []
        assert loop.take().seq_id == a.seq_id
    finally:
        loop.close()


def test_a_failed_decode_fails_its_parts_and_the_loop_goes_on() -> None:
    shared = FakeShared(fail=True)
    loop = StepLoop(shared, gather_s=0.0)
    try:
        s = loop.take()
        with pytest.raises(BackendError, match="decode failed"):
            s.eval([1])
        shared.fail = False
        assert s.eval([5])[-1][5] == 1.0
    finally:
        loop.close()
    with pytest.raises(BackendError, match="closed"):
        s.eval([1])


def test_an_emulated_node_charges_a_decode_of_n_sessions_once_at_the_curves_n() -> None:
    """--emulate on the node holds its one context (emulate/hold.py EmulatedBatch): three
    sessions' tokens in one decode are held once, for the curve's cost of 3 tokens, as
    the target's batch is charged, not three plain steps."""
    from fakes import FakeBatch, FakeClock, FakeModel

    from specwire.emulate.hold import HoldCounters, Regime, emulate
    from specwire.policy.throughput import VerifyCurve

    clock, holds = FakeClock(), HoldCounters()
    fake = FakeBatch(FakeModel(n_vocab=40, seed=3), n_seq=4)
    # what a LlamaBackend is besides a batch (sequence 0's view, closing), as the fake has not
    fake.name, fake.params, fake.n_vocab, fake.n_ctx = "fake", None, 40, 512
    fake.close = lambda: None
    for s in fake.seqs:
        s.params = None
    loop = StepLoop(emulate(fake, Regime(0.1, VerifyCurve.parse("1:1,8:3")), holds, clock),
                    gather_s=1.0)
    try:
        seqs = [loop.take() for _ in range(4)][1:]   # sequence 0 waits for its verdict
        start = threading.Barrier(3)

        def draft(s) -> None:
            with s.drafting():
                start.wait(5)
                s.eval([1 + s.seq_id])

        threads = [threading.Thread(target=draft, args=(s,)) for s in seqs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert len(fake.decodes) == 1 and loop.snapshot().per_decode() == (3.0, 0.0)
        assert holds.decodes == 1
        assert clock.now == pytest.approx(0.1 * (1 + 2 * 2 / 7))   # 1:1 to 8:3, at 3
    finally:
        loop.close()


# ======================================================================== a real node


@pytest.fixture
def node_in_process():
    node = node_mod.start(NodeSettings(model=ModelParams(draft_model_path(), n_ctx=N_CTX),
                                       port=0, max_sessions=4, metrics_port=0))
    try:
        yield node
    finally:
        node.stop()


@pytest.mark.slow
@pytest.mark.parametrize("connections", ["one", "each"])
def test_synchronous_sessions_asked_at_once_draft_in_one_decode_per_token(
        target, node_in_process, connections) -> None:
    """Four synchronous sessions, each asked for K tokens per verdict at the same moment,
    on one connection (as serve -np 4's slots) or each on its own: the node drafts the four
    in about K decodes a round, where drafting them one after another took 4 K. (Bounded
    at 2 K a round: on a loaded machine a session's verdict may come a decode late.)"""
    node, n, k, rounds = node_in_process, 4, 4, 6
    histories = [target.tokens(CODE), target.tokens(PROSE),
                 target.tokens(CODE + "\n# again\n"), target.tokens(PROSE + " and so on:")]
    one = grpc.insecure_channel(f"127.0.0.1:{node.port}")
    channels = ([one] * n if connections == "one"
                else [grpc.insecure_channel(f"127.0.0.1:{node.port}") for _ in range(n)])
    try:
        sessions = [RawSession(pbg.DraftNodeStub(ch)) for ch in channels]
        for s, h in zip(sessions, histories, strict=True):
            s.send(open=_sync_open(h, want=k))
        answers = [s.answer()[0] for s in sessions]
        positions = [len(h) for h in histories]
        before = node.service.steps.snapshot()
        for _ in range(rounds):
            for i, s in enumerate(sessions):     # every branch kept, then a token of its own
                got = answers[i]
                s.send(verdict=pb.Verdict(position=positions[i], accepted=len(got.tokens),
                                          tokens=[got.tokens[0]], gen=got.gen, want=k))
                positions[i] += len(got.tokens) + 1
            answers = [s.answer()[0] for s in sessions]
            assert all(len(a.tokens) == k for a in answers)
        after = node.service.steps.snapshot()
        for s in sessions:
            s.close()
    finally:
        for ch in {id(c): c for c in channels}.values():
            ch.close()
    decodes = after.decodes - before.decodes
    branches = after.branches - before.branches
    assert branches == n * k * rounds        # a part per drafted token of every session
    print(f"{n} sessions ({connections}) x {k} tokens x {rounds} rounds: {decodes} decodes, "
          f"{branches / decodes:.2f} sessions per decode")
    assert decodes <= 2 * k * rounds, (decodes, branches)


@pytest.mark.slow
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "sync"])
def test_four_targets_drafting_at_once_share_decodes_and_keep_plain_tokens(
        target, node_in_process, pipelined) -> None:
    """Four target contexts over the same weights, each with its own RemoteDrafter (trees
    and alternates where pipelined), run at once against one node: each output equals its
    own plain decoding, each request accepted drafts, and the node's decodes held more
    than one session on average."""
    node, n, length = node_in_process, 4, 24
    prompts = [target.tokens(CODE), target.tokens(PROSE),
               target.tokens(CODE + "\n# again\n"), target.tokens(PROSE + " and so on:")]
    want = [target.plain(p, GREEDY, length) for p in prompts]
    backends = [target.backend] + [target.twin() for _ in range(n - 1)]
    results: list = [None] * n
    barrier = threading.Barrier(n)
    url = f"127.0.0.1:{node.port}"
    before = node.service.steps.snapshot()

    def work(i: int) -> None:
        rd = target.drafter(url, pipelined=pipelined)
        try:
            barrier.wait(timeout=60)
            g = Engine(backends[i], rd).generate(request(prompts[i], length, GREEDY, 4))
            results[i] = (run_to_end(g, on_step=settled(rd)), g.stats)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            results[i] = e
        finally:
            rd.close()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for i, res in enumerate(results):
        assert not isinstance(res, BaseException) and res is not None, res
        assert res[0] == want[i]
    accepted = [stats.draft_n_accepted for _, stats in results]
    # A pipelined target never waits: each round here waits a little for the node's
    # lookahead (settled), else on a loaded machine none is verified in time (CI saw it).
    assert min(accepted) > 0, accepted
    after = node.service.steps.snapshot()
    decodes = after.decodes - before.decodes
    parts = after.branches + after.alternates - before.branches - before.alternates
    print(f"{n} targets ({'pipelined' if pipelined else 'sync'}): {decodes} decodes, "
          f"{parts / decodes:.2f} parts per decode")
    assert parts / decodes > 1.3


@pytest.mark.slow
def test_the_batch_shows_on_the_nodes_metrics_and_the_targets_live_page(
        target, node_in_process) -> None:
    """The node's /metrics count its decodes and the parts in them; a target's live page
    (/stats.json, what index.html draws) shows what the node's last decode for it held,
    as the node's chunks said."""
    import httpx
    from toy_server import serve_app

    from specwire.server import ServerSettings, create_app
    from specwire.server.metrics import parse_figures

    node = node_in_process
    prompt = target.tokens(CODE)
    drafter = target.drafter(f"127.0.0.1:{node.port}", pipelined=True)
    try:
        app = create_app(Engine(target.backend, drafter), ServerSettings(sampling=GREEDY))
        with serve_app(app) as base:
            r = httpx.post(base + "/completion", json={"prompt": prompt, "n_predict": 12,
                                                        "temperature": 0}, timeout=120)
            assert r.status_code == 200 and r.json()["timings"]["draft_n"] > 0
            nodes = httpx.get(base + "/stats.json").json()["nodes"]
    finally:
        drafter.close()
    assert len(nodes) == 1 and nodes[0]["up"]
    step = nodes[0]["step"]
    # it drafted alone: its branch, and at most its own alternate beside it (on its fork)
    assert step["sessions"] == 1 and step["alternates"] <= 1, step
    wait_for(lambda: node.service.in_use() == 0, 10, "the session closed")
    figures = parse_figures(httpx.get(f"http://127.0.0.1:{node.metrics_port}/metrics").text)
    c = node.service.steps.snapshot()
    assert figures["specwire:node_decodes_total"] == c.decodes > 0
    assert figures['specwire:node_decode_parts_total{kind="branch"}'] == c.branches > 0
    assert figures['specwire:node_decode_parts_total{kind="alternate"}'] == c.alternates
    assert figures["specwire:node_alternates_beside_total"] == c.beside <= c.alternates
    assert figures["specwire:node_sessions_per_decode"] == pytest.approx(c.branches / c.decodes)
