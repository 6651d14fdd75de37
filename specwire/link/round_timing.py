"""When a branch drafter's rounds and branches happened: what the bubble rule learns from.

A pipelined target verifies whatever the draft node has sent when a round starts; after
a rejection the node's fresh branch is on its way and the round may hold for it
(drafters/bubble.py). That rule learns from the times kept here: when each verdict went
out, when the fresh branch's tokens arrived after it, how long each round's propose took
and how the round went. The counters (LinkCounters) add up the rounds that had nothing to
verify (starved: since a rejection) and how long the target waited.
"""

from __future__ import annotations

import time

from specwire.drafters.bubble import BubbleWait
from specwire.link.transport.base import LinkCounters


class RoundTiming:
    """The times of one request's rounds; the BranchDrafter calls it as they happen."""

    __slots__ = ("counters", "drafted", "starving", "starved_at", "proposed_at", "waited_s",
                 "verdict_at", "fresh_gen", "fresh_n")

    def __init__(self, counters: LinkCounters) -> None:
        self.counters = counters
        self.drafted = 0  # tokens proposed in the current round
        self.starving = False  # since a rejection, no round has had a draft
        self.starved_at: float | None = None  # perf_counter of a starved round's propose
        self.proposed_at: float | None = None  # perf_counter when the round's draft was given
        self.waited_s = 0.0  # how long the round's propose took
        self.verdict_at: float | None = None  # perf_counter when the last verdict went out
        self.fresh_gen = -1  # a branch begun after the last verdict: its arrivals are timed
        self.fresh_n = 0  # tokens of it received

    def since_verdict(self) -> float | None:
        """Seconds since the last verdict went out (None before one)."""
        return None if self.verdict_at is None else time.perf_counter() - self.verdict_at

    def proposed(self, n: int, started: float, pipelined: bool) -> None:
        """A round's propose that began at `started` (perf_counter) gave n tokens: count
        a pipelined round with nothing to verify, and whether a rejection left it so."""
        self.proposed_at = time.perf_counter()
        self.waited_s = self.proposed_at - started
        self.counters.wait_ms += 1000 * self.waited_s
        self.drafted = n
        if n:
            self.starving = False
        elif pipelined:
            self.counters.empty_rounds += 1
            if self.starving:
                self.counters.starved_rounds += 1
                self.starved_at = time.perf_counter()

    def learned(self, accepted: int, bubble: BubbleWait | None) -> None:
        """The round's verdict: `accepted` of its draft kept (the bubble rule learns how
        the round went)."""
        now = time.perf_counter()
        if self.starved_at is not None:
            self.counters.starved_ms += 1000 * (now - self.starved_at)
            self.starved_at = None
        if bubble is not None and self.proposed_at is not None:
            bubble.observe_round(self.drafted, accepted, now - self.proposed_at, self.waited_s)
        self.proposed_at = None
        if accepted < self.drafted:
            self.counters.rejections += 1
            self.starving = True
        self.drafted = 0

    def told(self) -> None:
        """A verdict went out: a branch begun after it has its arrivals timed from now."""
        self.verdict_at, self.fresh_gen = time.perf_counter(), -1

    def arrived(self, gen: int, newer: bool, n: int, bubble: BubbleWait | None) -> None:
        """A chunk of n tokens of branch gen arrived (newer: it began that branch): the
        first branch begun after the last verdict has its arrivals timed."""
        if newer and self.verdict_at is not None and self.fresh_gen < 0:
            self.fresh_gen, self.fresh_n = gen, 0
        if gen != self.fresh_gen or not n:
            return
        since = time.perf_counter() - self.verdict_at
        if self.fresh_n == 0:
            self.counters.fresh_branches += 1
            self.counters.fresh_first_ms += 1000 * since
        self.fresh_n += n
        if bubble is not None:
            bubble.observe_arrival(self.fresh_n, since)
