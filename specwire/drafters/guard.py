"""The one place where a drafter's failure becomes plain decoding, and the one wrapper.

A drafter only buys speed, so nothing it does may fail a request: an exception from any
method, tokens outside the vocabulary or a draft without the q rejection mode needs is
logged, counted (`guard_failures`), ends the drafter's sequence, and rounds decode plainly
while it rests for a pause that doubles per failure in a row (BACKOFF_MIN_S to
BACKOFF_MAX_S). DraftGuard reads the drafter's Capabilities once and calls an optional
member only where declared. A `deterministic` drafter (its draft never depends on the
target's random draws) gets a point mass at each drafted token as its q, which keeps
speculative sampling exact.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Capabilities, Draft, Drafter, LinkStatus, cut_branches
from specwire.drafters.lockstep import Drafting
from specwire.sample.constraints.grammar import GrammarSpec
from specwire.sample.sampling import SparseDraft

log = logging.getLogger("specwire.engine")

BACKOFF_MIN_S = 0.25
BACKOFF_MAX_S = 30.0


class DrafterFailure(Exception):
    """A drafter returned something the engine cannot use; the message says what."""


def point_q(tokens: Sequence[int]) -> list[SparseDraft]:
    one = np.ones(1, dtype=np.float32)
    return [SparseDraft(int(t), np.array([t], dtype=np.int64), one.copy()) for t in tokens]


class DraftGuard:
    """Forwards the drafter protocol to `drafter`, turning every failure into an empty
    draft and a pause, after which the drafter is begun again on the current history; a
    round with a usable draft resets the pause. Lives as long as its engine, so the pause
    spans requests."""

    def __init__(self, drafter: Drafter, n_vocab: int, hold: bool = True) -> None:
        """hold: the drafter may hold a round for a fresh branch (False where the step
        carries other sequences: a declared `waits` drafter is told never_wait)."""
        if not hold and drafter.capabilities.waits:
            drafter.never_wait()
        self.drafter, self.n_vocab = drafter, n_vocab
        self.name = drafter.name
        self.capabilities: Capabilities = drafter.capabilities
        self.backend = drafter.backend
        self.failures = 0  # in a row
        self.total_failures = 0
        self.retry_at = 0.0
        self._live = False  # begun, and not failed since
        self._sampling = SamplingParams()
        self._params = DraftParams()
        self._policy = None
        self._grammar: GrammarSpec | None = None
        self._one_hot = False

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams, *,
              policy=None, grammar: GrammarSpec | None = None) -> None:
        self._sampling, self._params = sampling, params
        self._policy, self._grammar = policy, grammar
        rejection = params.mode is VerifyMode.REJECTION and not sampling.greedy
        self._one_hot = rejection and not self.capabilities.provides_q
        self._live = False
        self._start(prompt)

    def propose(self, history: Sequence[int], k: int) -> Draft:
        if not self._live and not self._start(history):
            return Draft()
        try:
            draft = self._checked(self.drafter.propose(history, k), k)
        except Exception as e:  # noqa: BLE001 - the boundary: any failure is plain decoding
            self._failed("propose", e)
            return Draft()
        if draft.tokens:
            self.failures = 0
        return draft

    def ask(self, history: Sequence[int], k: int) -> None:
        """Let a live drafter that declares asks_ahead send this round's request now."""
        if not self._live or not self.capabilities.asks_ahead:
            return
        try:
            self.drafter.ask(history, k)
        except Exception as e:  # noqa: BLE001
            self._failed("ask", e)

    def drafting(self, history: Sequence[int], k: int) -> Drafting | Draft:
        """A draft to be stepped in lockstep with other sequences' (`draft_together`) from
        a drafter that declares lockstep, then handed to `drafted`; any other drafter's
        draft now, as propose gives it."""
        if not self.capabilities.lockstep:
            return self.propose(history, k)
        if not self._live and not self._start(history):
            return Draft()
        try:
            return self.drafter.draft_in_steps(history, k)
        except Exception as e:  # noqa: BLE001
            self._failed("propose", e)
            return Draft()

    def drafted(self, run: Drafting | Draft, k: int) -> Draft:
        """The draft of a finished `drafting` (checked, as propose's), or the Draft itself."""
        if isinstance(run, Draft):
            return run
        try:
            if run.error is not None:
                raise run.error
            draft = self._checked(run.draft, k)
        except Exception as e:  # noqa: BLE001
            self._failed("propose", e)
            return Draft()
        if draft.tokens:
            self.failures = 0
        return draft

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        if not self._live:
            return
        try:
            self.drafter.learn(history, accepted, appended)
        except Exception as e:  # noqa: BLE001
            self._failed("learn", e)

    def end(self) -> None:
        if self._live:
            self._live = False
            self._end()

    def rebase(self, history: Sequence[int]) -> None:
        """The history changed other than by appending (a context shift): the drafter's
        sequence ends and starts again on it, since what it cached or was told no longer
        matches (a remote drafter opens a new session on the shifted history)."""
        self.end()
        self._start(history)

    def stats(self) -> dict[str, float]:
        try:
            out = dict(self.drafter.stats())
        except Exception as e:  # noqa: BLE001
            log.warning("drafter %s: stats failed: %s", self.name, _describe(e))
            out = {}
        if self.total_failures:
            out["guard_failures"] = float(self.total_failures)
        return out

    def use_costs(self, costs, draft=None) -> None:
        try:
            self.drafter.use_costs(costs, draft)
        except Exception as e:  # noqa: BLE001
            self._failed("use_costs", e)

    def cache_use(self) -> tuple[int, int] | None:
        """(draft_cache_n, draft_prompt_n) from a drafter that keeps a cache, else None."""
        try:
            return self.drafter.cache_use()
        except Exception as e:  # noqa: BLE001
            self._failed("cache_use", e)
            return None

    def status(self) -> tuple[LinkStatus, ...]:
        """Each link's state, from a drafter that declares links (else none)."""
        if not self.capabilities.links:
            return ()
        try:
            return tuple(self.drafter.status())
        except Exception as e:  # noqa: BLE001 - a report: logged, not a failure
            log.warning("drafter %s: status failed: %s", self.name, _describe(e))
            return ()

    def close(self) -> None:
        try:
            self.drafter.close()
        except Exception as e:  # noqa: BLE001
            log.warning("drafter %s: close failed: %s", self.name, _describe(e))

    # -- inside the boundary ----------------------------------------------------------

    def _start(self, history: Sequence[int]) -> bool:
        """Begin the drafter's sequence on history, unless it is resting; True if live."""
        if time.monotonic() < self.retry_at:
            return False
        try:
            self.drafter.begin(history, self._sampling, self._params, policy=self._policy,
                               grammar=self._grammar)
        except Exception as e:  # noqa: BLE001
            self._failed("begin", e)
            return False
        self._live = True
        return True

    def _checked(self, draft: object, k: int) -> Draft:
        if not isinstance(draft, Draft):
            raise DrafterFailure(f"proposed a {type(draft).__name__}, not a Draft")
        tokens = draft.tokens
        if not tokens:
            return draft
        if len(tokens) > k:
            draft = draft.cut(k)
            tokens = draft.tokens
        if not all(type(t) is int or isinstance(t, int | np.integer) for t in tokens):
            raise DrafterFailure("proposed token ids that are not integers")
        if min(tokens) < 0 or max(tokens) >= self.n_vocab:
            raise DrafterFailure(f"proposed token ids outside the vocabulary of {self.n_vocab}")
        if draft.branches:
            ids = [t for _, alt in draft.branches for t in alt]
            if not all(isinstance(t, int | np.integer) and 0 <= t < self.n_vocab for t in ids):
                raise DrafterFailure("proposed branch token ids outside the vocabulary of "
                                     f"{self.n_vocab}")
            draft.branches = cut_branches(draft.branches, len(tokens))
        if self._one_hot:
            draft.sparse = point_q(tokens)
        elif self._params.mode is VerifyMode.REJECTION and not self._sampling.greedy and (
                draft.sparse is None or len(draft.sparse) != len(tokens)):
            raise DrafterFailure("proposed a draft without its q in rejection mode")
        return draft

    def _failed(self, where: str, e: Exception) -> None:
        self.failures += 1
        self.total_failures += 1
        pause = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** (self.failures - 1))
        self.retry_at = time.monotonic() + pause
        log.warning("drafter %s failed in %s (%s); decoding plainly, retry in %.2f s",
                    self.name, where, _describe(e), pause)
        if self._live:
            self._live = False
            self._end()

    def _end(self) -> None:
        try:
            self.drafter.end()
        except Exception as e:  # noqa: BLE001
            log.warning("drafter %s: end failed: %s", self.name, _describe(e))


def _describe(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"[:300]


def check_verify_mode(drafter: Drafter, mode: VerifyMode) -> None:
    """Refuse a drafter that cannot take part in `mode` (raises ValueError naming it);
    log once that rejection mode trusts a remote drafter's q. A deterministic drafter
    without q passes: DraftGuard gives its drafts a one-hot q."""
    if mode is not VerifyMode.REJECTION:
        return
    caps = drafter.capabilities
    if not caps.provides_q and not caps.deterministic:
        raise ValueError(
            f"--verify rejection: the drafter {drafter.name} gives no draft "
            f"distribution q and its drafts are not deterministic; use --verify coupled")
    if caps.remote:
        _log_trust_once(drafter)


_trust_logged = False


def _log_trust_once(drafter: Drafter) -> None:
    global _trust_logged
    if _trust_logged:
        return
    _trust_logged = True
    log.warning("--verify rejection trusts the q that the remote drafter %s sends: a hostile "
                "one can steer the output; coupled verification (the default) cannot be "
                "steered by any draft", drafter.name)
