"""Fakes the hybrid drafter's tests share: the fake target and its plain-decoding
reference, the lookup at a fixed stop, and a model that works ahead and records what it
is told."""

from __future__ import annotations

from fakes import FakeModel

from specwire.config import SamplingParams
from specwire.drafters.base import Capabilities, Draft, DrafterBase
from specwire.drafters.ngram.drafter import KEEP, NgramDrafter
from specwire.sample import sampling

V = 32
TARGET = FakeModel(n_vocab=V, seed=0)
OTHER = TARGET.perturbed(0.7, seed=5)
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]
FAKE_GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.8, top_k=12, top_p=0.9, min_p=0.05, seed=1234)


def lookup() -> NgramDrafter:
    """Stops at the fixed KEEP: fake rounds take no time worth measuring."""
    return NgramDrafter(keep=KEEP)


def reference(params: SamplingParams, n: int, prompt=PROMPT) -> list[int]:
    hist, out = list(prompt), []
    for _ in range(n):
        row = TARGET.row(hist)
        t = sampling.coupled(row, params, len(hist), sampling.recent_window(hist, params))
        out.append(t)
        hist.append(t)
    return out


class AheadSpy(DrafterBase):
    """A model that drafts ahead (as a node or a thread does): records what learn() hears."""

    name = "ahead"
    capabilities = Capabilities(pipelined=True)

    def __init__(self, fn) -> None:
        self.fn, self.learned, self.drafts = fn, [], []

    def begin(self, prompt, sampling_, params, **guide) -> None:
        self.learned, self.drafts = [], []

    def propose(self, history, k) -> Draft:
        self.drafts.append((len(history), list(self.fn(history, k))))
        return Draft(list(self.drafts[-1][1]))

    def learn(self, history, accepted, appended) -> None:
        base, draft = self.drafts[-1]
        new = history[base:base + appended]
        kept = next((i for i, (t, h) in enumerate(zip(draft, new, strict=False))
                     if t != h),
                    min(len(draft), len(new)))
        self.learned.append((accepted, kept))

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}
