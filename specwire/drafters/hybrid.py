"""An n-gram lookup and a draft model together: each round, the draft worth more.

On code rewriting a lookup copies long stretches the model would draft token by
token; on prose the lookup rarely matches and the model wins. Each round the
hybrid values both candidates as expected tokens per second of the round and
verifies the better one:

    n-gram:  (1 + E_ng) / t_v(n)            E_ng from its calibrated per-token keeps
    model:   (1 + E_m) / (t_d(k) + t_v(k))  E_m = a + ... + a^k, a learnt online

t_v is the target's verification cost and t_d the model's drafting cost (both
policy/costs.py, handed by the engine; the hybrid times its model's steady rounds
into t_d, as it alone knows which rounds were the model's), a the model's acceptance. A model in
this process is asked only when its candidate is worth more (or, to keep its
estimates fresh, as a short probe now and then), its cost including the tokens it
must catch up on; a drafter that works ahead (a node, a thread) costs nothing to
ask and is always asked. Under the adaptive policy the hybrid makes each round's
call itself and both drafts stop at the policy's per-token threshold.
docs/drafting.md has the reasoning and the measurements (including why verifying
both candidates in one decode was not built).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, fields

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.base import Capabilities, Draft, Drafter, DrafterBase
from specwire.drafters.ngram.drafter import NgramDrafter, Offer
from specwire.policy.costs import DraftCost, VerifyCost
from specwire.policy.throughput import expected_tokens

#: Plain steps in a row without asking a model that did not look worth it, at first...
PROBE_EVERY = 16
#: ...and at most, after probes that did not pay.
PROBE_MAX = 128
#: Verified model rounds (weighted: 1.5 is two) before what they yielded may veto the
#: estimate: one unlucky first round (often catching up on a whole prompt) would keep a
#: model that pays from being asked until its probes back off.
MIN_REALISED = 1.5
#: Tokens a probe asks the model for: enough to judge it, no more to verify.
PROBE_TOKENS = 2


def kept_prefix(draft: Sequence[int], new: Sequence[int]) -> int:
    """How many leading draft tokens the history took."""
    n = 0
    for t, h in zip(draft, new, strict=False):
        if t != h:
            break
        n += 1
    return n


@dataclass(slots=True)
class HybridEstimates:
    """What the hybrid learns of its candidates' yields and catching up (the model's
    drafting cost is its draft backend's, DraftCost). It outlives a request: a server
    keeps its drafter, and bench, which builds a drafter per prompt, keeps these per
    configuration (as the n-gram's calibration and the policy's estimates)."""

    accepted: float = 1.5       # the model's a, pseudo-counts
    rejected: float = 0.5
    model_len: float = 0.0      # mean length of its drafts
    #: seconds the model spent catching up (tokens added while not asked), over the tokens
    catch_up_s: float = 0.0
    catch_up_tokens: float = 0.0
    #: what the model's verified rounds yielded, tokens and seconds (drafting and
    #: verification, not catching up), exponentially weighted: its rate as it turned out
    model_tokens: float = 0.0
    model_s: float = 0.0
    model_rounds: float = 0.0   # the weight of those rounds
    probe_gap: int = PROBE_EVERY


class LookupStop:
    """The policy's stop threshold as the lookup needs it: the value of one more drafted
    token against what it adds to verification only. The policy's own threshold also
    charges the drafter's time per token, which its draft line learns from every round,
    the model's included: the lookup, which takes no time, would be cut short by it."""

    __slots__ = ("policy",)

    def __init__(self, policy) -> None:
        self.policy = policy

    def stop_threshold(self) -> float:
        p = self.policy
        return p.round_rate() * (p.verify_cost(2) - p.verify_cost(1))


@dataclass(slots=True)
class HybridCounters:
    """Which drafter's draft the hybrid handed out, cumulative over its life."""

    ngram_rounds: float = 0
    model_rounds: float = 0
    drafted: float = 0  # tokens handed out, from either

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}


class HybridDrafter(DrafterBase):
    """Composes an NgramDrafter and a model drafter (local, threaded or remote).

    It ends its own drafts (`stops`): whether a round drafts at all, and which candidate,
    is its call each round, both candidates stopping at the policy's threshold (the
    policy's one chain of equal chances, fitted over both kinds of rounds, would skip
    matches worth taking and cut them short).
    """

    capabilities = Capabilities(stops=True)

    def __init__(self, ngram: NgramDrafter, model: Drafter, alpha: float = 0.1,
                 estimates: HybridEstimates | None = None) -> None:
        # Its model never waits for a fresh branch: the lookup's draft may be ready.
        if model.capabilities.waits:
            model.never_wait()
        self.ngram, self.model, self.alpha = ngram, model, alpha
        self.name = f"hybrid:{self.model.name}"
        # asking costs the target nothing when the model drafts on its own (node, thread)
        self.ahead = self.model.capabilities.pipelined
        self.est = estimates if estimates is not None else HybridEstimates()
        #: the target's verification cost; without an engine's (use_costs), the rounds'
        #: own times feed it (own_costs)
        self.costs, self.own_costs = VerifyCost(), True
        #: the model's drafting cost, which the hybrid feeds (the engine's, use_costs)
        self.draft = DraftCost()
        self._model_at = -1       # len(history) when the model was last asked (-1: never)
        self._asked_last = False  # the model was asked in the previous round
        self._probing = False     # the model was last asked only to probe
        # the round in progress: len(history), model draft, tokens handed out, when
        self._round: tuple[int, list[int] | None, int, float] | None = None
        self._idle = 0  # plain steps in a row where the model was not worth asking
        self._drafting_s = 0.0  # the round in progress: the model's drafting time
        self.counters = HybridCounters()

    @property
    def backend(self):
        """The local draft model's backend, if any (bench empties its cache per prompt)."""
        return self.model.backend

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        self.costs, self.own_costs = costs, False
        if draft is not None:
            self.draft = draft
        self.ngram.use_costs(costs)
        self.model.use_costs(costs, draft)

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar=None) -> None:
        """Both stop at the policy's threshold (the lookup's as LookupStop prices it); the
        grammar is not passed on (the model drafts free, the target applies it)."""
        self.ngram.begin(prompt, sampling, params,
                         policy=None if policy is None else LookupStop(policy))
        self.model.begin(prompt, sampling, params, policy=policy)
        self._round = None
        self._model_at, self._asked_last = 0, False    # the prompt is its first catch-up

    # -- the estimates ------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        return self.est.accepted / (self.est.accepted + self.est.rejected)

    def _verify_s(self, n: int) -> float | None:
        """Seconds to verify a draft of n tokens; None before any verification."""
        return self.costs.seconds(n + 1)

    def ngram_rate(self, offer: Offer) -> float | None:
        v = self._verify_s(len(offer.tokens))
        return None if v is None else (1.0 + offer.expected_kept()) / v

    def model_rate(self, k: float, drafting_s: float | None = None,
                   behind: int = 0) -> float | None:
        """Expected tokens/s of a model draft of k tokens; drafting_s: its drafting time
        (None: the fitted estimate, plus catching up on `behind` tokens)."""
        v = self._verify_s(round(k))
        if v is None:
            return None
        kept = expected_tokens(self.acceptance, round(k)) - 1.0
        cost = (self.draft.seconds(k) + self.catch_up_cost(behind) if drafting_s is None
                else drafting_s)
        return (1.0 + kept) / (cost + v)

    def model_worth(self, estimate: float | None, behind: int) -> float | None:
        """The model's rate for the choice against a plain step: the lower of its estimate
        and what its verified rounds yielded, per round over a steady round's seconds
        plus catching up on `behind` tokens now. The estimate alone judged it worth
        asking where its rounds, once run, kept fewer tokens per second than plain steps
        (its acceptance is learnt over every round, also the easy ones the lookup
        covers). Catching up is left out of the rounds' seconds and priced for now:
        rounds after a long stretch of plain steps would otherwise keep it judged dear."""
        est = self.est
        if estimate is None or est.model_rounds < MIN_REALISED:
            return estimate
        return min(estimate, est.model_tokens / (est.model_s + self.catch_up_cost(behind)))

    def catch_up_cost(self, behind: int) -> float:
        """Seconds the model spends evaluating `behind` tokens it missed while not asked."""
        est = self.est
        return est.catch_up_s / est.catch_up_tokens * behind if est.catch_up_tokens else 0.0

    def _behind(self, history: Sequence[int]) -> int:
        """Tokens added since the model was last asked, when that was before the previous
        round (0 in a steady run of model rounds, whose drafting time t_d covers it)."""
        if self._model_at < 0 or self._asked_last:
            return 0
        return len(history) - self._model_at

    # -- a round ---------------------------------------------------------------------------

    def propose(self, history: Sequence[int], k: int) -> Draft:
        offer = self.ngram.usable(self.ngram.offer(history, k))
        if self.ahead:
            draft = self.model.propose(history, k)
            ng, m = self.ngram_rate(offer), self.model_rate(len(draft), 0.0)
            use_ngram = bool(offer.tokens) and (
                offer.expected_kept() > expected_tokens(self.acceptance, len(draft)) - 1.0
                if ng is None or m is None else ng > m)
            return self._hand_out(history, offer, draft, use_ngram)
        model_k = self.est.model_len or k
        behind = self._behind(history)
        self._asked_last = False
        ng, m = self.ngram_rate(offer), self.model_rate(min(model_k, k), behind=behind)
        if offer.tokens and (ng is None and offer.expected_kept() >= 1.0
                             or ng is not None and m is not None and ng > m):
            return self._hand_out(history, offer, None, True)
        # No match worth it: the model, unless a plain step is worth more (its drafting
        # and catching up cost more than its tokens yield); asked now and then anyway,
        # so that its estimates can recover, less often while such probes do not pay.
        v0 = self._verify_s(0)
        m = self.model_worth(m, behind)
        worse = not offer.tokens and m is not None and v0 is not None and m * v0 < 1.0
        if worse and self._probing:
            self.est.probe_gap = min(2 * self.est.probe_gap, PROBE_MAX)
        elif not worse:
            self.est.probe_gap = PROBE_EVERY
        self._probing = False
        if worse and self._idle < self.est.probe_gap:
            self._idle += 1
            return self._hand_out(history, offer, None, False)
        self._probing, self._idle = worse, 0
        t0 = time.perf_counter()
        draft = self.model.propose(history, min(k, PROBE_TOKENS) if worse else k)
        took = time.perf_counter() - t0
        if draft.tokens:
            if not behind:              # a steady round: its time is drafting
                self.draft.observe(len(draft), took)
            else:
                w = 1.0 - self.alpha
                extra = max(0.0, took - self.draft.seconds(len(draft)))
                self.est.catch_up_s = w * self.est.catch_up_s + extra
                self.est.catch_up_tokens = w * self.est.catch_up_tokens + behind
        self._model_at, self._asked_last = len(history), True
        # what the model proposed may still be worth less than the match; its drafting
        # time is spent either way, so only verification counts now
        use_ngram = bool(offer.tokens) and ng is not None and (
            self.model_rate(len(draft), 0.0) or 0.0) < ng
        out = self._hand_out(history, offer, draft, use_ngram)
        if self._drafting_s == 0.0:         # its draft goes to verification
            self._drafting_s = self.draft.seconds(len(draft)) if behind else took
        return out

    def _hand_out(self, history: Sequence[int], offer: Offer, draft: Draft | None,
                  use_ngram: bool) -> Draft:
        """The round's draft; `draft` is the model's (None: it was not asked)."""
        if draft is not None and draft.tokens:
            est, w = self.est, 1.0 - self.alpha
            est.model_len = (w * est.model_len + self.alpha * len(draft) if est.model_len
                             else float(len(draft)))
        if use_ngram:
            out = self.ngram.take(offer)
            self.counters.ngram_rounds += 1
        else:
            out = draft if draft is not None else Draft()
            if out.tokens:
                self.counters.model_rounds += 1
        self.counters.drafted += len(out)
        self._drafting_s = -1.0 if use_ngram or not out.tokens else 0.0
        model_tokens = None if draft is None else list(draft.tokens)
        self._round = (len(history), model_tokens, len(out), time.perf_counter())
        return out

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        """Both learn from the tokens that followed: the verified draft by its verdict,
        the other by how far it agreed with them."""
        self.ngram.learn(history, accepted, appended)
        if self._round is None:
            self.model.learn(history, accepted, appended)
            return
        base, model_tokens, handed, t = self._round
        self._round = None
        verify_s = time.perf_counter() - t
        if self.own_costs:
            self.costs.observe(handed + 1, verify_s)
        if self._drafting_s >= 0.0 and handed:     # the model's draft was verified
            w = 1.0 - self.alpha
            self.est.model_tokens = w * self.est.model_tokens + accepted + 1
            self.est.model_s = w * self.est.model_s + self._drafting_s + verify_s
            self.est.model_rounds = w * self.est.model_rounds + 1.0
        if model_tokens is None:        # a model in this process that was not asked
            self.model.learn(history, 0, appended)
            return
        kept = kept_prefix(model_tokens, history[base:base + appended])
        if model_tokens:
            judged = kept < min(len(model_tokens), appended)
            w = 1.0 - self.alpha
            self.est.accepted = w * self.est.accepted + kept
            self.est.rejected = w * self.est.rejected + (1.0 if judged else 0.0)
        # as if its draft had been verified: the tokens of it the history took
        self.model.learn(history, kept, appended)

    def end(self) -> None:
        self.ngram.end()
        self.model.end()
        self._round = None

    def close(self) -> None:
        """Close the model drafter's connection, if it has one."""
        self.model.close()

    def stats(self) -> dict[str, float]:
        return {**self.model.stats(), **{k: v for k, v in self.ngram.stats().items()
                                          if k != "drafted"}, **self.counters.as_dict()}
