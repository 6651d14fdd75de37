"""Drafters and backends declare what they can do; the engine checks it when it is built.

A drafter without its own q in rejection mode is refused at build time unless it is
deterministic, in which case DraftGuard hands the verifier a one-hot q for its drafts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from fakes import FakeBackend, FakeModel, FixedDrafter, RandomDrafter, SpyDrafter

from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import CAPABILITIES, Draft, DrafterBase, NoDrafter, declared
from specwire.drafters.guard import DraftGuard, check_verify_mode
from specwire.engine.engine import Engine, Request

REJECTION = DraftParams(mode=VerifyMode.REJECTION)
SAMPLED = SamplingParams(temperature=0.8, seed=3)


class _Cycle(FixedDrafter):
    """Drafts the next few tokens of a fixed cycle: a function of the history alone."""

    deterministic = True

    def __init__(self) -> None:
        super().__init__(lambda history, n: [(history[-1] + 1 + i) % 20 for i in range(n)])


class _Legacy:
    """A drafter written before the capabilities were declared: the five calls and steer."""

    name = "legacy"

    def __init__(self) -> None:
        self.steered: list[object] = []

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams) -> None:
        pass

    def propose(self, history: Sequence[int], max_n: int) -> Draft:
        return Draft([1] * max_n)

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def steer(self, policy: object) -> None:
        self.steered.append(policy)


def test_the_base_declares_every_capability_absent() -> None:
    d = DrafterBase()
    assert (d.provides_q, d.deterministic, d.remote, d.pipelined, d.backend) == (
        False, False, False, False, None)
    assert d.steer(object()) is None and d.constrain(None) is None and d.close() is None
    assert d.cache_use() is None
    assert NoDrafter().deterministic and isinstance(NoDrafter(), DrafterBase)


def test_declared_gives_a_legacy_drafter_the_defaults_and_keeps_its_own() -> None:
    legacy = _Legacy()
    view = declared(legacy)
    assert all(hasattr(view, name) for name in CAPABILITIES)
    assert view.name == "legacy" and not view.provides_q and view.cache_use() is None
    view.constrain(None)                 # absent: nothing happens
    view.steer("policy")
    assert legacy.steered == ["policy"]  # present: its own
    own = FixedDrafter(lambda h, n: [])
    assert declared(own) is own


def test_the_guard_forwards_the_capabilities_inside_its_boundary() -> None:
    class Broken(DrafterBase):
        name = "broken"
        provides_q = True

        def constrain(self, spec: object) -> None:
            raise RuntimeError("no grammar here")

        def cache_use(self) -> tuple[int, int] | None:
            return (3, 4)

    guard = DraftGuard(Broken(), n_vocab=32)
    assert guard.provides_q and not guard.deterministic
    assert guard.cache_use() == (3, 4)
    guard.constrain(None)                # raises inside: counted, never raised
    assert guard.total_failures == 1
    assert DraftGuard(_Legacy(), 32).cache_use() is None


def test_rejection_mode_refuses_a_drafter_without_q_when_the_engine_is_built() -> None:
    target = FakeBackend(FakeModel(32))
    no_q = FixedDrafter(lambda h, n: [1] * n)
    with pytest.raises(ValueError, match="fixed gives no draft distribution q"):
        check_verify_mode(no_q, VerifyMode.REJECTION)
    with pytest.raises(ConfigError, match="use --verify coupled"):
        Engine(target, no_q, verify=VerifyMode.REJECTION)
    check_verify_mode(no_q, VerifyMode.COUPLED)
    check_verify_mode(_Cycle(), VerifyMode.REJECTION)
    check_verify_mode(RandomDrafter(32), VerifyMode.REJECTION)
    with pytest.raises(ValueError, match="legacy"):
        check_verify_mode(_Legacy(), VerifyMode.REJECTION)


def test_a_deterministic_drafter_without_q_gets_a_one_hot_q() -> None:
    guard = DraftGuard(_Cycle(), n_vocab=32)
    guard.begin([3, 4], SAMPLED, REJECTION)
    draft = guard.propose([3, 4], 3)
    assert draft.tokens == [5, 6, 7]
    assert draft.sparse is not None
    for token, q in zip(draft.tokens, draft.sparse, strict=True):
        assert q.ids.tolist() == [token] and np.allclose(q.probs, [1.0])
    honest = DraftGuard(RandomDrafter(32), n_vocab=32)  # sends its own q: kept
    honest.begin([3, 4], SAMPLED, REJECTION)
    assert len(honest.propose([3, 4], 2).sparse[0].ids) > 1


def test_an_engine_runs_a_deterministic_drafter_in_rejection_mode() -> None:
    target = FakeBackend(FakeModel(32))
    engine = Engine(target, SpyDrafter(_Cycle()), verify=VerifyMode.REJECTION)
    gen = engine.generate(Request([1, 2, 3], n_predict=24, sampling=SAMPLED, draft=REJECTION))
    tokens = list(gen)
    assert len(gen.tokens) == 24 and tokens
    assert gen.stats.draft_n > 0


def test_backends_declare_their_decode_time_and_chunk_reuse() -> None:
    target = FakeBackend(FakeModel(32))
    assert target.decode_s == 0.0
    target.eval([1, 2, 3], logits="all")
    assert target.decode_s > 0.0
    assert target.reuse_chunks([1, 2, 3, 4], 2, 1) == 2
