"""Tree verification: a draft chain with side branches, verified in one decode.

A tree's nodes are draft tokens with parent indices; node 0 is the root (the history's
last token), the chain of first choices is nodes 1..k, and an alternate (a second choice
with its continuation) hangs under its position's parent. The verifier walks the tree as
greedy and coupled verification walk a chain: at each node it draws the target's own token
from that node's row and moves to the child holding it; where no child does, the drawn
token ends the round. Every drawn token is the one plain decoding would draw on the walked
path, so the output is the target's own, whatever the tree (sample/verify.py's rule).
Rejection mode has no tree: its q belongs to one chain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specwire.config import VerifyMode
from specwire.sample.verify import Verifier

#: A side branch: (offset, tokens); tokens[0] takes the chain's place at chain index
#: `offset` (0: right after the root), the rest continue it.
Branch = tuple[int, Sequence[int]]


@dataclass(slots=True, frozen=True)
class Tree:
    """Draft tokens as a tree. tokens: (n,) ids, tokens[0] the root (history[-1]);
    parents: (n,) indices, parents[0] == -1 and parents[i] < i; depth: (n,) positions
    after the root (depth[0] == 0); branch: (n,) the index, among the branches given to
    build, of the branch each node belongs to (-1: the root and the chain)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    depth: tuple[int, ...]
    branch: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.tokens)
        assert n >= 1 and len(self.parents) == n == len(self.depth) == len(self.branch), self
        assert self.parents[0] == -1 and all(0 <= p < i for i, p in
                                             enumerate(self.parents) if i), self

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, i: int) -> list[int]:
        """Node i's children, in the order they were added (the chain's first)."""
        return [j for j in range(i + 1, len(self.tokens)) if self.parents[j] == i]

    def path(self, i: int) -> list[int]:
        """The nodes from the root's first child down to node i (empty for the root)."""
        out = []
        while i > 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order (the chain's end first)."""
        has_child = set(self.parents[1:])
        return [i for i in range(len(self.tokens)) if i not in has_child]

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    @property
    def chain_len(self) -> int:
        """The chain's nodes are 1..chain_len."""
        return self.branch.count(-1) - 1


def build(root: int, chain: Sequence[int], branches: Sequence[Branch] = ()) -> Tree:
    """The tree of a chain and its side branches. A branch whose offset lies past the
    chain, that is empty, or whose first token repeats a token already there (the
    chain's own, or an earlier branch's at the same place) is left out: it would verify
    nothing new."""
    tokens, parents, depth, branch = [root], [-1], [0], [-1]
    for i, t in enumerate(chain):
        tokens.append(int(t))
        parents.append(i)     # chain node i + 1 hangs under chain node i (0: the root)
        depth.append(i + 1)
        branch.append(-1)
    taken = {(i, int(t)) for i, t in enumerate(chain)}
    for b, (off, alt) in enumerate(branches):
        if not alt or not 0 <= off < len(chain) or (off, int(alt[0])) in taken:
            continue
        taken.add((off, int(alt[0])))
        parent = off   # the chain node before chain index off (0: the root)
        for j, t in enumerate(alt):
            tokens.append(int(t))
            parents.append(parent)
            depth.append(off + 1 + j)
            branch.append(b)
            parent = len(tokens) - 1
    return Tree(tuple(tokens), tuple(parents), tuple(depth), tuple(branch))


@dataclass(slots=True, frozen=True)
class TreeOutcome:
    """The walk: `path` the accepted nodes (root excluded), then the target's `token`.
    chain: how many of them are chain nodes (the chain's accepted prefix); branch: the
    index, among the branches given to build, of the branch the path ends in (-1: it
    ends in the chain, or at the root)."""

    path: tuple[int, ...]
    tokens: tuple[int, ...]   # (len(path),) the accepted nodes' tokens
    token: int
    chain: int
    branch: int

    @property
    def accepted(self) -> int:
        return len(self.path)


def verify(verifier: Verifier, rows: np.ndarray, history: Sequence[int],
           tree: Tree) -> TreeOutcome:
    """Walk the tree along the target's own samples, committing each (verifier.sample).
    rows: (len(tree), V), row i the target's logits after node i's path; history ends
    with the root's token."""
    assert rows.shape[0] >= len(tree), (rows.shape, len(tree))
    if verifier.mode is VerifyMode.REJECTION:
        raise ValueError("tree verification serves greedy and coupled modes only")
    ctx = list(history)
    node, path = 0, []
    while True:
        t = verifier.sample(rows[node], ctx)
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == t), None)
        if nxt is None:
            break
        node = nxt
        path.append(node)
        ctx.append(t)
    chain = sum(1 for i in path if tree.branch[i] == -1)
    return TreeOutcome(tuple(path), tuple(tree.tokens[i] for i in path), t, chain,
                       tree.branch[node])
