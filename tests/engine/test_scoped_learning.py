"""What one tenant's requests teach never sets another tenant's draft lengths.

The learned estimates (the adaptive policy's acceptance and calibration, the n-gram
drafter's match calibration and yield, the hybrid's, the trees') are kept per cache scope
(policy/scoped.py). On fakes and a FakeClock (every decode costs what the fakes charge,
so a timing is a function of what was decoded): after tenant A sent text the drafter
copies well, or text it copies badly, tenant B's next request drafts the same tokens in
every round, takes the same fake time and gives the same answer. The control, A and B
in one scope (a server without keys), shows the probe can tell A's two texts apart.
"""

from __future__ import annotations

import pytest
from fakes import FakeBackend, FakeBatch, FakeClock, FakeModel

from specwire.config import DraftParams, SamplingParams
from specwire.drafters import hybrid as hybrid_mod
from specwire.drafters import lockstep as lockstep_mod
from specwire.drafters.hybrid import HybridDrafter
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram import drafter as ngram_mod
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine import engine as engine_mod
from specwire.engine import round as round_mod
from specwire.engine import sequence as sequence_mod
from specwire.engine.engine import Engine, Request
from specwire.policy.adaptive import AdaptivePolicy, AdaptiveState, PolicyMemory
from specwire.policy.scoped import MAX_SCOPES, Scoped
from specwire.sample import sampling

V = 32
TARGET = FakeModel(n_vocab=V, seed=0)
DRAFT = TARGET.perturbed(0.4, seed=5)
GREEDY = SamplingParams(temperature=0.0)


def _plain(prompt: list[int], n: int) -> list[int]:
    hist, out = list(prompt), []
    for _ in range(n):
        t = sampling.coupled(TARGET.row(hist), GREEDY, len(hist),
                             sampling.recent_window(hist, GREEDY))
        out.append(t)
        hist.append(t)
    return out


def _copying(i: int) -> list[int]:
    """A prompt holding plain decoding's own continuation: the lookup is right."""
    head = [3 + i, 9, 4 + i, 17]
    return [*head, *_plain(head, 40), 30, *head]


def _junk(i: int) -> list[int]:
    """A prompt of one repeated cycle, which the target does not follow: every match
    is wrong."""
    return [5 + i, 11, 2, 29, 8] * 9


B_PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]


class Recording:
    """Makes the drafter record each round's draft length (the engine asks propose)."""

    def __init__(self, drafter) -> None:
        self.drafter, self.lengths = drafter, []
        inner = drafter.propose

        def propose(history, k):
            draft = inner(history, k)
            self.lengths.append(len(draft.tokens))
            return draft

        drafter.propose = propose


def _drafter(kind: str, clock: FakeClock):
    if kind == "ngram":
        return NgramDrafter()          # measured stops: the policy's threshold
    model = ModelDrafter(FakeBackend(DRAFT, name="d.gguf", clock=clock, cost=(2e-3, 0.5e-3)))
    return HybridDrafter(NgramDrafter(), model)


def _b_after_a(monkeypatch, kind: str, a_text, a_scope: str) -> tuple:
    """Tenant B's request after three of tenant A's (scope a_scope): its draft length in
    every round, its tokens, drafted and accepted counts, and its fake seconds."""
    clock = FakeClock().install(monkeypatch, engine_mod, round_mod, sequence_mod,
                                hybrid_mod, lockstep_mod, ngram_mod)
    target = FakeBackend(TARGET, n_ctx=1024, clock=clock, cost=(10e-3, 1e-3))
    rec = Recording(_drafter(kind, clock))
    engine = Engine(target, rec.drafter)

    def run(prompt: list[int], scope: str, policy: str = "adaptive", n: int = 30):
        dp = DraftParams(n_max=8, p_min=0.0, policy=policy, cache_scope=scope)
        gen = engine.generate(Request(list(prompt), n, GREEDY, dp))
        gen.run()
        return gen

    # The machine's costs (shared by design) learnt first, the same in every run: fixed
    # drafts of every length on a text the lookup copies, in a scope of its own.
    run(_copying(7), "warm-up", policy="fixed")
    for i in range(3):
        run(a_text(i), a_scope)
    rec.lengths.clear()
    t0 = clock.now
    gen = run(B_PROMPT, "B")
    return (tuple(rec.lengths), tuple(gen.tokens), gen.stats.draft_n,
            gen.stats.draft_n_accepted, round(clock.now - t0, 9))


@pytest.mark.parametrize("kind", ["ngram", "hybrid"])
def test_b_drafts_the_same_whatever_a_sent(monkeypatch, kind: str) -> None:
    after_copying = _b_after_a(monkeypatch, kind, _copying, "A")
    after_junk = _b_after_a(monkeypatch, kind, _junk, "A")
    assert after_copying == after_junk
    assert after_copying[1] == tuple(_plain(B_PROMPT, 30))
    # The control: A in B's scope (one tenant). What A's text taught changes B's rounds,
    # so the comparison above could fail.
    shared_copying = _b_after_a(monkeypatch, kind, _copying, "B")
    shared_junk = _b_after_a(monkeypatch, kind, _junk, "B")
    assert shared_copying[0] != shared_junk[0]
    assert shared_copying[1] == shared_junk[1] == after_copying[1]


def test_each_scope_has_its_own_policy_from_the_priors() -> None:
    """PolicyMemory: one policy per (name, n_max) and scope; scope ""'s is `policies`."""
    memory = PolicyMemory()
    a = memory.policy("adaptive", 8, "A")
    assert isinstance(a, AdaptivePolicy)
    a.observe(4, 0, 0.01, 0.02)
    b = memory.policy("adaptive", 8, "B")
    assert b is not a and b.state == AdaptiveState() and a.state != AdaptiveState()
    assert memory.policy("adaptive", 8, "A") is a
    assert memory.policies == {} and memory.policy("adaptive", 8) is memory.policies[
        ("adaptive", 8)]


def test_a_new_sequence_adopts_only_its_own_scopes_experience() -> None:
    """Engine.policy: a sequence's first policy copies the most experienced sequence's of
    the same scope, never another scope's."""
    engine = Engine(FakeBatch(TARGET, 2), [NgramDrafter(), NgramDrafter()])
    learned = engine.policy(0, "adaptive", 8, "A")
    learned.observe(4, 4, 0.01, 0.02)
    learned.state.asked_rounds = 10
    same = engine.policy(1, "adaptive", 8, "A")
    other = engine.policy(1, "adaptive", 8, "B")
    assert same is not learned and same.state.accepted == learned.state.accepted
    assert other.state.accepted == AdaptiveState().accepted != learned.state.accepted


def test_scoped_keeps_the_most_recently_used_scopes() -> None:
    made = []
    s = Scoped(lambda: made.append(1) or len(made), first=0, limit=3)
    assert s.get("") == 0 and s.get("a") == 1 and s.get("b") == 2
    assert s.get("") == 0                   # used: "a" is now the least recently used
    assert s.get("c") == 3 and s.scopes() == ["b", "", "c"]
    assert s.peek("a") is None and s.get("a") == 4 and len(s) == 3
    assert MAX_SCOPES >= 16
    with pytest.raises(ValueError, match="limit"):
        Scoped(int, limit=0)
