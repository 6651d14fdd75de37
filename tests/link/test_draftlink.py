"""The draft link's domain: the messages' own checks, the protobuf edge, and the branch
rule followed alike by the node's session and the target's BranchDrafter.

Fakes only (tests/support/fakes.py): the node's end is a real DraftSession drafting with a
ModelDrafter over a FakeBackend, the target's end a real BranchDrafter; they are
joined by function calls instead of a socket, so every round is deterministic.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from branch_fakes import Joined, _wire
from fakes import FakeBackend, FakeModel

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.link.branch import lookahead_for
from specwire.link.messages import (
    Chunk,
    Close,
    Failure,
    Open,
    ProtocolError,
    Verdict,
    pad_sparse,
)
from specwire.link.rule import AHEAD, LEFT, PASSED, follow
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.sample.sampling import SparseDraft

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)
PENALISED = SamplingParams(temperature=0.0, repeat_penalty=1.3, repeat_last_n=32,
                           presence_penalty=0.4, frequency_penalty=-0.3,
                           logit_bias=((3, 2.5), (17, -math.inf), (3, 0.1)))

# ============================================================================ the rule


@pytest.mark.parametrize(("start", "branch", "history", "expected"), [
    (3, [7, 8, 9], [1, 2, 3], 0),            # nothing committed yet: all of it still drafts
    (3, [7, 8, 9], [1, 2, 3, 7, 8], 2),      # two kept: the branch goes on from 9
    (3, [7, 8, 9], [1, 2, 3, 7, 8, 9], 3),   # all kept, nothing left of it
    (3, [7, 8, 9], [1, 2, 3, 7, 5], LEFT),   # the target's own 5 where the branch said 8
    (3, [7, 8], [1, 2, 3, 7, 8, 9], PASSED),  # the history runs past the branch
    (3, [], [1, 2, 3, 4], PASSED),
    (5, [7], [1, 2, 3], AHEAD),              # a branch after the history's end
])
def test_follow(start: int, branch: list[int], history: list[int], expected: int) -> None:
    assert follow(start, branch, history) == expected


# ============================================================================ the messages


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Open([], GREEDY, VerifyMode.GREEDY), "open: empty history"),
    (lambda: Open([1], GREEDY, VerifyMode.GREEDY, lookahead=257), "lookahead, want or top_k_q"),
    (lambda: Open([1], GREEDY, VerifyMode.GREEDY, p_min=math.nan), "open: p_min nan outside"),
    (lambda: Open([1], GREEDY, VerifyMode.GREEDY, keep_min=2.0), "open: keep_min 2.0 outside"),
    (lambda: Verdict(4, 0, [1], k=300), "verdict: want 300 above 256"),
    (lambda: Verdict(4, 0, [1], keep_min=-0.5), "verdict: keep_min -0.5 outside"),
    (lambda: Chunk(0, 4, [1] * 257), "chunk of 257 tokens"),
    (lambda: Chunk(0, 4, [1, 2], sparse=[]), "chunk of 2 tokens with 0 q distributions"),
])
def test_messages_check_themselves(make, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        make()


def test_checks_that_need_the_other_end() -> None:
    """Vocabulary, context and positions are checked by the end that knows them."""
    o = Open([1, 2, 3], GREEDY, VerifyMode.GREEDY)
    o.check(n_vocab=4, n_ctx=3)
    with pytest.raises(ProtocolError, match="exceeds the node's context \\(2\\)"):
        o.check(n_vocab=4, n_ctx=2)
    with pytest.raises(ProtocolError, match="open history: token id 3 outside"):
        o.check(n_vocab=3, n_ctx=8)
    with pytest.raises(ProtocolError, match="verdict: token id 9 outside"):
        Verdict(3, 0, [9]).check(n_vocab=9)
    with pytest.raises(ProtocolError, match="positions 6..8 beyond 7"):
        Chunk(0, 6, [1, 2]).check(n_vocab=9, max_position=7)


# ============================================================================ the protobuf edge


def _sparse(tokens: list[int], k: int, seed: int) -> list[SparseDraft]:
    rs = np.random.default_rng(seed)
    out = []
    for t in tokens:
        ids = np.asarray([t, *rs.choice([i for i in range(50) if i != t], k - 2, replace=False)])
        out.append(SparseDraft(t, ids, rs.dirichlet(np.ones(len(ids))).astype(np.float32)))
    return pad_sparse(out, k)   # k - 1 ids each, padded to k with zero mass


def _same_chunk(a: Chunk, b: Chunk) -> bool:
    plain = [(c.gen, c.start, c.tokens, c.done, c.busy_us, c.cache_n, c.prompt_n) for c in (a, b)]
    if plain[0] != plain[1] or (a.sparse is None) != (b.sparse is None):
        return False
    return all(x.token == y.token and np.array_equal(x.ids, y.ids)
               and np.array_equal(x.probs, y.probs) for x, y in zip(a.sparse or [], b.sparse or [],
                                                                    strict=True))


@pytest.mark.parametrize("message", [
    Open([5, 6, 7], protocol.wire_sampling(SEEDED), VerifyMode.REJECTION, pipelined=True,
         lookahead=16, k=0, p_min=0.25, top_k_q=4, timing=True),
    Open([5], protocol.wire_sampling(GREEDY), VerifyMode.GREEDY, k=3, calibrated=True,
         keep_min=0.5),
    Open([5, 3], protocol.wire_sampling(PENALISED), VerifyMode.GREEDY, k=4),
    Verdict(10, 2, [4, 9], gen=3, k=5, keep_min=0.25),
    Verdict(10, 0, [4]),
    Close(),
])
def test_target_messages_round_trip(message) -> None:
    assert _wire(message) == message


@pytest.mark.parametrize("message", [
    Chunk(2, 40, [5, 7, 9], done=True, busy_us=1234, cache_n=30, prompt_n=10),
    Chunk(0, 3, [], cache_n=0, prompt_n=900),
    Chunk(1, 3, [], prompt_n=12),
    Chunk(4, 8, [11, 12], sparse=_sparse([11, 12], 4, seed=1)),
    Failure("verdict at position 3, expected 4"),
])
def test_draft_messages_round_trip(message) -> None:
    back = _wire(message)
    assert back == message if isinstance(message, Failure) else _same_chunk(back, message)


def test_sampling_penalties_and_bias_cross_the_wire() -> None:
    """The node drafts under the target's penalties and logit bias; an older target that
    sends none of them means none, and a malformed bias is refused at the edge."""
    back = _wire(Open([1], PENALISED, VerifyMode.GREEDY)).sampling
    assert back == protocol.wire_sampling(PENALISED) != PENALISED   # float32 on the wire
    assert back.logit_bias[1] == (17, -math.inf) and back.presence_penalty == pytest.approx(0.4)
    old = pb.Sampling(temperature=0.5, top_k=40, top_p=0.9, repeat_penalty=1.1,
                      repeat_last_n=64, seed=3)          # what an older target sends
    s = protocol.sampling_from_pb(pb.Sampling.FromString(old.SerializeToString()))
    assert (s.presence_penalty, s.frequency_penalty, s.logit_bias) == (0.0, 0.0, ())
    assert protocol.sampling_to_pb(SEEDED).SerializeToString() == pb.Sampling(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
        repeat_last_n=64, seed=7).SerializeToString()   # no penalty, no byte more
    for fields, message in (({"logit_bias_ids": [1, 2], "logit_bias_values": [1.0]},
                             "2 logit bias ids but 1 values"),
                            ({"logit_bias_ids": [1], "logit_bias_values": [math.nan]},
                             "NaN, \\+inf"),
                            ({"presence_penalty": 3.0}, "presence_penalty")):
        with pytest.raises(ProtocolError, match=message):
            protocol.sampling_from_pb(pb.Sampling(top_p=1.0, repeat_penalty=1.0, **fields))
    with pytest.raises(ProtocolError, match="beyond float32"):   # +inf in float32
        protocol.wire_sampling(SamplingParams(logit_bias=((1, 1e39),)))
    with pytest.raises(ProtocolError, match="open logit bias: token id 17 outside"):
        Open([1], PENALISED, VerifyMode.GREEDY).check(n_vocab=17, n_ctx=8)


def test_unset_fields_cost_no_byte() -> None:
    """The wire format is what it was: a verdict's zero gen, want and keep_min are not
    sent, and a chunk without cache figures says nothing of them (HasField false)."""
    m = protocol.target_to_pb(Verdict(100, 0, [70]))
    assert m.verdict.ByteSize() == 5 and m.SerializeToString() == pb.TargetMessage(
        verdict=pb.Verdict(position=100, tokens=[70])).SerializeToString()
    c = protocol.draft_to_pb(Chunk(1, 9, [3])).chunk
    assert not c.HasField("cache_n") and not c.HasField("prompt_n")


def test_the_edge_refuses_what_is_not_a_message() -> None:
    with pytest.raises(ProtocolError, match="neither a chunk nor an error"):
        protocol.draft_from_pb(pb.DraftMessage())
    with pytest.raises(ProtocolError, match="neither an open, a verdict nor a close"):
        protocol.target_from_pb(pb.TargetMessage())
    with pytest.raises(ProtocolError, match="unknown verify mode 9"):
        protocol.open_from_pb(pb.Open(history=[1], sampling=protocol.sampling_to_pb(GREEDY),
                                      mode=9))


# ============================================================================ both ends agree


def _verify(rng: random.Random, draft: list[int], n_vocab: int) -> tuple[int, int]:
    """A verifier's outcome: how many draft tokens it keeps, then its own token (now and
    then the draft's next token, as a target that decoded past a round would commit)."""
    a = rng.randint(0, len(draft))
    if a < len(draft) and rng.random() < 0.6:
        return a, draft[a]
    return a, rng.randrange(n_vocab - 6)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sync", "pipelined"])
@pytest.mark.parametrize("seed", range(6))
def test_both_ends_follow_the_same_branch(seed: int, pipelined: bool) -> None:
    """Over 80 rounds of random verdicts (some rounds plain, several tokens at once), after
    every verdict the node and the target hold the same history and the same branch: the
    target's usable draft is what the node drafted, with its gen; no answer is ever
    stale, late or useless."""
    rng = random.Random(seed)
    model = FakeModel(n_vocab=40, seed=seed)
    target = Joined(FakeBackend(model.perturbed(0.5, seed), n_ctx=400), pipelined=pipelined)
    history = [1, 2, 3, 4]
    target.begin(history, GREEDY, DraftParams(n_max=4, p_min=0.0))
    for _ in range(80):
        k = rng.choice([0, 1, 2, 4])
        if k == 0:   # a plain round: the drafter hears of it with the next verdict
            history = [*history, rng.randrange(34)]
            target.learn(history, 0, 1)
            continue
        draft = target.propose(history, k).tokens
        node = target.node
        assert node.committed == history
        assert node.gen == max(target.received.gen, 0)
        assert draft == node.branch[: len(draft)]
        assert node.sent == len(node.branch)
        assert len(draft) == min(k, len(node.branch)), "the target missed tokens it was sent"
        a, own = _verify(rng, draft, model.n_vocab)
        history = [*history, *draft[:a], own]
        target.learn(history, a, a + 1)
    stats = target.stats()
    assert stats["sync_timeouts"] == 0 and stats["useless_answers"] == 0
    assert stats["stale_chunks"] == 0
    assert min(target.outcomes.values()) > 5, target.outcomes   # both outcomes of the rule
    target.end()


@pytest.mark.parametrize("n_max", [1, 4, 8])
def test_a_round_that_keeps_its_draft_finds_the_next_one_drafted(n_max: int) -> None:
    """A pipelined node drafts, while the target verifies, as far as its default
    lookahead: the round's draft, the bonus token's guess and the next round's whole
    draft. So a round that keeps every token, the bonus as guessed, finds the next
    n_max tokens already drafted at its verdict, none left to draft while the target
    waits."""
    model = FakeModel(n_vocab=40, seed=3)
    target = Joined(FakeBackend(model, n_ctx=400), pipelined=True, lookahead=0)
    history = [1, 2, 3, 4]
    target.begin(history, GREEDY, DraftParams(n_max=n_max, p_min=0.0))
    node = target.node
    assert node.lookahead == lookahead_for(n_max)
    while len(node.branch) < node._limit():    # what it drafts during the verification
        node._draft_burst()
    draft = target.propose(history, n_max).tokens
    assert len(draft) == n_max
    bonus = node.branch[n_max]
    node._apply(Verdict(len(history), n_max, [bonus], gen=node.gen))
    assert len(node.branch) >= n_max, (n_max, node.branch)
    target.end()
