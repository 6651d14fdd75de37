"""The engine: requests in, token ids out, one target decode per step.

A step schedules every running sequence's part (a round: the last token and the
draft length its policy picks; or a prompt chunk), drafts the rounds, decodes all
the parts at once on the target, and hands each sequence its rows to verify and
emit (scheduler.py, round.py). With an empty draft a round is a plain decoding
step, so a drafter that has nothing to offer costs nothing but the call. The
drafter is only ever called through its DraftGuard (drafters/guard.py): whatever
it does, the request goes on as plain decoding.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from specwire.backend.base import Backend, reusable_prefix, window_kept
from specwire.backend.batch import BatchBackend, as_batch
from specwire.config import ConfigError, VerifyMode
from specwire.drafters.base import Drafter, NoDrafter
from specwire.drafters.guard import DraftGuard, check_verify_mode
from specwire.engine.request import Request
from specwire.engine.scheduler import Batch, BatchScheduler
from specwire.engine.sequence import SequenceState, adapter_scales
from specwire.engine.stats import Stats
from specwire.policy.adaptive import AdaptivePolicy, Policy, PolicyMemory
from specwire.policy.scoped import Scoped
from specwire.policy.tree import TreeYield
from specwire.sample.constraints.grammar import Grammar
from specwire.sample.logprobs import TokenProb
from specwire.sample.verify import Verifier

if TYPE_CHECKING:
    from specwire.drafters.ngram.persist import CacheFile

__all__ = ["Engine", "Generation", "Request"]


class Generation:
    """A running request, the caller's handle: iterate for lists of new token ids; then
    read tokens and stats.

    It is one sequence of its engine's batch (sequence.py); iterating it runs the
    engine's steps until it has new tokens, so a single request is the batch of one.
    stop_type is llama-server's: "eos", "limit" (n_predict or context), or "word" when
    the caller stops it on a stop string via stop(). Closing it early (client gone)
    ends the drafter's sequence and frees the sequence at once. `probs` holds one
    TokenProb per generated token when the request asked for them.
    """

    def __init__(self, engine: Engine, state: SequenceState) -> None:
        self.engine, self.state = engine, state

    def __iter__(self) -> Iterator[list[int]]:
        return self

    def __next__(self) -> list[int]:
        s = self.state
        while not s.out:
            if s.error is not None:
                err, s.error = s.error, None
                raise err
            if s.done:
                raise StopIteration
            self.engine.step()
        return s.pending()

    def stop(self, stop_type: str = "word") -> None:
        self.state.stop(stop_type)

    def close(self) -> None:
        """Leave the batch now (a no-op once done)."""
        self.engine.scheduler.leave(self.state)

    def run(self) -> list[int]:
        """Drive to the end; return the generated token ids."""
        for _ in self:
            pass
        return self.tokens

    def pending(self) -> list[int]:
        """The tokens produced since the last call (the server's worker reads them)."""
        return self.state.pending()

    @property
    def req(self) -> Request:
        return self.state.req

    @property
    def seq(self) -> int:
        return self.state.seq

    @property
    def tokens(self) -> list[int]:
        return self.state.tokens

    @property
    def stats(self) -> Stats:
        return self.state.stats

    @property
    def probs(self) -> list[TokenProb]:
        return self.state.probs

    @property
    def stop_type(self) -> str:
        return self.state.stop_type

    @property
    def truncated(self) -> bool:
        return self.state.truncated

    @property
    def shifts(self) -> int:
        """Context shifts done (--context-shift)."""
        return self.state.shifts

    @property
    def error(self) -> Exception | None:
        return self.state.error

    @property
    def done(self) -> bool:
        """Left the batch (finished, stopped, failed or closed)."""
        return self.state.done

    @property
    def policy(self) -> Policy:
        """The draft-length policy this generation ran with (its state at the end)."""
        return self.state.policy


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
        self.no_drafter = NoDrafter()
        drafters = (list(drafter) if isinstance(drafter, (list, tuple))
                    else [drafter or self.no_drafter] * (1 if drafter else self.batch.n_seq))
        if len(drafters) != self.batch.n_seq:
            raise ConfigError(f"{len(drafters)} drafters for {self.batch.n_seq} sequences: "
                              "each sequence needs a drafter of its own")
        self.drafters = drafters
        self.drafter = drafters[0]
        if verify is not None:
            try:
                for d in drafters:
                    check_verify_mode(d, verify)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        # A round waiting for its drafter would hold every step of a batch.
        self.guards = [DraftGuard(d, self.target.n_vocab, hold=self.batch.n_seq == 1)
                       for d in drafters]
        self.guard = self.guards[0]
        self.policies = policies if policies is not None else PolicyMemory()
        #: each sequence's policies: a policy holds the state of its round in progress
        self.memories = [self.policies, *(PolicyMemory() for _ in drafters[1:])]
        #: the target's verification cost, fed by every decode of rounds and read by the
        #: policies, the drafters and the bubble rule (policy/costs.py); it goes with what
        #: the policies learned, as the machine's
        self.costs = self.policies.costs
        # One drafting cost per draft backend, kept beside each sequence's policies: the
        # sequences that draft in lockstep share one draft context (ModelDrafter.per_sequence),
        # so one model; any other sequence's drafter has a backend (or none) of its own.
        shared = [m for m, g in zip(self.memories, self.guards, strict=True)
                  if g.capabilities.lockstep]
        for memory in shared[1:]:
            memory.draft = shared[0].draft
        for guard, memory in zip(self.guards, self.memories, strict=True):
            guard.use_costs(self.costs, memory.draft)
        self.scheduler = BatchScheduler(self.batch, self.start)
        #: each sequence's cache scope: that of the request whose tokens its KV caches (the
        #: target's and a local draft model's) hold; "" for every request of a server
        #: without API keys or cache_salt
        self.scopes = [""] * self.batch.n_seq
        #: what side branches of verified trees added (policy/tree.py), per cache scope
        #: (policy/scoped.py); scope ""'s is tree_yield
        self.tree_yields: Scoped[TreeYield] = Scoped(TreeYield)
        #: llama-server's --context-shift: a full context drops half of what follows the
        #: request's n_keep tokens and generation goes on (False: it stops there). Only
        #: for a target whose cache can shift (its `shift`; see enable_context_shift).
        self.context_shift = False
        #: the adapter scales each sequence's cache was computed under (SequenceState.lora);
        #: a cache restored from a file is taken to be the target's own
        self.cache_lora: list[tuple[float, ...]] = [
            adapter_scales(self.batch.seq(i)) for i in range(self.batch.n_seq)]
        #: --lookup-cache-dynamic: the n-gram drafters' cache file (build.py sets it), which
        #: the command saves when it ends
        self.lookup_file: CacheFile | None = None

    @property
    def tree_yield(self) -> TreeYield:
        """Scope ""'s tree yield (a server without API keys or cache_salt has no other)."""
        return self.tree_yields.get("")

    @tree_yield.setter
    def tree_yield(self, value: TreeYield) -> None:
        self.tree_yields = Scoped(TreeYield, value)

    @property
    def n_seq(self) -> int:
        return self.batch.n_seq

    def generate(self, req: Request, seq: int | None = None) -> Generation:
        """A generation in sequence `seq` (default: a free one); it joins the batch now.
        With every sequence (or `seq`) running a generation: BatchFull, and the batch goes
        on untouched (a generation leaves it when done or closed)."""
        def make(s: int) -> SequenceState:
            drafter = self.guards[s] if req.draft.enabled else self.no_drafter
            return SequenceState(req, s, self.batch.seq(s), drafter)

        return Generation(self, self.scheduler.join(make, seq))

    def step(self) -> None:
        """One decode for every running sequence: plan each part (a decoding sequence's
        policy picks its k), draft the rounds together, decode all the parts at once,
        and hand each sequence its rows."""
        batch = self.scheduler.schedule()
        self.scheduler.draft(batch)
        rows = self.decode(batch)
        if rows is not None:
            self.scheduler.postprocess(batch, rows)

    def decode(self, batch: Batch) -> list[np.ndarray] | None:
        """The step's one target decode, timed into the target's costs; None where it
        failed, which fails every sequence in it."""
        if not batch.planned:
            return []
        parts = batch.parts
        t0 = time.perf_counter()
        try:
            first = batch.planned[0][0]
            if first.lora:     # the step's sequences share their adapter scales (scheduler)
                first.target.apply_lora(first.lora)
            rows = self.batch.decode(parts)
        except Exception as e:  # noqa: BLE001 - each sequence in the step reports it
            for s, _ in batch.planned:
                self.scheduler.fail(s, e)
            return None
        batch.decode_s = time.perf_counter() - t0
        # A step that reads a prompt chunk is off the curve: its chunk's tokens cost far
        # less each than rounds' (one logits row, not one per token), and a long one would
        # set the line's slope alone.
        if all(p.logits == "all" for p in parts):
            self.costs.observe(sum(len(p.tokens) for p in parts), batch.decode_s)
        return rows

    def start(self, s: SequenceState) -> None:
        """A sequence joins the batch: its verifier, its policy, the drafter's sequence
        (given the policy and the grammar), the target's cache."""
        req, target, drafter = s.req, s.target, s.drafter
        s.started = True
        s.batch = self.batch
        s.costs = self.costs
        s.tree_yield = self.tree_yields.get(req.draft.cache_scope)
        s.context_shift = self.context_shift
        s.t0 = time.perf_counter()
        s.grammar = (Grammar.for_backend(req.grammar, target) if req.grammar is not None
                     else None)
        s.verifier = Verifier(req.sampling, req.draft.mode, s.grammar, req.logprobs)
        s.probs = s.verifier.probs
        # Plain requests leave the learned policies alone: they would teach them nothing.
        if req.draft.enabled:
            s.policy = self.policy(s.seq, req.draft.policy, req.draft.n_max,
                                   req.draft.cache_scope)
        prompt = req.prompt
        n_adapters = len(adapter_scales(target))
        if req.lora is not None and len(req.lora) != n_adapters:
            raise ConfigError(f"lora: {len(req.lora)} scales for the target's {n_adapters} "
                              "adapters (--lora)")
        if len(prompt) + (1 if req.n_predict else 0) > target.n_ctx:
            raise ConfigError(
                f"prompt: {len(prompt)} tokens do not fit the context of {target.n_ctx} (-c)"
            )
        if req.n_predict == 0:
            s.stop_type, s.done = "limit", True
            return
        # A draft model stops where the adaptive policy finds the next token not worth it;
        # one that ends its own drafts (declared: stops) is asked for the most.
        adaptive = s.policy if isinstance(s.policy, AdaptivePolicy) else None
        if adaptive is not None:
            adaptive.drafter_stops = drafter.capabilities.stops
        self.enter_scope(s.seq, req.draft.cache_scope)
        s.begun = True
        s.drafter0 = drafter.stats()
        # A drafter that can follow the grammar drafts only what it allows: more accepted.
        drafter.begin(prompt, req.sampling, req.draft, policy=adaptive, grammar=req.grammar)
        if isinstance(s.policy, AdaptivePolicy):
            # What its first draft must catch up with: the prompt, less the drafter's cache.
            got = drafter.cache_use()
            s.policy.behind(got[1] if got is not None else 0)
        # A cache computed under other adapter scales holds other keys and values.
        same_lora = self.cache_lora[s.seq] == s.lora
        kept = self.reuse_cache(target, prompt) if req.cache_prompt and same_lora else 0
        self.cache_lora[s.seq] = s.lora
        if kept < target.n_past:
            target.truncate(kept)
        kept = target.n_past   # a backend that cannot cut its cache there empties it
        s.prefilled = kept
        s.stats.prompt_n, s.stats.cache_n = len(prompt) - kept, kept

    def policy(self, seq: int, name: str, n_max: int, scope: str = "") -> Policy:
        """Sequence seq's policy for (name, n_max) in cache scope `scope`. A sequence's
        first one starts from what the most experienced other sequence learned in the same
        scope (the costs are the machine's, the acceptance the drafter's on that scope's
        text), not from the priors. Its verification cost is the target's (self.costs),
        which every decode feeds; its drafting cost the sequence's draft backend's
        (memory.draft)."""
        memory = self.memories[seq]
        key = (name, n_max)
        if key not in memory.by_scope.get(scope):
            held = [(m, m.by_scope.peek(scope)) for m in self.memories]
            donors = [(m, p[key]) for m, p in held if p is not None and key in p]
            if donors:
                best, donor = max(donors, key=lambda d: _experience(d[1]))
                keep = {id(self.costs): self.costs, id(best.draft): best.draft}
                memory.by_scope.get(scope)[key] = copy.deepcopy(donor, keep)
                memory.draft.adopt(best.draft)
        policy = memory.policy(name, n_max, scope)
        if isinstance(policy, AdaptivePolicy):
            policy.costs, policy.own_costs = self.costs, False
            policy.draft = memory.draft
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

    def enter_scope(self, seq: int, scope: str) -> None:
        """A request of cache scope `scope` starts in sequence seq: if the sequence's caches
        hold another scope's tokens, empty them (the target's and a local draft model's),
        so that no request reuses, or learns through cache_n, draft_cache_n or the time
        its prompt took, what a request of another scope left there."""
        if self.scopes[seq] == scope:
            return
        self.scopes[seq] = scope
        self.batch.seq(seq).truncate(0)
        backend = self.guards[seq].backend
        if backend is not None:
            backend.truncate(0)

    def reuse_cache(self, target: Backend, prompt: Sequence[int]) -> int:
        """How many prompt tokens a sequence's cache can keep: the common prefix, and with
        --cache-reuse the chunks shifted into place after it (a backend that cannot shift
        keeps the prefix only); none where the cache lost cells of their attention window
        (a sliding-window cache after a long sequence: base.window_kept)."""
        kept = reusable_prefix(target.tokens, prompt)
        if self.cache_reuse > 0 and kept < len(target.tokens):
            kept = target.reuse_chunks(prompt, kept, self.cache_reuse)
        return window_kept(target, kept)


def _experience(policy: Policy) -> int:
    """Rounds a policy has learned from: only the adaptive one learns."""
    return policy.state.asked_rounds if isinstance(policy, AdaptivePolicy) else 0
