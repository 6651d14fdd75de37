"""A pipelined draft session's alternates: where to draft them, when, and what to send.

As the session drafts its branch it notes the draft's two best choices at each token
(`note`). From those, and from how far the target is likely to keep the branch, the plan
says which sent position's alternate to draft next (`first`), or which second choices go
alone (`queue_second_choices`) for a target that verifies trees; the session drafts them
(link/alternates.py draft_alternate) and hands them back (`drafted`), and they go out with
its next chunk (`take_pending`). Verdicts move the plan with the branch (`kept`,
`restart`). The worth of each alternate is link/alternates.py's arithmetic.
"""

from __future__ import annotations

import numpy as np

from specwire.config import SamplingParams
from specwire.link import alternates as alt
from specwire.link.messages import Alternate
from specwire.sample.sampling import recent_window


class AlternatePlan:
    """The alternates of one session's branch, from its first unverified token on."""

    __slots__ = ("params", "sampling", "tree", "second_choices", "choices", "alts",
                 "pending")

    def __init__(self, params: alt.AlternateParams, sampling: SamplingParams, tree: int,
                 second_choices: bool) -> None:
        """tree: the target verifies up to this many alternates beside the branch in one
        decode (0: chains), so each is drafted right after its position is sent;
        second_choices: such a target also verifies a second choice alone."""
        self.params, self.sampling, self.tree = params, sampling, tree
        self.second_choices = bool(tree and second_choices)
        self.choices: list[alt.TopTwo | None] = []   # per branch token
        #: alternates by position, drafted once (sent if longer than a token)
        self.alts: dict[int, list[int]] = {}
        self.pending: list[Alternate] = []   # drafted or chosen, to go with the next chunk

    # -- as the branch changes ----------------------------------------------------

    def note(self, row: np.ndarray, ctx: list[int], tok: int) -> None:
        """The branch drafts `tok` after ctx from this logits row: note the draft's two
        best choices there, which say later whether an alternate there is worth it."""
        two = alt.top_two(row, self.sampling, len(ctx), recent_window(ctx, self.sampling))
        self.choices.append(two if two is not None and two.first == tok else None)

    def kept(self, n: int, end: int) -> None:
        """A verdict committed the branch's first n tokens; the history now ends at end."""
        del self.choices[:n]
        self.alts = {p: t for p, t in self.alts.items() if p >= end}

    def restart(self, known: int = 0) -> None:
        """A new branch, of which `known` tokens (a taken alternate's rest) have no choices."""
        self.choices, self.alts = [None] * known, {}

    # -- what to draft --------------------------------------------------------------

    def first(self, start: int, sent: int, full: bool, lookahead: int) -> int | None:
        """The sent branch token whose alternate to draft before the branch's next token
        (start: the branch's first position; full: the branch waits, its lookahead full
        or stopped): for a target that verifies trees, the first one worth it (tree_at);
        else any worth it while the branch waits, or one whose worth per token drafted
        beats the chance that the target will ever verify that next token
        (alternates.alternate_first)."""
        if self.tree:
            j = self.tree_at(start, sent, lookahead)
            if j is not None:
                return j
        j, value = self.late_at(start, sent)
        if j is None or full:
            return j
        reach = 1.0
        for c in self.choices:
            reach *= 1.0 if c is None else c.p_first
        return j if alt.alternate_first(value, reach, self.params) else None

    def beside(self, start: int, sent: int) -> int | None:
        """The sent branch token whose alternate to draft next on a fork (link/fork.py),
        where it holds the branch up by nothing: for a target that verifies trees, the
        first worth it at any length of the branch (tree_at); else the one worth most."""
        if self.tree:
            return self.tree_at(start, sent, 0)
        return self.late_at(start, sent)[0]

    def tree_at(self, start: int, upto: int, lookahead: int) -> int | None:
        """For a target that verifies trees: the first of the branch's first `upto` tokens
        whose alternate is worth drafting (alternates.worth_branching) and not yet tried,
        while fewer than `tree` alternates wait for the branch's unverified part. An
        alternate joins the decode of its position only if it arrives before that decode,
        so it is drafted before the branch goes on, but only once the branch holds a
        round's worth (half the lookahead): before that, the target is likely waiting for
        the branch's next tokens, which the alternate would delay."""
        bp = self.params
        if (upto < lookahead // 2
                or sum(1 for p, t in self.alts.items() if p >= start and len(t) > 1)
                >= self.tree):
            return None
        reach = 1.0
        for j, two in enumerate(self.choices[:upto]):
            if two is None:
                continue
            if start + j not in self.alts and alt.worth_branching(two, reach, bp):
                return j
            reach *= two.p_first
            if reach < bp.value_min:
                break
        return None

    def late_at(self, start: int, sent: int) -> tuple[int | None, float]:
        """The sent branch token whose alternate is now worth most, and its worth: as
        verdicts keep the branch, its later positions come within reach. None when there
        is none."""
        bp = self.params
        best, best_value, reach = None, 0.0, 1.0
        for j, two in enumerate(self.choices[:sent]):
            if two is None:
                continue
            if start + j not in self.alts and alt.worth_branching(two, reach, bp):
                value = reach * two.p_second
                if value > best_value:
                    best, best_value = j, value
            reach *= two.p_first
            if reach < bp.value_min:
                break
        return best, best_value

    # -- what to send ---------------------------------------------------------------

    def drafted(self, at: int, tokens: list[int]) -> bool:
        """The alternate drafted for position at (tried: never again); whether it goes
        out (a lone second choice leaves nothing to verify after it)."""
        self.alts[at] = tokens
        if len(tokens) > 1:
            self.pending.append(Alternate(at, tokens))
            return True
        return False

    def queue_second_choices(self, start: int, first: int, n: int) -> None:
        """Branch tokens first..first+n-1 are about to be sent: queue the second choice
        alone at each where a drafted alternate is not worth it yet
        (alternates.second_choice_due), up to a chunk's alternates. Such a position never
        gets a drafted alternate: both ends read a verdict by the one alternate sent
        there."""
        bp = self.params
        reach = 1.0
        for j, two in enumerate(self.choices[: first + n]):
            if two is None:
                continue
            if (j >= first and len(self.pending) < bp.per_chunk
                    and start + j not in self.alts
                    and alt.second_choice_due(two, reach, bp)):
                self.pending.append(Alternate(start + j, [two.second]))
            reach *= two.p_first

    def take_pending(self) -> list[Alternate]:
        """The alternates for the chunk going out now (each then counts as sent there)."""
        out, self.pending = self.pending, []
        self.alts.update((a.at, a.tokens) for a in out)
        return out
