"""--emulate on the commands: bad figures are one clear line (fast, before a model loads);
an emulated run gives exactly the unemulated run's tokens (slow, the bundled pair)."""

from __future__ import annotations

import json
import subprocess
import sys

import bundled
import pytest

pytestmark = pytest.mark.q8_0   # the tests' fast target (bundled.py)


@pytest.mark.parametrize("command, args, needle", [
    ("generate", ["x", "--draft-tps", "30"], "--draft-tps: emulates a model"),
    ("generate", ["x", "--emulate", "seed-moe", "--draft-tps", "0"], "--draft-tps: must be > 0"),
    ("generate", ["x", "--emulate", "seed-moe", "--verify-cost", "8"], "--verify-cost"),
    ("generate", ["x", "--emulate", "seed-moe", "--emulate-scale", "fast"], "--emulate-scale"),
    ("generate", ["x", "--target-tps", "-1"], "--target-tps: must be > 0"),
    ("serve", ["--emulate", "seed-moe", "--emulate-scale", "0"], "--emulate-scale"),
    ("bench", ["--emulate", "seed-moe", "--prompt-tps", "-5"], "--prompt-tps"),
    ("draft", ["--emulate", "seed-moe"], "--emulate-scale: required on a draft node"),
    ("draft", ["--draft-tps", "100", "--emulate-scale", "x"], "--emulate-scale: not a number"),
    ("draft", ["--verify-cost", "1:1,8:3"], "give --emulate PRESET or --draft-tps"),
])
def test_bad_emulation_flags_are_one_clear_line(specwire_cli, command: str, args: list[str],
                                                needle: str) -> None:
    r = specwire_cli(command, *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_preset_is_refused(specwire_cli) -> None:
    r = specwire_cli("generate", "x", "--emulate", "h100")
    assert r.returncode == 2 and "--emulate" in r.stderr and "seed-moe" in r.stderr


def _generate(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "specwire", "generate", "def fib(n):", "-n", "12",
                        "--temp", "0", "--json", "-c", "512", "--draft-mode", "sync", *args],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_emulated_generation_gives_the_unemulated_tokens() -> None:
    """The holds change time only: greedy tokens with a local draft are the same, and the
    emulated run reports its regime and every target and draft decode it held."""
    plain = _generate()
    held = _generate("--emulate", "seed-moe", "--draft-tps", "100")
    assert held["tokens"] == plain["tokens"]
    emu = held["emulation"]
    assert emu["preset"] == "seed-moe" and emu["draft_tps"] == 100.0 and emu["scale"] > 0
    assert emu["target"]["decodes"] > 0 and emu["draft"]["decodes"] > 0
    assert "emulation" not in plain


@pytest.mark.slow
def test_emulated_engine_matches_for_every_draft_length() -> None:
    """In one process, with fixed regimes (no fit): target and draft held, greedy output
    token-identical to the unheld run at draft lengths 1, 4 and 8."""
    from specwire.assets import models
    from specwire.backend.llama import LlamaBackend
    from specwire.config import DraftParams, ModelParams, SamplingParams
    from specwire.drafters.model import ModelDrafter
    from specwire.emulate.hold import Regime, emulate
    from specwire.engine.engine import Engine, Request
    from specwire.policy.throughput import VerifyCurve

    target = LlamaBackend(ModelParams(str(bundled.target()), n_ctx=512))
    draft = LlamaBackend(ModelParams(str(models.default_draft()), n_ctx=512))
    prompt = target.tokenize("def is_prime(n: int) -> bool:\n", add_special=True,
                             parse_special=False)
    curve = VerifyCurve.parse("1:1,8:3")
    held_t = emulate(target, Regime(0.2, curve, prompt_tps=200.0))
    held_d = emulate(draft, Regime(0.02, curve))
    sp = SamplingParams(temperature=0.0)
    for k in (1, 4, 8):
        out = []
        for t, d in ((target, draft), (held_t, held_d)):
            t.truncate(0)
            d.truncate(0)
            out.append(Engine(t, ModelDrafter(d)).generate(
                Request(prompt, 16, sp, DraftParams(n_max=k))).run())
        assert out[0] == out[1], k
    assert held_t.counters.decodes > 0 and held_d.counters.decodes > 0


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True])
def test_a_synchronous_node_is_waited_for_on_the_emulated_clock(hybrid: bool) -> None:
    """--emulate stretches wall time by its scale: the synchronous round's wait for its
    draft node too, or a node reading a long prompt (emulated, well in time) would be
    dropped as late, as `bench --emulate seed-moe --emulate-scale 3` saw."""
    from specwire.build import build_engine
    from specwire.cli.main import build_parser
    from specwire.cli.settings import engine_settings

    argv = ["serve", "-m", str(bundled.target()), "--emulate", "seed-moe",
            "--emulate-scale", "4", "--draft-url", "127.0.0.1:9", "--draft-mode", "sync",
            *(["--draft-hybrid"] if hybrid else [])]
    engine = build_engine(engine_settings(build_parser().parse_args(argv)))
    try:
        drafter = engine.drafters[0]
        remote = drafter.model if hybrid else drafter
        assert remote.sync_timeout_s == pytest.approx(4.0)
    finally:
        for d in engine.drafters:
            d.close()
