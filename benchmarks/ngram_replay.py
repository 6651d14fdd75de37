"""n-gram drafters replayed against the target's own greedy output: figures a loaded machine
cannot blur.

    python -m benchmarks.ngram_replay [--prompts code] [--limit 12] [-n 192]

Greedy output does not depend on the drafter (lossless), so it is generated
once per prompt and every configuration is replayed against it: each round's
draft is judged exactly (the tokens it shares with the output), and costs what
verifying it costs on this target, t_v(draft + 1) from the measured verification
curve (bench's calibrate.verify_curve, or --curve). The figure is tokens per
plain step, i.e. the speedup over plain decoding if drafting and per-round
overhead were free, which for an n-gram lookup (microseconds) they nearly are.
What it cannot show is a machine's noise; what a wall-clock run on a shared
machine cannot show is a 5% difference. `versus_llama` measures wall clock.

`llama-simple-like` is llama.cpp's ngram-simple rule as its source reads (a
12-token key at its latest earlier occurrence, a copy only when at least 12
tokens follow it), re-stated here as a reference point; the real binary is
what versus_llama runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.base import Draft, StatelessDrafter
from specwire.policy.adaptive import AdaptivePolicy, FixedPolicy

#: t_v(n) / t_v(1) measured on the bundled F32 target, one thread (benchmarks/NOTES.md)
DEFAULT_CURVE = ((1, 1.0), (2, 1.34), (4, 1.7), (8, 2.37), (16, 3.2))


@dataclass(slots=True)
class Replayed:
    tokens: int = 0
    steps: float = 0.0      # verification cost in plain steps
    rounds: int = 0
    drafted: int = 0
    kept: int = 0

    @property
    def speedup(self) -> float:
        return self.tokens / self.steps if self.steps else 0.0


class KeyCopy(StatelessDrafter):
    """A fixed-key lookup: the latest earlier occurrence of the last `key` tokens, copied
    only when at least `key` tokens follow it (llama.cpp's ngram-simple rule)."""

    name = "key-copy"

    def __init__(self, key: int = 12, most: int = 48) -> None:
        self.key, self.most = key, most

    def propose(self, history: Sequence[int], k: int) -> Draft:
        n, key = len(history), self.key
        if n <= key + self.most + 1:
            return Draft()
        pattern = list(history[n - key:])
        for j in range(n - key - 1, 0, -1):
            if list(history[j:j + key]) == pattern:
                follow = min(self.most, n - j - key)
                return Draft(list(history[j + key:j + key + min(follow, k)])
                             if follow >= key else [])
        return Draft()


def curve_cost(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """t_v(n) in plain steps: piecewise linear through the points, extended by the last
    segment's slope."""
    xs = np.array([p[0] for p in points], dtype=float)
    ys = np.array([p[1] for p in points], dtype=float)
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

    def cost(n: int) -> float:
        if n > xs[-1]:
            return float(ys[-1] + slope * (n - xs[-1]))
        return float(np.interp(n, xs, ys))
    return cost


def replay(records: Sequence[tuple[list[int], list[int]]], drafter, policy,
           cost: Callable[[int], float], step_s: float = 0.05) -> Replayed:
    """The engine's loop with judged drafts and modelled time; one policy for all."""
    out = Replayed()
    greedy = SamplingParams(temperature=0.0)
    for prompt, output in records:
        adaptive = policy if isinstance(policy, AdaptivePolicy) else None
        if adaptive is not None:    # as the engine does: a drafter that stops is asked the most
            adaptive.drafter_stops = drafter.capabilities.stops
        policy.start()
        drafter.begin(prompt, greedy, DraftParams(n_max=getattr(policy, "n_max", 16)),
                      policy=adaptive)
        history, pos = [*prompt, output[0]], 1
        while pos < len(output):
            k = policy.choose(len(output) - pos - 1)
            draft = list(drafter.propose(history, k).tokens)[:k] if k > 0 else []
            kept = 0
            while kept < len(draft) and draft[kept] == output[pos + kept]:
                kept += 1
            steps = cost(len(draft) + 1)
            policy.observe(len(draft), kept, 0.0, steps * step_s)
            new = output[pos:pos + kept + 1]
            history.extend(new)
            pos += len(new)
            drafter.learn(history, kept, len(new))
            out.rounds, out.drafted, out.kept = out.rounds + 1, out.drafted + len(draft), \
                out.kept + kept
            out.steps += steps
        drafter.end()
        if adaptive is not None:
            adaptive.drafter_stops = False
        out.tokens += len(output) - 1
    return out


class PolicyLength(AdaptivePolicy):
    """The adaptive policy choosing k itself even for a lookup (as before drafter_stops)."""

    @property
    def drafter_stops(self) -> bool:
        return False

    @drafter_stops.setter
    def drafter_stops(self, value: bool) -> None:
        pass


def configurations(k: int):
    """(label, drafter factory, policy factory) of each configuration replayed."""
    from specwire.bench.baselines import ClassicNgramDrafter
    from specwire.drafters.ngram.drafter import NgramDrafter
    return [
        ("llama-simple-like", lambda: KeyCopy(), lambda: FixedPolicy(k)),
        ("ngram-classic", lambda: ClassicNgramDrafter(), lambda: FixedPolicy(k)),
        ("ngram keep 0.3", lambda: NgramDrafter(cache=None, keep=0.3), lambda: FixedPolicy(k)),
        ("ngram adaptive, policy's k", lambda: NgramDrafter(cache=None),
         lambda: PolicyLength(k)),
        ("ngram adaptive", lambda: NgramDrafter(cache=None), lambda: AdaptivePolicy(k)),
    ]


def parse_curve(text: str) -> tuple[tuple[int, float], ...]:
    try:
        points = tuple(sorted((int(n), float(c)) for n, c in
                              (item.split(":") for item in text.split(",") if item)))
    except ValueError:
        raise SystemExit(f"--curve: expected N:COST,..., got {text!r}") from None
    if len(points) < 2:
        raise SystemExit("--curve: need at least two points")
    return points


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ngram_replay",
                                description="n-gram drafters replayed against greedy output")
    p.add_argument("--prompts", default="code")
    p.add_argument("--limit", type=int, default=12)
    p.add_argument("-n", "--n-predict", type=int, default=192)
    p.add_argument("--draft-max", default="16", help="comma list of k")
    p.add_argument("--curve", default=None,
                   help="t_v(n)/t_v(1) as N:COST,... (default: measured on the target)")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("--records", default=None,
                   help="JSON of [{prompt, output}] token lists: read if it exists (no model "
                        "is run, --curve needed), else written after generating")
    a = p.parse_args(argv)
    if a.records and Path(a.records).is_file():
        if not a.curve:
            raise SystemExit("--records: give --curve too (no target is loaded to measure it)")
        data = json.loads(Path(a.records).read_text())
        report([(r["prompt"], r["output"]) for r in data], parse_curve(a.curve), a.draft_max)
        return 0

    from specwire.assets.models import bundled_path
    from specwire.backend.llama import LlamaBackend
    from specwire.bench import prompts as prompt_sets
    from specwire.bench.calibrate import verify_curve
    from specwire.config import ModelParams
    from specwire.drafters.ngram.drafter import NgramDrafter
    from specwire.engine.engine import Engine, Request

    target = LlamaBackend(ModelParams(a.model or str(bundled_path("target")), n_ctx=2048,
                                      n_threads=a.threads))
    plist = prompt_sets.resolve(a.prompts, a.limit)
    engine = Engine(target, NgramDrafter(cache=None))
    records = []
    for prompt in plist:
        tokens = prompt_sets.tokenize(prompt, target)
        target.truncate(0)
        gen = engine.generate(Request(tokens, a.n_predict, SamplingParams(temperature=0.0),
                                      DraftParams(n_max=16)))
        records.append((tokens, gen.run()))
    if a.records:
        Path(a.records).write_text(json.dumps([{"prompt": p, "output": o} for p, o in records]))
    points = (parse_curve(a.curve) if a.curve else
              verify_curve(target, records[0][0], sizes=(1, 2, 4, 8, 16, 32)).points)
    report(records, points, a.draft_max)
    return 0


def report(records, points, draft_max: str) -> None:
    cost = curve_cost(points)
    print(f"{len(records)} prompts, {sum(len(o) for _, o in records)} tokens; t_v(n)/t_v(1): "
          + ", ".join(f"{n}:{c:.2f}" for n, c in points))
    print(f"{'configuration':28s} {'k':>3s} {'speedup':>8s} {'rounds':>7s} {'drafted':>8s} "
          f"{'kept':>6s}")
    for k in (int(x) for x in draft_max.split(",")):
        for label, make_drafter, make_policy in configurations(k):
            r = replay(records, make_drafter(), make_policy(), cost)
            print(f"{label:28s} {k:3d} {r.speedup:7.2f}x {r.rounds:7d} {r.drafted:8d} "
                  f"{r.kept:6d}")


if __name__ == "__main__":
    sys.exit(main())
