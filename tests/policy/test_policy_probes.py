"""The adaptive policy's probes: rarer while they fail, at once frequent again when they pay.

A useless drafter's probes are pure cost (each one verifies a token that is never
kept), so the interval between them doubles per failed probe, up to a bound; a
drafter that turns useful again is found within that bound and drafting resumes.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from specwire.policy.adaptive import AdaptiveParams, AdaptivePolicy, AdaptiveState, PolicyMemory


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
    assert all(ks[i] == 1 for i in probes[1:])              # one-token probes
    assert max(gaps) <= p.params.probe_every * p.params.probe_backoff_max
    assert gaps[-1] >= 4 * gaps[0]
    flat = AdaptivePolicy(8, AdaptiveParams(probe_backoff_max=1))
    tail = sum(1 for k in _drive(flat, 2000, good=False)[-1024:] if k)
    assert 4 * sum(1 for k in ks[-1024:] if k) <= tail


def test_a_drafter_that_turns_useful_is_found_within_the_bound() -> None:
    """Backed off as far as it goes, a probe still comes within the bound, its kept token
    resets the interval, and drafting resumes."""
    p = AdaptivePolicy(8)
    _drive(p, 2000, good=False)
    assert p.state.probe_backoff == p.params.probe_backoff_max
    ks = _drive(p, p.params.probe_every * p.params.probe_backoff_max + 200, good=True)
    assert all(k >= 4 for k in ks[-50:])
    assert p.state.probe_backoff == 1


def test_probe_interval_carries_across_short_requests() -> None:
    """Requests shorter than the interval still get probes, as many as one long request
    would: the count of rounds since the last probe is the policy's, not the request's."""
    mem = PolicyMemory()
    p = mem.policy("adaptive", 8)
    _drive(p, 2000, good=False)
    one = copy.deepcopy(p)
    rounds = 3 * p.params.probe_every * p.params.probe_backoff_max
    asked = 0
    for _ in range(rounds // 32):                           # 32-round requests
        p = mem.policy("adaptive", 8)
        asked += sum(1 for k in _drive(p, 32, good=False) if k)
    assert asked >= 3
    assert abs(asked - sum(1 for k in _drive(one, rounds, good=False) if k)) <= 1


def _serve(pols: list[PolicyMemory], requests: int, prompt: int, n: int, accept: float,
           step: tuple[float, float], catch: float, per_token: float,
           seed: int = 0) -> tuple[float, float, int]:
    """Sequences decoding in shared steps, each running n-token requests back to back on a
    machine with these costs: a step, fixed + per token in it; a draft model that evaluates
    `catch` seconds per token it catches up with (the prompt, and every plain step since it
    was last asked) and `per_token` per drafted token; tokens kept with probability
    `accept`. Returns (tokens/s over plain decoding's, share of the time spent drafting,
    draft rounds)."""
    rs = np.random.default_rng(seed)
    n_seq = len(pols)
    live = [mem.policy("adaptive", 8) for mem in pols]
    for p in live:
        p.behind(prompt)
    done, lag = [0] * n_seq, [prompt] * n_seq
    finished = [0] * n_seq
    wall = drafting = 0.0
    tokens = rounds = 0
    while min(finished) < requests:
        ks = [p.choose(max(0, n - d - 1), batch_tokens=n_seq - 1)
              for p, d in zip(live, done, strict=True)]
        verify = step[0] + step[1] * (n_seq + sum(ks))
        for j, (p, k) in enumerate(zip(live, ks, strict=True)):
            spent, kept = 0.0, 0
            if k:
                spent, lag[j] = catch * (lag[j] + 1) + per_token * k, 0
                while kept < k and rs.random() < accept:
                    kept += 1
                rounds += 1
            else:
                lag[j] += 1
            drafting += spent
            p.observe(k, kept, spent, verify, batch_tokens=n_seq - 1 + sum(ks) - k)
            done[j] += kept + 1
            tokens += kept + 1
            if done[j] >= n:
                finished[j] += 1
                live[j] = pols[j].policy("adaptive", 8)
                live[j].behind(prompt)
                done[j], lag[j] = 0, prompt
        wall += verify
    wall += drafting
    plain = n_seq / (step[0] + step[1] * n_seq)
    return tokens / wall / plain, drafting / wall, rounds


def test_probes_that_must_catch_up_a_prompt_cost_at_most_their_budget() -> None:
    """Eight sequences, 64-token requests behind 150-token prompts, a draft that does not
    pay in the batch: every probe first catches up with about 200 tokens (as long as 10
    plain steps). Probes are rationed to probe_budget of the time: the batch runs at
    plain decoding's speed but for that, and still probes now and then."""
    pols = [PolicyMemory() for _ in range(8)]
    _serve(pols, 10, 150, 64, 0.3, (0.06, 0.002), 0.004, 0.01)     # learn the costs
    speed, drafting, rounds = _serve(pols, 120, 150, 64, 0.3, (0.06, 0.002), 0.004, 0.01)
    budget = pols[0].policies[("adaptive", 8)].params.probe_budget
    assert drafting <= 1.5 * budget and speed >= 1 - 2 * budget
    assert rounds >= 4                                  # it keeps looking


def test_in_a_batch_it_drafts_where_drafting_pays_prompt_catch_up_included() -> None:
    """The same batch with a draft that is cheap and mostly right: every request's first
    draft pays for catching up with its prompt, spread over the request, and drafting
    wins by far."""
    pols = [PolicyMemory() for _ in range(8)]
    speed, _, rounds = _serve(pols, 20, 150, 64, 0.9, (0.1, 0.001), 0.0005, 0.002)
    assert speed > 1.4 and rounds > 8 * 20 * 5


def test_a_probe_drafts_what_it_asked_for_whatever_the_stop_rule() -> None:
    """In a batch, a probe's draft is not cut by the calibrated stop rule (a probe that
    drafts nothing would pay its catch-up and learn nothing); an ordinary round's is."""
    p = AdaptivePolicy(8)
    for _ in range(300):                    # in a batch of 4, a drafter never right
        k = p.choose(16, batch_tokens=3)
        p.observe(k, 0, 0.0001 * k, _verify(k + 4))
    for _ in range(300):                    # a draft this unsure is never right
        p.calibration.learn([0.01], 0)
    while not p.choose(16, batch_tokens=3):
        p.observe(0, 0, 0.0, _verify(4))
    assert p.state.probing and p.keep_drafting(0, 0.01)
    p.observe(1, 0, 0.0001, _verify(5))
    assert p.choose(16, batch_tokens=3) == 0 and not p.state.probing
    assert not p.keep_drafting(0, 0.01)


def test_a_drafter_never_kept_gets_no_benefit_of_the_doubt() -> None:
    """Early rounds keep drafting while plain steps look only a little better (the first
    estimates are noisy), but not for a drafter none of whose tokens was ever kept: a
    useless drafter stops after a few rounds, not after `settle` of them."""
    useless = _drive(AdaptivePolicy(8), 12, good=False)
    assert sum(1 for k in useless if k) <= 4
    p = AdaptivePolicy(8)
    p.state.kept_any = True     # the same rounds after a drafter that was once right
    assert sum(1 for k in _drive(p, 12, good=False) if k) > 4


def test_a_probe_that_measured_the_drafter_without_its_catch_up_corrects_its_cost() -> None:
    """A drafter priced far too dear (one slow sample) is probed; the probe's round carries
    steady_s, the draft's cost without its catch-up: the cost line learns it, the catch-up
    is priced as the rest, and later probes ask for 2 tokens, enough to measure again."""
    p = AdaptivePolicy(8)
    p.choose(16)
    p.observe(p.state.k, 0, 0.5, _verify(1))      # a cold first round: nothing learnt
    p.choose(16)
    p.observe(p.state.k, p.state.k, 2.0, _verify(p.state.k + 1))   # one slow warm sample
    dear = p.draft_cost(2)
    p.choose(16)
    p.observe(0, 0, 0.0, _verify(1))
    for _ in range(5):
        p.observe(0, 0, 0.0, _verify(1))
    p.state.k, p.state.warm, p.state.skipped = 2, False, 6   # a probe of 2 after 6 plain steps
    p.observe(2, 2, 0.3, _verify(3), steady_s=0.002)
    assert p.draft_cost(2) < dear and p.state.probing_measures
    assert p.catch_up_cost() == pytest.approx((0.3 - 0.002) / 6, rel=0.05)
    measuring = AdaptivePolicy(8, state=AdaptiveState(probing_measures=True))
    ks = _drive(measuring, 1000, good=False)
    probes = [k for k in ks[ks.index(0):] if k]
    assert probes and all(k == 2 for k in probes)


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
    eager = AdaptiveParams(resume_gain=0.0)
    without = [_drive_loaded(AdaptivePolicy(8, eager), 1000, s) for s in range(6)]
    assert sum(with_gain) < sum(without)
    assert max(with_gain) <= 24
