"""Verification is lossless: what a round emits is distributed as the target's p.

* greedy: the kept prefix is the longest one equal to the argmax, then the
  target's argmax (recovered or bonus token); checked against the definition.
* coupled: the emitted tokens are the target's own keyed samples whatever the
  draft (checked token for token), hence distributed as p (checked by Monte
  Carlo over seeds).
* rejection (Leviathan/Chen with sparse q): the first emitted token's
  distribution is computed from the verifier's own code with the accept and
  residual uniforms driven over a midpoint grid of m points (every draft token,
  weighted by q): exact up to the grid's resolution, a total-variation error of
  at most (1 + n/2)/m for n possible outputs. Then Monte Carlo with the real
  keyed generator, one round and three-token sequences through the engine.
* an always-accept verifier fails the same checks: its TV distance is large.

Monte Carlo thresholds: Pearson's chi-square below `fakes.chi_square_limit`
(false alarm < 5e-6) and a TV bound stated at each test; all seeds are fixed.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from fakes import (
    AlwaysAcceptVerifier,
    FakeBackend,
    FakeModel,
    chi_square,
    chi_square_limit,
    reference_probs,
    tv_distance,
)

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.model import ModelDrafter
from specwire.engine import engine as engine_mod
from specwire.engine.engine import Engine, Request
from specwire.sample import rng, sampling
from specwire.sample.sampling import SparseDraft
from specwire.sample.verify import Outcome, Verifier

V = 10
P_ROW = np.array([2.0, 1.6, 1.1, 0.9, 0.2, -0.5, -1.0, -3.0, 0.5, 1.3], dtype=np.float32)
P_NEXT = np.array([0.3, -1.0, 2.2, 0.0, 1.9, 0.4, 1.0, -2.0, 0.8, -0.3], dtype=np.float32)
#: The draft's view: it prefers tokens the target ranks low, one the target's top-6 drops (5).
Q_ROW = np.array([0.4, 1.9, -0.2, 0.7, 1.5, 2.3, -1.5, -2.5, 0.1, 0.2], dtype=np.float32)
#: A draft over-confident in the target's favourite: q(0) = 0.57 > p(0) = 0.34 with
#: p(0)/q(0) > q(0), so sharing the draft's uniform with the accept draw visibly biases.
Q_SHARP = P_ROW + np.array([0.8, 0, 0.6, 0, 0, 0, 0, 0, 0, 0], dtype=np.float32)
PARAMS = SamplingParams(temperature=0.9, top_k=6, top_p=0.97, min_p=0.02, seed=0)
HISTORY = [3, 1, 4, 1, 5]
ROWS = np.stack([P_ROW, P_NEXT])


def _rows(*rows: np.ndarray) -> np.ndarray:
    return np.stack([np.asarray(r, dtype=np.float32) for r in rows])


# ------------------------------------------------------------------------------------ greedy

GREEDY = SamplingParams(temperature=0.0)


def _onehot_rows(argmaxes: list[int]) -> np.ndarray:
    rows = np.zeros((len(argmaxes), V), dtype=np.float32)
    for i, a in enumerate(argmaxes):
        rows[i, a] = 5.0
        rows[i, (a + 1) % V] = 4.0
    return rows


@pytest.mark.parametrize(("argmaxes", "draft", "verdict"), [
    ([4, 7, 2, 9], [4, 7, 1], Outcome(2, 2)),      # mismatch at 2: recovered = argmax
    ([4, 7, 2, 9], [5, 7, 2], Outcome(0, 4)),      # first token wrong: nothing kept
    ([4, 7, 2, 9], [4, 7, 2], Outcome(3, 9)),      # all kept: bonus from the last row
    ([6], [], Outcome(0, 6)),                       # empty draft: a plain step
])
def test_greedy_keeps_the_longest_argmax_prefix(argmaxes, draft, verdict) -> None:
    """Greedy: kept = longest prefix equal to the argmaxes; then the target's argmax."""
    assert Verifier(GREEDY, VerifyMode.GREEDY).verify(_onehot_rows(argmaxes), [1], draft) == verdict


def test_greedy_matches_its_definition_on_random_rows() -> None:
    """500 random rounds (draft tokens agreeing with the argmax 60% of the time) against
    a plain loop; rejection mode at T=0 is greedy as well."""
    gen = np.random.default_rng(0)
    for _ in range(500):
        k = int(gen.integers(0, 6))
        rows = gen.normal(size=(k + 1, V)).astype(np.float32)
        best = rows.argmax(axis=1)
        draft = [int(best[i]) if gen.random() < 0.6 else int(gen.integers(V)) for i in range(k)]
        n = 0
        while n < k and draft[n] == best[n]:
            n += 1
        want = Outcome(n, int(best[n]))
        assert Verifier(GREEDY, VerifyMode.COUPLED).verify(rows, [0], draft) == want
        assert Verifier(GREEDY, VerifyMode.REJECTION).verify(rows, [0], draft) == want


def test_verify_penalises_repeats_of_the_drafted_tokens() -> None:
    """Row i sees draft[:i] as recent history: the repeat penalty must count drafted tokens.

    Row 1's raw argmax is token 2, which was just drafted; penalised (3.0 / 4 < 2.5),
    token 3 wins, exactly as in plain decoding where token 2 would be history.
    """
    p = SamplingParams(temperature=0.0, repeat_penalty=4.0, repeat_last_n=8)
    rows = _rows([0, 0, 5, 0, 0, 0, 0, 0, 0, 0], [0, 0, 3.0, 2.5, 0, 0, 0, 0, 0, 0],
                 [0] * V)
    assert Verifier(p, VerifyMode.GREEDY).verify(rows, [7], [2, 2]) == Outcome(1, 3)


# ----------------------------------------------------------------------------------- coupled


def test_coupled_emits_the_targets_own_samples_whatever_the_draft() -> None:
    """The kept prefix plus the verdict token equal the target's plain keyed samples at those
    positions, for random drafts (the tokens the target would sample, or noise)."""
    gen = np.random.default_rng(1)
    for s in range(300):
        p = replace(PARAMS, seed=s, repeat_penalty=1.2, repeat_last_n=6)
        ver = Verifier(p, VerifyMode.COUPLED)
        k = int(gen.integers(0, 5))
        rows = (gen.normal(size=(k + 1, V)) * 1.5).astype(np.float32)
        own, ctx = [], list(HISTORY)
        for i in range(k + 1):
            own.append(ver.sample(rows[i], ctx))
            ctx.append(own[-1])
        draft = [own[i] if gen.random() < 0.7 else int(gen.integers(V)) for i in range(k)]
        v = ver.verify(rows, HISTORY, draft)
        emitted = [*draft[:v.accepted], v.token]
        assert emitted == own[:len(emitted)]
        assert v.accepted == k or draft[v.accepted] != own[v.accepted]


def _one_round(verifier: Verifier, draft_token: int, sparse=None) -> int:
    v = verifier.verify(ROWS, HISTORY, [draft_token], sparse)
    return draft_token if v.accepted else v.token


N_ROUND = 3000
N_BROKEN = 1000


def _coupled_counts(verifier_cls, n: int) -> np.ndarray:
    counts = np.zeros(V)
    pos = len(HISTORY)
    for s in range(n):
        p = replace(PARAMS, seed=s)
        d = sampling.coupled(Q_ROW, p, pos)          # the draft samples with the shared noise
        counts[_one_round(verifier_cls(p, VerifyMode.COUPLED), d)] += 1
    return counts


def test_coupled_round_is_distributed_as_the_target() -> None:
    """First emitted token over 3000 seeds, draft sampled with the shared noise:
    chi-square passes and TV < 0.05 (for exact samples of p the TV averages 0.015
    at this size and exceeds 0.042 with probability < 1e-4)."""
    p = reference_probs(P_ROW, PARAMS, HISTORY)
    counts = _coupled_counts(Verifier, N_ROUND)
    stat, df = chi_square(counts, p)
    assert stat < chi_square_limit(df)
    assert tv_distance(counts / N_ROUND, p) < 0.05


def test_always_accept_fails_the_coupled_round_test() -> None:
    """The broken verifier emits the draft's sample: TV to p is far beyond the bound."""
    p = reference_probs(P_ROW, PARAMS, HISTORY)
    counts = _coupled_counts(AlwaysAcceptVerifier, N_BROKEN)
    assert tv_distance(counts / N_BROKEN, p) > 0.3
    assert chi_square(counts, p)[0] > 100 * chi_square_limit(5)


# --------------------------------------------------------------------------------- rejection


GRID = 500


def _grid_distribution(verifier: Verifier, rows: np.ndarray, q_ids: np.ndarray,
                       q_probs: np.ndarray, monkeypatch, m: int = GRID) -> np.ndarray:
    """P(first emitted token = x), from the verifier's own decisions.

    For each draft token d (weight q(d)): A_d = share of the m accept uniforms
    for which d is kept; R_d = the distribution of the recovered token over m
    residual uniforms with d rejected. P = sum_d q(d) (A_d [x = d] + (1 - A_d) R_d).
    """
    u: dict[int, float] = {}
    monkeypatch.setattr(rng, "scalar", lambda seed, domain, position: u[domain])
    grid = (np.arange(m) + 0.5) / m
    out = np.zeros(V)
    for d, qd in zip(q_ids.tolist(), q_probs.astype(np.float64).tolist(), strict=True):
        sd = [SparseDraft(d, q_ids, q_probs)]
        u[rng.RESIDUAL] = 0.5
        kept = 0
        for a in grid:
            u[rng.ACCEPT] = a
            kept += verifier.verify(rows, HISTORY, [d], sd).accepted
        share = kept / m
        out[d] += qd * share
        if share < 1.0:
            u[rng.ACCEPT] = 1.0 - 2.0 ** -53
            for r in grid:
                u[rng.RESIDUAL] = r
                v = verifier.verify(rows, HISTORY, [d], sd)
                assert v.accepted == 0
                out[v.token] += qd * (1.0 - share) / m
    return out


def _sparse_q(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    sd = sampling.sparse_draft(row, PARAMS, k, len(HISTORY))
    return sd.ids, sd.probs


def _q_cases() -> list[tuple[str, np.ndarray, np.ndarray]]:
    point = np.array([2]), np.array([1.0], dtype=np.float32)
    return [
        ("other model, K=3, one token outside p", *_sparse_q(Q_ROW, 3)),
        ("point mass on a token", *point),
        ("same model, K=all (q == p)", *_sparse_q(P_ROW, 10)),
        ("same model, K=2", *_sparse_q(P_ROW, 2)),
    ]


@pytest.mark.parametrize("case", range(4))
def test_rejection_round_is_exactly_the_target(case: int, monkeypatch) -> None:
    """Exact (grid) distribution of the first emitted token equals p within (2 + V/2)/m."""
    name, q_ids, q_probs = _q_cases()[case]
    p = reference_probs(P_ROW, PARAMS, HISTORY)
    got = _grid_distribution(Verifier(PARAMS, VerifyMode.REJECTION), ROWS, q_ids, q_probs,
                             monkeypatch)
    assert got.sum() == pytest.approx(1.0, abs=1e-6), name    # q is float32
    assert tv_distance(got, p) < (2 + V / 2) / GRID, name
    assert np.all(got[p == 0] < 1e-12), name     # filtered-out tokens are never emitted


def test_the_grid_check_catches_the_always_accept_verifier(monkeypatch) -> None:
    """The same computation with the broken verifier yields q, far from p, in the cases
    where q differs from p (the first two)."""
    p = reference_probs(P_ROW, PARAMS, HISTORY)
    assert 5 in _q_cases()[0][1] and p[5] == 0.0      # the case does exercise p(x) = 0
    for _, q_ids, q_probs in _q_cases()[:2]:
        got = _grid_distribution(AlwaysAcceptVerifier(PARAMS, VerifyMode.REJECTION), ROWS,
                                 q_ids, q_probs, monkeypatch)
        assert tv_distance(got, p) > 0.15


def test_rejection_needs_the_sparse_q() -> None:
    """Without q for every draft token rejection mode cannot be lossless: refused."""
    ver = Verifier(PARAMS, VerifyMode.REJECTION)
    with pytest.raises(ValueError, match="sparse"):
        ver.verify(ROWS, HISTORY, [1])
    assert ver.verify(ROWS[:1], HISTORY, []).accepted == 0     # an empty draft is a plain step


def test_rejection_refuses_a_token_its_q_could_not_draw() -> None:
    """A draft token outside q's support (q(x) = 0) is rejected, whatever the uniforms."""
    sd = [SparseDraft(0, np.array([1, 2]), np.array([0.5, 0.5], dtype=np.float32))]
    for s in range(50):
        ver = Verifier(replace(PARAMS, seed=s), VerifyMode.REJECTION)
        assert ver.verify(ROWS, HISTORY, [0], sd).accepted == 0    # p(0) = 0.34 > 0


def _rejection_counts(verifier_cls, q_row: np.ndarray, k_q: int, n: int) -> np.ndarray:
    counts = np.zeros(V)
    pos = len(HISTORY)
    for s in range(n):
        p = replace(PARAMS, seed=s)
        sd = sampling.sparse_draft(q_row, p, k_q, pos)      # the draft's own stream
        counts[_one_round(verifier_cls(p, VerifyMode.REJECTION), sd.token, [sd])] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize(("q_row", "k_q"), [(Q_ROW, 3), (Q_SHARP, 4)])
def test_rejection_round_with_the_keyed_generator_is_the_target(q_row, k_q: int) -> None:
    """Monte Carlo with the real streams (draft DRAFT, accept ACCEPT, residual RESIDUAL):
    3000 seeds, chi-square passes, TV < 0.05 (as above). With Q_SHARP, a draft draw that
    reused the accept uniform would be off by TV 0.27; the always-accept verifier too."""
    p = reference_probs(P_ROW, PARAMS, HISTORY)
    counts = _rejection_counts(Verifier, q_row, k_q, N_ROUND)
    stat, df = chi_square(counts, p)
    assert stat < chi_square_limit(df)
    assert tv_distance(counts / N_ROUND, p) < 0.05
    broken = _rejection_counts(AlwaysAcceptVerifier, q_row, k_q, N_BROKEN)
    assert tv_distance(broken / N_BROKEN, p) > 0.2


# ------------------------------------------------------------------- sequences in the engine

N_SEQ = 2000
SEQ_PARAMS = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
TARGET = FakeModel(n_vocab=16, seed=21, sharp=0.8)
DRAFT = TARGET.perturbed(1.0, seed=22)
PROMPT = [2, 7, 1]


def _exact_sequences() -> dict[tuple[int, int, int], float]:
    """p(t1) p(t2 | t1) p(t3 | t1 t2) from the fake model, enumerated."""
    out = {}
    p1 = reference_probs(TARGET.row(PROMPT), SEQ_PARAMS)
    for a in np.flatnonzero(p1):
        p2 = reference_probs(TARGET.row([*PROMPT, a]), SEQ_PARAMS)
        for b in np.flatnonzero(p2):
            p3 = reference_probs(TARGET.row([*PROMPT, a, b]), SEQ_PARAMS)
            for c in np.flatnonzero(p3):
                out[(int(a), int(b), int(c))] = float(p1[a] * p2[b] * p3[c])
    return out


def _engine_sequences(mode: VerifyMode, n: int) -> tuple[dict[tuple[int, ...], int], int]:
    """n_predict=3: a plain first token, then a round with a 1-token draft (recovered or
    kept + bonus), then possibly a plain step: the tokens after the first go through verify."""
    counts: dict[tuple[int, ...], int] = {}
    drafted = 0
    dp = DraftParams(n_max=4, p_min=0.0, mode=mode, top_k_q=2)
    for s in range(n):
        eng = Engine(FakeBackend(TARGET), ModelDrafter(FakeBackend(DRAFT)))
        gen = eng.generate(Request(PROMPT, 3, replace(SEQ_PARAMS, seed=s), dp))
        toks = tuple(gen.run())
        counts[toks] = counts.get(toks, 0) + 1
        drafted += gen.stats.draft_n
    return counts, drafted


def _compare(counts: dict, exact: dict) -> tuple[float, float, int]:
    keys = sorted(set(exact) | set(counts))
    c = np.array([counts.get(k, 0) for k in keys], dtype=float)
    p = np.array([exact.get(k, 0.0) for k in keys])
    stat, df = chi_square(c, p)
    return tv_distance(c / c.sum(), p), stat, df


@pytest.mark.slow
@pytest.mark.parametrize("mode", [VerifyMode.COUPLED, VerifyMode.REJECTION])
def test_engine_three_token_sequences_follow_the_target(mode: VerifyMode) -> None:
    """Joint law of (t1, t2, t3) over 2000 seeds vs the enumerated target (27 outcomes):
    chi-square passes and TV < 0.075 (for exact samples the TV averages 0.041 at this
    size and exceeds 0.07 with probability < 1e-4)."""
    exact = _exact_sequences()
    assert len(exact) == 27
    counts, drafted = _engine_sequences(mode, N_SEQ)
    assert drafted >= N_SEQ                      # every run did verify a draft
    tv, stat, df = _compare(counts, exact)
    assert stat < chi_square_limit(df)
    assert tv < 0.075


@pytest.mark.parametrize("mode", [VerifyMode.COUPLED, VerifyMode.REJECTION])
def test_engine_with_always_accept_fails_the_sequence_test(mode: VerifyMode, monkeypatch) -> None:
    """The engine driven by the always-accept verifier emits the draft's sequences: the
    same statistics are far beyond their bounds (600 seeds suffice)."""
    monkeypatch.setattr(engine_mod, "Verifier", AlwaysAcceptVerifier)
    counts, _ = _engine_sequences(mode, 600)
    tv, stat, df = _compare(counts, _exact_sequences())
    assert tv > 0.15
    assert stat > 10 * chi_square_limit(df)
