"""A draft model in this process (or inside a draft node): llama.cpp's own setup.

The drafter keeps its own KV cache and re-syncs it to the engine's history on
every proposal by longest common prefix, so a rejection, a fully accepted
block or a brand-new request all take the same path: truncate, evaluate the
missing suffix, draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from specwire.backend.base import Backend, sync_prefix, usable_prefix
from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Capabilities, Draft, DrafterBase
from specwire.drafters.lockstep import Drafting, DraftSteps
from specwire.policy.costs import DraftCost, VerifyCost
from specwire.sample import sampling
from specwire.sample.constraints.grammar import Grammar, GrammarSpec
from specwire.sample.constraints.trail import GrammarTrail


class ModelDrafter(DrafterBase):
    """Drafts by running a small model autoregressively, token by token.

    How the draft picks each token follows the verification mode: argmax for
    greedy, the shared Gumbel noise for coupled (so it proposes what the target
    would sample where the two agree), its own stream and sparse q for rejection.

    Where a draft stops: at --draft-p-min (llama.cpp's rule: the next token's top
    probability below it), or, when `stop_rule` is set (by the adaptive policy begin
    is given, or by a draft node's session), wherever stop_rule(i, top probability)
    says no to token i.

    With a grammar (begin's, for a constrained request) the draft samples from its
    row masked by the grammar, as the target will; the grammar's states are kept
    per position (GrammarTrail) and a draft works on a copy.
    """

    @classmethod
    def per_sequence(cls, shared) -> list[ModelDrafter]:
        """A drafter for each sequence of one multi-sequence draft backend (serve -np N:
        one draft context, drafts of all requests in lockstep), with one DraftCost."""
        cost = DraftCost()
        return [cls(shared.seq(i), shared, i, cost) for i in range(shared.n_seq)]

    def __init__(self, backend: Backend, shared: object = None, seq: int = 0,
                 cost: DraftCost | None = None,
                 stop_rule: Callable[[int, float], bool] | None = None) -> None:
        """shared: the multi-sequence draft backend whose sequence `seq` backend is (its
        drafts are then stepped in lockstep with the other sequences'); None: alone.
        cost: the draft backend's cost model (an engine hands its own, use_costs).
        stop_rule: where drafts stop, for good (a draft node's calibrated session)."""
        self.backend, self.shared, self.seq = backend, shared, seq
        self.cost = cost if cost is not None else DraftCost()
        self.name = f"model:{backend.name}"
        # its sparse top-K q in rejection mode; in lockstep with the other sequences of a
        # shared draft backend (alone, propose drafts as it always did)
        self.capabilities = Capabilities(provides_q=True, lockstep=shared is not None)
        self.sampling = SamplingParams(temperature=0.0)
        self.params = DraftParams()
        self._drafted = 0
        self.stop_rule = stop_rule
        self._steered = False  # stop_rule is a begin's policy's (end drops it)
        self._grammar: GrammarTrail | None = None
        self._cache_use: tuple[int, int] | None = None  # this request's, see cache_use

    def use_costs(self, costs: VerifyCost, draft: DraftCost | None = None) -> None:
        """Its lockstep decodes feed the draft backend's cost model, the engine's."""
        if draft is not None:
            self.cost = draft

    def follow(self, spec: GrammarSpec | None, start: int) -> None:
        """Follow this grammar from position `start` (the prompt's length) on, now."""
        self._drop_grammar()
        if spec is not None:
            try:
                self._grammar = GrammarTrail(Grammar.for_backend(spec, self.backend), start)
            except ConfigError:       # only the target must apply it; drafting goes on free
                self._grammar = None

    def begin(self, prompt: Sequence[int], sampling_: SamplingParams, params: DraftParams, *,
              policy=None, grammar: GrammarSpec | None = None) -> None:
        """policy: stop drafts where this adaptive policy says (None: at --draft-p-min, or
        at a stop_rule set from outside); grammar: follow it from the prompt's end."""
        if policy is not None:
            self.stop_rule, self._steered = policy.keep_drafting, True
        self.follow(grammar, len(prompt))
        if params.seed is not None:
            sampling_ = replace(sampling_, seed=params.seed)
        self.sampling, self.params = sampling_, params
        kept = usable_prefix(self.backend, prompt)
        self._cache_use = (kept, len(prompt) - kept)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        return self.draft_from(history, k)

    def draft_in_steps(self, history: Sequence[int], k: int) -> Drafting:
        """This sequence's draft in progress, for draft_together (drafters/lockstep.py) to
        step beside the other sequences of the same draft context."""
        return Drafting(self._steps(history, k), self.backend, self.shared, self.seq,
                        self.cost)

    def draft_from(self, history: Sequence[int], k: int, on_token=None,
                   at_choice=None) -> Draft:
        """Draft up to k tokens after history, alone.

        on_token(i, token, sparse_or_None) is called as each token is drafted (a draft
        node streams it from there) and may return False to stop early.
        at_choice(row, ctx, token) is called first, while the cache holds exactly ctx
        and token is chosen for the next position: a node drafts its alternates there
        (it must leave the cache holding ctx).
        """
        steps = self._steps(history, k, on_token, at_choice)
        try:
            want = next(steps)
            while True:
                want = steps.send(self.backend.eval(want, logits="last")[-1])
        except StopIteration as stop:
            return stop.value

    def _steps(self, history: Sequence[int], k: int, on_token=None,
               at_choice=None) -> DraftSteps:
        """The draft as steps: yields the tokens to evaluate (the history's catch-up, then
        each drafted token), is sent their last logits row, returns the draft."""
        be, sp, dp = self.backend, self.sampling, self.params
        k = min(k, be.n_ctx - len(history))
        if k <= 0:
            return Draft()
        kept = sync_prefix(be, history)
        row = yield list(history[kept:])
        rejection = dp.mode is VerifyMode.REJECTION and not sp.greedy
        stop_rule = self.stop_rule
        draft = Draft(sparse=[] if rejection else None,
                      confidence=[] if stop_rule or dp.p_min > 0.0 else None)
        ctx = list(history)
        grammar = self._grammar_after(history)
        allow = _cheap(grammar, be.n_vocab) if grammar is not None else None
        try:
            for i in range(k):
                if draft.confidence is not None:
                    p = sampling.top_prob(row)
                    if not (stop_rule(i, p) if stop_rule else p >= dp.p_min):
                        break
                    draft.confidence.append(p)
                recent = sampling.recent_window(ctx, sp)
                sd = None
                try:
                    if rejection:
                        sd = sampling.sparse_draft(row, sp, dp.top_k_q, len(ctx), recent, allow)
                        tok = sd.token
                    else:
                        tok = sampling.coupled(row, sp, len(ctx), recent, allow)
                    if grammar is not None:
                        grammar.accept(tok)
                except ConfigError:       # the grammar is at its end: nothing more to draft
                    break
                if at_choice is not None:
                    at_choice(row, ctx, tok)
                if sd is not None:
                    draft.sparse.append(sd)
                draft.tokens.append(tok)
                ctx.append(tok)
                if on_token is not None and on_token(i, tok, sd) is False:
                    break
                if i + 1 == k:
                    break
                row = yield [tok]
        finally:
            if grammar is not None:
                grammar.close()
        self._drafted += len(draft)
        return draft

    def _grammar_after(self, history: Sequence[int]) -> Grammar | None:
        """A scratch copy of the grammar's state after history (None: nothing to follow)."""
        return self._grammar.after(history) if self._grammar is not None else None

    def _drop_grammar(self) -> None:
        if self._grammar is not None:
            self._grammar.close()
            self._grammar = None

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        """Nothing to do: the next proposal re-syncs the cache by common prefix."""

    def end(self) -> None:
        self._drop_grammar()
        if self._steered:
            self.stop_rule, self._steered = None, False

    def cache_use(self) -> tuple[int, int] | None:
        """(draft_cache_n, draft_prompt_n): the request's prompt tokens this model's cache
        held at its start, and those it evaluates (at its first draft) to catch up."""
        return self._cache_use

    def stats(self) -> dict[str, float]:
        """Counters over this drafter's life, as every drafter's: tokens drafted, ms inside
        the draft's llama_decode (the engine takes each request's share)."""
        return {"drafted": float(self._drafted), "decode_ms": 1000 * self._decode_s()}

    def _decode_s(self) -> float:
        """Seconds inside the draft's llama_decode for this sequence: in a shared draft
        context its share of each decode, not the other sequences' drafts."""
        return (self.shared.seq_decode_s(self.seq) if self.shared is not None
                else self.backend.decode_s)


def _cheap(grammar: Grammar, n_vocab: int):
    """The grammar as a drafter asks it: never about the whole vocabulary.

    Where none of the draft's best few thousand tokens fits (at the end of a JSON
    document only end-of-generation does), a whole-vocabulary scan would cost far
    more than one speculative token is worth: the draft stops there instead.
    """
    def allow(ids):
        if len(ids) >= n_vocab:
            raise ConfigError("draft: no likely token fits the grammar")
        return grammar.allowed(ids)
    return allow
