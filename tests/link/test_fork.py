"""Alternates on a fork of the branch's sequence (link/fork.py, backend/llama.py fork_seq).

A fork holds its parent's first n tokens by sharing their cells, then decodes on its own,
in the same llama_decode as its parent: what it computes must be what a sequence that
evaluated those tokens itself computes, and its parent must not feel it. On a real node,
pipelined sessions draft their alternates on forks beside their branch, and the output
stays plain decoding's.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from wire_helpers import CODE, GREEDY, N_CTX, draft_model_path, request, run_to_end, settled

from specwire.backend.batch import Part
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import ModelParams
from specwire.emulate.hold import Regime
from specwire.engine.engine import Engine
from specwire.link.fork import ForkDrafter, ForkJob
from specwire.node import server as node_mod
from specwire.node.server import NodeSettings
from specwire.policy.throughput import VerifyCurve

# ======================================================================== fakes (fast)


class FakeFork:
    """A fork whose rows favour token (last + 1) % 8, counting its evals."""

    n_vocab, n_ctx = 8, 64

    def __init__(self, held: list[int], fail: bool = False) -> None:
        self.tokens, self.fail, self.evals, self.closed = list(held), fail, 0, False

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def eval(self, tokens, logits="last") -> np.ndarray:
        if self.fail:
            raise RuntimeError("decode failed")
        self.evals += 1
        self.tokens += list(tokens)
        row = np.zeros((1, 8), dtype=np.float32)
        row[0, (self.tokens[-1] + 1) % 8] = 5.0
        return row

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def close(self) -> None:
        self.closed = True


class FakeBranch:
    """A sequence with a fork, holding `tokens`."""

    forks = True

    def __init__(self, tokens: list[int], fail: bool = False) -> None:
        self.tokens, self.fail, self.forked = tokens, fail, []

    def fork(self, n: int) -> FakeFork:
        f = FakeFork(self.tokens[:n], self.fail)
        self.forked.append((n, f))
        return f


def _run(drafter: ForkDrafter, woken: threading.Event) -> ForkJob:
    assert woken.wait(5)
    job = drafter.take()
    assert job is not None and not drafter.busy
    return job


def test_a_fork_drafts_the_alternate_from_the_branchs_shared_cells() -> None:
    branch, woken = FakeBranch([1, 2, 3, 4, 9]), threading.Event()
    d = ForkDrafter(branch, GREEDY, 4, stale=lambda job: False, wake=woken.set)
    assert ForkDrafter.usable(branch) and not d.busy
    d.start(0, [1, 2, 3, 4, 5], 6)        # the branch holds 1 2 3 4, then 9 (not 5)
    assert d.busy
    job = _run(d, woken)
    assert job.at == 5 and job.tokens == [6, 7, 0, 1] and job.error is None
    (n, fork), = branch.forked
    assert n == 4 and fork.evals == 3     # 5 and 6 in the first decode, then one a token
    d.close()
    assert fork.closed


def test_a_stale_job_stops_and_a_failed_one_says_why() -> None:
    woken = threading.Event()
    d = ForkDrafter(FakeBranch([1, 2]), GREEDY, 8, stale=lambda job: True, wake=woken.set)
    d.start(3, [1, 2], 5)
    job = _run(d, woken)
    assert job.tokens == [5] and job.gen == 3   # stopped before its first decode
    woken.clear()
    d = ForkDrafter(FakeBranch([1, 2], fail=True), GREEDY, 8, stale=lambda job: False,
                    wake=woken.set)
    d.start(0, [1, 2], 5)
    job = _run(d, woken)
    assert isinstance(job.error, RuntimeError)
    d.close()


def test_one_job_at_a_time() -> None:
    gate = threading.Event()
    d = ForkDrafter(FakeBranch([1]), GREEDY, 3, stale=lambda job: not gate.wait(5),
                    wake=lambda: None)
    d.start(0, [1], 2)
    with pytest.raises(RuntimeError, match="still out"):
        d.start(0, [1], 3)
    gate.set()
    d.close()


# ======================================================================== the real model


@pytest.fixture(scope="module")
def model():
    return load_model(ModelParams(draft_model_path(), n_ctx=N_CTX, n_threads=1))


@pytest.mark.slow
def test_a_forks_rows_are_a_fresh_sequences_and_its_parent_does_not_feel_it(model) -> None:
    params = ModelParams(draft_model_path(), n_ctx=N_CTX, n_threads=1)
    be = LlamaBackend(params, model, n_seq=2, forks=True)
    ref = LlamaBackend(params, model)
    try:
        prompt = be.tokenize(CODE)
        be.eval(prompt, "none")
        tail = [11, 12, 13]
        fork = be.seq(be.fork_seq(0, len(prompt) - 2))
        assert list(fork.tokens) == prompt[:-2]
        # the fork's catch-up and alternate beside the parent's next token, in one decode
        got_fork, got_parent = (r.copy() for r in be.decode(
            [Part(fork.seq_id, [*prompt[-2:], *tail], "all"), Part(0, [7], "last")]))
        ref.eval(prompt, "none")
        want_parent = ref.eval([7], "last").copy()
        ref.truncate(len(prompt))
        want_fork = ref.eval(tail, "all").copy()
        for got, want in ((got_fork[2:], want_fork), (got_parent, want_parent)):
            assert np.argmax(got, axis=-1).tolist() == np.argmax(want, axis=-1).tolist()
            assert float(np.abs(got - want).max()) < 0.1
        # The parent cut below the fork's prefix: the fork keeps the shared cells. Its next
        # token lands in a cell the cut freed, out of order, and on this Q2_K model the
        # sums' order moves the row by about 2 (two sequences in any context do so too),
        # against 8 for a context that lost one cell (`lost`).
        be.truncate(3)
        nxt = fork.eval([5], "last")[0].copy()
        ref.truncate(len(prompt))
        ref.eval(tail, "none")
        want = ref.eval([5], "last")[0].copy()
        ref.truncate(len(prompt) - 1)
        ref.eval(tail, "none")
        lost = float(np.abs(ref.eval([5], "last")[0] - want).max())
        assert np.argmax(nxt) == np.argmax(want)
        assert float(np.abs(nxt - want).max()) < lost / 2, lost
        fork.truncate(0)
        assert be.fork_seq(0, 3) == be.n_seq and list(fork.tokens) == prompt[:3]
        with pytest.raises(Exception, match="fork of 9 tokens"):
            be.fork_seq(0, 9)
    finally:
        be.close()
        ref.close()


@pytest.mark.slow
@pytest.mark.parametrize("emulated", [False, True], ids=["real", "emulated"])
def test_a_nodes_alternates_are_drafted_beside_their_branch_losslessly(target,
                                                                       emulated) -> None:
    """A real node, as `specwire draft` and its --emulate run it (the held context
    addresses the forks too)."""
    regime = Regime(0.01, VerifyCurve.parse("1:1,16:1.1")) if emulated else None
    node = node_mod.start(NodeSettings(model=ModelParams(draft_model_path(), n_ctx=N_CTX),
                                       port=0, max_sessions=2, emulation=regime))
    try:
        prompt = target.tokens(CODE)
        want = target.plain(prompt, GREEDY, 48)
        rd = target.drafter(f"127.0.0.1:{node.port}", pipelined=True)
        try:
            gen = Engine(target.backend, rd).generate(request(prompt, 48, GREEDY, 4))
            assert run_to_end(gen, on_step=settled(rd)) == want
            received = gen.stats.drafter.get("alternates_received", 0.0)
        finally:
            rd.close()
        steps = node.service.steps.snapshot()
    finally:
        node.stop()
    assert steps.alternates > 0 and steps.beside > 0, steps
    assert received > 0


@pytest.mark.slow
def test_forks_only_where_llama_cpp_has_the_sequence_ids(model, caplog) -> None:
    """A context holds at most max_sequences() ids: more sessions than leave room for their
    forks keep the node serving (alternates between the branch's tokens), with a warning;
    a context that cannot hold its sequences at all is refused by name."""
    from specwire.backend.base import BackendError
    from specwire.backend.llama import max_sequences
    from specwire.emulate.hold import HoldCounters

    params = ModelParams(draft_model_path(), n_ctx=64, n_threads=1)
    most = max_sequences()
    with pytest.raises(BackendError, match=f"at most {most}"):
        LlamaBackend(params, model, n_seq=most // 2 + 1, forks=True)
    for sessions, forks in ((8, 16), (most // 4 + 1, 0)):
        ctx = node_mod.draft_context(NodeSettings(model=params, max_sessions=sessions), model,
                                     HoldCounters())
        try:
            assert ctx.n_seq == 2 * sessions and ctx.n_forks == forks
        finally:
            ctx.close()
    assert "no llama.cpp sequence ids for forks" in caplog.text
