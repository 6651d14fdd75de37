"""Emulation presets in target steps, and their scale to this machine's wall time.

A preset states a deployment's physics relative to one plain target step: the
verification curve, what a draft token and a prompt token cost, the round trip.
Wall time is emulated time times a scale, chosen at start-up so that every
real decode of the models at hand fits under its emulated time (the hold can
only lengthen a decode). Ratios between configurations do not depend on the
scale; tokens/s in the emulated model's own units are wall tokens/s times it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from specwire.backend.timing import batch_tries
from specwire.emulate.hold import Regime
from specwire.policy.throughput import VerifyCurve

#: Real decodes must fit under their emulated times with this much room: a shared
#: machine's noise should not push them over.
MARGIN = 1.6
TARGET_SIZES = (1, 2, 4, 8, 16, 32)
#: A draft evaluates one token at a time, and short catch-ups wanting their last row.
DRAFT_SIZES = (1, 2, 4)
REPS = 5


@dataclass(frozen=True, slots=True)
class Preset:
    """A regime in target steps (target_tps only names the unit: tokens/s of the model)."""

    name: str
    target_tps: float
    verify_cost: str            # t_v(n) in plain steps, `plan --verify-cost` syntax
    prompt_tps: float
    draft_tps: float
    rtt_steps: float            # the link's round trip, in plain steps
    source: str

    @property
    def rtt_s(self) -> float:
        return self.rtt_steps / self.target_tps


PRESETS = {p.name: p for p in (
    Preset("seed-moe", 6.6, "1:1,8:3", 270.0, 30.0, 0.001 * 6.6,
           "the FIELD.md seed case: Qwen3-Coder-480B (5.15 bpw, experts in RAM) at 6.6 tokens/s "
           "plain and 270 tokens/s prompt, a batch of 8 costing 3 plain steps and a 30B-A3B "
           "draft at 30 tokens/s, which together reproduce its same-process 6.60 -> 7.81 "
           "tokens/s (810/1093 accepted); a 1 ms LAN round trip. On its own GPU the draft makes "
           "about 100 tokens/s: --draft-tps 100"),
    Preset("gpu-dense", 30.0, "1:1,16:1.1,32:2.2", 3000.0, 300.0, 0.1,
           "a dense target on one GPU, memory-bound: a batch up to 16 tokens costs about one "
           "step (the weights are read once), compute-bound beyond; a draft at 0.1 steps a "
           "token, a round trip of 10% of a step (illustrative figures, not a measurement)"),
    Preset("cpu-membound", 5.0, "1:1,8:1.05,32:1.3,64:2.6", 50.0, 50.0, 0.005,
           "a dense target read from RAM by a CPU (about 5 tokens/s for 20 GB of weights at "
           "100 GB/s): a batch nearly flat to 32 tokens, so batched requests share a step; a "
           "draft at 0.1 steps a token, 1 ms round trip (illustrative figures, derived from "
           "the memory-bound model, not a measurement)"),
)}


def preset_help() -> str:
    return "; ".join(f"{p.name}: {p.source}" for p in PRESETS.values())


@dataclass(frozen=True, slots=True)
class Emulation:
    """A resolved emulation: the regime in emulated seconds, and the scale to wall time.

    draft_tps None: the draft's decodes are not held (its real speed counts).
    """

    preset: str
    target_tps: float
    verify: VerifyCurve
    prompt_tps: float | None
    draft_tps: float | None
    rtt_s: float
    scale: float = 1.0

    def target_regime(self) -> Regime:
        return Regime(self.scale / self.target_tps, self.verify,
                      self.prompt_tps / self.scale if self.prompt_tps else None)

    def draft_regime(self) -> Regime | None:
        """The draft's decodes: its tokens at draft_tps, a batch on the target's curve
        shape (a draft of the same family), the catch-up of a prompt on it too."""
        if self.draft_tps is None:
            return None
        return Regime(self.scale / self.draft_tps, self.verify)

    @property
    def wall_rtt_s(self) -> float:
        return self.rtt_s * self.scale

    def with_scale(self, scale: float) -> Emulation:
        return replace(self, scale=scale)

    def describe(self) -> str:
        draft = f"draft {self.draft_tps:g} tokens/s" if self.draft_tps else "draft not held"
        prompt = f"prompt {self.prompt_tps:g} tokens/s" if self.prompt_tps else "prompt on curve"
        return (f"emulating {self.preset}: target {self.target_tps:g} tokens/s, "
                f"{self.verify.describe()}, {prompt}, {draft}, round trip "
                f"{1000 * self.rtt_s:g} ms; wall time = emulated x {self.scale:.3g}")

    def to_dict(self) -> dict:
        return {"preset": self.preset, "target_tps": self.target_tps,
                "verify_cost": [list(p) for p in self.verify.points],
                "prompt_tps": self.prompt_tps, "draft_tps": self.draft_tps,
                "rtt_ms": 1000 * self.rtt_s, "scale": self.scale}


def resolve(preset: str | None, target_tps: float | None = None,
            verify_cost: str | None = None, prompt_tps: float | None = None,
            draft_tps: float | None = None, rtt_s: float | None = None) -> Emulation:
    """A preset with the given figures replacing its own; without a preset, --target-tps
    is required and the rest default to plan's assumptions. ValueError names the flag."""
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"--emulate: unknown preset {preset!r}; known: {', '.join(PRESETS)}")
    for flag, v in (("--target-tps", target_tps), ("--prompt-tps", prompt_tps),
                    ("--draft-tps", draft_tps)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag}: must be > 0, got {v:g}")
    if rtt_s is not None and rtt_s < 0:
        raise ValueError(f"--rtt: must be >= 0, got {rtt_s:g}")
    try:
        curve = VerifyCurve.parse(verify_cost) if verify_cost else None
    except ValueError as e:
        raise ValueError(f"--verify-cost: {e}") from None
    if preset is None:
        if target_tps is None:
            raise ValueError("--target-tps: needed to emulate without --emulate PRESET")
        return Emulation("custom", target_tps, curve or VerifyCurve(), prompt_tps, draft_tps,
                         rtt_s or 0.0)
    p = PRESETS[preset]
    tps = target_tps or p.target_tps
    return Emulation(p.name, tps, curve or VerifyCurve.parse(p.verify_cost),
                     prompt_tps or p.prompt_tps, draft_tps or p.draft_tps,
                     p.rtt_s if rtt_s is None else rtt_s)


# --------------------------------------------------------------------------- the scale


def batch_seconds(backend: Any, prompt: Sequence[int], sizes: Sequence[int],
                  reps: int = REPS, clock: Any = time, logits: str = "all") -> dict[int, float]:
    """A high estimate (the second largest of reps) of the real seconds a batch of n
    tokens takes after the prompt (logits: the rows asked for, as the engine's
    verification or a draft's catch-up asks)."""
    tries = batch_tries(backend, prompt, sizes, reps, clock, logits)
    return {n: sorted(t)[-2] if len(t) > 1 else t[0] for n, t in tries.items()}


def fit_scale(emu: Emulation, target_s: dict[int, float],
              draft_s: dict[int, float] | None = None, margin: float = MARGIN) -> float:
    """The smallest scale at which every measured real decode, with the margin, fits under
    its emulated time (the prompt rate is left out: prompt time is not generation time)."""
    unit = emu.with_scale(1.0)
    ratios = [t / unit.target_regime().decode_s(n) for n, t in target_s.items()]
    d = unit.draft_regime()
    if d is not None and draft_s:
        ratios += [t / d.decode_s(n) for n, t in draft_s.items()]
    if not ratios:
        raise ValueError("fit_scale: nothing measured")
    return round_up(margin * max(ratios))


def round_up(x: float, digits: int = 2) -> float:
    """x rounded up to `digits` significant digits (a scale that reads well: 1.7, 0.42)."""
    if x <= 0:
        return x
    step = 10 ** (math.floor(math.log10(x)) - digits + 1)
    return round(math.ceil(x / step - 1e-9) * step, 12)


def measure_scale(emu: Emulation, target: Any, prompt: Sequence[int],
                  draft: Any | None = None) -> tuple[float, dict]:
    """Time the real target (and draft) and fit the scale; (scale, what was measured)."""
    t = batch_seconds(target, prompt, TARGET_SIZES)
    d = (batch_seconds(draft, prompt, DRAFT_SIZES, logits="last") if draft is not None
         else None)
    measured = {"target_s": t, "draft_s": d,
                "target_plain_ms": 1000 * t.get(1, statistics.fmean(t.values()))}
    return fit_scale(emu, t, d), measured


#: What the scale is measured after: a prompt of about a hundred tokens of code.
SCALE_TEXT = ("def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n"
              "    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n"
              "    out, i, j = [], 0, 0\n    while i < len(a) and j < len(b):\n"
              "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n"
              "        else:\n            out.append(b[j]); j += 1\n"
              "    return out + a[i:] + b[j:]\n\n# Rewrite it as a generator, with a test.\n")


def scaled(emu: Emulation, fit: bool, target: Any, draft: Any | None = None
           ) -> tuple[Emulation, dict]:
    """The emulation at its scale: measured on the real target (and draft) when `fit`,
    else as given; (emulation, what was measured, empty when nothing was)."""
    if not fit:
        return emu, {}
    prompt = target.tokenize(SCALE_TEXT, add_special=True, parse_special=False)
    scale, measured = measure_scale(emu, target, prompt, draft)
    return emu.with_scale(scale), measured
