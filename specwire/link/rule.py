"""The branch rule, which both ends of a branch session follow.

A drafter drafts a *branch*: tokens past the committed history, numbered by a generation
`gen`. After a verdict the branch lives on exactly when it agrees with the new history
where they overlap and reaches at least to its end; otherwise it is dead and the drafter
starts branch gen + 1 from the history's end. A verdict may instead take an *alternate*
(a second choice sent for one position, with a few tokens after it): its rest becomes
branch gen + 1 (take_alternate), or, for a target that verifies trees and a node that says
"tree" in Hello, whatever part of it the tokens agree with (take_tree_alternate). The node
(link/session.py) holds its whole branch; the target (link/branch.py) only what has arrived
of it, so there the same outcome means the rest is on its way. docs/protocol.md states it.
"""

from __future__ import annotations

from collections.abc import Sequence

#: follow(): the branch disagrees with the history; it is dead.
LEFT = -1
#: follow(): the history runs past the branch (or what is known of it), agreeing with it.
PASSED = -2
#: follow(): the branch starts after the history's end.
AHEAD = -3


def follow(start: int, branch: Sequence[int], history: Sequence[int]) -> int:
    """The branch rule: for a branch whose first token stands at position `start`, how
    many of its tokens `history` commits (>= 0: the branch goes on from there), or LEFT,
    PASSED or AHEAD."""
    off = len(history) - start
    if off < 0:
        return AHEAD
    if off > len(branch):
        return PASSED
    # Only the overlap is compared: O(tokens committed since the branch began).
    if list(branch[:off]) != list(history[start:]):
        return LEFT
    return off


def take_alternate(alternate: Sequence[int] | None, tokens: Sequence[int]) -> list[int] | None:
    """The rule for a verdict that takes an alternate: what is left of it after the
    verdict's own tokens, which must begin it and leave at least one token; None when
    they do not (or there is no alternate)."""
    n = len(tokens)
    if alternate is None or n == 0 or n >= len(alternate) or list(alternate[:n]) != list(tokens):
        return None
    return list(alternate[n:])


def take_tree_alternate(alternate: Sequence[int] | None,
                        tokens: Sequence[int]) -> list[int] | None:
    """The tree rule for a verdict that takes an alternate: the verdict's tokens begin
    with its first token; what is left of it after them where they agree with it
    throughout ([] where they leave it or use it up: the next branch starts afresh);
    None when they do not begin with it (or there is no alternate). Where take_alternate
    gives a rest, this gives the same."""
    if alternate is None or not tokens or tokens[0] != alternate[0]:
        return None
    rest = take_alternate(alternate, tokens)
    return [] if rest is None else rest
