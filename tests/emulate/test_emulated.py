"""The emulated backend's arithmetic and over-time counting, on the FakeClock.

Every eval of a FakeBackend charges the clock its fixed cost; the emulation then
waits (FakeClock.sleep) until the regime's time. No wall clock is read.
"""

from __future__ import annotations

import pytest
from fakes import FakeBackend, FakeBatch, FakeClock, FakeModel

from specwire.backend.batch import BatchBackend, Part
from specwire.config import DraftParams, SamplingParams
from specwire.emulate import hold as emu_mod
from specwire.emulate import regimes
from specwire.emulate.hold import HoldCounters, Regime, emulate, split_tokens
from specwire.engine.engine import Engine, Request
from specwire.policy.throughput import VerifyCurve

MODEL = FakeModel(n_vocab=40, seed=3)
CURVE = VerifyCurve.parse("1:1,8:3")


def test_regime_arithmetic() -> None:
    r = Regime(0.1, CURVE, prompt_tps=200.0)
    assert r.decode_s(1) == pytest.approx(0.1)
    assert r.decode_s(8) == pytest.approx(0.3)
    assert r.decode_s(4) == pytest.approx(0.1 * (1 + 2 * 3 / 7))   # interpolated
    assert r.decode_s(0, prompt=100) == pytest.approx(0.5)
    assert r.decode_s(2, prompt=50) == pytest.approx(0.1 * (1 + 2 / 7) + 0.25)
    # without a prompt rate, a prompt chunk costs what the curve says
    assert Regime(0.1, CURVE).decode_s(0, prompt=8) == pytest.approx(0.3)
    # ... and a decode's tokens are one batch on it, not a batch and a chunk apart: a
    # lockstep draft decode of 3 sequences' tokens and a 5-token catch-up reads once
    assert Regime(0.1, CURVE).decode_s(3, prompt=5) == pytest.approx(0.3)


def test_tokens_split_into_batch_and_prompt() -> None:
    assert split_tokens(9, "all") == (9, 0)
    assert split_tokens(1, "last") == (1, 0)
    assert split_tokens(30, "last") == (0, 30)
    assert split_tokens(30, "none") == (0, 30)


def test_bad_regimes_are_refused() -> None:
    with pytest.raises(ValueError, match="step"):
        Regime(0.0)
    with pytest.raises(ValueError, match="prompt rate"):
        Regime(0.1, prompt_tps=-1.0)


def test_an_eval_is_held_to_its_emulated_time() -> None:
    clock = FakeClock()
    real = FakeBackend(MODEL, clock=clock, cost=(0.02, 0.0))
    b = emulate(real, Regime(0.1, CURVE, prompt_tps=100.0), clock=clock)
    b.eval([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], logits="last")      # a prompt: 0.1 s
    assert clock.now == pytest.approx(0.1)
    b.eval([3], logits="last")                                  # a plain step: 0.1 s
    assert clock.now == pytest.approx(0.2)
    b.eval([1] * 8, logits="all")                               # a batch of 8: 3 steps
    assert clock.now == pytest.approx(0.5)
    assert b.decode_s == pytest.approx(0.5)
    c = b.counters
    assert (c.decodes, c.over, c.prompt_chunks, c.prompt_over) == (2, 0, 1, 0)
    # without a prompt rate a long chunk is generation (a draft's catch-up): a decode
    d = emulate(FakeBackend(MODEL, clock=clock, cost=(0.5, 0.0)), Regime(0.1), clock=clock)
    d.eval([1, 2, 3], logits="last")
    assert (d.counters.decodes, d.counters.over, d.counters.prompt_chunks) == (1, 1, 0)
    assert b.tokens == real.tokens and b.n_past == 19
    b.truncate(3)
    assert real.n_past == 3
    assert b.vocab_fingerprint() == real.vocab_fingerprint()   # the rest is the real one's


def test_a_decode_over_its_time_is_counted_and_not_held() -> None:
    clock = FakeClock()
    real = FakeBackend(MODEL, clock=clock, cost=(0.15, 0.0))
    b = emulate(real, Regime(0.1, CURVE), clock=clock)
    b.eval([3], logits="last")          # 0.15 real > 0.1 emulated: over, no wait
    assert clock.now == pytest.approx(0.15)
    b.eval([1] * 8, logits="all")       # 0.15 real < 0.3: held to 0.3
    assert clock.now == pytest.approx(0.45)
    c = b.counters
    assert (c.decodes, c.over) == (2, 1)
    assert c.over_share == pytest.approx(0.5) and not c.valid
    assert c.worst == pytest.approx(1.5)


def test_counters_between_snapshots() -> None:
    c = HoldCounters()
    before = c.snapshot()
    for real in (0.05, 0.05, 0.2):
        c.note(real, 0.1, prompt=False)
    c.note(0.5, 0.1, prompt=True)
    d = HoldCounters.since(before, c.snapshot())
    assert (d["decodes"], d["over"], d["prompt_chunks"], d["prompt_over"]) == (3, 1, 1, 1)
    assert d["over_share"] == pytest.approx(1 / 3) and not d["valid"]
    assert emu_mod.MAX_OVER_SHARE == 0.05


def test_a_batch_decode_is_one_held_batch_of_all_parts() -> None:
    clock = FakeClock()
    fb = FakeBatch(MODEL, n_seq=2)
    for s in fb.seqs:
        s.clock, s.cost = clock, (0.01, 0.0)
    b = emulate(fb, Regime(0.1, CURVE, prompt_tps=100.0), clock=clock)
    assert isinstance(b, BatchBackend) and b.n_seq == 2
    b.decode([Part(0, [1, 2, 3, 4], "all"), Part(1, [5] * 20, "last")])
    # 4 rows on the curve (1 + 3 * 2/7 steps) plus 20 prompt tokens at 100/s
    assert clock.now == pytest.approx(0.1 * (1 + 6 / 7) + 0.2)
    b.seq(1).eval([7], logits="last")                  # a sequence's own eval is held too
    assert clock.now == pytest.approx(0.1 * (1 + 6 / 7) + 0.3)
    assert b.decode_s == pytest.approx(clock.now)
    # each sequence's share follows its share of the real time (FakeBatch: its own evals)
    shares = [b.seq_decode_s(i) for i in range(2)]
    assert sum(shares) == pytest.approx(b.decode_s)
    assert b.seq(1).decode_s == pytest.approx(shares[1])
    assert b.seq(1).tokens == fb.seqs[1].tokens
    assert not isinstance(emulate(FakeBackend(MODEL), Regime(0.1)), BatchBackend)


def test_emulated_engine_gives_the_same_tokens() -> None:
    """Holding changes time only: greedy output with a draft is the unemulated one."""
    from specwire.drafters.model import ModelDrafter

    draft_model = MODEL.perturbed(0.3, seed=9)
    prompt = [1, 2, 3, 4, 5]
    sp, dp = SamplingParams(temperature=0.0), DraftParams(n_max=4)

    def run(emulated: bool) -> list[int]:
        clock = FakeClock()
        target = FakeBackend(MODEL, clock=clock, cost=(0.01, 0.001))
        draft = FakeBackend(draft_model, clock=clock, cost=(0.002, 0.0))
        if emulated:
            target = emulate(target, Regime(0.1, CURVE), clock=clock)
            draft = emulate(draft, Regime(0.02, CURVE), clock=clock)
        gen = Engine(target, ModelDrafter(draft)).generate(Request(prompt, 40, sp, dp))
        out = gen.run()
        if emulated:
            assert target.counters.decodes > 0 and target.counters.over == 0
            assert draft.counters.decodes > 0 and draft.counters.over == 0
        return out

    assert run(True) == run(False)


def test_presets_resolve_in_target_steps() -> None:
    e = regimes.resolve("seed-moe")
    assert e.target_tps == 6.6 and e.draft_tps == 30.0 and e.prompt_tps == 270.0
    assert e.rtt_s == pytest.approx(0.001)
    assert e.verify.cost(8) == pytest.approx(3.0)
    fast = regimes.resolve("seed-moe", draft_tps=100.0)
    assert fast.draft_tps == 100.0
    g = regimes.resolve("gpu-dense")
    assert g.rtt_s == pytest.approx(0.1 / g.target_tps)
    assert g.verify.cost(16) == pytest.approx(1.1)
    assert regimes.resolve("cpu-membound").verify.cost(32) == pytest.approx(1.3)
    for p in regimes.PRESETS.values():
        assert p.source and p.name in regimes.preset_help()


def test_scaled_regimes() -> None:
    e = regimes.resolve("seed-moe").with_scale(2.0)
    t = e.target_regime()
    assert t.step_s == pytest.approx(2.0 / 6.6)
    assert t.prompt_tps == pytest.approx(135.0)
    assert e.draft_regime().step_s == pytest.approx(2.0 / 30.0)
    assert e.wall_rtt_s == pytest.approx(0.002)


def test_fit_scale_covers_every_measured_decode() -> None:
    e = regimes.resolve("seed-moe")
    step = 1 / 6.6
    # real: a plain step of half an emulated one, a batch of 8 at 1.2 emulated steps
    target = {1: 0.5 * step, 8: 1.2 * step}
    draft = {1: 0.5 / 30}
    s = regimes.fit_scale(e, target, draft, margin=1.0)
    assert s == pytest.approx(0.5)          # the plain step and the draft token bind
    assert regimes.fit_scale(e, {1: 0.5 * step, 8: 3.3 * step}, None, margin=1.0) == \
        pytest.approx(1.1)                  # the batch binds
    assert regimes.fit_scale(e, target, draft) == pytest.approx(
        regimes.round_up(0.5 * regimes.MARGIN))
    assert regimes.round_up(1.6976) == 1.7 and regimes.round_up(0.4101) == 0.42
    assert regimes.round_up(2.0) == 2.0
    # at the fitted scale nothing measured is over its emulated time
    scaled = e.with_scale(s)
    assert all(t <= scaled.target_regime().decode_s(n) + 1e-12 for n, t in target.items())


def test_batch_seconds_on_the_fake_clock() -> None:
    clock = FakeClock()
    fb = FakeBackend(MODEL, clock=clock, cost=(0.01, 0.002))
    got = regimes.batch_seconds(fb, [1, 2, 3], (1, 4), reps=3, clock=clock)
    assert got == {1: pytest.approx(0.012), 4: pytest.approx(0.018)}
    assert fb.n_past == 0


def test_resolve_refuses_bad_figures() -> None:
    with pytest.raises(ValueError, match="--emulate: unknown preset 'nope'"):
        regimes.resolve("nope")
    with pytest.raises(ValueError, match="--target-tps"):
        regimes.resolve(None)
    with pytest.raises(ValueError, match="--draft-tps: must be > 0"):
        regimes.resolve("seed-moe", draft_tps=0.0)
    with pytest.raises(ValueError, match="--verify-cost"):
        regimes.resolve("seed-moe", verify_cost="8")
    custom = regimes.resolve(None, target_tps=10.0, verify_cost="1:1,4:2")
    assert custom.preset == "custom" and custom.draft_tps is None
    assert custom.draft_regime() is None


def _run(over: int, decodes: int, draft_over: int = 0):
    from specwire.bench.runner import PromptRun
    hold = {"decodes": decodes, "over": over, "prompt_chunks": 1, "prompt_over": 1,
            "real_s": 1.0, "emulated_s": 2.0}
    return PromptRun("p", "code", 10, 20, 5.0, 1.0, 4000.0, "limit", "x", {}, extra={
        "emulation": {"target": hold, "draft": {**hold, "over": draft_over}}})


def test_bench_marks_a_configuration_over_five_percent() -> None:
    from specwire.bench import report
    ok = report.emulation([_run(1, 50), _run(1, 50)])            # 2 of 100: valid
    assert ok["target"]["over"] == 2 and ok["target"]["decodes"] == 100
    assert ok["target"]["over_share"] == pytest.approx(0.02) and ok["valid"]
    bad = report.emulation([_run(0, 50, draft_over=3), _run(0, 50, draft_over=3)])
    assert bad["draft"]["over_share"] == pytest.approx(0.06) and not bad["valid"]
    from specwire.bench.runner import PromptRun
    assert report.emulation([PromptRun("p", "code", 1, 1, 1.0, 1.0, 1.0, "limit", "x", {})]) \
        is None
    results = {"emulation": {"scale": 2.0, "describe": "emulating seed-moe",
                             "node": {"decodes": 100, "over": 7}},
               "records": [{"label": "local k=8", "emulation": bad, "prompts": [
                   {"category": "code", "generated": 20, "predicted_ms": 4000.0}]}]}
    text = "\n".join(report.emulation_lines(results))
    assert "local k=8: 10.00 emulated tok/s" in text
    assert "draft 6/100 (6.0%) - NOT A VALID EMULATION" in text
    assert "draft node (all its configurations): 7/100" in text and text.count("NOT A VALID") == 2


def test_bench_reads_the_nodes_count(tmp_path) -> None:
    from specwire.bench.sweep import node_holds
    log = tmp_path / "draft-node.log"
    assert node_holds(log) is None
    log.write_text("x INFO specwire.node: emulation: 10 draft decodes, 1 over their emulated "
                   "time; 2 prompt chunks, 0 over\nx INFO specwire.node: emulation: 25 draft "
                   "decodes, 3 over their emulated time; 4 prompt chunks, 1 over\n")
    assert node_holds(log) == {"decodes": 25, "over": 3, "prompt_chunks": 4, "prompt_over": 1}
