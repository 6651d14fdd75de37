"""What the n-gram drafter learns and remembers: long matches, learned stops, the cache.

Pure algorithm tests on token lists (the invariance tests run it on the real models).
"""

from __future__ import annotations

import numpy as np
import pytest

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.ngram.cache import KEY, LookupCache
from specwire.drafters.ngram.drafter import KEEP, MatchCalibration, NgramDrafter, RoundCost
from specwire.drafters.ngram.index import HistoryIndex
from specwire.policy.adaptive import AdaptivePolicy

SP, DP = SamplingParams(), DraftParams()


def test_a_long_match_beats_a_later_shorter_one_and_its_length_is_measured() -> None:
    """[1..7] occurred first (followed by 50); [4 5 6 7] again later (followed by 60):
    the 7-token match wins over the later 4-token one, and its length is exact."""
    h = [1, 2, 3, 4, 5, 6, 7, 50, 9, 4, 5, 6, 7, 60, 8, 1, 2, 3, 4, 5, 6, 7]
    m = HistoryIndex(32, 1).match(h)
    assert m is not None and (m.end, m.length) == (7, 7)
    short = HistoryIndex(4, 1).match(h)
    assert short is not None and (short.end, short.length) == (13, 4)


def test_calibration_learns_per_effective_length() -> None:
    """Tokens of effective length 1 always rejected, of length 12 always kept: their
    estimates part from the prior towards 0 and 1."""
    c = MatchCalibration(alpha=0.1)
    p1, p12 = c(1), c(12)
    for _ in range(60):
        c.learn([1], 0)
        c.learn([12, 13, 14], 3)
    assert c(1) < 0.1 < p1 and c(12) > 0.95 > p12


def _run_rounds(d: NgramDrafter, seq: list[int], start: int, k: int = 8) -> list[int]:
    """Drive the drafter as the engine would over a known output: propose, then append
    the kept prefix and the target's token; returns each round's draft length."""
    lengths = []
    d.begin(seq[:start], SP, DP)
    pos = start
    while pos < len(seq):
        draft = d.propose(seq[:pos], k).tokens
        kept = 0
        while kept < len(draft) and pos + kept < len(seq) and draft[kept] == seq[pos + kept]:
            kept += 1
        appended = min(kept + 1, len(seq) - pos)
        pos += appended
        lengths.append(len(draft))
        d.learn(seq[:pos], min(kept, appended), appended)
    d.end()
    return lengths


def test_matches_that_verification_rejects_stop_being_drafted() -> None:
    """Random tokens from 6 symbols: a match's copy is right one time in 6. After
    learning, the drafter offers nothing, where the pure lookup keeps drafting (and
    paying verification for) wrong tokens."""
    seq = np.random.default_rng(3).integers(0, 6, size=400).tolist()
    learning = NgramDrafter(cache=None, keep=KEEP)     # no verification cost to measure here
    lengths = _run_rounds(learning, seq, 5)
    assert sum(lengths[-50:]) == 0 < sum(lengths[:20])
    blind = _run_rounds(NgramDrafter(keep=0.0, cache=None), seq, 5)
    assert sum(blind[-50:]) > 0


def test_the_adaptive_policy_sets_the_stop_threshold() -> None:
    """Begun with a policy, the drafter stops where its threshold says; else at keep."""
    h = [1, 2, 3, 9, 1, 2, 3]
    d = NgramDrafter(cache=None, keep=0.4)
    d.begin(h, SP, DP)
    assert d.threshold() == 0.4
    policy = AdaptivePolicy(8)
    d.begin(h, SP, DP, policy=policy)
    assert d.threshold() == pytest.approx(policy.stop_threshold())
    offer = d.offer(h, 4)
    run, expected = 1.0, 0
    for p in offer.keep:
        run *= p
        if run < policy.stop_threshold():
            break
        expected += 1
    assert len(d.propose(h, 4)) == expected
    d.end()
    assert d.threshold() == 0.4
    assert not policy.drafter_stops        # the drafter writes nothing into the policy


def test_unsteered_the_threshold_is_measured_rate_times_marginal_verification() -> None:
    """Rounds whose verification takes 0.1 s + 0.02 s per drafted token, appending 3
    tokens in 0.1 + 0.02 x 4 s each: threshold = tokens/s x 0.02 s (KEEP before 8 rounds)."""
    cost = RoundCost(alpha=0.05)
    assert cost.threshold() == KEEP
    for i in range(400):
        drafted = (0, 2, 4, 6, 8)[i % 5]
        cost.add(drafted, 0.1 + 0.02 * drafted, 3)
    rate = 3 / (0.1 + 0.02 * 4)
    assert cost.costs.per_token() == pytest.approx(0.02, rel=0.02)
    assert cost.threshold() == pytest.approx(rate * 0.02, rel=0.05)
    assert NgramDrafter(cache=None, cost=cost).threshold() == cost.threshold()


def test_a_discarded_draft_is_still_judged_by_the_tokens_that_followed() -> None:
    """learn() compares the offer with the appended tokens, whatever the engine did
    with it: a 3-token offer of which 2 agree teaches 2 hits and 1 miss."""
    h = [5, 6, 7, 8, 1, 5, 6]
    d = NgramDrafter(keep=0.0, cache=None, calibration=MatchCalibration(alpha=0.0))
    d.begin(h, SP, DP)
    offer = d.offer(h, 3)
    assert offer.tokens == [7, 8, 1] and offer.length == 2
    before = list(d.calibration.seen), list(d.calibration.hits)
    d.learn([*h, 7, 8, 2], accepted=0, appended=3)
    seen = [a - b for a, b in zip(d.calibration.seen, before[0], strict=True)]
    hits = [a - b for a, b in zip(d.calibration.hits, before[1], strict=True)]
    assert sum(seen) == pytest.approx(3.0) and sum(hits) == pytest.approx(2.0)


def test_a_rewrite_seen_in_an_earlier_request_is_drafted_from_the_cache() -> None:
    """The second request of the same rewrite drafts its answer from the first one's;
    without the cache it cannot (the answer's tokens are new to its own history)."""
    prompt = list(range(100, 140))
    answer = list(range(200, 260))
    cache = LookupCache()
    d = NgramDrafter(cache=cache, keep=0.0)
    first = _run_rounds(d, [*prompt, *answer], len(prompt) + 1)
    assert len(cache) == 1 and cache.tokens == len(prompt) + len(answer)
    second = _run_rounds(d, [*prompt, *answer], len(prompt) + 1)
    # 59 tokens to go: one plain step each the first time, 9 a round (8 drafted) after
    assert sum(first) == 0 and len(first) == len(answer) - 1
    assert len(second) == 7 and sum(second) == 6 * 8 + 5
    assert d.stats()["cache_drafts"] >= 1
    alone = NgramDrafter(cache=None, keep=0.0)
    assert sum(_run_rounds(alone, [*prompt, *answer], len(prompt) + 1)) == 0


def test_the_cache_is_bounded_and_stores_a_repeat_once() -> None:
    cache = LookupCache(max_tokens=100)
    a, b, c = list(range(0, 40)), list(range(50, 90)), list(range(100, 140))
    cache.add(a)
    cache.add(a)
    assert len(cache) == 1 and cache.tokens == 40
    cache.add(b)
    cache.add(c)                       # 120 > 100: a goes
    assert len(cache) == 2 and cache.tokens == 80
    assert cache.match(a[:10]) is None
    m = cache.match(b[:10])
    assert m is not None and m.tokens[m.end] == b[10] and m.length == 10
    assert cache.match(c[: KEY - 1]) is None                    # shorter than a key
    cache.add(list(range(1000, 1200)))                          # longer than the bound: not kept
    assert len(cache) == 2
    with pytest.raises(ValueError):
        LookupCache(max_tokens=-1)
