"""The one place where a drafter's failure becomes plain decoding.

A drafter only ever buys speed, so nothing it does may fail a request: not an
exception of any type from any of its methods, not tokens outside the
vocabulary, not a draft without the q that rejection mode needs. The engine
calls its drafter only through DraftGuard. A failure is logged, counted
(`guard_failures` in the drafter's stats), the drafter's sequence is ended,
and rounds decode plainly while the drafter rests for a pause that doubles
with each failure in a row (BACKOFF_MIN_S up to BACKOFF_MAX_S); then it is
begun again on the current history. A round with a usable draft resets the pause.

Rejection mode also passes through here: a drafter that declares itself
`deterministic` (its draft never depends on the target's random draws: a
lookup, a greedy draft, a remote greedy server, a generator of its own) gets
a point mass at each drafted token as its q, which keeps speculative sampling
exact (accept with probability p(x), else sample p with x removed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Draft, Drafter, declared
from specwire.drafters.lockstep import Drafting
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
    draft and a pause. Lives as long as its engine, so the pause spans requests."""

    def __init__(self, drafter: Drafter, n_vocab: int) -> None:
        self.drafter, self.n_vocab = declared(drafter), n_vocab
        self.name = self.drafter.name
        self.provides_q = self.drafter.provides_q
        self.deterministic = self.drafter.deterministic
        self.remote = self.drafter.remote
        self.pipelined = self.drafter.pipelined
        self.self_stopping = self.drafter.self_stopping
        self.backend = self.drafter.backend
        self.failures = 0  # in a row
        self.total_failures = 0
        self.retry_at = 0.0
        self._live = False  # begun, and not failed since
        self._sampling = SamplingParams()
        self._params = DraftParams()
        self._one_hot = False

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams) -> None:
        self._sampling, self._params = sampling, params
        rejection = params.mode is VerifyMode.REJECTION and not sampling.greedy
        self._one_hot = rejection and not self.provides_q
        self._live = False
        self._start(prompt)

    def propose(self, history: Sequence[int], max_n: int) -> Draft:
        if not self._live and not self._start(history):
            return Draft()
        try:
            draft = self._checked(self.drafter.propose(history, max_n), max_n)
        except Exception as e:  # noqa: BLE001 - the boundary: any failure is plain decoding
            self._failed("propose", e)
            return Draft()
        if draft.tokens:
            self.failures = 0
        return draft

    def ask(self, history: Sequence[int], max_n: int) -> None:
        """Let a live drafter send this round's request ahead of propose (DrafterBase.ask)."""
        if not self._live:
            return
        try:
            self.drafter.ask(history, max_n)
        except Exception as e:  # noqa: BLE001
            self._failed("ask", e)

    def drafting(self, history: Sequence[int], max_n: int) -> Drafting | Draft:
        """A draft to be stepped in lockstep with other sequences' (`draft_together`) from
        a drafter that can (`drafting`), then handed to `drafted`; any other drafter's
        draft now, as propose gives it."""
        if not self.drafter.lockstep:
            return self.propose(history, max_n)
        if not self._live and not self._start(history):
            return Draft()
        try:
            return self.drafter.draft_in_steps(history, max_n)
        except Exception as e:  # noqa: BLE001
            self._failed("propose", e)
            return Draft()

    def drafted(self, run: Drafting | Draft, max_n: int) -> Draft:
        """The draft of a finished `drafting` (checked, as propose's), or the Draft itself."""
        if isinstance(run, Draft):
            return run
        try:
            if run.error is not None:
                raise run.error
            draft = self._checked(run.draft, max_n)
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

    def stats(self) -> dict[str, float]:
        try:
            out = dict(self.drafter.stats())
        except Exception as e:  # noqa: BLE001
            log.warning("drafter %s: stats failed: %s", self.name, _describe(e))
            out = {}
        if self.total_failures:
            out["guard_failures"] = float(self.total_failures)
        return out

    def steer(self, policy) -> None:
        try:
            self.drafter.steer(policy)
        except Exception as e:  # noqa: BLE001
            self._failed("steer", e)

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

    def constrain(self, spec) -> None:
        """Pass a request's grammar to a drafter that can follow it (more accepted tokens)."""
        try:
            self.drafter.constrain(spec)
        except Exception as e:  # noqa: BLE001
            self._failed("constrain", e)

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
            self.drafter.begin(history, self._sampling, self._params)
        except Exception as e:  # noqa: BLE001
            self._failed("begin", e)
            return False
        self._live = True
        return True

    def _checked(self, draft: object, max_n: int) -> Draft:
        if not isinstance(draft, Draft):
            raise DrafterFailure(f"proposed a {type(draft).__name__}, not a Draft")
        tokens = draft.tokens
        if not tokens:
            return draft
        if len(tokens) > max_n:
            draft = draft.cut(max_n)
            tokens = draft.tokens
        if not all(type(t) is int or isinstance(t, int | np.integer) for t in tokens):
            raise DrafterFailure("proposed token ids that are not integers")
        if min(tokens) < 0 or max(tokens) >= self.n_vocab:
            raise DrafterFailure(f"proposed token ids outside the vocabulary of {self.n_vocab}")
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


def check_verify_mode(drafter: object, mode: VerifyMode) -> None:
    """Refuse a drafter that cannot take part in `mode` (raises ValueError naming it);
    log once that rejection mode trusts a remote drafter's q. A deterministic drafter
    without q passes: DraftGuard gives its drafts a one-hot q."""
    if mode is not VerifyMode.REJECTION:
        return
    d = declared(drafter)
    if not d.provides_q and not d.deterministic:
        raise ValueError(
            f"--verify rejection: the drafter {d.name} gives no draft "
            f"distribution q and its drafts are not deterministic; use --verify coupled")
    if d.remote:
        _log_trust_once(d)


_trust_logged = False


def _log_trust_once(drafter: Drafter) -> None:
    global _trust_logged
    if _trust_logged:
        return
    _trust_logged = True
    log.warning("--verify rejection trusts the q that the remote drafter %s sends: a hostile "
                "one can steer the output; coupled verification (the default) cannot be "
                "steered by any draft", drafter.name)
