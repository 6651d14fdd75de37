"""Tree verification never changes the output: the real bundled pair, greedy and seeded,
draft lengths 1, 2, 4 and 8, on a thread and through a real draft node (pipelined), with
drafted alternates and with second choices alone (Open.second_choices).

The target is a LlamaBackend with tree sequences (tree_branches); the reference is plain
decoding on a context without them. A near-tie flipped by a different batch shape is
reported with both logit rows (test_invariance.explain_mismatch), never tolerated. The
backend's own test checks that a tree's rows are the chain's, path by path, and that the
kept path's KV is what decoding that path gives.
"""

from __future__ import annotations

import numpy as np
import pytest
from alternates_everywhere import threaded_alternates_everywhere
from invariance_checks import explain_mismatch, taking_turns
from wire_helpers import CODE, GREEDY, N_CTX, PROSE, SEEDED, request, run_to_end, settled

from specwire.assets import models
from specwire.backend.base import sync_prefix
from specwire.backend.batch import Part
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import ModelParams
from specwire.drafters.base import Draft, DrafterBase
from specwire.engine import tree_round
from specwire.engine.engine import Engine
from specwire.link import alternates
from specwire.sample import sampling
from specwire.sample import tree as trees

pytestmark = pytest.mark.slow

DRAFT_LENGTHS = (1, 2, 4, 8)
N = 40
#: The default run verifies each drafter's trees once, and greedy and seeded, drafted
#: alternates and second choices alone each somewhere; `-m extended` runs the rest of the
#: cross product (docs/testing.md, "The extended tier").
EXTENDED = pytest.mark.extended


@pytest.fixture(autouse=True)
def every_tree_verified(monkeypatch) -> None:
    """Every tree that can be made is verified: whether one pays is policy/tree.py's
    question (tests/sample/test_tree.py); here, what any tree verifies is plain decoding's.
    On this compute-bound pair the priced rule sends chains once its rate is measured."""
    monkeypatch.setattr(tree_round, "tree_pays", lambda *args, **kwargs: True)


@pytest.fixture(scope="module")
def tree_target(target) -> LlamaBackend:
    return LlamaBackend(ModelParams(target.path, n_ctx=N_CTX, n_threads=1), target.backend.model,
                        tree_branches=4)


def _check(target, text: str, want: list[int], got: list[int], what: str) -> None:
    if got != want:
        pytest.fail(f"{what}:\n" + explain_mismatch(target.backend, text, want, got))


class TreeModelDrafter(DrafterBase):
    """The bundled draft model's chain, with its second choice and length - 1 tokens after
    it at each of the first positions where it is at all unsure: a local drafter of trees
    (link/alternates.py's top_two and draft_alternate, as a node drafts them)."""

    name = "tree-model"

    def __init__(self, backend: LlamaBackend, branches: int = 3, length: int = 4) -> None:
        self.backend, self.branches, self.length, self.sp = backend, branches, length, GREEDY

    def begin(self, prompt, sampling_params, params, **guides) -> None:
        self.sp = sampling_params

    def propose(self, history, k: int) -> Draft:
        be, sp = self.backend, self.sp
        ctx = list(history)
        sync_prefix(be, ctx)
        row = be.eval(ctx[be.n_past:], "last")[-1]
        chain, branches = [], []
        for _ in range(k):
            recent = sampling.recent_window(ctx, sp)
            two = alternates.top_two(row, sp, len(ctx), recent)
            tok = sampling.coupled(row, sp, len(ctx), recent)
            if two is not None and two.first == tok and len(branches) < self.branches \
                    and two.p_first < 0.95:
                alt = alternates.draft_alternate(be, sp, ctx, two.second, self.length)
                branches.append((len(chain), alt))
            chain.append(tok)
            ctx.append(tok)
            row = be.eval([tok], "last")[-1]
        return Draft(chain, branches=branches)

    def learn(self, history, accepted, appended) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}


@pytest.mark.parametrize("sp, length", [
    pytest.param(GREEDY, 4, id="greedy-drafted"),
    pytest.param(SEEDED, 4, id="seeded-drafted", marks=EXTENDED),
    pytest.param(GREEDY, 1, id="greedy-alone", marks=EXTENDED),
    pytest.param(SEEDED, 1, id="seeded-alone", marks=EXTENDED),
])
def test_local_trees_are_token_identical(target, tree_target, sp, length) -> None:
    """length 1: the second choice alone, as a node sends it for Open.second_choices."""
    p = ModelParams(str(models.default_draft(progress=False)), n_ctx=N_CTX, n_threads=1)
    drafter = TreeModelDrafter(LlamaBackend(p, load_model(p)), length=length)
    verified = taken = 0
    for text, k in taking_turns((CODE, PROSE), DRAFT_LENGTHS):
        prompt = target.tokens(text)
        want = target.plain(prompt, sp, N)
        eng = Engine(tree_target, drafter)
        gen = eng.generate(request(prompt, N, sp, n_max=k, policy="fixed"))
        _check(target, text, want, run_to_end(gen), f"local trees, draft-max {k}")
        verified += eng.tree_yield.rounds
        taken += eng.tree_yield.taken
    assert verified > 0 and taken > 0, (verified, taken)


def test_a_trees_rows_are_each_paths_and_the_kept_path_is_its_kv(target, tree_target) -> None:
    be, ref = tree_target, target.twin()
    prompt = be.tokenize(CODE)
    tree = trees.build(prompt[-1], [10, 20, 30, 40], [(1, [50, 60, 70]), (0, [80, 90]),
                                                       (3, [11])])
    for leaf in tree.leaves():
        be.truncate(0)
        be.eval(prompt[:-1], "none")
        (rows,) = be.decode([Part(0, list(tree.tokens), "all", list(tree.parents))])
        rows = rows.copy()
        path = tree.path(leaf)
        ref.truncate(0)
        ref.eval(prompt[:-1], "none")
        chain = ref.eval([prompt[-1], *(tree.tokens[i] for i in path)], "all").copy()
        for k, node in enumerate([0, *path]):
            assert np.allclose(rows[node], chain[k], atol=1e-3), (leaf, node)
            assert np.argmax(rows[node]) == np.argmax(chain[k])
        keep = path[: max(1, len(path) - 1)]
        be.keep_tree(0, keep)
        assert list(be.tokens) == [*prompt, *(tree.tokens[i] for i in keep)]
        ref.truncate(len(prompt) + len(keep))
        nxt, want = be.eval([7], "last")[0].copy(), ref.eval([7], "last")[0].copy()
        # The kept cells need not lie together (the dropped ones leave holes that the next
        # token fills), so the sums run in another order: a batch shape's rounding, far
        # below what one wrong cell of the context does (`wrong`, the chain's path).
        ref.truncate(len(prompt) + 1)
        wrong = ref.eval([tree.tokens[i] for i in range(1, len(keep) + 1)] + [7],
                         "last")[0].copy()
        off = float(np.abs(nxt - want).max())
        assert np.argmax(nxt) == np.argmax(want) and off < 0.1, (leaf, off)
        if keep != list(range(1, len(keep) + 1)):
            assert float(np.abs(nxt - wrong).max()) > 10 * max(off, 1e-3), leaf
    be.truncate(0)


@pytest.mark.parametrize("sp, kind", [
    pytest.param(SEEDED, "alone", id="seeded-alone"),
    pytest.param(GREEDY, "drafted", id="greedy-drafted", marks=EXTENDED),
    pytest.param(SEEDED, "drafted", id="seeded-drafted", marks=EXTENDED),
    pytest.param(GREEDY, "alone", id="greedy-alone", marks=EXTENDED),
])
def test_threaded_trees_everywhere_are_token_identical(target, tree_target, sp, kind,
                                                       monkeypatch) -> None:
    """drafted: an alternate drafted at every position; alone: the second choice alone
    at every position (Open.second_choices), none worth drafting."""
    drafter = threaded_alternates_everywhere(monkeypatch, N_CTX,
                                             value_min=0.0 if kind == "drafted" else 1.0)
    verified = alone = 0.0

    try:
        for text, k in taking_turns((CODE, PROSE), DRAFT_LENGTHS):
            prompt = target.tokens(text)
            want = target.plain(prompt, sp, N)
            eng = Engine(tree_target, drafter)
            gen = eng.generate(request(prompt, N, sp, n_max=k, policy="fixed"))
            _check(target, text, want, run_to_end(gen, on_step=settled(drafter)),
                   f"threaded {kind}, draft-max {k}")
            verified += eng.tree_yield.rounds
            alone += gen.stats.drafter.get("second_choices_taken", 0.0)
    finally:
        drafter.end()
    assert verified > 0
    assert (alone > 0) is (kind == "alone"), alone


@pytest.mark.parametrize("sp", [pytest.param(GREEDY, id="greedy", marks=EXTENDED),
                                pytest.param(SEEDED, id="seeded")])
def test_remote_pipelined_trees_are_token_identical(target, tree_target, node, sp) -> None:
    """The node's own choice of alternates: drafted ones and second choices alone."""
    verified = received = alone = 0.0
    for text, k in taking_turns((CODE, PROSE), DRAFT_LENGTHS):
        prompt = target.tokens(text)
        want = target.plain(prompt, sp, N)
        remote = target.drafter(node.url, pipelined=True)
        try:
            eng = Engine(tree_target, remote)
            gen = eng.generate(request(prompt, N, sp, n_max=k, policy="fixed"))
            _check(target, text, want, run_to_end(gen, on_step=settled(remote)),
                   f"remote, draft-max {k}")
            verified += eng.tree_yield.rounds
            received += gen.stats.drafter.get("alternates_received", 0.0)
            alone += gen.stats.drafter.get("second_choices", 0.0)
        finally:
            remote.close()
    assert received > alone > 0 and verified > 0, (received, alone, verified)
