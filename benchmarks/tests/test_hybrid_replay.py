"""The hybrid replay: the engine's loop on a modelled clock, against recorded drafts.

Pure bookkeeping, on synthetic records: with a model that drafts the output exactly the
hybrid does at least as well as either candidate alone, and as well as choosing with
foresight when the model is free; a model that drafts junk is left alone by the hybrid,
which then does about as well as the lookup alone; verifying both candidates where it
pays never loses.
"""

from __future__ import annotations

import pytest

from benchmarks.hybrid_replay import Costs, Record, best_of, configurations, replay, with_both
from benchmarks.ngram_replay import curve_cost

CURVE = curve_cost(((1, 1.0), (2, 1.3), (4, 1.7), (8, 2.4), (16, 3.2)))


def _record(seed: int, right: bool) -> Record:
    """New text (nothing to copy), then the prompt repeated: both candidates matter."""
    prompt = [1000 * seed + i for i in range(30)]
    output = [100 * seed + (i * 7) % 23 for i in range(40)] + prompt[:30]
    full = [*prompt, *output]
    drafts, conf = [[]], [[]]
    for pos in range(1, len(output)):
        at = len(prompt) + pos
        drafts.append(full[at:at + 8] if right else [7] * 8)
        conf.append([0.9] * len(drafts[-1]))
    return Record(prompt, output, drafts, conf)


def _records(right: bool) -> list[Record]:
    """Six requests through one drafter and policy, as a server sees them."""
    return [_record(seed, right) for seed in range(1, 7)]


def _rates(records: list[Record], draft_cost: float) -> dict[str, float]:
    costs = Costs(CURVE, draft_cost)
    out = {label: replay(records, d, p(), costs).speedup
           for label, d, p in configurations(8)}
    out["foresight"] = best_of(records, costs, 8, both=False).speedup
    out["hybrid+both"] = with_both(records, costs, 8).speedup
    return out


@pytest.mark.parametrize("draft_cost", [0.0, 0.05, 0.3])
def test_with_an_exact_model_the_hybrid_beats_both_alone(draft_cost: float) -> None:
    rates = _rates(_records(right=True), draft_cost)
    assert rates["hybrid"] >= max(rates["model"], rates["ngram"])
    assert rates["hybrid+both"] >= rates["hybrid"]
    if draft_cost == 0.0:
        assert rates["model"] > rates["ngram"]
        assert rates["hybrid"] >= 0.95 * rates["foresight"]


@pytest.mark.parametrize("draft_cost", [0.05, 0.3])
def test_with_a_junk_model_the_hybrid_does_as_well_as_the_lookup(draft_cost: float) -> None:
    rates = _rates(_records(right=False), draft_cost)
    assert rates["model"] <= 1.0
    # what learning that the model is junk costs over six short requests: its first
    # rounds (waiting for a second verified one as evidence), then short probes after
    # 16, 32, 64 and 128 plain steps
    assert rates["hybrid"] >= 0.9 * rates["ngram"]
    assert rates["hybrid+both"] >= rates["hybrid"]
