"""The n-gram replay: the engine's loop against a recorded output, with modelled cost.

Pure bookkeeping, on synthetic token lists: plain decoding costs one step a token;
an oracle drafting k exact tokens a round costs t_v(k + 1) per k + 1 tokens; every
drafter is judged by the tokens it shares with the output.
"""

from __future__ import annotations

import pytest

from benchmarks.ngram_replay import KeyCopy, curve_cost, parse_curve, replay
from specwire.drafters.base import Draft, NoDrafter, StatelessDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.policy.adaptive import AdaptivePolicy, FixedPolicy

COST = curve_cost(((1, 1.0), (2, 1.5), (4, 2.0), (8, 3.0)))
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]
OUTPUT = [40 + i % 7 for i in range(65)]


class Oracle(StatelessDrafter):
    """Drafts the recorded output itself."""

    name = "oracle"

    def __init__(self, prompt, output) -> None:
        self.full = [*prompt, *output]

    def propose(self, history, k) -> Draft:
        return Draft(self.full[len(history):len(history) + k])


def test_curve_cost_interpolates_and_extends() -> None:
    assert COST(1) == 1.0 and COST(3) == pytest.approx(1.75)
    assert COST(16) == pytest.approx(3.0 + 8 * 0.25)
    assert parse_curve("2:1.5,1:1") == ((1, 1.0), (2, 1.5))
    with pytest.raises(SystemExit):
        parse_curve("1:1")


def test_plain_decoding_is_one_step_a_token() -> None:
    r = replay([(PROMPT, OUTPUT)], NoDrafter(), FixedPolicy(8), COST)
    assert r.tokens == len(OUTPUT) - 1 == r.rounds
    assert r.steps == pytest.approx(r.tokens) and r.speedup == pytest.approx(1.0)
    assert r.drafted == r.kept == 0


def test_an_oracle_keeps_everything_at_the_curve_s_price() -> None:
    r = replay([(PROMPT, OUTPUT)], Oracle(PROMPT, OUTPUT), FixedPolicy(8), COST)
    assert r.kept == r.drafted
    assert r.tokens == r.kept + r.rounds
    assert r.rounds == 8       # 64 tokens after the first: 7 rounds of 9, then 1 of 1
    assert r.steps == pytest.approx(7 * COST(9) + COST(1))


@pytest.mark.parametrize("drafter", [KeyCopy(key=4, most=8), NgramDrafter(cache=None)],
                         ids=["key-copy", "ngram"])
def test_lookups_copy_a_repeating_output(drafter) -> None:
    """A 7-token cycle: both lookups find it and beat plain decoding; nothing is counted
    kept that the output does not hold."""
    policy = AdaptivePolicy(8) if isinstance(drafter, NgramDrafter) else FixedPolicy(8)
    r = replay([(PROMPT, OUTPUT)], drafter, policy, COST)
    assert r.kept <= r.drafted and r.tokens == r.kept + r.rounds
    assert r.speedup > 1.5
