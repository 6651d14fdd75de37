"""benchmarks/repredict.py on stored runs: the model's prediction for each measured
configuration, recomputed. Every run is a valid emulation on held-out prompts
(docs/benchmarks.md, "`plan` on held-out prompts"): gpu-dense on prose and qa, 128 tokens a
reply; seed-moe on two long code rewrites, 64 tokens; cpu-membound on a code rewrite and
prose, 32 tokens. Each was run twice: at 3927caa, where bench built every prompt's drafter
with a bubble rule that had learnt nothing, and again (`-warm`) once a configuration's
drafters handed it on, as a server's drafter per slot keeps it.

The pipelined predictions took the acceptance fitted at the mean draft length (+11%, +8%
and +6.4% on the first runs), then the maximum-likelihood one (+4.1%, +5.04%, +0.8%), then
a request's first round as a plain step: within 5% on five of the nine pipelined
configurations, and nearer the measured rate than the prediction stored with the run on
all nine. The other four (gpu-dense warm +5.8% and +7.9%, cpu-membound +5.2%, +5.3% and
+5.3%) are what is left of issue 39."""

import json
from pathlib import Path

import pytest

from benchmarks.repredict import repredict

RESULTS = Path(__file__).resolve().parents[1] / "results"
RUNS = sorted(p.name for p in RESULTS.glob("*.json"))
PIPELINED = ("local-pipelined", "remote-pipelined")
#: (stored run, configuration, its maximum-likelihood acceptance: tokens kept over tokens
#: kept plus rounds refused): within issue 39's 5%
WITHIN_5 = [
    ("gpu-dense-heldout-n128.json", "local-pipelined", 213 / 221),
    ("gpu-dense-heldout-n128.json", "remote-pipelined", 212 / 220),
    ("seed-moe-heldout-code-n64.json", "remote-pipelined", None),
    ("seed-moe-heldout-code-n64-warm.json", "remote-pipelined", None),
    ("cpu-membound-heldout-n32-warm.json", "local-pipelined", None),
]


def _rows(name: str) -> dict:
    results = json.loads((RESULTS / name).read_text())
    return {label.split()[0]: (stored, today) for label, stored, today in repredict(results)}


@pytest.mark.parametrize("name", RUNS)
def test_plain_is_predicted_exactly_and_alternating_as_stored(name: str) -> None:
    rows = _rows(name)
    assert rows["plain"][1]["error_pct"] == pytest.approx(0.0, abs=1e-9)
    if "local" in rows:   # drafts the drafter stopped itself: still fitted at the mean
        stored, today = rows["local"]
        assert today["error_pct"] == pytest.approx(stored["error_pct"], abs=1e-6)


@pytest.mark.parametrize("name", RUNS)
def test_every_pipelined_prediction_is_nearer_than_the_stored_one(name: str) -> None:
    rows = _rows(name)
    for mode in PIPELINED:
        if mode in rows:
            stored, today = rows[mode]
            assert today["measured_tps"] == pytest.approx(stored["measured_tps"])
            assert abs(today["error_pct"]) < abs(stored["error_pct"]), (mode, today, stored)


@pytest.mark.parametrize("name, mode, acceptance", WITHIN_5)
def test_pipelined_predictions_within_five_percent(name: str, mode: str,
                                                   acceptance: float | None) -> None:
    stored, today = _rows(name)[mode]
    if acceptance is not None:
        assert today["inputs"]["acceptance"] == pytest.approx(acceptance)
    assert abs(today["error_pct"]) < 5.0, today["error_pct"]


#: The same gpu-dense run on four held-out prompts (two prose, two qa, 128 tokens each)
#: before and after the pipelined drafter's default lookahead grew from 2 n_max to
#: 2 n_max + 1 (link/branch.py lookahead_for): before, a round that kept its whole draft
#: found the next one a token short, and the target waited for that token in 37 of 70
#: rounds, which the model does not price (+7.1%); after, 13 and 15 rounds waited.
LOOKAHEAD = RESULTS / "lookahead"


def _lookahead_rows(name: str) -> dict:
    results = json.loads((LOOKAHEAD / name).read_text())
    return {label.split()[0]: today for label, _, today in repredict(results)}


@pytest.mark.parametrize("mode", PIPELINED)
def test_with_the_next_draft_drafted_the_pipelined_predictions_are_within_five_percent(
        mode: str) -> None:
    before = _lookahead_rows("gpu-dense-heldout4-n128-lookahead-2k.json")[mode]
    after = _lookahead_rows("gpu-dense-heldout4-n128-lookahead-2k1.json")[mode]
    assert before["error_pct"] > 5.0, before["error_pct"]
    assert abs(after["error_pct"]) < 5.0, after["error_pct"]


@pytest.mark.parametrize("mode", PIPELINED)
def test_cpu_membound_after_the_lookahead_is_within_five_percent(mode: str) -> None:
    """cpu-membound's held-out run again (a code rewrite and prose, 32 tokens) after the
    lookahead grew: the stored runs before it were +5.2% and +5.3% off."""
    after = _lookahead_rows("cpu-membound-heldout-n32-lookahead-2k1.json")[mode]
    assert abs(after["error_pct"]) < 5.0, after["error_pct"]


#: Runs of every mode bench has (plain, local alternating, local and remote pipelined,
#: remote sync, n-gram, hybrid, random) on a regime and two prompt sets, each a valid
#: emulation (docs/benchmarks.md, "Every mode, after the lookahead"). seed-moe on the
#: shipped qa set and held-out short code rewrites: the pipelined modes were -6.5% and
#: -3.6% off while the model raced a miss until a whole draft had come; the engine
#: verifies the first draft that pays (throughput.race_resume), and so does the model now.
#: gpu-dense on shipped code and held-out short code rewrites, 128 tokens, and cpu-membound
#: on qa and the short rewrites, 64 tokens: within 2.1%; gpu-dense on prose, held-out prose
#: and a 285-token rewrite, 128 tokens: within 2.6%.
EVERY_MODE = RESULTS / "every-mode"


#: What is left of issue 39: seed-moe on shipped code and prose, held-out prose and one
#: held-out 285-token code rewrite. Each prompt but the long one is within 5% alone
#: (`repredict --per-prompt`); on the long one the pipelined modes are +20% (their targets
#: waited for the drafter in 12-14 rounds, 4.5 s of 31) and the synchronous one -21%.
OPEN = {("seed-moe-code-prose-heldout-n64.json", mode): limit for mode, limit in
        (("local-pipelined", 9.0), ("remote-pipelined", 9.0), ("remote-sync", 6.5))}


@pytest.mark.parametrize("name", sorted(p.name for p in EVERY_MODE.glob("*.json")))
def test_every_mode_is_predicted_within_five_percent(name: str) -> None:
    results = json.loads((EVERY_MODE / name).read_text())
    rows = {label.split()[0]: today for label, _, today in repredict(results)}
    assert len(rows) >= 8
    for mode, today in rows.items():
        limit = OPEN.get((name, mode), 5.0)
        assert abs(today["error_pct"]) < limit, (mode, today["error_pct"])


def test_per_prompt_predicts_each_request_from_its_own_rounds() -> None:
    """--per-prompt: one prediction per prompt of each configuration, measured against
    that prompt's own tokens and time; plain decoding predicted exactly."""
    from benchmarks.repredict import per_prompt

    results = json.loads((EVERY_MODE / "seed-moe-qa-codeshort-n64.json").read_text())
    rows = dict(per_prompt(results))
    ids = [p["id"] for p in results["records"][0]["prompts"]]
    for rec in results["records"]:
        label = rec["label"]
        assert [pid for pid, _ in rows[label]] == ids
        for (pid, pred), p in zip(rows[label], rec["prompts"], strict=True):
            assert pred["measured_tps"] == pytest.approx(
                1000.0 * p["generated"] / p["predicted_ms"]), (label, pid)
    assert all(abs(pred["error_pct"]) < 1e-9 for _, pred in rows["plain"])
