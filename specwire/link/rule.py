"""The branch rule, which both ends of a branch session follow.

A drafter drafts a *branch*: tokens past the committed history, numbered by a
generation `gen`. A verdict commits some of them and then tokens of the
target's own. The branch lives on exactly when it agrees with the new history
where they overlap and reaches at least to its end: its first tokens are then
committed and the rest is still a draft. Otherwise it is dead, and the drafter
starts branch gen + 1 from the history's end.

A verdict may instead take an *alternate*: a second choice the drafter sent
for one position of its branch, with a few tokens after it (Verdict.alternate).
The history then ends inside that alternate, and its rest, already sent,
becomes branch gen + 1 (take_alternate).

The drafter (link/session.py) holds its whole branch, so a history that
runs past it ends it too. The target (link/branch.py) holds only what has
arrived of the branch: there the same outcome means the rest is on its way.
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
