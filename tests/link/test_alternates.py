"""Pre-drafted branches: the rule, the messages, old peers, and both ends agreeing.

Fakes only (tests/support/fakes.py): the node's end is a real DraftSession over a
FakeBackend, the target's a real BranchDrafter, joined by function calls
(test_draftlink.Joined), so every round is deterministic. The real models and a
real node are in tests/invariance/test_invariance_alternates.py (slow).
"""

from __future__ import annotations

import argparse
import random

import numpy as np
import pytest
from branch_fakes import Branching, _wire
from fakes import FakeBackend, FakeModel

from specwire.cli.args import _branch_count
from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.link.alternates import (
    AlternateParams,
    TopTwo,
    alternate_params,
    draft_alternate,
    top_two,
    worth_branching,
)
from specwire.link.messages import (
    MAX_ALTERNATE_TOKENS,
    MAX_ALTERNATES,
    Alternate,
    Chunk,
    Open,
    ProtocolError,
    Verdict,
)
from specwire.link.rule import take_alternate
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.sample import sampling

GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7)

# ============================================================================ the rule


@pytest.mark.parametrize(("alternate", "tokens", "rest"), [
    ([5, 6, 7], [5], [6, 7]),        # the target's token is the second choice: verify 6, 7
    ([5, 6, 7], [5, 6], [7]),        # two of the target's own, both the alternate's
    ([5, 6, 7], [5, 6, 7], None),    # nothing would be left of it
    ([5, 6, 7], [4], None),          # another token
    ([5, 6, 7], [5, 9], None),       # leaves it after its first token
    ([5], [5], None),                # a lone second choice: nothing to verify after it
    (None, [5], None),
    ([5, 6], [], None),
])
def test_take_alternate(alternate, tokens, rest) -> None:
    assert take_alternate(alternate, tokens) == rest


# ============================================================================ the messages


def test_alternates_cross_the_wire() -> None:
    o = Open([5, 6], protocol.wire_sampling(SEEDED), VerifyMode.COUPLED, pipelined=True,
             lookahead=16, alternates=2, alternate_len=4)
    assert _wire(o) == o
    v = Verdict(10, 2, [4], gen=3, alternate=True)
    assert _wire(v) == v
    c = Chunk(2, 40, [5, 7, 9], alternates=[Alternate(41, [8, 1, 2]), Alternate(38, [3, 4])])
    back = _wire(c)
    assert back.alternates == c.alternates and back.tokens == c.tokens
    # an alternates-only chunk: second choices for positions already sent
    assert _wire(Chunk(2, 43, [], alternates=[Alternate(42, [6, 6])])).alternates == [
        Alternate(42, [6, 6])]


def test_what_a_peer_without_alternates_sends_is_byte_for_byte_what_it_was() -> None:
    """The fields are new and optional: a verdict that takes none and a chunk that carries
    none send exactly the bytes of protocol version 2, and an Open that asks for none
    says nothing of them; a node that predates them reads them as unknown fields."""
    assert protocol.target_to_pb(Verdict(100, 1, [70], gen=2)).SerializeToString() == \
        pb.TargetMessage(verdict=pb.Verdict(position=100, accepted=1, tokens=[70], gen=2)
                         ).SerializeToString()
    assert protocol.draft_to_pb(Chunk(1, 9, [3])).SerializeToString() == pb.DraftMessage(
        chunk=pb.DraftChunk(gen=1, start=9, tokens=[3])).SerializeToString()
    asked = protocol.target_to_pb(Open([1, 2], GREEDY, VerifyMode.GREEDY, pipelined=True,
                                       alternates=2, alternate_len=4))
    old = pb.TargetMessage(open=pb.Open(history=[1, 2], pipelined=True,
                                        sampling=protocol.sampling_to_pb(GREEDY)))
    assert asked.ByteSize() == old.ByteSize() + 4   # two one-byte fields, tag and value
    assert protocol.target_from_pb(old).alternates == 0


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Chunk(0, 5, [1, 2], alternates=[Alternate(5, [3])] * (MAX_ALTERNATES + 1)),
     "alternates"),
    (lambda: Chunk(0, 5, [1, 2], alternates=[Alternate(5, [3] * (MAX_ALTERNATE_TOKENS + 1))]),
     "alternate of 9 tokens"),
    (lambda: Chunk(0, 5, [1, 2], alternates=[Alternate(6, [])]), "alternate of 0 tokens"),
    (lambda: Chunk(0, 5, [1, 2], alternates=[Alternate(7, [3, 4])]), "past its chunk's end"),
    (lambda: Open([1], GREEDY, VerifyMode.GREEDY, alternates=MAX_ALTERNATES + 1),
     "open: alternates"),
    (lambda: Open([1], GREEDY, VerifyMode.GREEDY, alternate_len=MAX_ALTERNATE_TOKENS + 1),
     "open: alternates"),
])
def test_alternates_are_bounded(make, message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        make()


def test_an_alternate_outside_the_vocabulary_is_refused() -> None:
    c = Chunk(0, 5, [1, 2], alternates=[Alternate(5, [3, 99])])
    with pytest.raises(ProtocolError, match="alternate: token id 99"):
        c.check(50, 1000)


def test_branches_flag_is_checked() -> None:
    assert _branch_count("0") == 0 and _branch_count("4") == 4
    for bad in ("5", "-1", "two"):
        with pytest.raises(argparse.ArgumentTypeError):
            _branch_count(bad)
    assert alternate_params(0) is None and alternate_params(None) == AlternateParams()
    assert alternate_params(3).per_chunk == 3


# ============================================================================ choosing


def test_top_two_is_the_drafts_own_first_choice_then_the_next() -> None:
    rng = np.random.default_rng(3)
    for _ in range(20):
        row = rng.normal(size=64).astype(np.float32) * 3
        g = top_two(row, GREEDY, 10)
        order = np.argsort(-row)
        assert (g.first, g.second) == (order[0], order[1])
        assert g.p_first >= g.p_second > 0 and g.p_first + g.p_second <= 1
        s = top_two(row, SEEDED, 10)
        if s is None:   # one token survives top-p and min-p: no second choice to draft
            assert sampling.candidates(row, SEEDED).ids.size == 1
            continue
        assert s.first == sampling.coupled(row, SEEDED, 10) and s.second != s.first


def test_worth_branching_where_the_draft_hesitates_and_the_target_will_look() -> None:
    bp = AlternateParams(top_below=0.8, value_min=0.15)
    unsure, sure = TopTwo(1, 2, 0.5, 0.4), TopTwo(1, 2, 0.9, 0.05)
    assert worth_branching(unsure, 1.0, bp)
    assert not worth_branching(unsure, 0.3, bp)       # likely rejected before it
    assert not worth_branching(sure, 1.0, bp)
    assert not worth_branching(None, 1.0, bp)
    assert not worth_branching(unsure, 1.0, AlternateParams(per_chunk=0))


def test_drafting_an_alternate_leaves_the_cache_as_it_was() -> None:
    model = FakeModel(n_vocab=40, seed=1)
    be = FakeBackend(model, n_ctx=64)
    ctx = [1, 2, 3, 4]
    be.eval(ctx, logits="last")
    out = draft_alternate(be, GREEDY, ctx, 7, 4)
    assert out[0] == 7 and len(out) == 4
    assert list(be.tokens) == ctx
    # what the draft would draft after the second choice, token for token
    be.truncate(0)
    ref = [int(np.argmax(be.eval([*ctx, 7], logits="last")[-1]))]
    assert out[1] == ref[0]
    assert draft_alternate(be, GREEDY, ctx, 7, 4, stop=lambda: True) == [7]


# ============================================================================ both ends


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("seed", range(5))
def test_both_ends_take_the_same_alternates(seed: int, sp: SamplingParams) -> None:
    """Random verdicts whose own token is, now and then, the node's alternate at the
    rejected position: after every verdict both ends hold the same history, gen and
    branch, the target's draft after a taken alternate is the alternate's rest, and
    nothing is stale or refused."""
    rng = random.Random(seed)
    model = FakeModel(n_vocab=40, seed=seed)
    target = Branching(FakeBackend(model.perturbed(0.8, seed), n_ctx=600))
    history = [1, 2, 3, 4]
    target.begin(history, sp, DraftParams(n_max=4, p_min=0.0))
    assert target.node.plan is not None
    taken = 0
    for _ in range(80):
        k = rng.choice([1, 2, 4])
        node = target.node
        alts_before = dict(node.plan.alts)
        draft = target.propose(history, k).tokens
        assert node.committed == history
        assert node.gen == max(target.received.gen, 0)
        assert draft == node.branch[: len(draft)]
        a = rng.randint(0, len(draft))
        at = len(history) + a
        alt = alts_before.get(at)
        if alt is not None and len(alt) > 1 and (a == len(draft) or alt[0] != draft[a]) \
                and rng.random() < 0.7:
            own = alt[0]
        elif a < len(draft) and rng.random() < 0.5:
            own = draft[a]
        else:
            own = rng.randrange(34)
        history = [*history, *draft[:a], own]
        gen = node.gen
        target.learn(history, a, a + 1)
        # A second choice alone (Open.second_choices) adds nothing outside a tree: not taken.
        if alt is not None and len(alt) > 1 and own == alt[0] \
                and (a == len(draft) or own != draft[a]):
            taken += 1
            assert node.gen == gen + 1 and node.branch[: len(alt) - 1] == alt[1:]
            assert target.propose(history, 8).tokens[: len(alt) - 1] == alt[1:]
    st = target.stats()
    assert taken > 3 and st["alternate_rounds"] == taken
    assert st["alternates_received"] > taken and st["stale_chunks"] == 0
    target.end()


def test_a_node_that_does_not_branch_and_a_target_that_does_not_ask() -> None:
    """Old peers: a node that predates alternates reads the request as unknown fields
    (here: an Open without them), a target that predates them never asks; either way
    no chunk carries one, no verdict takes one, and the rounds go on as before."""
    model = FakeModel(n_vocab=40, seed=2)
    for asks in (True, False):
        target = Branching(FakeBackend(model.perturbed(0.8, 2), n_ctx=400))
        if not asks:
            target.alternates = None
        sent: list[Chunk] = []
        real_open = target.open_message

        def old_node_open(history, real_open=real_open, asks=asks):
            o = real_open(history)
            assert (o.alternates > 0) == asks
            o.alternates = o.alternate_len = 0  # what a node without the fields reads
            return o

        target.open_message = old_node_open
        seen = target.on_chunk
        target.on_chunk = lambda s, c, seen=seen, sent=sent: (sent.append(c), seen(s, c))[1]
        history = [1, 2, 3, 4]
        target.begin(history, GREEDY, DraftParams(n_max=4, p_min=0.0))
        rng = random.Random(0)
        for _ in range(30):
            draft = target.propose(history, 4).tokens
            a = rng.randint(0, len(draft))
            history = [*history, *draft[:a], rng.randrange(34)]
            target.learn(history, a, a + 1)
        assert sent and not any(c.alternates for c in sent)
        assert target.stats()["alternate_rounds"] == 0
        assert target.stats()["tokens_received"] > 30
        target.end()


def test_a_verdict_that_takes_an_alternate_never_sent_ends_the_session() -> None:
    model = FakeModel(n_vocab=40, seed=4)
    target = Branching(FakeBackend(model, n_ctx=400))
    target.begin([1, 2, 3, 4], GREEDY, DraftParams(n_max=4, p_min=0.0))
    node = target.node
    with pytest.raises(ProtocolError, match="alternate at 4"):
        node._apply(Verdict(4, 0, [39], gen=node.gen, alternate=True))
    target.end()


def test_alternates_for_committed_positions_are_not_kept() -> None:
    """A node that floods alternates for positions the history has passed costs the
    target nothing: it keeps only those still ahead."""
    from branch_fakes import PROMPT, ScriptedDrafter

    d = ScriptedDrafter(pipelined=True)
    d.begin(PROMPT, GREEDY, DraftParams(n_max=4, p_min=0.0))
    d.on_chunk(d.session, Chunk(0, 4, [10, 11], alternates=[Alternate(4, [12, 13])]))
    assert 4 in d.received.alts
    assert d.propose([*PROMPT, 10, 11], 4).tokens == []
    for _ in range(50):
        d.on_chunk(d.session, Chunk(0, 6, [], alternates=[Alternate(5, [14, 15])] * 4))
    assert d.received.alts == {}
