"""An n-gram lookup and a draft model together: each round, the draft worth more.

On code rewriting a lookup copies long stretches the model would draft token by
token; on prose the lookup rarely matches and the model wins. A server need not
choose: each round the hybrid values both candidates as expected tokens per
second of the round and verifies the better one.

    n-gram:  (1 + E_ng) / t_v(n)            E_ng from its calibrated per-token keeps
    model:   (1 + E_m) / (t_d(k) + t_v(k))  E_m = a + ... + a^k, a learnt online

t_v (seconds from handing out a draft of n tokens to hearing the verdict) and
t_d (seconds the model's propose took for k tokens) are lines fitted online,
and a is the model's acceptance, learnt from the tokens that followed each of
its drafts (also when the n-gram's draft was verified instead).

A model in this process drafts only when asked, so it is asked only when its
candidate is worth more by those estimates: a good match skips its drafting
time, and with no match a plain step (1 / t_v(0)) is taken instead when the
model's rate is below it (the model is still asked every PROBE_EVERY rounds).
A drafter that works ahead (a remote node, a thread) costs the target
nothing to ask, so it is always asked and its draft compared as it is; the
lookup then runs on the target while the node drafts, and the node is told
how many of its tokens the history kept, as if its draft had been verified.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from specwire.config import DraftParams, SamplingParams
from specwire.drafters.base import Draft, Drafter, DrafterBase, declared
from specwire.drafters.ngram import NgramDrafter, Offer
from specwire.throughput import draft_line, expected_tokens, verify_line

#: Most plain steps in a row without asking a model that did not look worth it.
PROBE_EVERY = 16


def _kept(draft: Sequence[int], new: Sequence[int]) -> int:
    """How many leading draft tokens the history took."""
    n = 0
    for t, h in zip(draft, new, strict=False):
        if t != h:
            break
        n += 1
    return n


class HybridDrafter(DrafterBase):
    """Composes an NgramDrafter and a model drafter (local, threaded or remote)."""

    def __init__(self, ngram: NgramDrafter, model: Drafter, alpha: float = 0.1) -> None:
        self.ngram, self.model, self.alpha = ngram, declared(model), alpha
        self.name = f"hybrid:{self.model.name}"
        # asking costs the target nothing when the model drafts on its own (node, thread)
        self.ahead = self.model.pipelined
        self.verify = verify_line()     # seconds vs tokens drafted
        self.drafting = draft_line()    # model seconds vs tokens drafted
        self.accepted, self.rejected = 1.5, 0.5             # the model's a, pseudo-counts
        self.model_len = 0.0                                # mean length of its drafts
        # the round in progress: len(history), model draft, tokens handed out, when
        self._round: tuple[int, list[int] | None, int, float] | None = None
        self._idle = 0  # plain steps in a row where the model was not worth asking
        self.counters = {"ngram_rounds": 0.0, "model_rounds": 0.0, "drafted": 0.0}

    @property
    def backend(self):
        """The local draft model's backend, if any (bench empties its cache per prompt)."""
        return self.model.backend

    def steer(self, policy) -> None:
        self.ngram.steer(policy)
        self.model.steer(policy)

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams) -> None:
        self.ngram.begin(prompt, sampling, params)
        self.model.begin(prompt, sampling, params)
        self._round = None

    # -- the estimates ------------------------------------------------------------------

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def _verify_s(self, n: int) -> float | None:
        return max(self.verify(n), 1e-6) if self.verify.w else None

    def ngram_rate(self, offer: Offer) -> float | None:
        v = self._verify_s(len(offer.tokens))
        return None if v is None else (1.0 + offer.expected_kept()) / v

    def model_rate(self, k: float, drafting_s: float | None = None) -> float | None:
        """Expected tokens/s of a model draft of k tokens; drafting_s: its drafting time
        (None: the fitted estimate)."""
        v = self._verify_s(round(k))
        if v is None:
            return None
        kept = expected_tokens(self.acceptance, round(k)) - 1.0
        cost = self.drafting(k) if drafting_s is None else drafting_s
        return (1.0 + kept) / (cost + v)

    # -- a round ---------------------------------------------------------------------------

    def propose(self, history: Sequence[int], max_n: int) -> Draft:
        offer = self.ngram.usable(self.ngram.offer(history, max_n))
        if self.ahead:
            draft = self.model.propose(history, max_n)
            ng, m = self.ngram_rate(offer), self.model_rate(len(draft), 0.0)
            use_ngram = bool(offer.tokens) and (
                offer.expected_kept() > expected_tokens(self.acceptance, len(draft)) - 1.0
                if ng is None or m is None else ng > m)
            return self._hand_out(history, offer, draft, use_ngram)
        k = self.model_len or max_n
        ng, m = self.ngram_rate(offer), self.model_rate(min(k, max_n))
        if offer.tokens and (ng is None and offer.expected_kept() >= 1.0
                             or ng is not None and m is not None and ng > m):
            return self._hand_out(history, offer, None, True)
        # No match worth it: the model, unless a plain step is worth more (its drafting
        # and catching up cost more than its tokens yield); asked now and then anyway,
        # so that its estimates can recover.
        v0 = self._verify_s(0)
        if (not offer.tokens and m is not None and v0 is not None and m * v0 < 1.0
                and self._idle < PROBE_EVERY):
            self._idle += 1
            return self._hand_out(history, offer, None, False)
        self._idle = 0
        t0 = time.perf_counter()
        draft = self.model.propose(history, max_n)
        took = time.perf_counter() - t0
        if draft.tokens:
            self.drafting.add(len(draft), took)
        # what the model proposed may still be worth less than the match
        use_ngram = bool(offer.tokens) and ng is not None and (
            self.model_rate(len(draft), took) or 0.0) < ng
        return self._hand_out(history, offer, draft, use_ngram)

    def _hand_out(self, history: Sequence[int], offer: Offer, draft: Draft | None,
                  use_ngram: bool) -> Draft:
        """The round's draft; `draft` is the model's (None: it was not asked)."""
        if draft is not None and draft.tokens:
            w = 1.0 - self.alpha
            self.model_len = w * self.model_len + self.alpha * len(draft) if self.model_len \
                else float(len(draft))
        if use_ngram:
            out = self.ngram.take(offer)
            self.counters["ngram_rounds"] += 1
        else:
            out = draft if draft is not None else Draft()
            if out.tokens:
                self.counters["model_rounds"] += 1
        self.counters["drafted"] += len(out)
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
        self.verify.add(handed, time.perf_counter() - t)
        if model_tokens is None:        # a model in this process that was not asked
            self.model.learn(history, 0, appended)
            return
        kept = _kept(model_tokens, history[base:base + appended])
        if model_tokens:
            judged = kept < min(len(model_tokens), appended)
            w = 1.0 - self.alpha
            self.accepted = w * self.accepted + kept
            self.rejected = w * self.rejected + (1.0 if judged else 0.0)
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
                                          if k != "drafted"}, **self.counters}
