"""What `specwire plan` would have predicted for a configuration bench measured.

The inputs come from the same run (the plain rate, the calibrated draft speed and
verification curve, the configuration's acceptance and emulated link), so comparing the
prediction with the measured rate checks the plan's cost model configuration by
configuration. The plan is fed the rounds bench actually saw (the mean draft length, the
acceptance fitted to it, the share f of rounds that had a draft), since real drafters stop
early or find no match; `predict` says how.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from specwire.bench.modes import MODEL_MODES
from specwire.bench.runner import RunParams
from specwire.policy.plan import free_bound
from specwire.policy.throughput import (
    PlanInputs,
    RateFn,
    VerifyCurve,
    expected_tokens,
    late_s,
    local_rate,
    pipelined_rate,
    sync_rate,
)

RATE_BY_MODE: dict[str, tuple[str, RateFn]] = {
    "local": ("local", local_rate),
    "ngram": ("local", local_rate),
    "ngram-classic": ("local", local_rate),
    "hybrid": ("local", local_rate),
    "hybrid-pipelined": ("pipelined", pipelined_rate),
    "random": ("local", local_rate),
    "remote-sync": ("synchronous", sync_rate),
    "llama-server": ("synchronous", sync_rate),
    "local-pipelined": ("pipelined", pipelined_rate),
    "remote-pipelined": ("pipelined", pipelined_rate),
    "remote-chains": ("pipelined", pipelined_rate),
}
#: Stand-in speed for a drafter whose drafting took no measurable time.
_FREE_DRAFT_TPS = 1e6


@dataclass(frozen=True, slots=True)
class Rounds:
    """What the rounds of a configuration looked like, summed over its prompts."""

    rounds: int
    drafting_rounds: int
    drafted: int
    accepted: int
    short: int = 0  # drafting rounds whose draft came back shorter than asked
    asked: int | None = None  # rounds that asked the drafter at all (None: every round)
    rejected: int | None = None  # drafting rounds that had a token refused (None: unknown)
    #: per request whose draft model was asked: (prompt tokens it read, seconds the
    #: target read its own prompt, tokens generated, rounds it was not asked in); empty:
    #: not known (older results)
    reads: tuple[tuple[int, float, int, int], ...] = ()
    generated: int = 0  # tokens generated in all (0: the reads' sum)

    @property
    def stop_evals(self) -> float:
        """Draft evaluations per drafting round beyond its tokens: a draft model that stops
        at --draft-p-min has evaluated the position it then declined."""
        return self.short / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def mean_drafted(self) -> float:
        """Tokens drafted per round that had a draft."""
        return self.drafted / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def k(self) -> int:
        return max(1, round(self.mean_drafted)) if self.drafting_rounds else 0

    @property
    def asked_share(self) -> float:
        """Rounds that asked the drafter, of all rounds; the rest were plain steps."""
        asked = self.rounds if self.asked is None else self.asked
        return asked / self.rounds if self.rounds else 0.0

    @property
    def share(self) -> float:
        return self.drafting_rounds / self.rounds if self.rounds else 0.0

    @property
    def kept_per_round(self) -> float:
        return self.accepted / self.drafting_rounds if self.drafting_rounds else 0.0

    @property
    def acceptance(self) -> float | None:
        """The per-token acceptance a of the geometric chain, by maximum likelihood: each
        draft token verified was a trial, kept `accepted` times and refused once per
        rejected round (a round that kept its whole draft was cut, not refused). Unlike
        the fit at the mean length, it does not move with how long the drafts were.
        None when the rejected rounds were not counted."""
        if self.rejected is None:
            return None
        trials = self.accepted + self.rejected
        return self.accepted / trials if trials else 0.0


def fit_acceptance(kept: float, k: int) -> float:
    """The a in [0, 1] with a + a^2 + ... + a^k = kept (bisection; kept is clamped to [0, k])."""
    kept = min(max(kept, 0.0), float(k))
    if k <= 0 or kept <= 0.0:
        return 0.0
    if kept >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_tokens(mid, k) - 1.0 < kept:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def predict(cfg: RunParams, plain_tps: float, draft_tps: float | None, rounds: Rounds,
            verify: VerifyCurve | None, measured_tps: float,
            draft_prompt_tps: float = 0.0) -> dict | None:
    """plan's tokens/s for cfg and its error against the measured rate (None if unknown).

    The plan gets k = the mean tokens per drafting round (rounded), a = the acceptance at
    which a k-token round keeps the tokens measured (pipelined: the geometric a by maximum
    likelihood, Rounds.acceptance, as `plan --bench` reads it; there a short draft is what
    had come, and on gpu-dense the rounds that kept one whole fitted a = 0.99 at k = 6 and
    0.95 at k = 7 for an MLE of 0.96: docs/benchmarks.md), and the share f of rounds that
    had a draft; the others were plain steps that still paid for asking, e = t_s + t_d (+ RTT):
    rate = (f E + (1 - f)) / (f E / rate_k + (1 - f) e). Pipelined drafting models its
    draftless rounds itself (the race after a miss), so f is not applied there. A draft
    model also reads each request's prompt before its first draft and catches up after
    each plain step it was not asked in (`_extra_s`), at draft_prompt_tps (0: along the
    verification curve, PlanInputs.draft_read_s). Modes map to plan's: local and ngram
    (its lookup time as draft speed) to `local`, remote-sync and llama-server to
    `synchronous`, remote- and local-pipelined to `pipelined`."""
    if not plain_tps > 0.0 or not measured_tps > 0.0:
        return None
    if not cfg.drafting:
        return _result("plain", 0, None, plain_tps, plain_tps, measured_tps, None)
    if rounds.drafting_rounds == 0:       # never drafted: every round was a plain step
        return _result("plain", 0, None, plain_tps, plain_tps, measured_tps, None)
    if draft_tps is None or not draft_tps > 0.0 or verify is None:
        return None
    plan_mode, fn = RATE_BY_MODE[cfg.mode]
    # The plan drafts a whole number of tokens a round; bench saw a mean. Predict at the
    # two whole numbers around it (each with its fitted a) and interpolate, so that a mean
    # of 3.49 and one of 3.51 do not land on two different models.
    mean = min(rounds.mean_drafted, 256.0)
    lo = max(1, math.floor(mean))
    hi = max(lo, math.ceil(mean))
    w = 0.0 if hi == lo else (mean - lo) / (hi - lo)
    # A pipelined round verifies what has come: its length says nothing of its tokens, so
    # a short draft kept whole is cut, not all-accepted, and the per-token a is the
    # maximum-likelihood one. A drafter that stops by its own confidence picks lengths
    # that do: there the a that keeps the measured tokens at the mean length is fitted.
    acceptance = rounds.acceptance if plan_mode == "pipelined" else None
    inputs = None
    rate = 0.0
    for k, weight in ((lo, 1.0 - w), (hi, w)):
        if weight == 0.0:
            continue
        a = acceptance if acceptance is not None else fit_acceptance(rounds.kept_per_round, k)
        inputs = PlanInputs(
            target_tps=plain_tps, draft_tps=min(draft_tps, _FREE_DRAFT_TPS), acceptance=a,
            rtt_s=cfg.rtt_s or 0.0, bandwidth_bps=cfg.bandwidth_bps or math.inf, verify=verify,
            draft_max=max(k, 1), draft_prompt_tps=draft_prompt_tps,
            stop_evals=rounds.stop_evals if cfg.mode in MODEL_MODES else 0.0)
        r = fn(inputs, k)
        if plan_mode != "pipelined":
            # A round that asked but got nothing still paid for asking; one that did not
            # ask (the adaptive policy chose k = 0) is a plain step.
            asked_s = inputs.t_s + inputs.t_d + (
                inputs.rtt_s if plan_mode == "synchronous" else 0.0)
            empty = 1.0 - rounds.share
            asked_empty = max(0.0, rounds.asked_share - rounds.share)
            empty_s = (asked_empty * asked_s + (empty - asked_empty) * inputs.t_s) / empty \
                if empty > 0 else inputs.t_s
            r = mixed_rate(r, expected_tokens(a, k), rounds.share, empty_s)
        rate += weight * r
    if cfg.mode in MODEL_MODES and inputs is not None and rounds.reads:
        tokens = rounds.generated or sum(r[2] for r in rounds.reads)
        rate = tokens / (tokens / rate + _extra_s(inputs, plan_mode, rounds, rate))
    return _result(plan_mode, rounds.k, rounds.share, rate, plain_tps, measured_tps, inputs)


def _extra_s(p: PlanInputs, plan_mode: str, rounds: Rounds, rate: float) -> float:
    """What a draft model adds to a steady run of rounds: each request's prompt read
    before its first draft (throughput.late_s: a node reads while the target reads its
    own; a pipelined target decodes plainly meanwhile) and, where the target waits for
    its drafts, the catch-up with every plain step it was not asked in (in a request that
    asked it at all: one that never did read nothing)."""
    remote = plan_mode != "local"
    extra = 0.0
    for prompt, prefill_s, n, plain in rounds.reads:
        q = replace(p, prompt_tokens=prompt, reply_tokens=n,
                    target_prompt_tps=prompt / prefill_s if prefill_s > 0 else 0.0)
        extra += late_s(q.prompt_lag_s(remote), n, rate, p.target_tps,
                        races=plan_mode == "pipelined")
        if plan_mode != "pipelined":
            extra += plain * p.catch_up_s(1)
    return extra


def bound(cfg: RunParams, plain_tps: float, rounds: Rounds, verify: VerifyCurve | None,
          measured_tps: float) -> dict | None:
    """What a free and instant drafter with this configuration's acceptance would reach on
    this target (plan.free_bound at k <= --draft-max), and the share of it measured.

    The acceptance is the geometric a by maximum likelihood (Rounds.acceptance: kept
    tokens over kept tokens plus rejected rounds); the free drafter drafts every round.
    Where rejected rounds were not counted (older results), the a fitted to the tokens
    kept per drafting round at the mean length drafted, as `predict` feeds the plan:
    that fit moves with the mix of draft lengths (a pipelined drafter's drafts are short
    after a rejection), by 0.04 either way in the runs of benchmarks/NOTES.md section 5,
    which moved the bound by 15%. Both are reported: `acceptance_fit`, `share_fit`.
    None for plain decoding, a configuration that never drafted, or no verification curve.
    """
    if not cfg.drafting or rounds.drafting_rounds == 0 or verify is None:
        return None
    if not plain_tps > 0.0 or not measured_tps > 0.0:
        return None
    fit = fit_acceptance(rounds.kept_per_round, rounds.k)
    a = rounds.acceptance if rounds.acceptance is not None else fit
    b = _free(plain_tps, a, verify, cfg.draft_max)
    return {"k": b.k, "acceptance": a, "tokens_per_s": b.tokens_per_s,
            "speedup": b.speedup, "share": measured_tps / b.tokens_per_s,
            "acceptance_fit": fit,
            "share_fit": measured_tps / _free(plain_tps, fit, verify, cfg.draft_max).tokens_per_s}


def _free(plain_tps: float, a: float, verify: VerifyCurve, draft_max: int):
    return free_bound(PlanInputs(target_tps=plain_tps, draft_tps=_FREE_DRAFT_TPS, acceptance=a,
                                 verify=verify, draft_max=max(1, draft_max)))


def mixed_rate(rate_k: float, tokens_k: float, share: float, empty_s: float) -> float:
    """Tokens/s when a share of rounds drafts (rate_k, tokens_k a round) and the rest
    yield one token in empty_s."""
    tokens = share * tokens_k + (1.0 - share)
    seconds = share * tokens_k / rate_k + (1.0 - share) * empty_s
    return tokens / seconds


def _result(plan_mode: str, k: int, share: float | None, rate: float, plain_tps: float,
            measured_tps: float, inputs: PlanInputs | None) -> dict:
    return {
        "plan_mode": plan_mode,
        "k": k,
        "drafting_share": share,
        "predicted_tps": rate,
        "predicted_speedup": rate / plain_tps,
        "measured_tps": measured_tps,
        "error_pct": 100.0 * (rate - measured_tps) / measured_tps,
        "inputs": None if inputs is None else {
            "target_tps": inputs.target_tps, "draft_tps": inputs.draft_tps,
            "acceptance": inputs.acceptance, "rtt_s": inputs.rtt_s,
            "bandwidth_bps": inputs.bandwidth_bps if math.isfinite(inputs.bandwidth_bps)
            else None,
            "verify_cost": [list(p) for p in inputs.verify.points]},
    }


def measured_draft_tps(draft_ms: float, draft_n: int) -> float | None:
    """Drafted tokens per second of the engine's wait (less the link): an n-gram's lookups,
    a llama-server's drafting; None when nothing was drafted."""
    if draft_n <= 0:
        return None
    return draft_n / (draft_ms / 1000.0) if draft_ms > 0 else _FREE_DRAFT_TPS
