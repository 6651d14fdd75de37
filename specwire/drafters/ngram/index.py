"""Where did the end of this token sequence occur before? The lookup behind n-gram drafts.

The answer is the *longest* suffix (up to match_max tokens, at least match_min) that
occurred earlier, at its *latest* such occurrence; the draft is what followed it.
Match length is what predicts whether the copy will be kept (a 1-token match is a
coin toss, a 12-token one almost never wrong), so it is measured exactly rather
than capped at a small fixed size: short n-grams (up to SHORT tokens) are looked
up in a dict, longer matches grow backwards from the latest occurrences of the
SHORT-gram.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: n-grams up to this size are indexed directly; longer matches extend backwards.
SHORT = 4
#: latest occurrences of each SHORT-gram tried for a longer match.
CANDIDATES = 16


@dataclass(slots=True, frozen=True)
class Match:
    """history[end - length:end] equals the suffix of the sequence looked up; the draft
    copies from `end` on."""

    end: int
    length: int


def continuation(source: Sequence[int], end: int, k: int) -> list[int]:
    """Up to k tokens copied from source[end:], continuing through the copy itself
    once source runs out: a match near the end of a repeating pattern repeats it."""
    out: list[int] = []
    n = len(source)
    for i in range(k):
        pos = end + i
        out.append(source[pos] if pos < n else out[pos - n])
    return out


class HistoryIndex:
    """An incremental index over one growing sequence (the request's history).

    It follows the history by longest common prefix, so a rollback after a rejection
    or a brand-new sequence costs only the re-indexing of what changed. The n-grams
    ending at the last token are indexed on the next call, so a lookup never finds the
    suffix itself.
    """

    def __init__(self, match_max: int = 4, match_min: int = 1) -> None:
        if not 1 <= match_min <= match_max:
            raise ValueError("ngram sizes: need 1 <= match_min <= match_max, "
                             f"got {match_min}, {match_max}")
        self.match_max, self.match_min = match_max, match_min
        self.short = min(SHORT, match_max)
        self._latest: dict[tuple[int, ...], int] = {}  # n-gram -> end of its latest occurrence
        self._ends: dict[tuple[int, ...], list[int]] = {}  # SHORT-gram -> its latest ends
        self._seen: list[int] = []

    def clear(self) -> None:
        self._latest.clear()
        self._ends.clear()
        self._seen = []

    def sync(self, history: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token of history."""
        seen = self._seen
        common, limit = 0, min(len(seen), len(history))
        while common < limit and seen[common] == history[common]:
            common += 1
        if common < len(seen) or len(history) <= len(seen):
            self.clear()
            common = 0
        long_ = self.match_max > self.short
        for end in range(max(common, 1), len(history)):
            for n in range(self.match_min, self.short + 1):
                if end - n >= 0:
                    self._latest[tuple(history[end - n:end])] = end
            if long_ and end >= self.short:
                ends = self._ends.setdefault(tuple(history[end - self.short:end]), [])
                ends.append(end)
                if len(ends) > 2 * CANDIDATES:
                    del ends[:CANDIDATES]
        self._seen = list(history[:-1]) if len(history) > 1 else []

    def match(self, history: Sequence[int]) -> Match | None:
        """The longest earlier occurrence of a suffix of history (latest on ties)."""
        self.sync(history)
        size = len(history)
        if self.match_max > self.short and size > self.short:
            best = self._longest(history)
            if best is not None:
                return best
        for n in range(min(self.short, size), self.match_min - 1, -1):
            end = self._latest.get(tuple(history[size - n:]))
            if end is not None:
                return Match(end, n)
        return None

    def _longest(self, history: Sequence[int]) -> Match | None:
        """A match longer than SHORT, grown backwards from the SHORT-gram's occurrences."""
        size, short = len(history), self.short
        ends = self._ends.get(tuple(history[size - short:]))
        if not ends:
            return None
        best: Match | None = None
        for end in reversed(ends[-CANDIDATES:]):
            n = short
            while (n < self.match_max and end - n > 0
                   and history[end - n - 1] == history[size - n - 1]):
                n += 1
            if best is None or n > best.length:
                best = Match(end, n)
                if n == self.match_max:
                    break
        return best if best is not None and best.length > short else None
