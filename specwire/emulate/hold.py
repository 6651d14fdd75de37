"""An emulated model: a real backend's decodes, each held until a slower model would finish.

The real model computes every logit, so tokens, acceptance and invariance stay
real; only time is emulated. Each decode is timed, then held (a sleep, never a
spin, so the other core stays free for a draft node) until the time the
emulated model would take: a plain step, a batch of n tokens on a cost curve in
plain steps (`plan --verify-cost`'s syntax), a prompt chunk at a prompt rate.
A decode whose real time already exceeds its emulated time cannot be held; it
is counted, and a run where many are is not a valid emulation of the regime.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from specwire.backend.batch import BatchBackend, Part
from specwire.policy.throughput import VerifyCurve

#: A configuration with more of its decodes over their emulated time is not valid.
MAX_OVER_SHARE = 0.05


class Clock(Protocol):
    """Where the hold reads and waits (the `time` module; a fake clock in tests)."""

    def perf_counter(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


@dataclass(frozen=True, slots=True)
class Regime:
    """What one emulated model's decodes take, in wall seconds.

    step_s: a plain step (one token); curve: a batch of n tokens in plain steps;
    prompt_tps: prompt chunks (tokens without their logits) at this rate, None: on the
    curve like any batch.
    """

    step_s: float
    curve: VerifyCurve = field(default_factory=VerifyCurve)
    prompt_tps: float | None = None

    def __post_init__(self) -> None:
        if not self.step_s > 0:
            raise ValueError(f"an emulated step must take > 0 s, got {self.step_s}")
        if self.prompt_tps is not None and not self.prompt_tps > 0:
            raise ValueError(f"an emulated prompt rate must be > 0, got {self.prompt_tps}")

    def decode_s(self, batch: int, prompt: int = 0) -> float:
        """Seconds for a decode of `batch` tokens with logits plus `prompt` prompt tokens.
        Without a prompt rate every token of the decode is on the curve as one batch (a
        draft's lockstep decode of several sequences' catch-ups and tokens reads the
        weights once, as a single sequence's decode of as many tokens does)."""
        if not self.prompt_tps:
            n = batch + prompt
            return self.step_s * self.curve.cost(n) if n else 0.0
        t = self.step_s * self.curve.cost(batch) if batch else 0.0
        return t + prompt / self.prompt_tps


def split_tokens(n: int, logits: str) -> tuple[int, int]:
    """(batch, prompt) tokens of one part: rows for every token (a verification) or a
    single token are a batch; a longer run that wants one row or none is a prompt chunk."""
    if logits == "all" or n == 1:
        return n, 0
    return 0, n


@dataclass(slots=True)
class HoldCounters:
    """What the holds saw: decodes (steps, batches, draft tokens) and prompt chunks apart,
    since only the former set a generation rate."""

    decodes: int = 0
    over: int = 0            # decodes whose real time exceeded their emulated time
    prompt_chunks: int = 0
    prompt_over: int = 0
    real_s: float = 0.0
    emulated_s: float = 0.0
    worst: float = 0.0       # the largest real / emulated time of a decode
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def note(self, real_s: float, emulated_s: float, prompt: bool) -> None:
        with self._lock:
            over = real_s > emulated_s
            if prompt:
                self.prompt_chunks += 1
                self.prompt_over += over
            else:
                self.decodes += 1
                self.over += over
                if emulated_s > 0:
                    self.worst = max(self.worst, real_s / emulated_s)
            self.real_s += real_s
            self.emulated_s += max(real_s, emulated_s)

    @property
    def over_share(self) -> float:
        return self.over / self.decodes if self.decodes else 0.0

    @property
    def valid(self) -> bool:
        return self.over_share <= MAX_OVER_SHARE

    def snapshot(self) -> dict:
        with self._lock:
            return {"decodes": self.decodes, "over": self.over,
                    "prompt_chunks": self.prompt_chunks, "prompt_over": self.prompt_over,
                    "real_s": self.real_s, "emulated_s": self.emulated_s,
                    "worst": self.worst}

    @staticmethod
    def since(before: dict, after: dict) -> dict:
        """The counters between two snapshots, with the share and the verdict."""
        d = {k: after[k] - before[k] for k in after if k != "worst"}
        d["over_share"] = d["over"] / d["decodes"] if d["decodes"] else 0.0
        d["valid"] = d["over_share"] <= MAX_OVER_SHARE
        return d


class _Hold:
    """Times a decode and waits out the rest of its emulated time."""

    def __init__(self, regime: Regime, counters: HoldCounters, clock: Clock) -> None:
        self.regime, self.counters, self.clock = regime, counters, clock
        self.held_s = 0.0   # wall seconds of held decodes (real plus waited)

    def run(self, fn, batch: int, prompt: int):
        emulated = self.regime.decode_s(batch, prompt)
        t0 = self.clock.perf_counter()
        out = fn()
        real = self.clock.perf_counter() - t0
        # a chunk at the prompt rate is prompt time; without a rate (a draft's catch-up)
        # it is part of generation and counts as a decode
        self.counters.note(real, emulated, prompt=batch == 0 and bool(self.regime.prompt_tps))
        if real < emulated:
            self.clock.sleep(emulated - real)
        self.held_s += self.clock.perf_counter() - t0
        return out


class EmulatedBackend:
    """A Backend whose evals take the regime's time; everything else is the real one's.

    decode_s counts the held time, so the engine and the policy see the emulated model.
    Attributes it does not define (model, ctx, adopt, ...) are the real backend's.
    """

    def __init__(self, inner: Any, regime: Regime, counters: HoldCounters | None = None,
                 clock: Clock = time) -> None:
        self.inner = inner
        self.counters = counters if counters is not None else HoldCounters()
        self._hold = _Hold(regime, self.counters, clock)

    @property
    def regime(self) -> Regime:
        return self._hold.regime

    @property
    def decode_s(self) -> float:
        return self._hold.held_s

    @property
    def n_past(self) -> int:
        return self.inner.n_past

    @property
    def tokens(self) -> Sequence[int]:
        return self.inner.tokens

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        batch, prompt = split_tokens(len(tokens), logits)
        return self._hold.run(lambda: self.inner.eval(tokens, logits), batch, prompt)

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":   # not yet set (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class _EmulatedSeq(EmulatedBackend):
    """Sequence i (> 0) of an EmulatedBatch: its evals are held on the batch's clock."""

    def __init__(self, owner: EmulatedBatch, i: int) -> None:
        super().__init__(owner.inner.seq(i), owner.regime, owner.counters, owner._hold.clock)
        self._hold = owner._hold   # one timeline: the batch's decode_s includes its evals
        self._owner, self._i = owner, i

    @property
    def decode_s(self) -> float:
        """This sequence's share of the batch's held time, as a real sequence view's."""
        return self._owner.seq_decode_s(self._i)


class EmulatedBatch(EmulatedBackend):
    """An EmulatedBackend over a BatchBackend: one decode of many parts is one held batch
    of all their tokens with logits (plus their prompt chunks at the prompt rate)."""

    def __init__(self, inner: BatchBackend, regime: Regime,
                 counters: HoldCounters | None = None, clock: Clock = time) -> None:
        super().__init__(inner, regime, counters, clock)
        self._views: list[EmulatedBackend] = [self]
        # every sequence the inner one addresses: its forks too (backend/llama.py)
        n_ids = inner.n_seq + getattr(inner, "n_forks", 0)
        self._views += [_EmulatedSeq(self, i) for i in range(1, n_ids)]

    def seq(self, i: int) -> EmulatedBackend:
        self.inner.seq(i)   # the real one's range check and message
        return self._views[i]

    def seq_decode_s(self, i: int) -> float:
        real_total = self.inner.decode_s
        share = self.inner.seq_decode_s(i) / real_total if real_total else 1.0 / self.n_seq
        return self.decode_s * share

    def decode(self, parts: Sequence[Part]) -> list[np.ndarray]:
        batch = prompt = 0
        for p in parts:
            b, q = split_tokens(len(p.tokens), p.logits)
            batch, prompt = batch + b, prompt + q
        return self._hold.run(lambda: self.inner.decode(parts), batch, prompt)


def emulate(backend: Any, regime: Regime, counters: HoldCounters | None = None,
            clock: Clock = time) -> EmulatedBackend:
    """The backend held to the regime (a batch backend stays one)."""
    if isinstance(backend, BatchBackend):
        return EmulatedBatch(backend, regime, counters, clock)
    return EmulatedBackend(backend, regime, counters, clock)
