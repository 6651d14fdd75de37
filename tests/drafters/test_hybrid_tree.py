"""The hybrid's tree: the lookup's copy and the model's draft verified in one decode.

On fake models and a fake target that verifies trees (FakeBatch): token-identical to
plain decoding for every draft length, greedy and seeded, fixed and adaptive, with a
model that works ahead and one in this process; trees are made where the candidates
differ, the round keeps whichever path the target takes (the branch's too), and the
model hears how many of its own tokens the history kept. The tree's value
(tree_kept) and its pricing by the drafter's gain (policy/tree.py) are checked
directly. On the real bundled pair (slow): a remote node and the lookup as trees on a
target with tree sequences, token-identical to plain decoding.
"""

from __future__ import annotations

import pytest
from fakes import FakeBackend, FakeBatch, FakeClock
from hybrid_fakes import FAKE_GREEDY, SAMPLED, TARGET, AheadSpy, V, lookup, reference
from invariance_checks import explain_mismatch, taking_turns
from wire_helpers import CODE, GREEDY, N_CTX, PROSE, SEEDED, request, run_to_end, settled

from specwire.config import DraftParams
from specwire.drafters import hybrid as hybrid_mod
from specwire.drafters.hybrid import HybridDrafter, reach, tree_kept
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram import drafter as ngram_mod
from specwire.engine import engine as engine_mod
from specwire.engine import round as round_mod
from specwire.engine import sequence as sequence_mod
from specwire.engine import tree_round
from specwire.engine.engine import Engine, Request
from specwire.policy.adaptive import AdaptivePolicy
from specwire.policy.tree import TreeYield, tree_pays

pytestmark = pytest.mark.q8_0   # the tests' fast target (bundled.py)

HEAD = [7, 8, 9, 10, 11]


def _prompt(params, n: int = 60) -> list[int]:
    """A prompt that holds plain decoding's continuation with every seventh token wrong:
    the lookup copies it and is rejected at each wrong token. (The fake target's row
    depends on the last two tokens and the position, so the continuation does not
    depend on the copy.)"""
    cont = reference(params, n, [*HEAD, *[0] * n, 20, *HEAD])
    wrong = [(t + 1) % V if i % 7 == 6 else t for i, t in enumerate(cont)]
    return [*HEAD, *wrong, 20, *HEAD]


def _short_twin(params):
    """A model that works ahead and drafts six tokens, the first two right (it samples
    as the target does) and the rest wrong."""
    def draft(h, k):
        right = reference(params, min(k, 6), h)
        return right[:2] + [(t + 1) % V for t in right[2:]]
    return AheadSpy(draft)


def _target(monkeypatch, leaves: int = 4) -> FakeBatch:
    """A tree target whose decode costs the same whatever its size (a flat curve), on a
    FakeClock: the hybrid's and the engine's pricing then find nearly every tree worth it."""
    clock = FakeClock().install(monkeypatch, engine_mod, round_mod, sequence_mod, hybrid_mod,
                                ngram_mod)
    return FakeBatch(TARGET, n_seq=1, n_ctx=512, tree_leaves=leaves, clock=clock,
                     cost=(1e-3, 0.0))


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
@pytest.mark.parametrize("params", [FAKE_GREEDY, SAMPLED], ids=["greedy", "t0.8"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_hybrid_trees_are_token_identical(monkeypatch, k, params, policy) -> None:
    prompt = _prompt(params)
    for model in (_short_twin(params), ModelDrafter(FakeBackend(TARGET.perturbed(0.7, seed=5),
                                                                   name="d.gguf"))):
        fb = _target(monkeypatch)
        hybrid = HybridDrafter(lookup(), model)
        req = Request(list(prompt), 48, params, DraftParams(n_max=k, p_min=0.0, policy=policy))
        gen = Engine(fb, hybrid).generate(req)
        gen.run()
        assert gen.tokens == reference(params, 48, prompt), (model.name, k)


def test_both_candidates_are_verified_as_a_tree_and_either_path_is_kept(monkeypatch) -> None:
    """Seeded, the lookup wrong at every seventh token, the model right for two of its
    six: trees are made, some rounds keep the model's branch past the lookup's mistake and some the
    lookup's longer copy, and the model is told each round how many of its own tokens
    the history kept."""
    prompt = _prompt(SAMPLED, 90)
    fb = _target(monkeypatch)
    model = _short_twin(SAMPLED)
    hybrid = HybridDrafter(lookup(), model)
    eng = Engine(fb, hybrid)
    gen = eng.generate(Request(list(prompt), 80, SAMPLED,
                               DraftParams(n_max=8, p_min=0.0, policy="fixed")))
    gen.run()
    assert gen.tokens == reference(SAMPLED, 80, prompt)
    st = hybrid.stats()
    assert st["trees"] >= len(fb.trees) > 0   # the engine's own rule verifies most of them
    assert st["tree_model_kept"] > 0 and st["tree_ngram_kept"] > 0, st
    assert eng.tree_yield.taken > 0
    assert all(acc == kept for acc, kept in model.learned)


def test_a_chain_target_verifies_the_better_candidate_alone(monkeypatch) -> None:
    """Without tree sequences the engine drops the branch: the chain is verified as before,
    and the output is still plain decoding's."""
    prompt = _prompt(FAKE_GREEDY)
    fb = _target(monkeypatch, leaves=1)
    hybrid = HybridDrafter(lookup(), _short_twin(FAKE_GREEDY))
    gen = Engine(fb, hybrid).generate(Request(list(prompt), 40, FAKE_GREEDY,
                                              DraftParams(n_max=8, p_min=0.0, policy="fixed")))
    gen.run()
    assert gen.tokens == reference(FAKE_GREEDY, 40, prompt)
    assert not fb.trees


def test_a_tree_is_made_only_where_it_beats_the_better_candidate() -> None:
    """On a steep verification curve (every token a step) a weak second candidate does
    not pay for its tokens; on a flat one it does."""
    from specwire.drafters.ngram.drafter import Offer
    for slope, want in ((1.0, False), (0.0, True)):
        hybrid = HybridDrafter(lookup(), _short_twin(FAKE_GREEDY))
        for n in range(1, 12):
            for _ in range(3):
                hybrid.costs.observe(n, 1.0 + slope * (n - 1))
        hybrid.est.accepted, hybrid.est.rejected = 1.0, 3.0     # a = 0.25
        offer = Offer([1, 2, 3, 4], [0.9] * 4)
        from specwire.drafters.base import Draft
        tree = hybrid._both(offer, Draft([1, 5, 6]), use_ngram=True)
        assert (tree is not None) is want, slope
        if tree is not None:
            (off, branch), = tree.branches
            assert tree.tokens == [1, 2, 3, 4] and off == 1 and branch in ([5], [5, 6])
            assert 0.0 < tree.gain < 1.0


def test_identical_or_nested_candidates_make_no_tree() -> None:
    from specwire.drafters.base import Draft
    from specwire.drafters.ngram.drafter import Offer
    hybrid = HybridDrafter(lookup(), _short_twin(FAKE_GREEDY))
    hybrid.costs.observe(1, 1.0)
    offer = Offer([1, 2, 3], [0.9] * 3)
    assert hybrid._both(offer, Draft([1, 2]), use_ngram=True) is None
    assert hybrid._both(offer, Draft([1, 2, 3, 4]), use_ngram=False) is None
    assert hybrid._both(Offer([], []), Draft([1, 2]), use_ngram=False) is None


def test_where_one_candidate_holds_the_other_the_longer_is_verified() -> None:
    """On a flat curve a copy that continues the model's shorter draft is worth more
    than either alone (their agreement makes the shared tokens likelier), and the
    reverse; on a steep one a doubtful copy's tail is not, and the choice stands."""
    from specwire.drafters.base import Draft
    from specwire.drafters.ngram.drafter import Offer
    for slope, want in ((0.0, True), (3.0, False)):
        hybrid = HybridDrafter(lookup(), _short_twin(FAKE_GREEDY))
        for n in range(1, 12):
            for _ in range(3):
                hybrid.costs.observe(n, 1.0 + slope * (n - 1))
        offer = Offer([1, 2, 3, 4, 5], [0.5] * 5)
        assert hybrid._agreeing(offer, Draft([1, 2]), use_ngram=False) is want, slope
    hybrid = HybridDrafter(lookup(), _short_twin(FAKE_GREEDY))
    hybrid.costs.observe(1, 1.0)
    assert hybrid._agreeing(Offer([1], [0.9]), Draft([1, 2, 3]), use_ngram=True) is False
    assert hybrid._agreeing(Offer([1, 2], [0.5] * 2), Draft([1, 3]), use_ngram=True) is True


def test_tree_kept_counts_each_depth_once() -> None:
    chain, branch = reach([0.5, 0.5, 0.5]), reach([0.5, 0.5])
    # shared first token: max(0.5, 0.5); past it, one or the other, never over the
    # chance of reaching the parting
    assert tree_kept(chain, branch, 1) == pytest.approx(0.5 + 0.5 + 0.125)
    # parting at once: the two first tokens exclude each other
    assert tree_kept(reach([0.7]), reach([0.6]), 0) == pytest.approx(1.0)
    assert tree_kept(reach([0.2, 0.2]), reach([0.3]), 0) == pytest.approx(0.5 + 0.04)


def test_the_tree_rule_prices_a_drafters_gain_on_the_curve() -> None:
    """policy/tree.py: given the drafter's gain, the learnt yield is not used."""
    policy = AdaptivePolicy(n_max=8)
    for n in range(1, 12):
        for _ in range(3):
            policy.costs.observe(n, 0.1 * (1.0 + 0.3 * (n - 1)))
    low = TreeYield(gained=0.0, sent=10.0)
    assert not tree_pays(policy, None, 4, 3, low)
    assert tree_pays(policy, None, 4, 3, low, gain=3.0)
    assert not tree_pays(policy, None, 4, 3, TreeYield(), gain=0.0)


# ------------------------------------------------------------------ real models (slow)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [pytest.param(GREEDY, id="greedy", marks=pytest.mark.extended),
                                pytest.param(SEEDED, id="seeded")])
def test_real_pair_remote_hybrid_trees_are_token_identical(target, node, sp,
                                                          monkeypatch) -> None:
    """A draft node drafting ahead and the lookup, on a target with tree sequences, for
    each draft length: plain decoding's tokens (a near-tie flipped by the batch's shape
    is reported with both rows, never tolerated), and trees of both were verified (every
    tree made is: on this compute-bound pair the priced rule would send chains, and
    verification here costs the same at any size, so that every round where the two
    candidates part is a tree whatever the loaded machine measured)."""
    monkeypatch.setattr(tree_round, "tree_pays", lambda *args, **kwargs: True)
    monkeypatch.setattr(HybridDrafter, "_verify_s", lambda self, n: 0.01)
    from specwire.backend.llama import LlamaBackend
    from specwire.config import ModelParams
    tree_target = LlamaBackend(ModelParams(target.path, n_ctx=N_CTX, n_threads=1),
                               target.backend.model, tree_branches=4)
    trees = 0.0
    for text, k in taking_turns((CODE, PROSE), (1, 2, 4, 8)):
        prompt = target.tokens(text)
        want = target.plain(prompt, sp, 40)
        hybrid = HybridDrafter(lookup(), target.drafter(node.url, pipelined=True))
        try:
            gen = Engine(tree_target, hybrid).generate(
                request(prompt, 40, sp, n_max=k, policy="fixed"))
            got = run_to_end(gen, on_step=settled(hybrid.model))
            if got != want:
                pytest.fail(f"hybrid trees, draft-max {k}:\n"
                            + explain_mismatch(target.backend, text, want, got))
            trees += hybrid.stats().get("trees", 0.0)
        finally:
            hybrid.close()
    assert trees > 0, "no round verified both candidates as a tree"


@pytest.mark.slow
@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_real_pair_local_hybrid_trees_are_token_identical(target, sp) -> None:
    """The draft model in this process and the lookup, on a target with tree sequences:
    plain decoding's tokens for each draft length, fixed and adaptive, the prompts taking
    turns (invariance_checks.taking_turns). (How many trees
    are made follows the measured times, so it is not asserted here: the node's test
    above asserts that trees were verified.)"""
    from specwire.assets import models
    from specwire.backend.llama import LlamaBackend, load_model
    from specwire.config import ModelParams
    tree_target = LlamaBackend(ModelParams(target.path, n_ctx=N_CTX, n_threads=1),
                               target.backend.model, tree_branches=4)
    p = ModelParams(str(models.default_draft(progress=False)), n_ctx=1024, n_threads=1)
    model = ModelDrafter(LlamaBackend(p, load_model(p)))
    settings = ((1, "fixed"), (3, "fixed"), (8, "fixed"), (8, "adaptive"))
    for text, (k, policy) in taking_turns((CODE, PROSE), settings):
        prompt = target.tokens(text)
        want = target.plain(prompt, sp, 40)
        hybrid = HybridDrafter(lookup(), model)
        gen = Engine(tree_target, hybrid).generate(
            request(prompt, 40, sp, n_max=k, policy=policy))
        got = run_to_end(gen)
        if got != want:
            pytest.fail(f"local hybrid trees, draft-max {k}, {policy}:\n"
                        + explain_mismatch(target.backend, text, want, got))
