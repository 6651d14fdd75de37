"""Prompt-lookup drafting against a brute-force definition.

The lookup must propose what follows the *latest earlier* occurrence of the
*longest* suffix of match_max..match_min tokens (continuing through its own copy when the
history runs out), never the suffix matching itself, and its incremental index
must give the same answers as a fresh one, including after the history was
rolled back or replaced. These tests switch off what the drafter learns
(keep=0: no learned stop) and the cross-request cache; test_ngram_learning.py
covers both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.ngram.drafter import NgramDrafter

SP, DP = SamplingParams(), DraftParams()


def brute(history: Sequence[int], k: int, match_max: int, match_min: int) -> list[int]:
    """The definition: longest suffix first, its latest occurrence ending before the end."""
    h = list(history)
    for n in range(match_max, match_min - 1, -1):
        if len(h) < n:
            continue
        suffix = h[len(h) - n:]
        for end in range(len(h) - 1, n - 1, -1):
            if h[end - n:end] == suffix:
                out: list[int] = []
                for i in range(k):
                    out.append(h[end + i] if end + i < len(h) else out[end + i - len(h)])
                return out
    return []


def lookup(match_max: int = 4, match_min: int = 1) -> NgramDrafter:
    """A pure lookup: no learned stop, no memory of earlier requests."""
    return NgramDrafter(match_max, match_min, keep=0.0, cache=None)


def _fresh(history: Sequence[int], k: int, match_max: int = 4, match_min: int = 1) -> list[int]:
    d = lookup(match_max, match_min)
    d.begin(history, SP, DP)
    return d.propose(history, k).tokens


def test_the_longest_suffix_wins_over_a_later_shorter_one() -> None:
    """[8 1 2 3] occurred at the start (followed by 4); [1 2 3] later (followed by 6):
    the 4-gram match is used. With match_max 3 the latest 3-gram match is."""
    h = [8, 1, 2, 3, 4, 0, 1, 2, 3, 6, 8, 1, 2, 3]
    assert _fresh(h, 3) == [4, 0, 1]
    assert _fresh(h, 3, match_max=3) == [6, 8, 1]


def test_the_latest_occurrence_is_used_and_max_n_respected() -> None:
    """Two earlier [1 2] occurrences: the later one's continuation, cut to k."""
    h = [1, 2, 7, 7, 1, 2, 9, 9, 9, 5, 1, 2]
    assert _fresh(h, 2, match_max=2) == [9, 9]
    # at the end of history the copy continues through itself
    assert _fresh(h, 10, match_max=2) == [9, 9, 9, 5, 1, 2, 9, 9, 9, 5]
    assert _fresh(h, 0, match_max=2) == []


def test_the_suffix_never_matches_itself() -> None:
    """No repeated token: nothing to propose. [5 5]: the earlier 5 is followed by 5."""
    assert _fresh([1, 2, 3, 4], 4) == []
    assert _fresh([7], 4) == []
    assert _fresh([5, 5], 4) == [5, 5, 5, 5]


def test_n_min_excludes_short_matches() -> None:
    """A single-token match is ignored when match_min is 2."""
    h = [3, 9, 4, 1, 3]
    assert _fresh(h, 2, match_max=3, match_min=1) == [9, 4]
    assert _fresh(h, 2, match_max=3, match_min=2) == []


def test_bad_sizes_are_refused() -> None:
    """1 <= match_min <= match_max, or ValueError."""
    for match_max, match_min in ((2, 3), (3, 0)):
        with pytest.raises(ValueError):
            lookup(match_max, match_min)


def test_a_history_one_token_shorter_than_before_is_served_correctly() -> None:
    """Proposing for h, then for h minus its last token (a client re-sending a shorter
    history): the index must not let the suffix match itself (which gave an empty draft)."""
    h = [1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3]
    d = lookup(4, 1)
    d.begin([], SP, DP)
    assert d.propose(h, 3).tokens == brute(h, 3, 4, 1) == [8, 1, 2]
    shorter = h[:-1]
    assert d.propose(shorter, 3).tokens == brute(shorter, 3, 4, 1) == [3, 8, 1]


@pytest.mark.parametrize(("match_max", "match_min"), [(4, 1), (3, 2), (1, 1), (9, 1), (64, 2)])
def test_incremental_index_matches_brute_force_through_rollbacks(match_max: int,
                                                                  match_min: int) -> None:
    """One drafter over a growing history (3 new tokens or a rollback of up to 4 each step,
    as rejections do, and once a brand-new history) answers as the definition does."""
    gen = np.random.default_rng(match_max * 10 + match_min)
    d = lookup(match_max, match_min)
    hist = gen.integers(0, 5, size=6).tolist()
    d.begin(hist, SP, DP)
    nonempty = 0
    for step in range(300):
        if step == 150:
            hist = gen.integers(0, 5, size=4).tolist()          # another request, no begin()
        elif gen.random() < 0.3 and len(hist) > 5:
            hist = hist[:len(hist) - int(gen.integers(1, 5))]
            hist.append(int(gen.integers(0, 5)))
        else:
            hist.extend(gen.integers(0, 5, size=3).tolist())
        k = int(gen.integers(1, 8))
        got = d.propose(hist, k).tokens
        assert got == brute(hist, k, match_max, match_min), (step, hist)
        nonempty += bool(got)
    assert nonempty > 100


def test_begin_forgets_the_previous_sequence() -> None:
    """After begin() nothing from the earlier history can be proposed."""
    d = lookup(2, 1)
    d.begin([], SP, DP)
    assert d.propose([4, 5, 6, 4], 3).tokens == [5, 6, 4]
    d.begin([], SP, DP)
    assert d.propose([6, 4], 3).tokens == []
    assert d.stats()["drafted"] == 3.0


def test_rejection_mode_drafts_carry_a_point_mass_q() -> None:
    """Rejection verification needs q for every drafted token: a lookup is deterministic,
    so each gets q = 1 on itself; other modes (and T = 0) send no q."""
    h = [4, 5, 6, 4]
    d = lookup(2, 1)
    d.begin(h, SamplingParams(temperature=0.8), DraftParams(mode=VerifyMode.REJECTION))
    draft = d.propose(h, 3)
    assert draft.tokens == [5, 6, 4]
    assert draft.sparse is not None and len(draft.sparse) == 3
    for t, sd in zip(draft.tokens, draft.sparse, strict=True):
        assert sd.token == t and sd.ids.tolist() == [t] and sd.probs.tolist() == [1.0]
    assert draft.cut(2).sparse == draft.sparse[:2]
    for sp, mode in ((SamplingParams(temperature=0.8), VerifyMode.COUPLED),
                     (SamplingParams(temperature=0.0), VerifyMode.REJECTION)):
        d.begin(h, sp, DraftParams(mode=mode))
        assert d.propose(h, 3).sparse is None
