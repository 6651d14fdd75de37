"""The target's buffer of a drafter's newest branch: what its chunks brought, checked.

A draft session streams its branch in chunks tagged with the branch number `gen`
(link/session.py); the target keeps only the newest branch, from the first position its
history has not confirmed, with the q of each token (rejection mode) and the alternates
sent for its positions. Every token is checked against the history by content
(link/rule.py follow), so a stale, reordered or lying chunk can only be ignored, never
change an output token. BranchDrafter (link/branch.py) holds one, under its lock.
"""

from __future__ import annotations

from collections.abc import Sequence

from specwire.link.messages import Chunk, ProtocolError
from specwire.link.rule import LEFT, follow, take_alternate, take_tree_alternate
from specwire.link.transport.base import LinkCounters


class ReceivedBranch:
    """Branch `gen`'s tokens from absolute position `start`, their q, its alternates."""

    __slots__ = ("counters", "gen", "dead_gen", "start", "tokens", "sparse", "done", "alts")

    def __init__(self, counters: LinkCounters) -> None:
        """counters: the drafter's, which count the alternates taken and missed."""
        self.counters = counters
        self.gen = -1  # gen of the buffered branch
        self.dead_gen = -1  # gens up to this one disagree with the history
        self.start = 0  # absolute position of tokens[0]
        self.tokens: list[int] = []
        self.sparse: list | None = None
        self.done = False  # the drafter stopped after these tokens (p_min or its reach)
        self.alts: dict[int, list[int]] = {}  # alternates of branch gen, by position

    def stale(self, gen: int) -> bool:
        """A chunk of branch gen is older than the buffer's, or of a dead branch."""
        return gen < self.gen or gen <= self.dead_gen

    def add(self, c: Chunk, history_n: int, whole: bool) -> bool:
        """A chunk that is not stale, for a history of history_n tokens (whole: it is the
        drafter's whole answer, as a synchronous chunk is); whether it began a newer
        branch. ProtocolError for a chunk that does not continue its branch."""
        new = c.gen > self.gen
        if new:
            self.gen, self.start, self.tokens = c.gen, c.start, []
            self.sparse = [] if c.sparse is not None else None
            self.alts = {}
        elif c.start != self.start + len(self.tokens):
            raise ProtocolError(
                f"chunk of gen {c.gen} at {c.start}, expected {self.start + len(self.tokens)}")
        self.tokens.extend(c.tokens)
        # Only positions not yet committed: the chunk check bounds them to the positions
        # a branch may reach, so a flood of alternates cannot grow this.
        if self.alts and min(self.alts) < history_n:
            self.alts = {p: t for p, t in self.alts.items() if p >= history_n}
        for a in c.alternates:
            if a.at >= history_n:
                self.alts[a.at] = a.tokens
        if c.sparse is not None and self.sparse is not None:
            self.sparse.extend(c.sparse)
        self.done = c.done or whole
        return new

    def usable(self, history: Sequence[int], k: int) -> tuple[list[int], list | None] | None:
        """Up to k tokens of the branch that extend history, and their q; None where the
        branch extends nothing: none yet, dead (marked so), or from before the history's
        last verdict."""
        if self.gen < 0 or self.gen <= self.dead_gen:
            return None
        off = follow(self.start, self.tokens, history)
        if off == LEFT:
            self.dead_gen = self.gen
            return None
        if off < 0:
            # PASSED: a branch from before the last verdict (its `done` is stale too): the
            # answer to that verdict is on its way, so a synchronous round waits for it.
            # (AHEAD: a chunk past the history, which only a broken drafter sends.)
            return None
        # Trim what the history has confirmed: the check is O(new tokens) per round.
        del self.tokens[:off]
        if self.sparse is not None:
            del self.sparse[:off]
        self.start = len(history)
        return self.tokens[:k], None if self.sparse is None else self.sparse[:k]

    def side_branches(self, start: int, n: int) -> list[tuple[int, list[int]]] | None:
        """The alternates sent for the n draft tokens from `start`, as side branches of
        the draft: the drafted ones first (each judged worth its drafting), then second
        choices alone, by position."""
        if not self.alts or not n:
            return None
        return [(p - start, list(t))
                for p, t in sorted(self.alts.items(), key=lambda a: (len(a[1]) == 1, a[0]))
                if start <= p < start + n] or None

    def take_alternate(self, at: int, own: list[int], draft_gen: int, trees: bool) -> bool:
        """After a round drafted from branch draft_gen was rejected at `at`: if the target's
        own tokens begin the alternate sent for `at`, its rest becomes the branch (gen + 1,
        as the drafter makes it on this verdict: link/rule.py, the tree rule where `trees`)
        and the next round verifies it at once. Whether it did."""
        a = self.alts.get(at)
        if a is None or draft_gen != self.gen or self.gen <= self.dead_gen:
            return False
        i = at - self.start
        if own and 0 <= i < len(self.tokens) and self.tokens[i] == own[0]:
            return False  # no rejection there: the branch goes on
        rest = take_tree_alternate(a, own) if trees else take_alternate(a, own)
        if rest is None:
            self.counters.alternate_misses += 1
            return False
        if not rest and len(own) == 1:
            return False  # a second choice alone, not in the tree: it adds nothing
        self.counters.alternate_trees += len(own) > 1   # a tree round kept some of it
        self.counters.second_choices_taken += len(a) == 1
        self.gen, self.start, self.tokens = self.gen + 1, at + len(own), rest
        self.sparse, self.alts = None, {}
        self.counters.alternate_rounds += 1
        return True
