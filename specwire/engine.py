"""The speculative decoding loop: the same whether the drafter is local or remote.

One round: ask the drafter for up to k tokens, evaluate [last, d1..dk] on the
target in one batch, verify, roll the KV cache back to what was kept, tell the
drafter. With an empty draft the round is a plain decoding step, so a drafter
that has nothing to offer costs nothing but the call. The drafter is only ever
called through its DraftGuard (drafters/guard.py): whatever it does, the request
goes on as plain decoding.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from specwire.backend.base import Backend, reusable_prefix
from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.constraints.grammar import Grammar, GrammarSpec
from specwire.drafters.base import Draft, Drafter, NoDrafter
from specwire.drafters.guard import DraftGuard, check_verify_mode
from specwire.logprobs import LogprobsSpec, TokenProb
from specwire.policy import AdaptivePolicy, FixedPolicy, PolicyMemory
from specwire.stats import Stats
from specwire.verify import Verifier


@dataclass(slots=True)
class Request:
    prompt: list[int]
    n_predict: int = 128
    sampling: SamplingParams = SamplingParams()
    draft: DraftParams = DraftParams()
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None     # constrains the target's sampling (lossless)
    logprobs: LogprobsSpec | None = None   # record the target's probabilities per token
    #: llama-server's cache_prompt: start from what the target's cache holds of the prompt.
    #: False evaluates the whole prompt again.
    cache_prompt: bool = True

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt: is empty (no tokens)")
        if self.n_predict < 0:
            raise ConfigError(f"n_predict: must be >= 0, got {self.n_predict}")


class Generation:
    """A running request: iterate for lists of new token ids; then read stats.

    stop_type is llama-server's: "eos", "limit" (n_predict or context), or
    "word" when the caller stops it on a stop string via stop(). Closing the
    iterator early (client gone) ends the drafter's sequence at once.
    `probs` holds one TokenProb per generated token when the request asked for them.
    """

    def __init__(self, engine: Engine, req: Request) -> None:
        self.engine, self.req = engine, req
        self.stats = Stats()
        self.tokens: list[int] = []
        self.stop_type = "none"
        self.truncated = False
        self.probs: list[TokenProb] = []
        self._stopped = False
        self._it = self._run()

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        return next(self._it)

    def stop(self, stop_type: str = "word") -> None:
        self.stop_type, self._stopped = stop_type, True

    def close(self) -> None:
        self._it.close()

    def run(self) -> list[int]:
        """Drive to the end; return the generated token ids."""
        for _ in self:
            pass
        return self.tokens

    def _run(self) -> Iterator[list[int]]:
        eng, req, st = self.engine, self.req, self.stats
        target, drafter = eng.target, eng.guard if req.draft.enabled else eng.no_drafter
        grammar = Grammar.for_backend(req.grammar, target) if req.grammar is not None else None
        verifier = Verifier(req.sampling, req.draft.mode, grammar, req.logprobs)
        self.probs = verifier.probs
        # Plain requests leave the learned policies alone: they would teach them nothing.
        policy = (eng.policies.policy(req.draft.policy, req.draft.n_max) if req.draft.enabled
                  else FixedPolicy(0))
        prompt = req.prompt
        if len(prompt) + (1 if req.n_predict else 0) > target.n_ctx:
            raise ConfigError(
                f"prompt: {len(prompt)} tokens do not fit the context of {target.n_ctx} (-c)"
            )
        if req.n_predict == 0:
            self.stop_type = "limit"
            return
        # A draft model stops where the adaptive policy finds the next token not worth it.
        steer = getattr(drafter, "steer", None) if isinstance(policy, AdaptivePolicy) else None
        if steer is not None:
            steer(policy)
        # A drafter that can follow the grammar drafts only what it allows: more accepted tokens.
        constrain = getattr(drafter, "constrain", None) if req.grammar is not None else None
        if constrain is not None:
            constrain(req.grammar)
        drafter.begin(prompt, req.sampling, req.draft)
        try:
            t0 = time.perf_counter()
            kept = eng.reuse_cache(prompt) if req.cache_prompt else 0
            if kept < target.n_past:
                target.truncate(kept)
            rows = target.eval(prompt[kept:], logits="last")
            first = verifier.sample(rows[-1], prompt)
            t1 = time.perf_counter()
            st.prompt_n, st.prompt_ms = len(prompt) - kept, 1000 * (t1 - t0)
            st.cache_n = kept
            decode0 = getattr(target, "decode_s", 0.0)
            history = [*prompt, first]
            new = self._emit([first])
            if new:
                yield new
            while not self._stopped:
                remaining = req.n_predict - len(self.tokens)
                room = target.n_ctx - len(history)
                if remaining <= 0 or room <= 0:
                    self.stop_type, self.truncated = "limit", room <= 0 and remaining > 0
                    break
                # A round appends up to k + 1 tokens; plain decoding stops at a full context.
                k = policy.choose(min(remaining, room) - 1)
                ta = time.perf_counter()
                draft = drafter.propose(history, k) if k > 0 else Draft()
                if len(draft) > k:
                    draft = draft.cut(k)
                if len(draft) < req.draft.n_min:
                    draft = Draft()
                tb = time.perf_counter()
                rows = target.eval([history[-1], *draft.tokens], logits="all")
                verdict = verifier.verify(rows, history, draft.tokens, draft.sparse)
                target.truncate(len(history) + verdict.accepted)
                tc = time.perf_counter()
                st.draft_ms += 1000 * (tb - ta)
                st.verify_ms += 1000 * (tc - tb)
                if not draft.tokens:
                    st.plain_steps += 1
                    st.plain_ms += 1000 * (tc - tb)
                st.record_round(len(draft), verdict.accepted, k)
                policy.observe(len(draft), verdict.accepted, tb - ta, tc - tb, draft.confidence)
                appended = [*draft.tokens[: verdict.accepted], verdict.token]
                new = self._emit(appended)
                history.extend(new)
                if new:
                    yield new
                if self.stop_type == "none" and not self._stopped:
                    drafter.learn(history, verdict.accepted, len(appended))
            st.predicted_n = len(self.tokens)
            st.predicted_ms = 1000 * (time.perf_counter() - t1)
            st.target_decode_ms = 1000 * (getattr(target, "decode_s", 0.0) - decode0)
        finally:
            st.drafter = drafter.stats()
            use = getattr(drafter, "cache_use", None)
            if callable(use) and (got := use()) is not None:
                st.draft_cache_n, st.draft_prompt_n = got
            drafter.end()
            if steer is not None:
                steer(None)
            if constrain is not None:
                constrain(None)
            if grammar is not None:
                grammar.close()

    def _emit(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens to the output up to end-of-generation or n_predict."""
        out = []
        for t in tokens:
            if not self.req.ignore_eos and self.engine.target.is_eog(t):
                self.stop_type = "eos"
                self._stopped = True
                break
            out.append(t)
            if len(self.tokens) + len(out) >= self.req.n_predict:
                self.stop_type = "limit"
                self._stopped = True
                break
        self.tokens.extend(out)
        return out


class Engine:
    """A target backend, the drafter that serves it, and what its draft policy learned.

    Requests run one at a time; `policies` may be shared by engines that take
    turns on the same target and drafter (bench rebuilds the drafter per prompt).
    """

    def __init__(
        self, target: Backend, drafter: Drafter | None = None, policies: PolicyMemory | None = None,
        verify: VerifyMode | None = None,
    ) -> None:
        """verify: the verification mode requests will use, if known: a drafter that cannot
        serve it is refused here (ConfigError) rather than mid-request."""
        self.target = target
        #: llama-server's --cache-reuse: shift cached chunks of at least this many tokens
        #: past the common prefix into place (0: the common prefix only).
        self.cache_reuse = 0
        self.no_drafter = NoDrafter()
        self.drafter = drafter or self.no_drafter
        if verify is not None:
            try:
                check_verify_mode(self.drafter, verify)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.guard = DraftGuard(self.drafter, target.n_vocab)
        self.policies = policies if policies is not None else PolicyMemory()

    def generate(self, req: Request) -> Generation:
        return Generation(self, req)

    def reuse_cache(self, prompt: Sequence[int]) -> int:
        """How many prompt tokens the target's cache can keep: the common prefix, and with
        --cache-reuse the chunks shifted into place after it (a backend that cannot shift
        keeps the prefix only)."""
        kept = reusable_prefix(self.target.tokens, prompt)
        if self.cache_reuse > 0 and kept < len(self.target.tokens):
            shift = getattr(self.target, "reuse_chunks", None)
            if callable(shift):
                kept = shift(prompt, kept, self.cache_reuse)
        return kept
