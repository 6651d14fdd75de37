"""The adaptive policy's probes: rarer while they fail, at once frequent again when they pay.

A useless drafter's probes are pure cost (each one verifies a token that is never
kept), so the interval between them doubles per failed probe, up to a bound; a
drafter that turns useful again is found within that bound and drafting resumes.
"""

from __future__ import annotations

import copy

from specwire.policy import AdaptivePolicy, PolicyMemory


def _verify(n: int) -> float:
    return 0.01 * (1 + 0.3 * (n - 1))


def _drive(p: AdaptivePolicy, rounds: int, good: bool) -> list[int]:
    ks = []
    for _ in range(rounds):
        k = p.choose(16)
        p.observe(k, k if good else 0, 0.0001 * k, _verify(k + 1))
        ks.append(k)
    return ks


def test_failed_probes_back_off_to_the_bound() -> None:
    """After the first probes fail, the gaps between them grow, never beyond probe_every x
    probe_backoff_max, and a useless drafter is probed at least 4x less often than
    without the backoff."""
    p = AdaptivePolicy(8)
    ks = _drive(p, 2000, good=False)
    probes = [i for i, k in enumerate(ks) if k and i > 5]    # past the first rounds' drafts
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert all(ks[i] == 1 for i in probes)                  # one-token probes
    assert max(gaps) <= p.probe_every * p.probe_backoff_max
    assert gaps[-1] >= 4 * gaps[0]
    flat = AdaptivePolicy(8, probe_backoff_max=1)
    tail = sum(1 for k in _drive(flat, 2000, good=False)[-1024:] if k)
    assert 4 * sum(1 for k in ks[-1024:] if k) <= tail


def test_a_drafter_that_turns_useful_is_found_within_the_bound() -> None:
    """Backed off as far as it goes, a probe still comes within the bound, its kept token
    resets the interval, and drafting resumes."""
    p = AdaptivePolicy(8)
    _drive(p, 2000, good=False)
    assert p.probe_backoff == p.probe_backoff_max
    ks = _drive(p, p.probe_every * p.probe_backoff_max + 200, good=True)
    assert all(k >= 4 for k in ks[-50:])
    assert p.probe_backoff == 1


def test_probe_interval_carries_across_short_requests() -> None:
    """Requests shorter than the interval still get probes, as many as one long request
    would: the count of rounds since the last probe is the policy's, not the request's."""
    mem = PolicyMemory()
    p = mem.policy("adaptive", 8)
    _drive(p, 2000, good=False)
    one = copy.deepcopy(p)
    rounds = 3 * p.probe_every * p.probe_backoff_max
    asked = 0
    for _ in range(rounds // 32):                           # 32-round requests
        p = mem.policy("adaptive", 8)
        asked += sum(1 for k in _drive(p, 32, good=False) if k)
    assert asked >= 3
    assert abs(asked - sum(1 for k in _drive(one, rounds, good=False) if k)) <= 1


def test_a_drafter_never_kept_gets_no_benefit_of_the_doubt() -> None:
    """Early rounds keep drafting while plain steps look only a little better (the first
    estimates are noisy), but not for a drafter none of whose tokens was ever kept: a
    useless drafter stops after a few rounds, not after `settle` of them."""
    useless = _drive(AdaptivePolicy(8), 12, good=False)
    assert sum(1 for k in useless if k) <= 4
    p = AdaptivePolicy(8)
    p.kept_any = True       # the same rounds after a drafter that was once right
    assert sum(1 for k in _drive(p, 12, good=False) if k) > 4


def _drive_loaded(p: AdaptivePolicy, rounds: int, seed: int) -> int:
    """A useless drafter on a machine whose load comes in bursts (2.5x slower steps for 50
    rounds now and then): how many rounds asked it for a draft."""
    import random
    rng, asked, load = random.Random(seed), 0, 1.0
    for i in range(rounds):
        if i % 50 == 0:
            load = rng.choice([1.0, 1.0, 2.5])
        k = p.choose(16)
        p.observe(k, 0, 0.0001 * k, _verify(k + 1) * load * rng.uniform(0.8, 1.2))
        asked += k > 0
    return asked


def test_bursts_of_load_do_not_restart_a_useless_drafter() -> None:
    """Slow plain steps in a burst flatten the fitted verification curve, and a drafter
    kept a few percent of the time then looks worth a round: drafting resumes from plain
    steps only on a clear (5%) expected gain, so such a drafter is asked only at its
    probes."""
    with_gain = [_drive_loaded(AdaptivePolicy(8), 1000, s) for s in range(6)]
    without = [_drive_loaded(AdaptivePolicy(8, resume_gain=0.0), 1000, s) for s in range(6)]
    assert sum(with_gain) < sum(without)
    assert max(with_gain) <= 24
