"""A request's own LoRA scales (llama-server's `lora` field) on fakes: applied to its own
decodes only, lossless under speculation, and read as llama-server reads it.

The fake context's adapter is a bias on every logits row times its scale, and like a
llama.cpp context's adapters it applies to every sequence of a decode: two requests
with different scales in one batch get their own outputs only if the scheduler never
decodes them together.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import pytest
from fakes import FakeBackend, FakeBatch, FakeModel

from specwire.config import ConfigError, DraftParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import KEEP, NgramDrafter
from specwire.engine.engine import Engine, Request
from specwire.sample import sampling
from specwire.server import schemas
from specwire.server.errors import ApiError

V = 32
TARGET = FakeModel(n_vocab=V, seed=11)
BIAS = (np.random.default_rng(2).normal(size=V) * 1.5).astype(np.float32)
PROMPT = [3, 4, 5, 6, 7, 3, 4]
N = 30
GREEDY = SamplingParams(temperature=0.0)
SAMPLED = SamplingParams(temperature=0.9, top_k=12, seed=21)


class LoraSeq(FakeBackend):
    """A sequence of a LoraBatch: its rows carry the batch's applied adapter."""

    def __init__(self, owner: LoraBatch) -> None:
        super().__init__(TARGET)
        self.owner = owner

    @property
    def lora_scales(self) -> list[float]:
        return self.owner.lora_scales

    def apply_lora(self, scales: Sequence[float]) -> None:
        self.owner.applied = list(scales)

    def eval(self, tokens, logits: str = "last") -> np.ndarray:
        rows = super().eval(tokens, logits)
        rows += self.owner.applied[0] * BIAS
        return rows


class LoraBatch(FakeBatch):
    def __init__(self, n_seq: int) -> None:
        super().__init__(TARGET, n_seq)
        self.lora_scales, self.applied = [1.0], [1.0]   # --lora A (scale 1)
        self.seqs = [LoraSeq(self) for _ in range(n_seq)]
        self.steps: list[tuple[float, tuple[int, ...]]] = []   # (scale, sequences)

    def decode(self, parts) -> list[np.ndarray]:
        self.steps.append((self.applied[0], tuple(p.seq for p in parts)))
        return super().decode(parts)


def reference(params: SamplingParams, scale: float, n: int = N) -> list[int]:
    hist, out = list(PROMPT), []
    for _ in range(n):
        row = TARGET.row(hist) + scale * BIAS
        t = sampling.coupled(row, params, len(hist), sampling.recent_window(hist, params))
        out.append(t)
        hist.append(t)
    return out


def drafter(kind: str):
    if kind == "none":
        return None
    if kind == "twin":   # the base model: it knows nothing of the adapter
        return ModelDrafter(FakeBackend(TARGET, name="twin.gguf"))
    return NgramDrafter(4, 1, keep=KEEP)


def run_alone(kind: str, params: SamplingParams, lora, n_max: int = 4):
    batch = LoraBatch(1)
    d = drafter(kind)
    engine = Engine(batch, [d] if d is not None else None)
    dp = DraftParams(n_max=n_max, p_min=0.0, enabled=d is not None)
    gen = engine.generate(Request(list(PROMPT), N, params, dp, lora=lora))
    return gen.run(), gen


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("kind", ["none", "twin", "ngram"])
def test_a_requests_scales_give_its_own_output_with_and_without_a_draft(kind, params) -> None:
    outputs = {}
    for lora in (None, (1.0,), (0.5,), (0.0,)):
        for n_max in (1, 4, 8):
            tokens, _ = run_alone(kind, params, lora, n_max)
            scale = 1.0 if lora is None else lora[0]
            assert tokens == reference(params, scale), (kind, lora, n_max)
        outputs[lora] = tokens
    assert outputs[None] == outputs[(1.0,)]
    assert len({tuple(t) for t in outputs.values()}) == 3     # the scale matters


def test_a_batch_never_decodes_two_sets_of_scales_together() -> None:
    """Three requests at scales 1 (the server's), 0.5 and 0, in one batch of three with a
    draft each: every one gets its alone output, and every decode ran at one scale, that
    of all its sequences."""
    batch = LoraBatch(3)
    engine = Engine(batch, [drafter("twin"), drafter("ngram"), drafter("twin")])
    dp = DraftParams(n_max=4, p_min=0.0)
    loras = [None, (0.5,), (0.0,)]
    gens = [engine.generate(Request(list(PROMPT), N, GREEDY, dp, lora=lo), seq=i)
            for i, lo in enumerate(loras)]
    while not all(g.done for g in gens):
        engine.step()
    for gen, lo in zip(gens, loras, strict=True):
        assert gen.tokens == reference(GREEDY, 1.0 if lo is None else lo[0])
    want = {0: 1.0, 1: 0.5, 2: 0.0}
    assert all(want[s] == scale for scale, seqs in batch.steps for s in seqs)
    assert {scale for scale, _ in batch.steps} == {1.0, 0.5, 0.0}


def test_a_cache_made_under_other_scales_is_not_reused() -> None:
    batch = LoraBatch(1)
    engine = Engine(batch)
    dp = DraftParams(enabled=False)

    def cached(lora) -> int:
        gen = engine.generate(Request(list(PROMPT), 4, GREEDY, dp, lora=lora))
        gen.run()
        return gen.stats.cache_n

    assert cached(None) == 0
    assert cached(None) == len(PROMPT) - 1        # same scales: the prompt is reused
    assert cached((0.5,)) == 0                    # other scales: evaluated again
    assert cached((0.5,)) == len(PROMPT) - 1
    assert cached((1.0,)) == 0


def test_a_cache_there_before_the_first_request_is_reused() -> None:
    """A slot file or --prompt-cache restored before any request: taken to be made under
    the target's own scales."""
    batch = LoraBatch(1)
    engine = Engine(batch)
    batch.seq(0).eval(PROMPT[:5], "none")
    gen = engine.generate(Request(list(PROMPT), 4, GREEDY, DraftParams(enabled=False)))
    gen.run()
    assert gen.stats.cache_n == 5


def test_scales_for_another_number_of_adapters_are_refused() -> None:
    gen = Engine(LoraBatch(1)).generate(Request(list(PROMPT), 4, lora=(1.0, 2.0)))
    with pytest.raises(ConfigError, match="lora: 2 scales for the target's 1 adapters"):
        gen.run()
    with pytest.raises(ConfigError, match="lora: scales must be finite"):
        Request(list(PROMPT), 4, lora=(float("nan"),))


# ------------------------------------------------------------- the field, as llama-server reads it

TWO = SimpleNamespace(lora_scales=[1.0, 0.25])


def test_the_field_names_scales_by_id_and_the_rest_are_off() -> None:
    assert schemas.lora_scales({}, TWO) is None
    assert schemas.lora_scales({"lora": []}, TWO) == (0.0, 0.0)
    assert schemas.lora_scales({"lora": [{"id": 1, "scale": 0.5}]}, TWO) == (0.0, 0.5)
    assert schemas.lora_scales({"lora": [{"id": 0, "scale": 2}, {"id": 1}]}, TWO) == (2.0, 0.0)


@pytest.mark.parametrize(("lora", "needle"), [
    ({"id": 0, "scale": 1}, "lora: must be an array"),
    ([0.5], "lora[0]: must be an object"),
    ([{"scale": 1}], "lora[0].id: must be an adapter id"),
    ([{"id": True, "scale": 1}], "lora[0].id: must be an adapter id"),
    ([{"id": 0}, {"id": 2, "scale": 1}], "lora[1].id: no adapter 2; this server has 2"),
    ([{"id": -1, "scale": 1}], "lora[0].id: no adapter -1"),
    ([{"id": 0, "scale": "high"}], "lora[0].scale: must be a finite number"),
    ([{"id": 0, "scale": float("inf")}], "lora[0].scale: must be a finite number"),
])
def test_a_bad_field_is_a_400_naming_it(lora, needle: str) -> None:
    with pytest.raises(ApiError) as e:
        schemas.lora_scales({"lora": lora}, TWO)
    assert e.value.status == 400 and needle in str(e.value)


def test_a_server_without_adapters_takes_only_an_empty_list() -> None:
    none = SimpleNamespace()
    assert schemas.lora_scales({"lora": []}, none) == ()
    with pytest.raises(ApiError, match="no adapter 0; this server has 0"):
        schemas.lora_scales({"lora": [{"id": 0, "scale": 1}]}, none)
