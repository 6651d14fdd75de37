"""The held-out discipline inside the suite: bench's prediction (the plan's model) is fitted
on one prompt set and checked on another it has not seen.

A simulated machine (fake models on a fake clock): the target's decode costs a fixed part
and a part per token, the draft model's too, and the draft reads a request's prompt before
its first draft. The costs are calibrated on set A (short prompts), as bench calibrates
them on its first prompt; the engine then runs set B (long prompts of other tokens) with
the adaptive policy, and the prediction from B's counted rounds and A's calibration must be
within 5% of what B measured. Without the draft's prompt read the model misses it by more.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest
from fakes import FakeBackend, FakeClock, FakeModel

from specwire.bench import calibrate, report, sweep
from specwire.bench.prompts import Prompt
from specwire.bench.runner import RunParams, Workload, run_config
from specwire.config import DraftParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.engine.engine import Engine

TARGET = FakeModel(n_vocab=40, seed=0)
DRAFT = TARGET.perturbed(0.25, seed=5)
#: (seconds per decode, per token): a plain step of 0.12 s, a draft token of 0.024 s
TARGET_COST, DRAFT_COST = (0.1, 0.02), (0.02, 0.004)


def _set(name: str, seed: int, n: int, length: int) -> tuple[list[Prompt], list[list[int]]]:
    rs = np.random.default_rng(seed)
    tokens = [[int(t) for t in rs.integers(0, TARGET.real_tokens, length)] for _ in range(n)]
    return [Prompt(f"{name}-{i}", name) for i in range(n)], tokens


def _run(monkeypatch, prompts: list[Prompt], tokens: list[list[int]], mode: str) -> tuple:
    """One configuration on a fresh simulated machine: (record, calibration on prompt 0)."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    target = FakeBackend(TARGET, n_ctx=1024, clock=clock, cost=TARGET_COST)
    draft = FakeBackend(DRAFT, n_ctx=1024, name="draft.gguf", clock=clock, cost=DRAFT_COST)
    work = Workload(prompts, tokens, SamplingParams(temperature=0.0),
                    DraftParams(p_min=0.0, policy="adaptive"), n_predict=64)
    cfg = RunParams(mode, 8, "adaptive")
    engine = Engine(target, ModelDrafter(draft) if cfg.drafting else None)
    runs = run_config(engine, work, cfg)
    calib = {"verify": calibrate.verify_curve(target, tokens[0]),
             "draft_tps": calibrate.draft_tps(draft, tokens[0])}
    calib["draft_prompt_tps"] = calibrate.draft_prompt_tps(draft, tokens[0], calib["draft_tps"])
    return cfg, runs, calib


def _predict(monkeypatch, fit: tuple, held: tuple, keep_reads: bool = True) -> dict:
    """Fit on `fit` (its calibration and plain rate), predict `held`'s local run."""
    _, _, calib = _run(monkeypatch, *fit, "local")
    cfg, plain_runs, _ = _run(monkeypatch, *held, "plain")
    cfg, runs, _ = _run(monkeypatch, *held, "local")
    plain_rec = report.aggregate(RunParams("plain"), plain_runs, plain_runs, True)
    rec = report.aggregate(cfg, runs, plain_runs, True)
    if not keep_reads:
        for p in rec["prompts"]:
            p["stats"]["draft_prompt_n"] = None
    return sweep.prediction(rec, cfg, report.overall_rate(plain_rec), calib)


def test_fitted_on_short_prompts_it_predicts_long_ones(monkeypatch) -> None:
    short, long = _set("short", 1, 3, 12), _set("long", 2, 3, 200)
    got = _predict(monkeypatch, short, long)
    assert got["k"] >= 1, got                       # the held-out run did draft
    assert abs(got["error_pct"]) < 5.0, got
    blind = _predict(monkeypatch, short, long, keep_reads=False)
    assert blind["error_pct"] > 5.0, blind          # the prompt read is what it would miss


@pytest.mark.parametrize("fit_len, held_len", [(200, 12), (40, 120)])
def test_held_out_both_ways(monkeypatch, fit_len: int, held_len: int) -> None:
    fit, held = _set("fit", 3, 3, fit_len), _set("held", 4, 3, held_len)
    got = _predict(monkeypatch, fit, held)
    assert abs(got["error_pct"]) < 5.0, got


def test_a_read_that_does_not_pay_runs_requests_plainly_and_is_predicted(monkeypatch) -> None:
    """A draft that reads its prompt slowly (15 ms a token, not on the target's curve):
    once the policy has paid one read, it runs the other long-prompt requests plainly, and
    the prediction counts the read and catch-ups of the one request that drafted only."""
    monkeypatch.setattr(sys.modules[__name__], "DRAFT_COST", (0.02, 0.015))
    got = _predict(monkeypatch, _set("short", 1, 3, 12), _set("long", 2, 4, 200))
    assert 0.0 < got["drafting_share"] < 0.3, got    # some requests drafted, most did not
    assert abs(got["error_pct"]) < 5.0, got


def test_the_drafts_prompt_rate_is_what_reading_costs_beyond_one_token(monkeypatch) -> None:
    """A decode of n tokens costs c0 + c1 n: one token's c0 + c1, the others c1 each."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    draft = FakeBackend(DRAFT, clock=clock, cost=DRAFT_COST)
    prompt = _set("p", 0, 1, 100)[1][0]
    assert calibrate.draft_tps(draft, prompt) == pytest.approx(1 / sum(DRAFT_COST))
    got = calibrate.draft_prompt_tps(draft, prompt, 1 / sum(DRAFT_COST))
    assert got == pytest.approx(1 / DRAFT_COST[1])
    assert calibrate.draft_prompt_tps(draft, prompt[:1], 10.0) is None
