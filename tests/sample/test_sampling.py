"""Sampling: llama.cpp's filters, greedy, the keyed generator and the two samplers.

The filters are checked on hand-made rows whose answers differ from the
plausible mistakes (top-p over the whole vocabulary, absolute min-p,
temperature before the filters), and against an independent oracle
(`fakes.reference_probs`) on random rows. The samplers are checked in
distribution with Pearson's chi-square over many seeds (threshold: see
`fakes.chi_square_limit`, false-alarm probability < 5e-6; all seeds are fixed,
so the outcome is deterministic anyway).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from fakes import chi_square, chi_square_limit, reference_probs, tv_distance

from specwire.config import SamplingParams
from specwire.sample import rng, sampling

OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def _params(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **OFF, **kw})


def _logits(probs) -> np.ndarray:
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


# ----------------------------------------------------------------------------- repeat penalty


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    """llama.cpp's rule: a positive logit is divided by the penalty, a negative one multiplied."""
    row = np.array([2.0, -2.0, 1.0, 0.5], dtype=np.float32)
    before = row.copy()
    out = sampling.penalized(row, np.array([0, 1]), 2.0)
    np.testing.assert_allclose(out, [1.0, -4.0, 1.0, 0.5])
    np.testing.assert_array_equal(row, before)          # the backend's buffer is never written


def test_recent_window_is_the_last_n_tokens() -> None:
    """repeat_last_n picks the tail of the history; -1 is all of it; 0 or penalty 1 disable."""
    hist = [5, 6, 7, 8, 9, 5]
    win = sampling.recent_window
    assert win(hist, SamplingParams(repeat_penalty=1.5, repeat_last_n=3)).ids.tolist() == [5, 8, 9]
    every = SamplingParams(repeat_penalty=1.5, repeat_last_n=-1)
    assert win(hist, every).ids.tolist() == [5, 6, 7, 8, 9]
    assert win(hist, every).counts.tolist() == [2, 1, 1, 1, 1]
    assert win(hist, SamplingParams(repeat_penalty=1.5, repeat_last_n=0)).size == 0
    assert win(hist, SamplingParams(repeat_penalty=1.0, repeat_last_n=3)).size == 0


def test_repeat_penalty_changes_the_greedy_choice() -> None:
    """Greedy is the argmax of the penalised logits, not of the raw row."""
    row = np.array([0.0, 3.0, 2.0, -1.0], dtype=np.float32)
    p = SamplingParams(temperature=0.0, repeat_penalty=2.0, repeat_last_n=4)
    assert sampling.greedy(row, p) == 1
    assert sampling.greedy(row, p, sampling.recent_window([1, 3], p)) == 2   # 3 / 2 < 2
    assert sampling.coupled(row, p, 9, sampling.recent_window([1, 3], p)) == 2


# ------------------------------------------------------------------------------------ filters

PROBS = [0.5, 0.3, 0.15, 0.05]


def _kept(row: np.ndarray, **kw) -> list[int]:
    return sampling.candidates(row, _params(**kw)).ids.tolist()


def test_top_k_keeps_the_k_largest_in_descending_order() -> None:
    """top-k keeps exactly the k highest logits, sorted; 0 keeps everything."""
    row = np.array([0.1, 2.0, -1.0, 1.5, 0.7], dtype=np.float32)
    assert _kept(row, top_k=2) == [1, 3]
    assert _kept(row, top_k=3) == [1, 3, 4]
    assert _kept(row, top_k=0) == [1, 3, 4, 0, 2]


@pytest.mark.parametrize(("top_p", "n"), [(0.45, 1), (0.55, 2), (0.75, 2), (0.85, 3), (0.97, 4)])
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, n: int) -> None:
    """top-p keeps the fewest most-likely tokens whose cumulative probability is >= p."""
    assert _kept(_logits(PROBS), top_p=top_p) == list(range(n))


def test_top_p_is_computed_over_the_top_k_survivors() -> None:
    """After top-k=2 the probabilities renormalise to (0.625, 0.375): p=0.6 keeps one token.

    Over the whole vocabulary 0.5 < 0.6 would keep two, so this tells the orders apart.
    """
    row = _logits(PROBS)
    assert _kept(row, top_k=2, top_p=0.6) == [0]
    assert _kept(row, top_p=0.6) == [0, 1]


def test_min_p_is_relative_to_the_most_likely_token() -> None:
    """min-p 0.25 keeps p >= 0.25 * 0.5 = 0.125: three tokens (an absolute 0.25 would keep two)."""
    assert _kept(_logits(PROBS), min_p=0.25) == [0, 1, 2]
    assert _kept(_logits(PROBS), min_p=0.7) == [0]


def test_temperature_is_applied_after_the_filters() -> None:
    """The filters see temperature-1 probabilities; survivors are then scaled by 1/T.

    At T=5 the distribution is much flatter; were the filters applied after the
    temperature, top-p 0.75 would keep more than two tokens.
    """
    row = _logits(PROBS)
    for t in (0.3, 1.0, 5.0):
        c = sampling.candidates(row, _params(temperature=t, top_p=0.75))
        assert c.ids.tolist() == [0, 1]
        np.testing.assert_allclose(c.scaled, row[:2].astype(np.float64) / t, rtol=1e-12)
        e = np.exp(row[:2] / t)
        np.testing.assert_allclose(c.probs(), e / e.sum(), rtol=1e-6)


CASES = [
    {},
    {"top_k": 5},
    {"top_p": 0.8},
    {"min_p": 0.1},
    {"top_k": 8, "top_p": 0.9, "min_p": 0.05, "temperature": 0.8},
    {"top_k": 3, "temperature": 1.7},
    {"top_p": 0.5, "min_p": 0.3, "temperature": 0.5},
    {"repeat_penalty": 1.3, "repeat_last_n": 4, "top_k": 6},
    {"repeat_penalty": 0.7, "repeat_last_n": -1, "top_p": 0.9},
]


@pytest.mark.parametrize("kw", CASES)
def test_candidates_match_the_reference_chain(kw: dict) -> None:
    """On 60 random rows per setting, candidates() keeps the oracle's tokens and probabilities."""
    gen = np.random.default_rng(11)
    params = _params(**kw)
    for _ in range(60):
        row = (gen.normal(size=24) * gen.uniform(0.5, 3.0)).astype(np.float32)
        hist = gen.integers(0, 24, size=7).tolist()
        ref = reference_probs(row, params, hist)
        c = sampling.candidates(row, params, sampling.recent_window(hist, params))
        assert sorted(c.ids.tolist()) == sorted(np.flatnonzero(ref).tolist())
        assert np.all(np.diff(c.scaled) <= 0)                   # descending order
        np.testing.assert_allclose(c.probs(), ref[c.ids], rtol=1e-6, atol=1e-12)


def test_greedy_is_the_argmax_and_coupled_is_greedy_at_temperature_zero() -> None:
    """T=0 means argmax, whatever the seed and position."""
    gen = np.random.default_rng(3)
    for seed in range(20):
        row = gen.normal(size=30).astype(np.float32)
        p = SamplingParams(temperature=0.0, seed=seed)
        assert sampling.greedy(row, p) == int(np.argmax(row))
        assert sampling.coupled(row, p, seed * 7) == int(np.argmax(row))


def test_top_prob_is_the_largest_softmax_probability() -> None:
    """top_prob (for --draft-p-min) is max softmax at temperature 1 over <= 10 candidates."""
    row = _logits(PROBS) + np.float32(3.0)
    assert sampling.top_prob(row) == pytest.approx(0.5, rel=1e-6)


def test_top_prob_counts_only_the_top_ten_like_llama_cpp() -> None:
    """llama.cpp's draft sampler keeps 10 candidates before comparing with p_min."""
    probs = np.array([0.4] + [0.05] * 9 + [0.01] * 10)          # 20 tokens
    row = _logits(probs / probs.sum())
    assert sampling.top_prob(row) == pytest.approx(0.4 / (0.4 + 9 * 0.05), rel=1e-5)


# ---------------------------------------------------------------------------------------- rng


def test_rng_same_key_same_value_and_every_key_part_matters() -> None:
    """Keyed uniforms: equal keys give equal numbers; changing any part changes them."""
    toks = np.arange(64)
    base = rng.uniform(7, rng.GUMBEL, 100, toks)
    np.testing.assert_array_equal(base, rng.uniform(7, rng.GUMBEL, 100, toks.copy()))
    assert rng.uniform(7, rng.GUMBEL, 100, toks[10:11])[0] == base[10]    # batch-independent
    for other in (rng.uniform(8, rng.GUMBEL, 100, toks), rng.uniform(7, rng.DRAFT, 100, toks),
                  rng.uniform(7, rng.GUMBEL, 101, toks)):
        assert not np.any(other == base)
    assert len(set(base.tolist())) == 64                                  # token matters
    assert rng.scalar(7, rng.ACCEPT, 5) == rng.scalar(7, rng.ACCEPT, 5)
    assert rng.scalar(7, rng.ACCEPT, 5) != rng.scalar(7, rng.RESIDUAL, 5)


def test_uniforms_lie_in_the_open_interval_and_look_uniform() -> None:
    """200k draws: all in (0, 1); mean 1/2 and variance 1/12 within 6 standard errors;
    deciles within chi-square bounds; neighbouring domains uncorrelated."""
    n = 200_000
    u = rng.uniform(1, rng.GUMBEL, 3, np.arange(n))
    assert u.min() > 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 6 * math.sqrt(1 / 12 / n)
    assert abs(u.var() - 1 / 12) < 6 * math.sqrt(1 / 180 / n)
    stat, df = chi_square(np.histogram(u, bins=10, range=(0, 1))[0], np.full(10, 0.1))
    assert stat < chi_square_limit(df)
    v = rng.uniform(1, rng.ACCEPT, 3, np.arange(n))
    assert abs(np.corrcoef(u, v)[0, 1]) < 6 / math.sqrt(n)


_MASK = (1 << 64) - 1
_G, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _unshift(y: int, s: int) -> int:
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x


def _unmix(y: int) -> int:
    y = (_unshift(y, 31) * pow(_M2, -1, 1 << 64)) & _MASK
    y = (_unshift(y, 27) * pow(_M1, -1, 1 << 64)) & _MASK
    return _unshift(y, 30)


def test_uniform_is_below_one_even_for_the_all_ones_draw() -> None:
    """A legal seed whose (GUMBEL, position 0, token 0) draw is all ones must still give u < 1.

    The mixer is a bijection, so such a seed exists; it is found by inverting it.
    (53 bits + 0.5 rounds up to 2**53 in float64: u == 1.0, Gumbel noise +inf.)
    """
    assert all(_mix(_unmix(x)) == x for x in (0, 1, 12345, _MASK, 0xDEADBEEF << 20))
    head = _unmix(_MASK) ^ _G                       # token 0: key part 0 * G + G
    head0 = _unmix(head)                            # position 0: xor with 0
    seed = ((_unmix(head0) - rng.GUMBEL) * pow(_G, -1, 1 << 64)) & _MASK
    SamplingParams(seed=seed)                       # a seed the settings accept
    u = rng.uniform(seed, rng.GUMBEL, 0, np.zeros(1, dtype=np.int64))[0]
    assert u > 0.999999
    assert u < 1.0
    assert np.isfinite(rng.gumbel(seed, rng.GUMBEL, 0, np.zeros(1, dtype=np.int64))).all()


def test_gumbel_noise_has_the_euler_gamma_mean() -> None:
    """Standard Gumbel: mean 0.5772 (Euler's gamma), variance pi^2/6.

    200k draws: the standard error of the mean is sqrt(1.645 / 2e5) = 0.0029;
    the tolerance 0.015 is five of them.
    """
    g = rng.gumbel(5, rng.GUMBEL, 17, np.arange(200_000))
    assert abs(g.mean() - 0.5772156649) < 0.015
    assert abs(g.var() - math.pi ** 2 / 6) < 0.05


# ---------------------------------------------------------------------------------- samplers

N_SEEDS = 6_000
N_SPARSE = 6_000
ROW = np.array([2.0, 1.6, 1.1, 0.9, 0.2, -0.5, -1.0, -3.0, 0.5, 1.3], dtype=np.float32)
FILTERED = _params(temperature=0.8, top_k=7, top_p=0.95, min_p=0.05)


def test_coupled_sample_is_distributed_as_the_filtered_softmax() -> None:
    """Over 6k seeds the Gumbel-max token follows the filtered, tempered softmax exactly
    (chi-square), never picks a filtered-out token, and TV < 0.03 (for an exact sampler
    the TV averages 0.012 at this size and exceeds 0.028 with probability < 1e-4)."""
    p = reference_probs(ROW, FILTERED)
    counts = np.zeros(ROW.shape[0])
    for s in range(N_SEEDS):
        counts[sampling.coupled(ROW, replace(FILTERED, seed=s), 42)] += 1
    stat, df = chi_square(counts, p)
    assert stat < chi_square_limit(df)
    assert tv_distance(counts / N_SEEDS, p) < 0.03


def test_coupled_sample_is_reproducible_and_keyed_by_seed_and_position() -> None:
    """Same (seed, position, row) -> same token; another position or seed, another draw."""
    p = replace(FILTERED, seed=9)
    a = [sampling.coupled(ROW, p, pos) for pos in range(200)]
    assert a == [sampling.coupled(ROW.copy(), p, pos) for pos in range(200)]
    assert len(set(a)) > 3
    b = [sampling.coupled(ROW, replace(FILTERED, seed=10), pos) for pos in range(200)]
    assert a != b


def test_gumbel_coupling_agrees_as_often_as_theory_says() -> None:
    """Two different rows sampled with shared noise pick the same token with probability
    sum_x 1 / sum_y max(p_y / p_x, q_y / q_x) (the P-MinHash collision rate).

    4000 seeds: standard error about 0.007; tolerance 0.03."""
    params = _params(temperature=1.0)
    other = (ROW + np.array([0.5, -0.4, 0.3, 0.0, 0.6, 0, 0, 0, -0.8, 0.2])).astype(np.float32)
    p, q = reference_probs(ROW, params), reference_probs(other, params)
    both = np.flatnonzero((p > 0) & (q > 0))
    exact = sum(1.0 / np.maximum(p / p[x], q / q[x]).sum() for x in both)
    n = 4000
    agree = sum(sampling.coupled(ROW, _params(temperature=1.0, seed=s), 3)
                == sampling.coupled(other, _params(temperature=1.0, seed=s), 3) for s in range(n))
    assert agree / n == pytest.approx(exact, abs=0.03)
    assert exact > 0.6
    assert tv_distance(p, q) > 0.1                    # the rows do differ


@pytest.mark.slow
def test_sparse_draft_is_distributed_as_its_q() -> None:
    """q is the draft's filtered distribution cut to its top K and renormalised;
    the drafted token follows q (chi-square over 6k seeds) and is one of q's ids."""
    k = 4
    ref = reference_probs(ROW, FILTERED)
    top = np.argsort(-ref, kind="stable")[:k]
    q_ref = np.zeros_like(ref)
    q_ref[top] = ref[top] / ref[top].sum()
    first = sampling.sparse_draft(ROW, FILTERED, k, 0)
    np.testing.assert_array_equal(first.ids, top)
    np.testing.assert_allclose(first.probs, q_ref[top], rtol=1e-6)
    assert first.probs.dtype == np.float32
    assert first.probs.sum(dtype=np.float64) == pytest.approx(1.0)
    counts = np.zeros(ROW.shape[0])
    for s in range(N_SPARSE):
        d = sampling.sparse_draft(ROW, replace(FILTERED, seed=s), k, 5)
        assert d.token in d.ids
        counts[d.token] += 1
    stat, df = chi_square(counts, q_ref)
    assert stat < chi_square_limit(df)


@pytest.mark.slow
def test_sparse_draft_noise_is_independent_of_the_targets() -> None:
    """Rejection mode must not share noise: with the same row, the draft token and the
    target's coupled sample agree at rate sum_x p_x q_x (independent), not ~1 (shared).

    4000 seeds: the rate's standard error is about 0.0065; tolerance 0.03."""
    k = ROW.shape[0]
    p = reference_probs(ROW, FILTERED)
    n = 4000
    agree = 0
    for s in range(n):
        sp = replace(FILTERED, seed=s)
        agree += sampling.sparse_draft(ROW, sp, k, 8).token == sampling.coupled(ROW, sp, 8)
    assert agree / n == pytest.approx(float((p * p).sum()), abs=0.03)


def test_top_ids_is_the_exact_top_k_lowest_id_first_among_ties() -> None:
    """The fast top-k (a comparison near the best, then a partition of the few) against
    a full sort, on rows with ties, -inf and all-but-one masked tokens."""
    rng = np.random.default_rng(0)
    for trial in range(2000):
        v = int(rng.integers(1, 400))
        kind = trial % 4
        if kind == 0:
            row = (rng.normal(size=v) * rng.uniform(0.1, 60)).astype(np.float32)
        elif kind == 1:
            row = rng.integers(-3, 3, size=v).astype(np.float32)
        elif kind == 2:
            row = rng.normal(size=v).astype(np.float32)
            row[rng.random(v) < 0.5] = -np.inf
        else:
            row = np.full(v, -np.inf, dtype=np.float32)
            row[rng.random(v) < 0.05] = rng.normal()
        k = int(rng.integers(1, 15))
        ref = np.lexsort((np.arange(v), -row))[: min(k, v)]
        assert np.array_equal(sampling.top_ids(row, k), ref), (row, k)
    assert sampling.top_ids(np.zeros(3, dtype=np.float32), 0).size == 0


def test_top_prob_matches_the_partition_it_replaces() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        row = (rng.normal(size=5000) * 4).astype(np.float32)
        top = np.partition(row, -10)[-10:].astype(np.float64)
        assert abs(sampling.top_prob(row) - 1.0 / np.exp(top - top.max()).sum()) < 1e-12
