"""An n-gram lookup and a draft model together: each round, the draft worth more.

A lookup copies long stretches of rewritten code; on prose the model wins. Each round
values both as expected tokens per second with the engine's cost models (policy/costs.py),
(1 + E_ng) / t_v(n) against (1 + E_m) / (t_d(k) + t_v(k)), and verifies the better, or
both as a tree where they differ and that is worth more (Draft.gain, policy/tree.py). A
local model is asked only when its candidate, catch-up included, is worth more, or as a
probe; a drafter that works ahead is always asked. Both learn from what the round kept.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.base import Capabilities, Draft, Drafter, DrafterBase, counter_values
from specwire.drafters.ngram.drafter import NgramDrafter, Offer
from specwire.policy.costs import DraftCost, PerToken, VerifyCost
from specwire.policy.scoped import Scoped
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


def parting(a: Sequence[int], b: Sequence[int]) -> int:
    """Where two drafts of one history part: their common prefix's length."""
    return kept_prefix(a, b)


def reach(keep: Sequence[float]) -> list[float]:
    """P(depth i + 1 is kept) for each i: the running products of per-token chances."""
    out, run = [], 1.0
    for p in keep:
        run *= p
        out.append(run)
    return out


def tree_kept(chain: Sequence[float], branch: Sequence[float], at: int) -> float:
    """Expected draft tokens kept of a chain and a branch that shares its first `at`
    tokens, from each one's chances of reaching each depth (reach()): up to `at` the
    likelier of the two (they are the same tokens), past it their sum (one token cannot
    be both), never more than the chance of reaching the parting."""
    total = 0.0
    for d in range(max(len(chain), len(branch))):
        c = chain[d] if d < len(chain) else 0.0
        b = branch[d] if d < len(branch) else 0.0
        if d < at:
            total += max(c, b)
        else:
            cap = 1.0 if at == 0 else max(chain[at - 1], branch[at - 1])
            total += min(cap, c + b)
    return total


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
    """What the hybrid learns of its candidates' yields (the model's drafting and
    catching-up costs are its draft backend's, DraftCost). It outlives a request: a server
    keeps its drafter, and bench, which builds a drafter per prompt, keeps these per
    configuration (as the n-gram's calibration and the policy's estimates)."""

    accepted: float = 1.5       # the model's a, pseudo-counts
    rejected: float = 0.5
    model_len: float = 0.0      # mean length of its drafts
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
    trees: float = 0  # rounds handed out as a tree of both candidates
    #: of those, the ones whose kept tokens went further along the lookup's / the model's
    tree_ngram_kept: float = 0
    tree_model_kept: float = 0

    def as_dict(self) -> dict[str, float]:
        return counter_values(self)


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
        #: per cache scope, what its requests taught (`estimates` is scope ""'s; each other
        #: scope starts from the priors, policy/scoped.py); begin picks one
        self.learned: Scoped[HybridEstimates] = Scoped(HybridEstimates, self.est)
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
        self._tree: tuple[list[int], list[int]] | None = None  # the tree in progress

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
        self.est = self.learned.get(params.cache_scope)
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
        """Seconds the model spends evaluating `behind` tokens it missed while not asked
        (in a request's first model draft, its prompt's)."""
        per_token = self._catch_up()
        return per_token() * behind

    def _catch_up(self) -> PerToken:
        """The catch-up a model draft now would do: the prompt's, or tokens missed since."""
        return self.draft.prompt if self._model_at == 0 else self.draft.catch_up

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
                self._catch_up().add(behind, max(0.0, took - self.draft.seconds(len(draft))))
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
        self._tree = None
        use_ngram = self._agreeing(offer, draft, use_ngram)
        tree = self._both(offer, draft, use_ngram)
        if tree is not None:
            self.ngram.take(offer)
            out, self._tree = tree, (list(offer.tokens), list(draft.tokens))
            self.counters.trees += 1
            use_ngram = False       # the model's draft is verified (for its realised yield)
        elif use_ngram:
            out = self.ngram.take(offer)
            self.counters.ngram_rounds += 1
        else:
            out = draft if draft is not None else Draft()
            if out.tokens:
                self.counters.model_rounds += 1
        self.counters.drafted += len(out)
        self._drafting_s = -1.0 if use_ngram or not out.tokens else 0.0
        model_tokens = None if draft is None else list(draft.tokens)
        # the decode's draft tokens, a tree's branch included (its verification's size)
        sent = len(out) + sum(len(t) for _, t in out.branches or ())
        self._round = (len(history), model_tokens, sent, time.perf_counter())
        return out

    def _agreeing(self, offer: Offer, draft: Draft | None, use_ngram: bool) -> bool:
        """Where one candidate is the other's prefix, the longer holds both, and their
        agreement makes the shared tokens likelier than either alone says: whether to
        verify the lookup's (else the model's), valuing the longer with the likelier
        chance per depth over the shared part against each candidate alone."""
        if draft is None or not draft.tokens or not offer.tokens:
            return use_ngram
        ng, md = list(offer.tokens), list(draft.tokens)
        at = parting(ng, md)
        if at < min(len(ng), len(md)) or len(ng) == len(md):
            return use_ngram
        r_ng, r_md = reach(offer.keep), reach([self.acceptance] * len(md))
        t_ng, t_md = self._verify_s(len(ng)), self._verify_s(len(md))
        if t_ng is None or t_md is None:
            return use_ngram
        longer_ng = len(ng) > len(md)
        t_long = t_ng if longer_ng else t_md
        both = (1.0 + tree_kept(r_ng if longer_ng else r_md, r_md if longer_ng else r_ng,
                                at)) / t_long
        if both > max((1.0 + sum(r_ng)) / t_ng, (1.0 + sum(r_md)) / t_md):
            return longer_ng
        return use_ngram

    def _both(self, offer: Offer, draft: Draft | None, use_ngram: bool) -> Draft | None:
        """Both candidates as one tree, where they differ and a tree of them beats the
        better candidate alone in expected tokens per second of verification; None
        otherwise. Each is cut where the tree is worth most (a long copy beside a short
        model draft, or the reverse, often pays where both whole do not); the longer of
        the two paths is the chain, the other a branch from where they part. Drafting
        is spent by now: only verification counts. The model's own alternates are left
        out of such a tree: a whole second candidate is the likelier branch."""
        if draft is None or not draft.tokens or not offer.tokens:
            return None
        ng, md = list(offer.tokens), list(draft.tokens)
        at = parting(ng, md)
        if at >= min(len(ng), len(md)):
            return None         # one is the other's prefix: the longer holds both
        r_ng, r_md = reach(offer.keep), reach([self.acceptance] * len(md))
        alone = 0.0
        for r in (r_ng, r_md):
            t = self._verify_s(len(r))
            if t is None:
                return None
            alone = max(alone, (1.0 + sum(r)) / t)
        best: tuple[float, int, int, float] | None = None   # rate, ng cut, model cut, E
        for i in range(at + 1, len(ng) + 1):
            for j in range(at + 1, len(md) + 1):
                t = self._verify_s(i + j - at)
                if t is None:
                    return None
                kept = tree_kept(r_ng[:i], r_md[:j], at)
                rate = (1.0 + kept) / t
                if rate > alone and (best is None or rate > best[0]):
                    best = (rate, i, j, kept)
        if best is None:
            return None
        _, i, j, kept = best
        if i > j or i == j and use_ngram:
            out, chain, branch = self.ngram.draft(ng[:i]), r_ng[:i], md[at:j]
        else:
            out = Draft(md[:j], None if draft.sparse is None else draft.sparse[:j],
                        None if draft.confidence is None else draft.confidence[:j])
            chain, branch = r_md[:j], ng[at:i]
        out.branches, out.gain = [(at, list(branch))], kept - sum(chain)
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
        if self._tree is not None:
            ng_tokens, md_tokens = self._tree
            self._tree = None
            new = history[base:base + appended]
            ng_kept, md_kept = kept_prefix(ng_tokens, new), kept_prefix(md_tokens, new)
            if ng_kept != md_kept:
                if ng_kept > md_kept:
                    self.counters.tree_ngram_kept += 1
                else:
                    self.counters.tree_model_kept += 1
        if self._drafting_s >= 0.0 and handed:     # the model's draft was verified
            w = 1.0 - self.alpha
            # what the round kept, on whichever path (a tree's may leave the chain)
            self.est.model_tokens = w * self.est.model_tokens + appended
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
        self._round, self._tree = None, None

    def close(self) -> None:
        """Close the model drafter's connection, if it has one."""
        self.model.close()

    def stats(self) -> dict[str, float]:
        return {**self.model.stats(), **{k: v for k, v in self.ngram.stats().items()
                                          if k != "drafted"}, **self.counters.as_dict()}
