"""Measure the planning model's inputs on this machine (`specwire plan --measure`).

`specwire plan` is arithmetic on four figures, and guessing them (above all the
verification cost) is where a plan goes wrong, so each is measured the way the engine
incurs it: the target's plain decoding rate through the engine (median over a few prompts),
the draft model evaluating one token at a time after a prompt, the target's batches of
n = 1, 2, 4, 8, 16 tokens with logits for every row (the KV cache truncated back between
tries; median relative to n = 1), and the acceptance of a short local speculative run
(draft_n_accepted / draft_n). bench uses the draft speed and curve for its predictions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from specwire.backend.timing import batch_tries
from specwire.policy.throughput import VerifyCurve
from specwire.settings import MeasureSettings

VERIFY_SIZES = (1, 2, 4, 8, 16)
DRAFT_TOKENS = 32
#: A prompt read: the first tokens of a prompt, read this many times from an empty cache.
PROMPT_TOKENS = 64
PROMPT_REPS = 3
VERIFY_REPS = 7


# --------------------------------------------------------------------------- single figures


def draft_tps(backend: Any, prompt: Sequence[int], n: int = DRAFT_TOKENS) -> float:
    """Greedy one-token steps after the prompt: the draft model's drafting speed."""
    n = max(1, min(n, backend.n_ctx - len(prompt) - 1))
    backend.truncate(0)
    tok = int(np.argmax(backend.eval(list(prompt), logits="last")[-1]))
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(backend.eval([tok], logits="last")[-1]))
    elapsed = time.perf_counter() - t0
    backend.truncate(0)
    return n / elapsed


def draft_prompt_tps(backend: Any, prompt: Sequence[int], draft_tps_: float,
                     n: int = PROMPT_TOKENS, reps: int = PROMPT_REPS) -> float | None:
    """The draft's prompt reading rate as PlanInputs.draft_prompt_tps wants it: reading n
    tokens at once costs one token's 1 / draft_tps_ and the other n - 1 at this rate
    (median of reps reads of the prompt's first n tokens from an empty cache; None for a
    prompt of one token)."""
    toks = list(prompt[:n])
    if len(toks) < 2:
        return None
    times = []
    for _ in range(reps):
        backend.truncate(0)
        t0 = time.perf_counter()
        backend.eval(toks, logits="last")
        times.append(time.perf_counter() - t0)
    backend.truncate(0)
    extra = statistics.median(times) - 1.0 / draft_tps_
    return (len(toks) - 1) / extra if extra > 0 else None


def verify_curve(backend: Any, prompt: Sequence[int], sizes: Sequence[int] = VERIFY_SIZES,
                 reps: int = VERIFY_REPS) -> VerifyCurve:
    """t_v(n) / t_v(1) for each n, measured after a prompt and truncated back each time."""
    times = batch_times(backend, prompt, sizes, reps)
    base = times[1] if 1 in times else min(times.values())
    points = tuple((n, round(t / base, 4)) for n, t in sorted(times.items()))
    if len(points) < 2:
        raise ValueError("verify_curve: need at least two batch sizes")
    return VerifyCurve(points, assumed=False)


def batch_times(backend: Any, prompt: Sequence[int], sizes: Sequence[int],
                reps: int) -> dict[int, float]:
    """Median seconds to evaluate a batch of n tokens (all logits) at the prompt's end."""
    tries = batch_tries(backend, prompt, sizes, reps)
    return {n: statistics.median(t) for n, t in tries.items()}


# --------------------------------------------------------------------------- plan --measure


@dataclass(frozen=True, slots=True)
class Measurement:
    target_tps: float
    draft_tps: float
    acceptance: float
    draft_n: int
    draft_n_accepted: int
    verify: VerifyCurve

    def describe(self) -> str:
        return (f"measured: target {self.target_tps:.2f} tokens/s, draft {self.draft_tps:.2f} "
                f"tokens/s, acceptance {self.acceptance:.3f} "
                f"({self.draft_n_accepted}/{self.draft_n}), {self.verify.describe()}")


def measure(s: MeasureSettings) -> Measurement:
    """Load the pair, then the four figures (target and draft one after the other)."""
    from specwire.backend.base import BackendError
    from specwire.backend.llama import LlamaBackend, check_pair, load_model
    from specwire.backend.placement import check
    from specwire.bench import prompts as prompt_sets
    from specwire.bench.runner import RunParams, Workload, run_config
    from specwire.config import ConfigError, DraftParams, SamplingParams
    from specwire.drafters.model import ModelDrafter
    from specwire.engine.engine import Engine

    tparams, dparams = s.target, s.draft
    try:
        plist = prompt_sets.resolve(s.prompts, s.limit)
        check(tparams.placement)                        # both, before either loads
        check(dparams.placement, dict(s.draft_flags))
        target = LlamaBackend(tparams)
        dmodel = load_model(dparams, dict(s.draft_flags))
        check_pair(target.model, dmodel)
        draft = LlamaBackend(dparams, dmodel)
    except (BackendError, prompt_sets.PromptError) as e:
        raise ConfigError(str(e)) from None
    tokens = [prompt_sets.tokenize(p, target) for p in plist]
    work = Workload(plist, tokens, SamplingParams(temperature=0.0), DraftParams(),
                    n_predict=s.n_predict)
    plain = run_config(Engine(target), work, RunParams("plain"))
    spec = run_config(Engine(target, ModelDrafter(draft)), work,
                      RunParams("local", DraftParams().n_max))
    drafted = sum(r.stats["draft_n"] for r in spec)
    accepted = sum(r.stats["draft_n_accepted"] for r in spec)
    return Measurement(
        target_tps=statistics.median(r.tokens_per_s for r in plain),
        draft_tps=draft_tps(draft, tokens[0]),
        acceptance=accepted / drafted if drafted else 0.0,
        draft_n=drafted, draft_n_accepted=accepted,
        verify=verify_curve(target, tokens[0]))
