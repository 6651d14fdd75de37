"""The target's side of a drafter that works ahead: on another machine, or on a thread.

A draft node (specwire/link/session.py) drafts a *branch* of tokens past the
last verdict and streams it in chunks tagged with a branch number `gen`. This
class keeps the newest branch (link/received.py, which checks every token against
the history by content, so a stale, reordered or lying chunk can only be ignored,
never change an output token) and, each round, hands the engine the part that
extends the committed history, and sends the verdicts. A Transport says how the
messages travel: over gRPC (link/transport/grpc_client.py, for RemoteDrafter) or by a
function call to a DraftSession in this process (link/threaded.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import replace

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Capabilities, Draft, DrafterBase
from specwire.drafters.bubble import BubbleWait
from specwire.link.alternates import AlternateParams
from specwire.link.messages import (
    MAX_ALTERNATES,
    MAX_CHUNK_TOKENS,
    NOTICE_AFTER,
    Chunk,
    Close,
    Open,
    Verdict,
    f32_sampling,
)
from specwire.link.received import ReceivedBranch
from specwire.link.round_timing import RoundTiming
from specwire.link.transport.base import LinkCounters, Transport
from specwire.policy.costs import VerifyCost
from specwire.policy.scoped import Scoped

log = logging.getLogger("specwire.branch")

#: How far the adaptive policy's stop threshold moves before a verdict carries it again.
KEEP_MIN_SLACK = 0.15
#: The alternates a pipelined drafter is asked for unless its builder says otherwise.
DEFAULT_ALTERNATES = AlternateParams()
#: Synchronous rounds in a row in which the drafter answered with nothing usable before it
#: is dropped (an honest drafter's answer to a verdict always extends the history).
USELESS_LIMIT = 3




def lookahead_for(n_max: int) -> int:
    """How far past the last verdict a pipelined drafter drafts by default: the round's
    draft, its guess at the target's bonus token, and the next round's whole draft, so
    that a round that keeps everything finds the next one drafted at its verdict (with
    twice n_max, the next draft's last token waited for the verdict, and the target for
    it: docs/benchmarks.md)."""
    return 2 * max(1, n_max) + 1


class BranchDrafter(DrafterBase):
    """Pipelined (never waits) or synchronous (waits for `k` tokens, with a deadline)."""

    name = "branch"
    remote = False  # its q comes over the network (RemoteDrafter)

    def __init__(self, transport: Transport, n_vocab: int, pipelined: bool = True,
                 lookahead: int = 0, sync_timeout_s: float = 1.0, *,
                 alternates: AlternateParams | None = DEFAULT_ALTERNATES,
                 tree: int = MAX_ALTERNATES,
                 timing: bool = False,
                 bubbles: Scoped[BubbleWait] | None = None) -> None:
        """alternates: the alternates to ask a pipelined drafter for (None: none); tree: how
        many of them a round may verify beside the draft (0: chains); timing: ask the
        drafter how long it worked on each chunk; bubbles: what the bubble rule learned
        per cache scope, kept by whoever replaces this drafter with the next (bench builds
        one per prompt: the estimates carry over, as a server's drafter per slot keeps
        them and as the policy's do; None: its own)."""
        self.transport = transport
        self.n_vocab, self.pipelined, self.lookahead = n_vocab, pipelined, lookahead
        self.sync_timeout_s = sync_timeout_s
        # Ask the node how long it worked on each chunk (DraftChunk.busy_us): what
        # link_overhead needs to tell the link's cost from drafting. Off by default,
        # as it adds about 4 bytes to every chunk.
        self.timing = timing
        # Pipelined: ask the drafter for pre-drafted branches (link/alternates.py);
        # None asks for none. A drafter that predates them ignores the request.
        self.alternates: AlternateParams | None = alternates if pipelined else None
        # Hand up to this many of those alternates to the engine as side branches of the
        # draft, for a target that verifies trees (engine/tree_round.py: --draft-tree), where
        # the drafter follows the tree rule; the Open tells the drafter (0: chains). Its
        # builders give it from the target's settings (link/remote.py, build.py).
        self.tree = tree
        # Pipelined: after a rejection, wait a moment for the fresh branch when that pays
        # more than a plain step (drafters/bubble.py); None never waits. Off where the
        # engine's step holds other sequences, or another drafter's draft may be ready.
        #: per cache scope, the bubble rule's estimates (acceptance and rate are learned
        #: from that scope's text: policy/scoped.py); begin picks one
        self.bubbles: Scoped[BubbleWait] | None = None
        self.bubble: BubbleWait | None = None
        if pipelined:
            self.bubbles = bubbles or Scoped(self._fresh_bubble, BubbleWait())
            self.bubble = self.bubbles.get("")
        self._cv = threading.Condition()
        self._session = 0  # bumps at every open: older chunks are ignored
        self._history: list[int] = []
        self._told = 0  # committed tokens the drafter knows
        self._sampling = SamplingParams()
        self._params = DraftParams()
        self._active = False
        self._late = False  # sync mode: the drafter missed a deadline; stop waiting
        self._k = 0
        self._k_told = 0  # the k the drafter last heard
        # Synchronous: branch tokens kept in the first round since the last verdict, None
        # while no round has ended since it.
        self._accepted: int | None = None
        self._policy = None  # an adaptive policy steering synchronous drafts (see begin)
        self._ahead = 0  # chunks received that start at or past the history's end
        self._useless_rounds = 0  # synchronous rounds in a row answered with nothing usable
        self._keep_min = 0.0  # the stop threshold the drafter was last told
        # This request's sessions: history tokens the drafter found cached and evaluated
        # (summed over its sessions, e.g. after a reconnect); None until one reported.
        self._cache_use: tuple[int, int] | None = None
        self.counters = LinkCounters()
        #: the newest branch the drafter sent, checked against the history (under _cv)
        self.received = ReceivedBranch(self.counters)
        self._aim = 0  # pipelined: the tokens a waiting round waits for
        self._draft_gen = -1  # the branch they came from
        #: when this request's rounds and branches happened (the bubble rule learns it)
        self.times = RoundTiming(self.counters)
        transport.bind(self)

    @property
    def capabilities(self) -> Capabilities:
        """The draft session sends its sparse q in rejection mode. Pipelined: it drafts
        ahead, and may hold a round for the fresh branch (bubble); synchronous: it sends
        a round's verdict and k ahead of propose (ask)."""
        return Capabilities(provides_q=True, remote=self.remote, pipelined=self.pipelined,
                            asks_ahead=not self.pipelined, waits=self.bubble is not None)

    def never_wait(self) -> None:
        """Never hold a round for a fresh branch: the step carries other sequences, or
        another drafter's draft may be ready."""
        self.bubble = self.bubbles = None

    # -- what the transport calls back ---------------------------------------------

    @property
    def lock(self) -> threading.Condition:
        """Guards the buffer and the session number; notified when a chunk arrives."""
        return self._cv

    @property
    def session(self) -> int:
        """The current session's number: chunks of another are stale."""
        return self._session

    def invalidate(self) -> None:
        """Make the current session's chunks stale (it is being dropped)."""
        with self._cv:
            self._session += 1

    @property
    def history(self) -> list[int]:
        return self._history

    @property
    def active(self) -> bool:
        """A request is running (between begin and end)."""
        return self._active

    @property
    def k(self) -> int:
        """The tokens the current round asks for."""
        return self._k

    def restart(self) -> None:
        """Open a new session on the current history (a reconnect)."""
        self._start(list(self._history))

    # -- Drafter protocol (engine thread) -----------------------------------------

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar=None) -> None:
        """policy: under an adaptive policy, synchronous drafts stop by its calibrated rule:
        the drafter is told the policy's threshold and judges its confidence itself. (A
        pipelined drafter drafts on its own core and is never stopped early.)"""
        self._policy = policy
        if self.bubble is not None and self.bubbles is not None:
            self.bubble = self.bubbles.get(params.cache_scope)
        self._sampling, self._params = f32_sampling(sampling), params
        self._history = list(prompt)
        self._active, self._late, self._k = True, False, params.n_max
        self.times = RoundTiming(self.counters)
        self._cache_use = None
        self._start(list(prompt))

    def use_costs(self, costs: VerifyCost, draft: object = None) -> None:
        """The bubble rule reads the target's verification cost (the engine's)."""
        if self.bubble is not None and self.bubbles is not None:
            for scope in self.bubbles.scopes():
                bubble = self.bubbles.peek(scope)
                bubble.costs, bubble.own_costs = costs, False

    def _fresh_bubble(self) -> BubbleWait:
        """A new scope's bubble rule: the priors, reading the machine's verification cost."""
        assert self.bubble is not None
        return BubbleWait(costs=self.bubble.costs, own_costs=self.bubble.own_costs)

    def ask(self, history: Sequence[int], k: int) -> None:
        """Synchronous: send this round's verdict and k now; the propose that follows finds
        it told and only waits (a batch's sessions then draft at the same time)."""
        if self.pipelined or not self.transport.live():
            return
        self._history = history if isinstance(history, list) else list(history)
        self._k = k
        self._tell(history, self._accepted or 0)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        self._history = history if isinstance(history, list) else list(history)
        self._draft_gen = -1
        if not self.pipelined:
            self._k = k
        if not self.transport.live():
            self.transport.revive()
            return Draft()
        # The verdict on what the drafter has not heard of (the first token; in synchronous
        # mode, every round since it was last asked), with this round's k.
        self._tell(history, self._accepted or 0)
        if self._late:
            self.transport.poll()
        deadline = None if self.pipelined or self._late else time.monotonic() + self.sync_timeout_s
        t0 = time.perf_counter()
        useless = False
        with self._cv:
            ahead, heard = self._ahead, self._heard()
            while True:
                draft, complete = self._usable(history, k)
                if deadline is None and self.pipelined:
                    deadline = self._bubble_deadline(len(draft), k)
                    if deadline is not None:
                        continue
                if complete or deadline is None or not self.transport.live():
                    break
                if self.pipelined:
                    if len(draft) >= self._aim or time.monotonic() >= deadline:
                        break
                    self.transport.wait(deadline - time.monotonic())
                    continue
                if self._ahead != ahead:
                    # The answer to this verdict came and extends nothing. (An answer to an
                    # earlier message, which an honest drafter may still be sending, starts
                    # inside the history; an answer to this one always extends it.)
                    useless = True
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self.counters.sync_timeouts += 1
                    self._late = True
                    useless = self._heard() != heard  # it sent only stale chunks meanwhile
                    log.warning(
                        "drafter %s missed the %.0f ms deadline; not waiting for it "
                        "until it catches up",
                        self.name,
                        1000 * self.sync_timeout_s,
                    )
                    break
                self.transport.wait(left)
        self.times.proposed(len(draft), t0, self.pipelined)
        if self.pipelined and deadline is not None:
            self.counters.waited_rounds += 1
            self.counters.waited_ms += 1000 * self.times.waited_s
            self.counters.waited_empty += not draft.tokens
            if not draft.tokens and self.bubble is not None:
                self.bubble.missed()
        self._judge_answer(draft, useless)
        return draft

    def _bubble_deadline(self, have: int, k: int) -> float | None:
        """Pipelined, a round with fewer than k tokens: the time.monotonic() until
        which to wait for the drafter (setting self._aim, the tokens worth waiting for),
        or None to verify what is there (drafters/bubble.py). Under self._cv."""
        since = self.times.since_verdict()
        if (self.bubble is None or self.received.done or self._late or since is None
                or not self.transport.live() or have >= k):
            return None
        aim, wait_s = self.bubble.aim(have, k, since, fresh=have == 0)
        if aim <= have:
            return None
        self._aim = aim
        _, per_token = self.bubble.arrival.coefficients()
        return time.monotonic() + wait_s + 0.5 * per_token + 0.001

    def _heard(self) -> float:
        return self.counters.chunks + self.counters.stale_chunks

    def _judge_answer(self, draft: Draft, useless: bool) -> None:
        """Count synchronous rounds answered uselessly; drop the drafter after USELESS_LIMIT
        in a row (each would otherwise cost a round, or a whole deadline)."""
        if draft.tokens:
            self._useless_rounds = 0
            self.transport.useful()
        if not useless:
            return
        self._useless_rounds += 1
        self.counters.useless_answers += 1
        if self._useless_rounds >= USELESS_LIMIT:
            self._useless_rounds = 0
            self.transport.useless(f"{USELESS_LIMIT} synchronous answers in a row extend nothing")

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        """Pipelined: send the verdict now, the drafter is at work. Synchronous: keep it
        for the next propose, which knows how many tokens to ask for (the adaptive k, 0
        for rounds that skip the drafter); it waits for the verdict either way."""
        self.times.learned(accepted, self.bubble)
        if self.pipelined:
            self._tell(history, accepted)
        elif len(history) > self._told and self._accepted is None:
            self._accepted = accepted

    def end(self) -> None:
        self._active, self._policy = False, None
        with self._cv:
            self._session += 1
        if self.transport.live():
            self.transport.post(Close())
        self.transport.detach()

    def stats(self) -> dict[str, float]:
        return self.counters.as_dict()

    def cache_use(self) -> tuple[int, int] | None:
        """(draft_cache_n, draft_prompt_n) of this request, if the drafter said."""
        with self._cv:
            return self._cache_use

    # -- verdicts -------------------------------------------------------------------

    def _tell(self, history: Sequence[int], accepted: int) -> None:
        """Send the verdict for history[told:]: `accepted` branch tokens, then the target's own."""
        if not self.transport.live() or len(history) <= self._told:
            return
        position, self._told = self._told, len(history)
        self._accepted = None
        own = list(history[position + accepted :])
        with self._cv:
            self.received.done = False  # the drafter works again after a verdict
            self.times.told()
            gen = max(self.received.gen, 0)
            # After a rejection where the drafter sent an alternate that the target's own
            # tokens begin: its rest is the next round's draft (ReceivedBranch).
            alternate = self.received.take_alternate(position + accepted, own,
                                                     self._draft_gen, self.transport.trees())
        # Fields that say nothing new stay 0, which the wire sends no byte for: gen when
        # no token is accepted, k when it is unchanged or the drafter pipelined.
        v = Verdict(position, accepted, own, alternate=alternate)
        if accepted or alternate:
            v.gen = gen
        if not self.pipelined and self._k != self._k_told:
            v.k = self._k_told = self._k
        if self._calibrated():
            # Five bytes, sent only when the threshold moved by more than KEEP_MIN_SLACK: it
            # moves a little every round, while a draft's P(all kept) falls by a bin's
            # calibrated chance (0.6-0.97) per token, so a smaller change seldom moves a stop.
            keep_min = self._policy.stop_threshold()
            if abs(keep_min - self._keep_min) > KEEP_MIN_SLACK * self._keep_min:
                v.keep_min = self._keep_min = min(1.0, max(keep_min, 1e-6))
        self.transport.post(v)

    def _calibrated(self) -> bool:
        return not self.pipelined and self._policy is not None

    def _start(self, history: list[int]) -> None:
        self._told = len(history)
        self._accepted = None
        with self._cv:
            self._session += 1
            self.received, self._aim = ReceivedBranch(self.counters), 0
            session = self._session
        self.transport.detach()
        self.transport.open(session, history)

    def open_message(self, history: list[int]) -> Open:
        p, mode = self._params, self._params.mode
        if self._sampling.greedy:
            mode = VerifyMode.GREEDY
        sampling = self._sampling if p.seed is None else replace(self._sampling, seed=p.seed)
        return Open(
            history=history,
            sampling=sampling,
            mode=mode,
            pipelined=self.pipelined,
            lookahead=self.lookahead or lookahead_for(p.n_max),
            k=self._open_k(),
            p_min=p.p_min,
            top_k_q=p.top_k_q,
            timing=self.timing,
            calibrated=self._calibrated(),
            keep_min=self._open_keep_min(),
            alternates=self.alternates.per_chunk if self.pipelined and self.alternates else 0,
            alternate_len=self.alternates.length if self.pipelined and self.alternates else 0,
            cache_scope=p.cache_scope,
            no_store=not p.cache_store,
            tree=self.tree if self.pipelined and self.alternates else 0,
            second_choices=bool(self.tree and self.pipelined and self.alternates),
        )

    def _open_k(self) -> int:
        self._k_told = self._k
        return self._k

    def _open_keep_min(self) -> float:
        if not self._calibrated():
            return 0.0
        self._keep_min = min(1.0, max(self._policy.stop_threshold(), 0.0))
        return self._keep_min

    # -- the received branch (under self._cv) ---------------------------------------

    def _usable(self, history: Sequence[int], k: int) -> tuple[Draft, bool]:
        """Tokens of the current branch that extend history; and whether to stop waiting."""
        got = self.received.usable(history, k)
        if got is None:
            return Draft(), False
        tokens, sparse = got
        if tokens:
            self._draft_gen = self.received.gen
        complete = len(tokens) >= min(k, self._k) or self.received.done
        return Draft(tokens, sparse, branches=self._branches(len(history), len(tokens))), \
            complete

    def _branches(self, start: int, n: int) -> list[tuple[int, list[int]]] | None:
        """The alternates sent for the n draft tokens from `start`, as side branches a
        tree round may verify (their drafter follows the tree rule)."""
        if not self.tree or not self.transport.trees():
            return None
        return self.received.side_branches(start, n)

    def on_chunk(self, session: int, c: Chunk) -> None:
        """A chunk arrived (transport thread). Raises ProtocolError for a broken peer."""
        c.check(self.n_vocab, len(self._history) + 4 * MAX_CHUNK_TOKENS)
        with self._cv:
            if session != self._session:
                self.counters.stale_chunks += 1
                return
            self.counters.chunks += 1
            self.counters.tokens_received += len(c.tokens)
            self.counters.node_busy_ms += c.busy_us / 1000
            if c.cache_n is not None:
                self._count_cache(c.cache_n, c.prompt_n or 0)
            if self.received.stale(c.gen):
                self.counters.stale_chunks += 1
                return
            n = len(self._history)
            self._ahead += c.start >= n
            newer = self.received.add(c, n, whole=not self.pipelined)
            self.times.arrived(c.gen, newer, len(c.tokens), self.bubble)
            self.counters.alternates_received += len(c.alternates)
            self.counters.second_choices += sum(len(a.tokens) == 1 for a in c.alternates)
            # An empty chunk saying the drafter is catching up (its first, on many tokens,
            # or a later one still behind): decode plainly, not waiting, until drafts come.
            behind = c.prompt_n or 0
            self._late = not c.tokens and (
                behind > NOTICE_AFTER or (behind > 0 and c.cache_n is None))
            self._cv.notify_all()

    def _count_cache(self, cache_n: int, prompt_n: int) -> None:
        """A session's first message said how much of its history was cached (under _cv)."""
        self.counters.draft_cache_n += cache_n
        self.counters.draft_prompt_n += prompt_n
        c, p = self._cache_use or (0, 0)
        self._cache_use = (c + cache_n, p + prompt_n)

    def wake(self) -> None:
        with self._cv:
            self._cv.notify_all()
