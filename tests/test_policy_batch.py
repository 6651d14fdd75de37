"""The adaptive policy in a batch: it drafts where drafting pays at the batch's size.

A simulated machine whose decode costs a fixed part plus a part per token in the
batch: alone, a good drafter's tokens are nearly free to verify and drafting pays;
beside 31 other tokens, the same draft's tokens cost the whole batch's time and the
others' tokens already fill the step, so plain steps win.
"""

from __future__ import annotations

import numpy as np

from specwire.policy import AdaptivePolicy


def simulate(policy: AdaptivePolicy, batches: list[int], rounds: int, seed: int = 0) -> dict:
    rs = np.random.default_rng(seed)
    chosen: dict[int, list[int]] = {b: [] for b in set(batches)}
    for i in range(rounds):
        b = batches[i % len(batches)]
        k = policy.choose(8, batch_tokens=b)
        accepted = 0
        while accepted < k and rs.random() < 0.8:
            accepted += 1
        policy.observe(k, accepted, 0.002 + 0.02 * k if k else 0.0, 0.1 + 0.01 * (k + b))
        chosen[b].append(k)
    return chosen


def test_drafts_alone_and_not_beside_a_full_batch() -> None:
    chosen = simulate(AdaptivePolicy(8), [0, 31], 600)
    alone, full = chosen[0][-100:], chosen[31][-100:]
    assert min(alone) > 0, alone
    assert sum(k == 0 for k in full) >= 80, full          # probes aside, plain steps
    assert np.mean(full) < np.mean(alone)


def test_alone_the_batch_keyword_changes_nothing() -> None:
    a, b = AdaptivePolicy(8), AdaptivePolicy(8)
    for _ in range(50):
        ka, kb = a.choose(8), b.choose(8, batch_tokens=0)
        assert ka == kb
        for p, k in ((a, ka), (b, kb)):
            p.observe(k, min(k, 2), 0.01 * k, 0.1 + 0.01 * k)
