"""Tree verification on fakes: the walk, the engine's tree rounds, and their pricing.

The contract is the chain's: the tokens a tree round emits are the ones plain decoding
gives, greedy and seeded, for every draft length, whatever the branches hold. The fake
target (FakeBatch with tree_leaves) computes each node's row from its own path, so a
wrong parent, position or kept path changes the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import numpy as np
import pytest
from branch_fakes import _work
from fakes import FakeBatch, FakeClock, FakeModel

from specwire.backend.base import BackendError
from specwire.backend.batch import Part
from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Draft, DrafterBase, cut_branches
from specwire.engine import engine as engine_mod
from specwire.engine import round as round_mod
from specwire.engine import sequence as sequence_mod
from specwire.engine.engine import Engine, Request
from specwire.link.alternates import AlternateParams
from specwire.link.rule import take_tree_alternate
from specwire.link.transport import specwire_pb2 as pb
from specwire.policy.adaptive import AdaptivePolicy, FixedPolicy
from specwire.policy.tree import TreeYield, tree_pays
from specwire.sample import sampling
from specwire.sample import tree as trees
from specwire.sample.verify import Verifier

V = 48
TARGET = FakeModel(V, seed=3, sharp=1.2)
DRAFT = TARGET.perturbed(0.5, seed=4)
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, min_p=0.0, seed=77)
PROMPT = [1, 5, 9, 2]


def _sample(model: FakeModel, seq: Sequence[int], sp: SamplingParams) -> int:
    return sampling.coupled(model.row(seq), sp, len(seq), sampling.recent_window(seq, sp))


def _plain(prompt: list[int], sp: SamplingParams, n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(_sample(TARGET, seq, sp))
    return seq[len(prompt):]


class TreeDrafter(DrafterBase):
    """A draft model's chain, with its second choice and a continuation at every position
    (at most `branches` of them, `length` tokens each)."""

    name = "tree-fake"

    def __init__(self, branches: int = 3, length: int = 3) -> None:
        self.branches, self.length = branches, length
        self.sp = GREEDY

    def begin(self, prompt, sampling_params, params, **guides) -> None:
        self.sp = sampling_params

    def _run(self, seq: list[int], n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(_sample(DRAFT, seq + out, self.sp))
        return out

    def propose(self, history, k: int) -> Draft:
        seq = list(history)
        chain = self._run(seq, k)
        branches = []
        for i in range(k):
            if len(branches) == self.branches:
                break
            row = DRAFT.row(seq + chain[:i])
            second = [int(t) for t in np.argsort(-row)[:2] if int(t) != chain[i]][0]
            rest = self._run(seq + chain[:i] + [second], self.length - 1)
            branches.append((i, [second, *rest]))
        return Draft(chain, branches=branches)

    def learn(self, history, accepted, appended) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


# -- the tree and its walk ---------------------------------------------------------------


def test_build_hangs_each_branch_under_its_chain_position() -> None:
    t = trees.build(7, [10, 11, 12], [(0, [20, 21]), (2, [30]), (1, [11]), (5, [40])])
    assert t.tokens == (7, 10, 11, 12, 20, 21, 30)
    assert t.parents == (-1, 0, 1, 2, 0, 4, 2)
    assert t.depth == (0, 1, 2, 3, 1, 2, 3)
    assert t.branch == (-1, -1, -1, -1, 0, 0, 1)   # (1, [11]) repeats the chain: left out
    assert t.chain_len == 3 and t.leaves() == [3, 5, 6]
    assert t.path(5) == [4, 5] and t.children(0) == [1, 4]


def test_cut_branches_keeps_them_within_the_chain() -> None:
    assert cut_branches([(0, [1, 2, 3]), (2, [4, 5]), (3, [6])], 3) == [(0, [1, 2, 3]),
                                                                          (2, [4])]


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_the_walk_emits_what_plain_decoding_gives(sp) -> None:
    """Random trees, some holding the target's own continuation in a branch: the accepted
    tokens and the final one are always plain decoding's next ones."""
    rs = np.random.default_rng(0)
    took_branch = 0
    for trial in range(200):
        history = [int(t) for t in rs.integers(0, V - 8, size=3)]
        want = _plain(history, sp, 8)
        chain = [int(t) for t in rs.integers(0, V - 8, size=4)]
        f = int(rs.integers(0, 4))
        chain[:f] = want[:f]
        branches = [(f, want[f:f + 3])] if trial % 2 else []
        branches.append((int(rs.integers(0, 4)), [int(t) for t in rs.integers(0, V, size=2)]))
        tree = trees.build(history[-1], chain, cut_branches(branches, len(chain)))
        rows = np.stack([TARGET.row(history + [tree.tokens[j] for j in tree.path(i)])
                         for i in range(len(tree))])
        out = trees.verify(Verifier(sp, VerifyMode.COUPLED), rows, history, tree)
        got = [*out.tokens, out.token]
        assert got == want[:len(got)], (trial, tree, got, want)
        assert out.chain <= out.accepted and out.accepted <= tree.max_depth
        took_branch += out.branch >= 0
    assert took_branch > 20


def test_rejection_mode_has_no_tree() -> None:
    tree = trees.build(1, [2], [(0, [3])])
    with pytest.raises(ValueError, match="greedy and coupled"):
        trees.verify(Verifier(SEEDED, VerifyMode.REJECTION), np.zeros((3, V)), [1], tree)


# -- the engine ---------------------------------------------------------------------------


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    """The engine's perf_counter, moved only by the fake's costs (FakeBatch's default: 10 ms
    a decode and 1 ms a token), so that whether a tree pays never depends on how busy the
    machine is: on the wall clock, a loaded machine made trees lose now and then."""
    return FakeClock().install(monkeypatch, engine_mod, round_mod, sequence_mod)


def _engine(clock: FakeClock, leaves: int, drafter: DrafterBase | None = None
            ) -> tuple[Engine, FakeBatch]:
    fb = FakeBatch(TARGET, n_seq=1, n_ctx=256, tree_leaves=leaves, clock=clock)
    return Engine(fb, drafter or TreeDrafter()), fb


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_tree_rounds_are_token_identical_to_plain_decoding(clock, sp, k) -> None:
    eng, fb = _engine(clock, leaves=4)
    req = Request(list(PROMPT), 60, sp, DraftParams(n_max=k, policy="fixed"))
    gen = eng.generate(req)
    assert gen.run() == _plain(PROMPT, sp, 60)
    assert fb.trees, "no round verified a tree"
    branch_wins = [nodes for nodes in fb.kept if nodes and nodes[-1] > k]
    assert branch_wins, "no round kept a branch's path"


def test_tree_rounds_yield_more_per_round_than_chains(clock) -> None:
    out = {}
    for leaves in (1, 4):
        eng, _ = _engine(clock, leaves)
        gen = eng.generate(Request(list(PROMPT), 80, GREEDY, DraftParams(n_max=4,
                                                                         policy="fixed")))
        tokens = gen.run()
        out[leaves] = (tokens, len(tokens) / gen.stats.rounds if gen.stats.rounds else 0)
    assert out[1][0] == out[4][0]
    assert out[4][1] > out[1][1], out


def test_a_chain_target_drops_the_branches(clock) -> None:
    eng, fb = _engine(clock, leaves=1)
    gen = eng.generate(Request(list(PROMPT), 30, GREEDY, DraftParams(n_max=4, policy="fixed")))
    assert gen.run() == _plain(PROMPT, GREEDY, 30)
    assert not fb.trees


def test_rejection_mode_sends_chains(clock) -> None:
    eng, fb = _engine(clock, leaves=4)
    req = Request(list(PROMPT), 20, SEEDED,
                  DraftParams(n_max=4, policy="fixed", mode=VerifyMode.REJECTION))
    eng.generate(req).run()
    assert not fb.trees


def test_a_tree_of_too_many_leaves_is_refused() -> None:
    fb = FakeBatch(TARGET, n_seq=1, tree_leaves=2)
    tree = trees.build(1, [2, 3], [(0, [4]), (1, [5])])
    with pytest.raises(BackendError, match="leaves"):
        fb.decode([Part(0, list(tree.tokens), "all", list(tree.parents))])


def test_keep_tree_refuses_a_path_that_is_not_one() -> None:
    fb = FakeBatch(TARGET, n_seq=1, tree_leaves=3)
    fb.seq(0).eval([1, 2], "none")
    tree = trees.build(3, [4, 5], [(0, [6, 7])])
    fb.decode([Part(0, list(tree.tokens), "all", list(tree.parents))])
    with pytest.raises(BackendError, match="not a path"):
        fb.keep_tree(0, [1, 4])


# -- pricing ------------------------------------------------------------------------------


def _policy(slope_steps: float) -> AdaptivePolicy:
    """A policy that measured a plain step of 0.1 s and slope_steps steps per extra token."""
    p = AdaptivePolicy(8)
    for n in range(1, 17):
        for _ in range(3):
            p.costs.observe(n, 0.1 * (1 + slope_steps * (n - 1)))
    return p


def test_a_flat_curve_pays_for_a_tree_and_a_steep_one_does_not() -> None:
    y = TreeYield()
    assert tree_pays(_policy(0.01), None, 4, 6, y)
    assert not tree_pays(_policy(1.0), None, 4, 6, y)


def test_a_tree_whose_branches_never_win_stops_paying() -> None:
    y, p = TreeYield(), _policy(0.08)
    assert tree_pays(p, None, 4, 6, y)
    for _ in range(60):
        y.observe(6, 0)
    assert not tree_pays(p, None, 4, 6, y)


def test_a_fixed_policy_tries_the_tree_until_the_curve_and_the_rate_are_measured() -> None:
    costs = _policy(1.0).costs
    assert tree_pays(FixedPolicy(4), None, 4, 3, TreeYield())
    assert tree_pays(FixedPolicy(4), costs, 4, 3, TreeYield())   # no round's rate yet
    assert not tree_pays(FixedPolicy(4), costs, 4, 0, TreeYield())


def test_a_fixed_policy_prices_the_tree_on_the_engines_curve() -> None:
    """A fixed draft length fixes the chain, not the side branches: on a steep curve (a
    MoE reading more experts per token) they cost more than they add, on a flat one not."""
    y = TreeYield()
    for _ in range(20):
        y.observe_round(3, 0.3)   # 10 tokens/s: a token is worth 0.1 s
    assert y.rate == pytest.approx(10.0)
    # 3 branch tokens at the prior's 1/4 token each: 0.075 s of tokens, against the
    # curve's 3 x 0.1 s x slope
    assert not tree_pays(FixedPolicy(4), _policy(0.3).costs, 4, 3, y)
    assert tree_pays(FixedPolicy(4), _policy(0.05).costs, 4, 3, y)


def test_the_adaptive_engine_sends_chains_on_a_steep_curve(monkeypatch) -> None:
    """An adaptive request on a target whose every extra token costs a step: trees are
    priced and not sent once the policy has measured the curve (the engine's own decodes,
    on a clock that moves by what the fake target charges, go on measuring it)."""
    clock = FakeClock().install(monkeypatch, engine_mod, round_mod, sequence_mod)
    fb = FakeBatch(TARGET, n_seq=1, n_ctx=256, tree_leaves=4, clock=clock, cost=(0.0, 0.1))
    eng = Engine(fb, TreeDrafter())
    policy = eng.policy(0, "adaptive", 4)
    for n in range(1, 17):
        for _ in range(3):
            policy.costs.observe(n, 0.1 * n)
    eng.tree_yield = TreeYield(gained=0.1, sent=10.0)
    gen = eng.generate(Request(list(PROMPT), 30, GREEDY, DraftParams(n_max=4, policy="adaptive")))
    assert gen.run() == _plain(PROMPT, GREEDY, 30)
    assert not fb.trees


# -- a pipelined drafter's alternates as branches (both ends of the link) -----------------


def _tree_link(trees_on: bool):
    from branch_fakes import Branching
    from fakes import FakeBackend

    d = Branching(FakeBackend(DRAFT, n_ctx=1024))
    d.alternates = AlternateParams(per_chunk=4, length=4, value_min=0.0, top_below=1.0)
    d.transport.trees = lambda: trees_on
    return d


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_pipelined_drafters_alternates_verified_as_trees_are_lossless(clock, sp, k) -> None:
    """Both ends of a real branch session (DraftSession and BranchDrafter, by function
    call): the alternates the node sends are verified beside the branch, the verdict
    names the one taken under the tree rule, both ends go on from it, and the output is
    plain decoding's."""
    drafter = _tree_link(True)
    eng, fb = _engine(clock, leaves=5, drafter=drafter)
    gen = eng.generate(Request(list(PROMPT), 80, sp, DraftParams(n_max=k, policy="fixed",
                                                                  p_min=0.0)))
    assert gen.run() == _plain(PROMPT, sp, 80)
    st = drafter.stats()
    assert fb.trees and st["alternate_trees"] > 0, st
    assert st["stale_chunks"] == 0, st
    drafter.end()


def test_a_node_without_the_tree_rule_gets_chains(clock) -> None:
    drafter = _tree_link(False)
    eng, fb = _engine(clock, leaves=5, drafter=drafter)
    gen = eng.generate(Request(list(PROMPT), 60, GREEDY, DraftParams(n_max=4, policy="fixed",
                                                                      p_min=0.0)))
    assert gen.run() == _plain(PROMPT, GREEDY, 60)
    assert not fb.trees and drafter.stats()["alternate_trees"] == 0
    drafter.end()


@pytest.mark.parametrize(("alternate", "tokens", "rest"), [
    ([5, 6, 7], [5], [6, 7]),         # as take_alternate: the rest is verified next
    ([5, 6, 7], [5, 6], [7]),
    ([5, 6, 7], [5, 9], []),          # the tree kept 5, the target's own 9 leaves it
    ([5, 6, 7], [5, 6, 7, 8], []),    # kept whole, then the bonus token
    ([5, 6, 7], [6], None),           # does not begin with the alternate
    (None, [5], None),
])
def test_take_tree_alternate(alternate, tokens, rest) -> None:
    assert take_tree_alternate(alternate, tokens) == rest


def test_the_node_says_tree_in_its_hello_and_the_target_asks_for_it() -> None:
    import inspect

    from specwire.link.transport import grpc_client
    from specwire.node import server

    assert "\"tree\"" in inspect.getsource(server.DraftNodeService.hello)

    class Link:
        def __init__(self, modes):
            self.hello = pb.HelloReply(modes=modes)

    t = object.__new__(grpc_client.GrpcTransport)
    for modes, want in ((["greedy", "coupled", "rejection"], False),
                        (["greedy", "coupled", "rejection", "tree"], True)):
        t._call = grpc_client._Call(None, Link(modes), 0, 0, pipelined=True)
        assert t.trees() is want
        t._call.pipelined = False      # a synchronous session carries no alternates
        assert t.trees() is False
    t._call = None
    assert t.trees() is False


def test_the_target_gets_tree_sequences_for_one_pipelined_sequence() -> None:
    from specwire.build import tree_branches
    from specwire.cli.main import build_parser
    from specwire.cli.settings import engine_settings

    def s(*argv: str):
        return engine_settings(build_parser().parse_args(["generate", "x", *argv]))

    assert tree_branches(s("--draft-url", "h:1"), 1) == 4
    assert tree_branches(s("--draft-url", "h:1", "--draft-tree", "2"), 1) == 2
    assert tree_branches(s("--draft-url", "h:1", "--draft-tree", "0"), 1) == 0
    assert tree_branches(s("--draft-url", "h:1"), 4) == 0                      # -np 4
    assert tree_branches(s("--draft-url", "h:1", "--draft-mode", "sync"), 1) == 0
    assert tree_branches(s("--no-draft"), 1) == 0
    # the hybrid's second candidate is a branch, with a node or a local model
    assert tree_branches(s("--draft-url", "h:1", "--draft-hybrid"), 1) == 4
    assert tree_branches(s("--draft-hybrid", "--draft-tree", "2"), 1) == 2
    assert tree_branches(s("--draft-hybrid"), 4) == 0


def test_a_tree_that_would_not_fit_the_batch_is_sent_as_its_chain() -> None:
    fb = FakeBatch(TARGET, n_seq=1, n_ctx=256, n_batch=6, tree_leaves=4)
    gen = Engine(fb, TreeDrafter()).generate(
        Request(list(PROMPT), 30, GREEDY, DraftParams(n_max=4, policy="fixed")))
    assert gen.run() == _plain(PROMPT, GREEDY, 30)
    assert fb.trees and all(len(tokens) <= 6 for _, tokens, _ in fb.trees)


# -- the node, told that its target verifies trees (Open.tree) -----------------------------

#: A draft sure enough of itself that its hesitations are worth an alternate (alternates.py).
SURE_DRAFT = FakeModel(V, seed=0, sharp=3.0)


def _node(tree: int, lookahead: int = 16):
    """A pipelined session of the fake draft asking for alternates, and what it sends."""
    from fakes import FakeBackend

    from specwire.link.messages import Open
    from specwire.link.session import DraftSession

    sent: list = []
    o = Open(list(PROMPT), GREEDY, VerifyMode.GREEDY, pipelined=True, lookahead=lookahead,
             alternates=2, alternate_len=4, tree=tree)
    return DraftSession(FakeBackend(SURE_DRAFT, n_ctx=1024), o, sent.append), sent


def _alternate_lags(sent: list) -> list[int]:
    """For each alternate sent: how many branch tokens past its position had gone out
    before it (0: it came right after its position)."""
    end, lags = 0, []
    for c in sent:
        lags += [end - 1 - a.at for a in c.alternates]
        end = max(end, c.start + len(c.tokens))
    return lags


def test_a_node_told_of_trees_drafts_its_alternates_before_the_branch_goes_on() -> None:
    """With Open.tree the node sends an alternate before the branch's next token once a
    round's worth (half the lookahead) is out, so that it reaches the target before the
    decode that verifies its position; at most `tree` of them wait for the branch's
    unverified part. Without it (a chain target, or an older one) they come later, as
    before: once the lookahead is full, or when one is worth more than the branch's next
    token."""
    node, sent = _node(tree=2, lookahead=4)
    _work(node)
    lags = _alternate_lags(sent)
    assert lags and max(lags) <= 1, lags          # sent once 2 branch tokens were out
    assert len(lags) <= 2 and len(node.branch) == node._limit()
    old, old_sent = _node(tree=0, lookahead=4)
    _work(old)
    assert old.branch == node.branch                # the same chain either way
    old_lags = _alternate_lags(old_sent)
    assert old_lags and min(old_lags) > max(lags), (old_lags, lags)


def test_after_a_verdict_the_node_drafts_alternates_for_the_new_positions() -> None:
    """A verdict keeps part of the branch: the alternates at committed positions no
    longer count against `tree`, and the positions still ahead get theirs."""
    from specwire.link.messages import Verdict

    node, sent = _node(tree=1, lookahead=8)
    _work(node)
    first = [a.at for c in sent for a in c.alternates]
    assert len(first) == 1
    for _ in range(6):
        a = first[-1] - len(node.committed)      # keep the branch up to that alternate
        own = node.branch[a]
        node._apply(Verdict(len(node.committed), a, [own], gen=node.gen))
        n = len(sent)
        _work(node)
        new = [x.at for c in sent[n:] for x in c.alternates]
        if not new:
            break
        assert all(p > first[-1] for p in new) and len(new) == 1
        first += new
    assert len(first) > 1, first


def test_open_tree_travels_and_older_peers_ignore_it() -> None:
    """Open.tree is a new field: unset it costs no byte (an older target's Open reads as
    0, chains); set, a parser that predates it (the descriptor without the field) reads
    every other field as before and skips it."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from specwire.link.messages import Open, ProtocolError
    from specwire.link.transport import protocol

    o = Open([1, 2, 3], GREEDY, VerifyMode.GREEDY, pipelined=True, lookahead=16,
             alternates=2, alternate_len=4, tree=3)
    m = protocol.open_to_pb(o)
    assert protocol.open_from_pb(pb.Open.FromString(m.SerializeToString())).tree == 3
    no_tree = protocol.open_to_pb(Open([1, 2, 3], GREEDY, VerifyMode.GREEDY, pipelined=True,
                                       lookahead=16, alternates=2, alternate_len=4))
    assert m.ByteSize() == no_tree.ByteSize() + 3       # field 16: a 2-byte tag, the value
    m.ClearField("tree")
    assert m.SerializeToString() == no_tree.SerializeToString()
    with pytest.raises(ProtocolError, match="open: tree above 4"):
        Open([1], GREEDY, VerifyMode.GREEDY, tree=5)

    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    old_open = next(t for t in fdp.message_type if t.name == "Open")
    fields = [f for f in old_open.field if f.name != "tree"]
    del old_open.field[:]
    old_open.field.extend(fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    OldOpen = message_factory.GetMessageClass(pool.FindMessageTypeByName("specwire.v1.Open"))
    old = OldOpen.FromString(protocol.open_to_pb(o).SerializeToString())
    assert not hasattr(old, "tree")
    assert (list(old.history), old.lookahead, old.alternates, old.alternate_len) == \
        ([1, 2, 3], 16, 2, 4)


def test_the_target_says_tree_only_where_it_verifies_trees() -> None:
    """open_message: the drafter's tree setting (the target's --draft-tree, set by its
    builders), only for a pipelined session that asks for alternates."""
    d = _tree_link(True)
    d.tree = 3
    assert d.open_message(list(PROMPT)).tree == 3
    d.tree = 0
    assert d.open_message(list(PROMPT)).tree == 0
    d.tree, d.alternates = 3, None
    assert d.open_message(list(PROMPT)).tree == 0


# -- second choices alone (Open.second_choices) --------------------------------------------


def _second_choice_link(monkeypatch):
    """A link whose node hesitates everywhere (top_below 1) but finds no drafted alternate
    worth it (value_min 1): it sends only second choices alone."""
    from specwire.link import alternates

    monkeypatch.setattr(alternates, "AlternateParams",
                        partial(AlternateParams, top_below=1.0, value_min=1.0))
    return _tree_link(True)


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_second_choices_alone_verified_as_trees_are_lossless(clock, sp, k, monkeypatch) -> None:
    """Both ends of a branch session: the node sends its second choice alone with each
    position, the target hangs it in the tree, a round that walks into it keeps it and
    the target's next token, both ends start the next branch afresh, and the output is
    plain decoding's."""
    drafter = _second_choice_link(monkeypatch)
    eng, fb = _engine(clock, leaves=5, drafter=drafter)
    gen = eng.generate(Request(list(PROMPT), 80, sp, DraftParams(n_max=k, policy="fixed",
                                                                  p_min=0.0)))
    assert gen.run() == _plain(PROMPT, sp, 80)
    st = drafter.stats()
    assert fb.trees and st["alternates_received"] == st["second_choices"] > 0, st
    assert st["alternate_trees"] == st["second_choices_taken"] > 0 and st["stale_chunks"] == 0, st
    drafter.end()


def test_a_node_sends_second_choices_alone_only_when_asked() -> None:
    """Open.second_choices (with tree): one-token alternates at sent positions, with the
    position's own chunk, at most a chunk's alternates; never a drafted alternate where
    one went. Without it, or without tree, no alternate is a lone token."""
    from fakes import FakeBackend

    from specwire.link.messages import Open
    from specwire.link.session import DraftSession

    def run(**kw):
        sent: list = []
        o = Open(list(PROMPT), GREEDY, VerifyMode.GREEDY, pipelined=True, lookahead=8,
                 alternates=2, alternate_len=4, **kw)
        node = DraftSession(FakeBackend(SURE_DRAFT, n_ctx=1024), o, sent.append)
        _work(node)
        return node, sent

    node, sent = run(tree=2, second_choices=True)
    singles = [(c, a) for c in sent for a in c.alternates if len(a.tokens) == 1]
    assert singles
    for c, a in singles:
        assert c.start <= a.at < c.start + len(c.tokens)      # with its position
        j = a.at - len(PROMPT)
        assert a.tokens[0] == node.plan.choices[j].second != node.branch[j]
    assert all(len(c.alternates) <= 2 for c in sent)
    ats = [a.at for c in sent for a in c.alternates]
    assert len(ats) == len(set(ats))                           # one alternate a position
    for kw in ({"tree": 2}, {"tree": 0, "second_choices": True}):
        old, old_sent = run(**kw)
        assert old.branch == node.branch
        assert all(len(a.tokens) > 1 for c in old_sent for a in c.alternates), kw


def test_a_second_choice_alone_outside_a_tree_is_not_taken(monkeypatch) -> None:
    """A round that verified the chain only, rejected where a lone second choice was sent,
    the target's token being it: nothing of it is left to verify, so the verdict does not
    take it (both ends start afresh, as after any rejection)."""
    drafter = _second_choice_link(monkeypatch)
    drafter.begin(list(PROMPT), GREEDY, DraftParams(n_max=4, p_min=0.0))
    draft = drafter.propose(list(PROMPT), 4)
    node = drafter.node
    single = next(a for a in (node.plan.alts.get(len(PROMPT) + j) for j in range(len(draft)))
                  if a is not None and len(a) == 1)
    at = next(p for p, t in node.plan.alts.items() if t == single)
    a = at - len(PROMPT)
    history = [*PROMPT, *draft.tokens[:a], single[0]]
    gen = node.gen
    drafter.learn(history, a, a + 1)
    assert node.gen == gen + 1 and node.committed == history
    assert drafter.stats()["alternate_rounds"] == 0
    assert drafter.propose(history, 4).tokens == node.branch[:4]
    drafter.end()


def test_open_second_choices_travels_and_older_peers_ignore_it() -> None:
    """Open.second_choices (field 17): unset, no byte; set, two bytes, which a parser
    that predates it skips."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    from specwire.link.messages import Open
    from specwire.link.transport import protocol

    def o(**kw):
        return Open([1, 2, 3], GREEDY, VerifyMode.GREEDY, pipelined=True, lookahead=16,
                    alternates=2, alternate_len=4, tree=3, **kw)

    m = protocol.open_to_pb(o(second_choices=True))
    assert protocol.open_from_pb(pb.Open.FromString(m.SerializeToString())).second_choices
    assert m.ByteSize() == protocol.open_to_pb(o()).ByteSize() + 3
    fdp = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(fdp)
    old_open = next(t for t in fdp.message_type if t.name == "Open")
    fields = [f for f in old_open.field if f.name != "second_choices"]
    del old_open.field[:]
    old_open.field.extend(fields)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    OldOpen = message_factory.GetMessageClass(pool.FindMessageTypeByName("specwire.v1.Open"))
    old = OldOpen.FromString(m.SerializeToString())
    assert (old.tree, old.alternates) == (3, 2) and not hasattr(old, "second_choices")


def test_the_target_asks_for_second_choices_where_it_verifies_trees() -> None:
    d = _tree_link(True)
    d.tree = 3
    assert d.open_message(list(PROMPT)).second_choices
    d.tree = 0
    assert not d.open_message(list(PROMPT)).second_choices
