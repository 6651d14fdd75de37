"""The plain prompt lookup: bench's `ngram-classic` baseline for the `ngram` drafter.

Longest suffix of 4..1 tokens, its latest occurrence, a full copy up to the asked
length, no learning, no cache (drafters/ngram/ adds all three).

When the answer repeats the prompt (renaming variables, refactoring code,
quoting), the tokens that followed the last occurrence of the current suffix
are an excellent guess, and finding them costs next to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Draft, StatelessDrafter
from specwire.sample.sampling import SparseDraft


class ClassicNgramDrafter(StatelessDrafter):
    """Matches the longest suffix of match_max..match_min tokens seen earlier in the history.

    An index maps each n-gram to the position just after its latest earlier
    occurrence; it is extended incrementally, so a round costs O(match_max).
    """

    name = "ngram-classic"

    def __init__(self, match_max: int = 4, match_min: int = 1) -> None:
        if not 1 <= match_min <= match_max:
            raise ValueError("ngram sizes: need 1 <= match_min <= match_max, "
                             f"got {match_min}, {match_max}")
        self.match_max, self.match_min = match_max, match_min
        self._index: dict[tuple[int, ...], int] = {}
        self._seen: list[int] = []
        self._point_q = False

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar=None) -> None:
        self._index.clear()
        self._seen = []
        # Rejection mode needs q for every token: a lookup is deterministic, so q is a
        # point mass on it (accepted with probability p(x), else norm(max(0, p - q))).
        self._point_q = params.mode is VerifyMode.REJECTION and not sampling.greedy

    def _sync(self, history: Sequence[int]) -> None:
        """Index every n-gram that ends before the last token of history."""
        common = 0
        limit = min(len(self._seen), len(history))
        while common < limit and self._seen[common] == history[common]:
            common += 1
        # History changed under us, or shrank to _seen itself (the index then holds the
        # n-grams ending at its last token, i.e. the suffix would match itself): rebuild.
        if common < len(self._seen) or len(history) <= len(self._seen):
            self._index.clear()
            self._seen, common = [], 0
        for end in range(max(common, 1), len(history)):
            for n in range(self.match_min, self.match_max + 1):
                if end - n >= 0:
                    self._index[tuple(history[end - n : end])] = end
        self._seen = list(history[:-1]) if len(history) > 1 else []
        # The n-grams ending at the last token are indexed on the next call, so
        # a lookup never finds the suffix itself.

    def propose(self, history: Sequence[int], k: int) -> Draft:
        self._sync(history)
        for n in range(self.match_max, self.match_min - 1, -1):
            if len(history) < n:
                continue
            start = self._index.get(tuple(history[len(history) - n :]))
            if start is not None:
                tokens = list(history[start : start + k])
                self.drafted += len(tokens)
                if self._point_q:
                    one = np.ones(1, dtype=np.float32)
                    return Draft(
                        tokens,
                        [SparseDraft(t, np.array([t], dtype=np.int64), one.copy()) for t in tokens],
                    )
                return Draft(tokens)
        return Draft()

