"""A grammar's states along a history, kept per position like a KV cache.

A drafter that follows the target's grammar is asked to draft after histories
that are not all committed: a pipelined draft drafts on after its own branch,
which the next verdict may cut. So the state is not advanced in place: the
trail keeps the state after each position (a llama.cpp sampler clone, cheap
beside a decode), finds the longest common prefix with the history it is
asked about, and advances a copy from there.
"""

from __future__ import annotations

from collections.abc import Sequence

from specwire.config import ConfigError
from specwire.sample.constraints.grammar import Grammar


class GrammarTrail:
    """States of one grammar after history[:start], history[:start + 1], ..."""

    #: positions kept; a rollback deeper than this (never in practice: drafts are at most
    #: 64 tokens) stops the drafter from following the grammar
    MAX_STATES = 256

    def __init__(self, grammar: Grammar, start: int) -> None:
        self.at = start                  # the position of states[0]
        self.states = [grammar]
        self.tokens: list[int] = []      # history[at:at + len(states) - 1]

    def after(self, history: Sequence[int]) -> Grammar | None:
        """A scratch copy of the state after history (the caller closes it); None when
        history leaves the grammar or reaches back before the kept states."""
        if len(history) < self.at:
            return None
        new = list(history[self.at:])
        k = 0
        while k < len(self.tokens) and k < len(new) and self.tokens[k] == new[k]:
            k += 1
        for g in self.states[k + 1:]:
            g.close()
        del self.states[k + 1:], self.tokens[k:]
        for t in new[k:]:
            g = self.states[-1].clone()
            try:
                g.accept(t)
            except ConfigError:
                g.close()
                return None
            self.states.append(g)
            self.tokens.append(t)
        while len(self.states) > self.MAX_STATES:
            self.states.pop(0).close()
            self.tokens.pop(0)
            self.at += 1
        return self.states[-1].clone()

    def close(self) -> None:
        for g in self.states:
            g.close()
        self.states.clear()
