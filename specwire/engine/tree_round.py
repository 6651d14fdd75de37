"""A round that verifies a tree: the chain and its side branches in one decode.

The round's draft may carry side branches (Draft.branches). Where the target can
decode a tree (backend/batch.py TreeBackend), the request's verification has one
(greedy and coupled, not rejection), the sequence is alone in its step, the tree
fits one decode (-b), and the policy finds the extra tokens worth their cost
(policy/tree.py), the round's part is the tree; otherwise it stays the chain and
the branches are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specwire.backend.batch import BatchBackend, Part, TreeBackend, tree_leaves
from specwire.config import VerifyMode
from specwire.drafters.base import Draft
from specwire.policy.adaptive import Policy
from specwire.policy.costs import VerifyCost
from specwire.policy.tree import TreeYield, tree_pays
from specwire.sample import tree as trees
from specwire.sample.verify import Verifier


def plan(batch: BatchBackend, part: Part, draft: Draft, mode: VerifyMode, policy: Policy,
         costs: VerifyCost | None, tree_yield: TreeYield) -> trees.Tree | None:
    """Make the round's part (the last token, already in it) a tree of the draft, or
    append the chain: the tree when it is possible and pays (on the target's measured
    curve, `costs`), else None."""
    leaves = tree_leaves(batch) if batch.n_seq == 1 else 1
    if (leaves > 1 and draft.branches and draft.tokens and mode is not VerifyMode.REJECTION):
        tree = trees.build(part.tokens[-1], draft.tokens, draft.branches[: leaves - 1])
        extra = len(tree) - 1 - len(draft.tokens)
        if len(tree) <= batch.n_batch and tree_pays(policy, costs, len(draft.tokens), extra,
                                                    tree_yield, draft.gain):
            part.tokens[:] = list(tree.tokens)
            part.parents = list(tree.parents)
            return tree
    part.tokens.extend(draft.tokens)
    return None


@dataclass(slots=True, frozen=True)
class Kept:
    """What a tree round keeps: `tokens` appended to the history (the accepted draft
    tokens, then the target's own); `accepted` draft tokens of them, `chain` of which are
    the chain's (what the drafter is told was kept of its chain)."""

    tokens: list[int]
    accepted: int
    chain: int


def verify(batch: BatchBackend, seq: int, verifier: Verifier, rows: np.ndarray,
           history: Sequence[int], tree: trees.Tree, tree_yield: TreeYield) -> Kept:
    """Walk the tree (sample/tree.py), keep the walked path's KV, learn the yield."""
    out = trees.verify(verifier, rows, history, tree)
    assert isinstance(batch, TreeBackend)
    batch.keep_tree(seq, out.path)
    extra = len(tree) - 1 - tree.chain_len
    tree_yield.observe(extra, out.accepted - out.chain)
    return Kept([*out.tokens, out.token], out.accepted, out.chain)
