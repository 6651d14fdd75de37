"""Drafters and backends declare what they can do; the engine checks it when it is built.

A drafter without its own q in rejection mode is refused at build time unless it is
deterministic, in which case DraftGuard hands the verifier a one-hot q for its drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import FrozenInstanceError

import numpy as np
import pytest
from fakes import FakeBackend, FakeModel, FixedDrafter, RandomDrafter, SpyDrafter

from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Capabilities, Draft, DrafterBase, LinkStatus, NoDrafter
from specwire.drafters.guard import DraftGuard, check_verify_mode
from specwire.drafters.llama_server import LlamaServerDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine, Request

REJECTION = DraftParams(mode=VerifyMode.REJECTION)
SAMPLED = SamplingParams(temperature=0.8, seed=3)


class _Cycle(FixedDrafter):
    """Drafts the next few tokens of a fixed cycle: a function of the history alone."""

    capabilities = Capabilities(deterministic=True)

    def __init__(self) -> None:
        super().__init__(lambda history, n: [(history[-1] + 1 + i) % 20 for i in range(n)])


class _Plain:
    """A drafter that does not derive from DrafterBase: the protocol and nothing else."""

    name = "plain"
    capabilities = Capabilities()
    backend = None

    def __init__(self) -> None:
        self.guides: list[dict] = []

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams,
              **guide) -> None:
        self.guides.append(guide)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        return Draft([1] * k)

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def cache_use(self) -> tuple[int, int] | None:
        return None

    def close(self) -> None:
        pass


class _Undeclared(DrafterBase):
    """Has every optional member, declares none of them: none may be called."""

    name = "undeclared"

    def __init__(self) -> None:
        self.called: list[str] = []

    def begin(self, prompt, sampling, params, **guide) -> None:
        pass

    def propose(self, history, k: int) -> Draft:
        return Draft([2] * k)

    def learn(self, history, accepted: int, appended: int) -> None:
        pass

    def end(self) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def ask(self, history, k: int) -> None:
        self.called.append("ask")

    def draft_in_steps(self, history, k: int):
        self.called.append("draft_in_steps")
        raise AssertionError("not declared lockstep")

    def never_wait(self) -> None:
        self.called.append("never_wait")

    def status(self):
        self.called.append("status")
        return (LinkStatus("x", True),)


def test_the_base_declares_no_capability() -> None:
    d = DrafterBase()
    assert d.capabilities == Capabilities() and d.backend is None
    assert d.close() is None and d.cache_use() is None and d.status() == ()
    assert NoDrafter().capabilities.deterministic and isinstance(NoDrafter(), DrafterBase)
    with pytest.raises(FrozenInstanceError):
        d.capabilities.pipelined = True  # type: ignore[misc]


def test_the_guard_calls_an_optional_member_only_where_it_is_declared() -> None:
    d = _Undeclared()
    guard = DraftGuard(d, n_vocab=32, hold=False)
    guard.begin([3, 4], SamplingParams(), DraftParams())
    guard.ask([3, 4], 2)
    assert guard.drafted(guard.drafting([3, 4], 2), 2).tokens == [2, 2]
    assert guard.status() == ()
    assert d.called == [] and guard.total_failures == 0


def test_the_guard_hands_begin_the_policy_and_grammar_again_after_a_failure() -> None:
    """The policy and grammar are begin's: re-begun after a pause, the drafter gets them
    again; a drafter not derived from DrafterBase needs only the protocol."""
    plain = _Plain()
    guard = DraftGuard(plain, n_vocab=32)
    policy, grammar = object(), object()
    guard.begin([3, 4], SamplingParams(), DraftParams(), policy=policy, grammar=grammar)
    guard._failed("propose", RuntimeError("once"))
    guard.retry_at = 0.0
    assert guard.propose([3, 4], 2).tokens == [1, 1]
    assert plain.guides == [{"policy": policy, "grammar": grammar}] * 2
    assert guard.cache_use() is None and guard.status() == ()


def test_the_engine_tells_the_policy_what_the_drafter_declares_it_stops() -> None:
    """A drafter declaring `stops` has the adaptive policy ask it for the most; one that
    does not leaves the policy choosing k. The drafter itself writes nothing into it."""
    for drafter, stops in ((NgramDrafter(cache=None), True), (_Cycle(), False)):
        engine = Engine(FakeBackend(FakeModel(32)), drafter)
        gen = engine.generate(Request([1, 2, 3, 1, 2], n_predict=4,
                                      draft=DraftParams(policy="adaptive")))
        seen: list[bool] = []
        propose = drafter.propose
        drafter.propose = lambda h, k, p=propose, g=gen, seen=seen: (
            seen.append(g.policy.drafter_stops), p(h, k))[1]
        gen.run()
        assert seen and set(seen) == {stops}
        assert not gen.policy.drafter_stops  # the request's end undoes it


def test_the_guard_forwards_the_capabilities_inside_its_boundary() -> None:
    class Broken(DrafterBase):
        name = "broken"
        capabilities = Capabilities(provides_q=True, links=True)

        def cache_use(self) -> tuple[int, int] | None:
            return (3, 4)

        def status(self):
            raise RuntimeError("no links here")

    guard = DraftGuard(Broken(), n_vocab=32)
    assert guard.capabilities.provides_q and not guard.capabilities.deterministic
    assert guard.cache_use() == (3, 4)
    assert guard.status() == ()          # raises inside: logged, never raised
    assert DraftGuard(_Plain(), 32).cache_use() is None


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
    with pytest.raises(ValueError, match="plain"):
        check_verify_mode(_Plain(), VerifyMode.REJECTION)


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


def test_a_llama_server_declares_its_link_and_reports_it_down_while_resting() -> None:
    """Link status is declared (Capabilities.links, status()), not read off attributes:
    a llama-server's is up, then down while it rests after a failure, with no node
    details to give."""
    d = LlamaServerDrafter("http://127.0.0.1:9")
    assert d.capabilities.links and d.capabilities.remote
    assert d.status() == (LinkStatus("http://127.0.0.1:9", True),)
    d._fail("connection refused")
    (st,) = DraftGuard(d, n_vocab=32).status()
    assert not st.up and st.model is None
