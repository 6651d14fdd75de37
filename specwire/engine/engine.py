"""The speculative decoding loop: the same whether the drafter is local or remote.

One round: ask the drafter for up to k tokens, evaluate [last, d1..dk] on the
target in one batch, verify, roll the KV cache back to what was kept, tell the
drafter. With an empty draft the round is a plain decoding step, so a drafter
that has nothing to offer costs nothing but the call. The drafter is only ever
called through its DraftGuard (drafters/guard.py): whatever it does, the request
goes on as plain decoding.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from specwire.backend.base import Backend, reusable_prefix
from specwire.backend.batch import BatchBackend, Part, as_batch
from specwire.config import ConfigError, DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Draft, Drafter, NoDrafter
from specwire.drafters.bubble import never_wait
from specwire.drafters.guard import DraftGuard, check_verify_mode
from specwire.drafters.lockstep import Drafting
from specwire.engine.context_shift import plan_shift, shifted
from specwire.engine.round import Round
from specwire.engine.scheduler import BatchScheduler
from specwire.engine.stats import Stats, counter_delta
from specwire.policy.adaptive import AdaptivePolicy, FixedPolicy, Policy, PolicyMemory
from specwire.sample.constraints.grammar import Grammar, GrammarSpec
from specwire.sample.logprobs import LogprobsSpec, TokenProb
from specwire.sample.verify import Verifier

if TYPE_CHECKING:
    from specwire.drafters.ngram.persist import CacheFile


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
    #: llama-server's n_keep (--keep): the prompt tokens a context shift keeps (-1: all);
    #: it only matters where the engine shifts the context (Engine.context_shift).
    n_keep: int = 0
    #: llama-server's n_discard: the tokens a shift drops (0: half of those after n_keep).
    n_discard: int = 0
    #: llama-server's per-request `lora`: every loaded adapter's scale for this request
    #: (None: the target's own, as --lora and POST /lora-adapters set them).
    lora: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt: is empty (no tokens)")
        if self.n_predict < 0:
            raise ConfigError(f"n_predict: must be >= 0, got {self.n_predict}")
        if self.n_keep < -1:
            raise ConfigError(f"n_keep: must be >= -1 (-1: the whole prompt), got {self.n_keep}")
        if self.n_discard < 0:
            raise ConfigError(f"n_discard: must be >= 0, got {self.n_discard}")
        if self.lora is not None and not all(np.isfinite(self.lora)):
            raise ConfigError(f"lora: scales must be finite numbers, got {list(self.lora)}")


class Generation:
    """A running request: iterate for lists of new token ids; then read stats.

    It is one sequence of its engine's batch: the engine's step (scheduler.py) asks
    it for its part of the decode (`plan`) and hands it its logits rows (`take`);
    iterating it alone runs those steps until it has new tokens, so a single request
    is the batch of one. stop_type is llama-server's: "eos", "limit" (n_predict or
    context), or "word" when the caller stops it on a stop string via stop().
    truncated: the context's end stopped it, or (with context shift) it was shifted.
    Closing it early (client gone) ends the drafter's sequence and frees the
    sequence at once. `probs` holds one TokenProb per generated token when the
    request asked for them.
    """

    def __init__(self, engine: Engine, req: Request, seq: int) -> None:
        self.engine, self.req, self.seq = engine, req, seq
        self.stats = Stats()
        self.tokens: list[int] = []
        self.stop_type = "none"
        self.truncated = False
        self.shifts = 0                 # context shifts done (Engine.context_shift)
        self.probs: list[TokenProb] = []
        self.error: Exception | None = None
        self.done = False               # left the batch (finished, stopped, failed or closed)
        self._stopped = False
        self._out: list[int] = []       # tokens not yet handed to the iterator
        self._round: Round | None = None
        self._started = self._begun = False
        self._drafter0: dict[str, float] = {}   # the drafter's counters as this request began
        self._t0 = self._t1 = 0.0
        self._prefilled = 0             # prompt tokens in the target's cache
        self._history: list[int] = []
        self._decode_s = 0.0            # the target's decode time in this request's steps
        self.target = engine.batch.seq(seq)
        self.drafter: DraftGuard | NoDrafter = (engine.guards[seq] if req.draft.enabled
                                                else engine.no_drafter)
        self._grammar: Grammar | None = None
        self._verifier: Verifier | None = None
        self._policy: Policy = FixedPolicy(0)
        self._steer = self._constrain = None

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        while not self._out:
            if self.error is not None:
                err, self.error = self.error, None
                raise err
            if self.done:
                raise StopIteration
            self.engine.step()
        out, self._out = self._out, []
        return out

    def stop(self, stop_type: str = "word") -> None:
        self.stop_type, self._stopped = stop_type, True

    def close(self) -> None:
        """Leave the batch now (a no-op once done)."""
        self.engine.scheduler.leave(self)

    def run(self) -> list[int]:
        """Drive to the end; return the generated token ids."""
        for _ in self:
            pass
        return self.tokens

    def pending(self) -> list[int]:
        """The tokens produced since the last call (the server's worker reads them)."""
        out, self._out = self._out, []
        return out

    @property
    def policy(self) -> Policy:
        """The draft-length policy this generation ran with (its state at the end)."""
        return self._policy

    # -- the scheduler's side --------------------------------------------------

    @property
    def lora(self) -> tuple[float, ...]:
        """The adapter scales its target decodes run with: the request's own, else the
        target's (the scheduler decodes together only sequences with equal ones)."""
        if self.req.lora is not None:
            return self.req.lora
        return tuple(getattr(self.target, "lora_scales", ()))

    @property
    def decoding(self) -> bool:
        """Past its prompt: its parts are a round (last token and draft), not a chunk."""
        return self._started and self._prefilled == len(self.req.prompt)

    def plan(self, budget: int, batch_tokens: int) -> Part | None:
        """This step's part, at most `budget` tokens; None to sit this step out. Ends
        the generation (done) when it has nothing more to do. batch_tokens: what the
        other sequences put into the same decode (the adaptive policy's concern)."""
        if not self._started:
            self._start()
            if self.done:
                return None
        if self._stopped:
            self.done = True
            return None
        if budget <= 0:
            return None
        prompt = self.req.prompt
        if self._prefilled < len(prompt):
            chunk = prompt[self._prefilled:self._prefilled + budget]
            last = self._prefilled + len(chunk) == len(prompt)
            return Part(self.seq, chunk, "last" if last else "none")
        remaining = self.req.n_predict - len(self.tokens)
        room = self.target.n_ctx - len(self._history)
        if room <= 0 < remaining and self.engine.context_shift:
            room = self._shift_context()
        if remaining <= 0 or room <= 0:
            self.stop_type = "limit"
            self.truncated = self.truncated or (room <= 0 and remaining > 0)
            self.done = True
            return None
        # A round appends up to k + 1 tokens; plain decoding stops at a full context.
        k = min(self._policy.choose(min(remaining, room) - 1, batch_tokens=batch_tokens),
                budget - 1)
        now = time.perf_counter()
        self._round = Round(Draft(), max(k, 0), now, now)
        return Part(self.seq, [self._history[-1]], "all")

    def _shift_context(self) -> int:
        """A full context shifted as llama-server does (context_shift.py); the room it
        made (0 when nothing can be dropped)."""
        target, req = self.target, self.req
        shift = plan_shift(target.n_past, len(req.prompt), req.n_keep, target.n_ctx,
                           bool(getattr(target, "adds_bos", False)), req.n_discard)
        if shift is None:
            return 0
        target.shift(shift.keep, shift.discard)
        self._history = shifted(self._history, shift)
        self.truncated = True
        self.shifts += 1
        self.drafter.rebase(self._history)
        return target.n_ctx - len(self._history)

    @property
    def asked(self) -> int:
        """The draft length this step's round asks for (0: none, or not a round)."""
        return self._round.k if self._round is not None else 0

    def ask(self) -> None:
        """The round's draft request goes out now (a remote drafter's verdict and k), before
        any sequence of the step waits for its draft."""
        self.drafter.ask(self._history, self._round.k)

    def drafting(self) -> Drafting | Draft:
        """The round's draft: in progress, for the step to draft together with the other
        sequences' (a draft model's sequence), or done now (any other drafter)."""
        self._round.started = time.perf_counter()
        return self.drafter.drafting(self._history, self._round.k)

    def drafted(self, part: Part, run: Drafting | Draft) -> None:
        """The round's draft is in: it follows the last token in this step's part."""
        rnd = self._round
        draft = self.drafter.drafted(run, rnd.k)
        if len(draft) > rnd.k:
            draft = draft.cut(rnd.k)
        if len(draft) < self.req.draft.n_min:
            draft = Draft()
        rnd.draft, rnd.drafted = draft, time.perf_counter()
        if isinstance(run, Drafting):
            rnd.own_s, rnd.steady_s = run.spent, run.steady_s
        part.tokens.extend(draft.tokens)

    def take(self, rows: np.ndarray, decode_s: float) -> None:
        """The step's rows for this sequence's part: verify, roll back, emit."""
        prompt, st = self.req.prompt, self.stats
        if self._round is None:     # a prompt chunk
            self._prefilled = self.target.n_past
            if self._prefilled < len(prompt):
                return
            first = self._verifier.sample(rows[-1], prompt)
            self._t1 = time.perf_counter()
            st.prompt_ms += 1000 * (self._t1 - self._t0)
            self._history = [*prompt, first]
            self._out.extend(self._emit([first]))
            return
        rnd, self._round = self._round, None
        tv = time.perf_counter()
        self._decode_s += decode_s
        draft, history = rnd.draft, self._history
        verdict = self._verifier.verify(rows, history, draft.tokens, draft.sparse)
        self.target.truncate(len(history) + verdict.accepted)
        # Verification: the step's decode and this sequence's own check, not the time the
        # other sequences of the step spent drafting or verifying.
        verify_s = decode_s + time.perf_counter() - tv
        st.draft_ms += 1000 * (rnd.drafted - rnd.started)
        st.verify_ms += 1000 * verify_s
        if not draft.tokens:
            st.plain_steps += 1
            st.plain_ms += 1000 * verify_s
        st.record_round(len(draft), verdict.accepted, rnd.k)
        self._policy.observe(len(draft), verdict.accepted, rnd.draft_s, verify_s,
                             draft.confidence, steady_s=rnd.steady_s)
        appended = [*draft.tokens[: verdict.accepted], verdict.token]
        new = self._emit(appended)
        history.extend(new)
        self._out.extend(new)
        if self.stop_type == "none" and not self._stopped:
            self.drafter.learn(history, verdict.accepted, len(appended))

    def _start(self) -> None:
        """Joining the batch: the verifier, the policy, the drafter's sequence, the cache."""
        eng, req, target, drafter = self.engine, self.req, self.target, self.drafter
        self._started = True
        self._t0 = time.perf_counter()
        self._grammar = (Grammar.for_backend(req.grammar, target) if req.grammar is not None
                         else None)
        self._verifier = Verifier(req.sampling, req.draft.mode, self._grammar, req.logprobs)
        self.probs = self._verifier.probs
        # Plain requests leave the learned policies alone: they would teach them nothing.
        if req.draft.enabled:
            self._policy = eng.policy(self.seq, req.draft.policy, req.draft.n_max)
        prompt = req.prompt
        n_adapters = len(getattr(target, "lora_scales", ()))
        if req.lora is not None and len(req.lora) != n_adapters:
            raise ConfigError(f"lora: {len(req.lora)} scales for the target's {n_adapters} "
                              "adapters (--lora)")
        if len(prompt) + (1 if req.n_predict else 0) > target.n_ctx:
            raise ConfigError(
                f"prompt: {len(prompt)} tokens do not fit the context of {target.n_ctx} (-c)"
            )
        if req.n_predict == 0:
            self.stop_type, self.done = "limit", True
            return
        # A draft model stops where the adaptive policy finds the next token not worth it.
        if isinstance(self._policy, AdaptivePolicy):
            self._steer = drafter.steer
            self._steer(self._policy)
        # A drafter that can follow the grammar drafts only what it allows: more accepted.
        if req.grammar is not None:
            self._constrain = drafter.constrain
            self._constrain(req.grammar)
        self._begun = True
        self._drafter0 = drafter.stats()
        drafter.begin(prompt, req.sampling, req.draft)
        if isinstance(self._policy, AdaptivePolicy):
            # What its first draft must catch up with: the prompt, less the drafter's cache.
            got = drafter.cache_use()
            self._policy.behind(got[1] if got is not None else 0)
        # A cache computed under other adapter scales holds other keys and values.
        same_lora = eng.cache_lora[self.seq] == self.lora
        kept = eng.reuse_cache(target, prompt) if req.cache_prompt and same_lora else 0
        eng.cache_lora[self.seq] = self.lora
        if kept < target.n_past:
            target.truncate(kept)
        self._prefilled = kept
        self.stats.prompt_n, self.stats.cache_n = len(prompt) - kept, kept

    def finish(self) -> None:
        """Leaving the batch: final figures, and the drafter's sequence ended."""
        st = self.stats
        if self._t1:
            st.predicted_n = len(self.tokens)
            st.predicted_ms = 1000 * (time.perf_counter() - self._t1)
            st.target_decode_ms = 1000 * self._decode_s
        try:
            if self._begun:
                st.drafter = counter_delta(self._drafter0, self.drafter.stats())
                if (got := self.drafter.cache_use()) is not None:
                    st.draft_cache_n, st.draft_prompt_n = got
                self.drafter.end()
        finally:
            if self._steer is not None:
                self._steer(None)
            if self._constrain is not None:
                self._constrain(None)
            if self._grammar is not None:
                self._grammar.close()

    def _emit(self, tokens: Sequence[int]) -> list[int]:
        """Append tokens to the output up to end-of-generation or n_predict."""
        out = []
        for t in tokens:
            if not self.req.ignore_eos and self.target.is_eog(t):
                self.stop_type = "eos"
                self._stopped = True
                break
            out.append(t)
            if len(self.tokens) + len(out) >= self.req.n_predict:
                self.stop_type = "limit"
                self._stopped = True
                break
        self.tokens.extend(out)
        if self._stopped:
            self.done = True
        return out


class Engine:
    """A target holding one or more sequences, a drafter per sequence, and what the draft
    policies learned.

    With a plain Backend (or a LlamaBackend of one sequence) requests run one at a time;
    with a LlamaBackend of n_seq sequences, up to n_seq run at once and every step is one
    decode for all of them (scheduler.py). `policies` may be shared by engines that take
    turns on the same target and drafter (bench rebuilds the drafter per prompt).
    """

    def __init__(
        self, target: Backend | BatchBackend, drafter: Drafter | Sequence[Drafter] | None = None,
        policies: PolicyMemory | None = None, verify: VerifyMode | None = None,
    ) -> None:
        """drafter: one per sequence of the target (one drafter holds one sequence).
        verify: the verification mode requests will use, if known: a drafter that cannot
        serve it is refused here (ConfigError) rather than mid-request."""
        self.batch = as_batch(target)
        self.target = self.batch.seq(0)
        #: llama-server's --cache-reuse: shift cached chunks of at least this many tokens
        #: past the common prefix into place (0: the common prefix only).
        self.cache_reuse = 0
        #: llama-server's --context-shift: a full context drops half of what follows the
        #: request's n_keep tokens and generation goes on (False: it stops there). Only
        #: for a target whose cache can shift (its `shift`; see enable_context_shift).
        self.context_shift = False
        #: the adapter scales each sequence's cache was computed under (Generation.lora);
        #: a cache restored from a file is taken to be the target's own
        self.cache_lora: list[tuple[float, ...]] = [
            tuple(getattr(self.batch.seq(i), "lora_scales", ())) for i in range(self.batch.n_seq)]
        self.no_drafter = NoDrafter()
        drafters = (list(drafter) if isinstance(drafter, (list, tuple))
                    else [drafter or self.no_drafter] * (1 if drafter else self.batch.n_seq))
        if len(drafters) != self.batch.n_seq:
            raise ConfigError(f"{len(drafters)} drafters for {self.batch.n_seq} sequences: "
                              "each sequence needs a drafter of its own")
        if self.batch.n_seq > 1:  # a round waiting for its drafter would hold every step
            drafters = [never_wait(d) for d in drafters]
        self.drafters = drafters
        self.drafter = drafters[0]
        if verify is not None:
            try:
                for d in drafters:
                    check_verify_mode(d, verify)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        self.guards = [DraftGuard(d, self.target.n_vocab) for d in drafters]
        self.guard = self.guards[0]
        self.policies = policies if policies is not None else PolicyMemory()
        #: each sequence's policies: a policy holds the state of its round in progress
        self.memories = [self.policies, *(PolicyMemory() for _ in drafters[1:])]
        self.scheduler = BatchScheduler(self.batch)
        #: --lookup-cache-dynamic: the n-gram drafters' cache file (build.py sets it), which
        #: the command saves when it ends
        self.lookup_file: CacheFile | None = None

    @property
    def n_seq(self) -> int:
        return self.batch.n_seq

    def generate(self, req: Request, seq: int | None = None) -> Generation:
        """A generation in sequence `seq` (default: a free one); it joins the batch now.
        With every sequence (or `seq`) running a generation: BatchFull, and the batch goes
        on untouched (a generation leaves it when done or closed)."""
        return self.scheduler.join(lambda s: Generation(self, req, s), seq)

    def policy(self, seq: int, name: str, n_max: int) -> Policy:
        """Sequence seq's policy for (name, n_max). A sequence's first one starts from what
        the most experienced other sequence learned (the costs are the machine's, the
        acceptance the drafter's), not from the priors. In a batch its verification line
        is the scheduler's, which every decode feeds."""
        memory = self.memories[seq]
        key = (name, n_max)
        if key not in memory.policies:
            donors = [m.policies[key] for m in self.memories if key in m.policies]
            if donors:
                best = max(donors, key=_experience)
                memory.policies[key] = copy.deepcopy(best)
        policy = memory.policy(name, n_max)
        if self.n_seq > 1 and isinstance(policy, AdaptivePolicy):
            # One verification curve for every sequence: the target's (scheduler.py).
            policy.verify, policy.fits_verify = self.scheduler.verify, False
        return policy

    def enable_context_shift(self) -> None:
        """--context-shift: refused (ConfigError) for a target that cannot shift its cache."""
        for i in range(self.n_seq):
            seq = self.batch.seq(i)
            can = getattr(seq, "can_shift", None)
            if can is None or not can():
                raise ConfigError(f"--context-shift: the target {seq.name} cannot shift its "
                                  "KV cache (llama_memory_can_shift is false)")
        self.context_shift = True

    def step(self) -> None:
        """One decode for every running sequence (see BatchScheduler.step)."""
        self.scheduler.step()

    def reuse_cache(self, target: Backend, prompt: Sequence[int]) -> int:
        """How many prompt tokens a sequence's cache can keep: the common prefix, and with
        --cache-reuse the chunks shifted into place after it (a backend that cannot shift
        keeps the prefix only)."""
        kept = reusable_prefix(target.tokens, prompt)
        if self.cache_reuse > 0 and kept < len(target.tokens):
            kept = target.reuse_chunks(prompt, kept, self.cache_reuse)
        return kept


def _experience(policy: Policy) -> int:
    """Rounds a policy has learned from: only the adaptive one learns."""
    return policy.asked_rounds if isinstance(policy, AdaptivePolicy) else 0
