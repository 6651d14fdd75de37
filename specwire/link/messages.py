"""The messages of a branch session, as checked dataclasses.

A target opens a session (Open), then answers the drafts (Chunk) with verdicts
(Verdict) until it closes it (Close); a drafter that fails says why (Failure).
Each message checks at construction what it can check alone (sizes, limits,
probabilities); what depends on the other end (vocabulary, context, positions)
is checked by the end that knows it, with `check`. A violation raises
ProtocolError naming the field: the reader drops the peer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from specwire.config import ConfigError, SamplingParams, VerifyMode
from specwire.sample.sampling import SparseDraft

MAX_CHUNK_TOKENS = 256  # tokens in one draft chunk
MAX_Q_K = 256  # sparse q entries per token
MAX_HISTORY = 1 << 20  # tokens in an Open
MAX_ASK = 256  # Open.lookahead, Open.k, Verdict.k
MAX_ALTERNATES = 4  # Open.alternates: alternates in one chunk
MAX_ALTERNATE_TOKENS = 8  # Open.alternate_len: tokens in one alternate
MAX_SCOPE_BYTES = 128  # Open.cache_scope
#: A session that must evaluate more history tokens than this before its first draft
#: says so at once, in an empty first chunk with cache_n and prompt_n: a synchronous
#: target then decodes plainly instead of waiting for drafts until the node catches up.
NOTICE_AFTER = 256


class ProtocolError(ValueError):
    """A peer sent something outside the protocol; the message says what."""


@dataclass(slots=True)
class Open:
    """Starts a session: the committed history and how to draft after it."""

    history: list[int]
    sampling: SamplingParams
    mode: VerifyMode
    pipelined: bool = False  # draft ahead of verdicts, up to `lookahead` tokens
    lookahead: int = 0
    k: int = 0  # synchronous: draft this many now
    p_min: float = 0.0  # stop a branch when the draft's top probability is below
    top_k_q: int = 0  # rejection mode: size of the sparse q per token
    timing: bool = False  # fill Chunk.busy_us
    calibrated: bool = False  # synchronous: stop by keep_min, calibrated on verdicts
    keep_min: float = 0.0
    # Pipelined: pre-drafted branches, at most `alternates` per chunk of at most
    # `alternate_len` tokens each (link/alternates.py); 0: none.
    alternates: int = 0
    alternate_len: int = 0
    # Tenants (node/kv_cache.py): cached history is shared only within one cache_scope of
    # one peer; no_store keeps the session out of the node's cache.
    cache_scope: str = ""
    no_store: bool = False
    # Pipelined, with alternates: the target verifies up to `tree` alternates beside the
    # branch in one decode, so the node drafts them ahead of the branch (0: chains).
    tree: int = 0
    # With tree: the target verifies one-token alternates too, so the node sends its second
    # choice at each hesitant position with the position itself, undrafted.
    second_choices: bool = False

    def __post_init__(self) -> None:
        if not self.history:
            raise ProtocolError("open: empty history")
        if len(self.history) > MAX_HISTORY:
            raise ProtocolError(f"open: history of {len(self.history)} tokens "
                                f"(limit {MAX_HISTORY})")
        if max(self.lookahead, self.k, self.top_k_q) > MAX_ASK:
            raise ProtocolError("open: lookahead, want or top_k_q above 256")
        check_probability(self.p_min, "open: p_min")
        check_probability(self.keep_min, "open: keep_min")
        if self.alternates > MAX_ALTERNATES or self.alternate_len > MAX_ALTERNATE_TOKENS:
            raise ProtocolError(f"open: alternates above {MAX_ALTERNATES} or alternate_len "
                                f"above {MAX_ALTERNATE_TOKENS}")
        if self.tree > MAX_ALTERNATES:
            raise ProtocolError(f"open: tree above {MAX_ALTERNATES}")
        if len(self.cache_scope.encode()) > MAX_SCOPE_BYTES:
            raise ProtocolError(f"open: cache_scope above {MAX_SCOPE_BYTES} bytes")

    def check(self, n_vocab: int, n_ctx: int) -> None:
        """What the node checks against its model."""
        if len(self.history) > n_ctx:
            raise ProtocolError(
                f"open: history of {len(self.history)} tokens exceeds the node's context "
                f"({n_ctx})")
        check_tokens(self.history, n_vocab, "open history")
        check_tokens((t for t, _ in self.sampling.logit_bias), n_vocab, "open logit bias")


@dataclass(slots=True)
class Verdict:
    """The target's answer: from `position`, `accepted` tokens of branch `gen` are kept,
    then its own `tokens`."""

    position: int
    accepted: int
    tokens: list[int]
    gen: int = 0  # meaningful when accepted > 0 or alternate
    k: int = 0  # synchronous: draft this many after the verdict; 0 keeps the last
    keep_min: float = 0.0  # calibrated sessions: a new threshold; 0 keeps the last
    # `tokens` begin the alternate branch `gen` sent for position + accepted: the
    # drafter continues from the rest of that alternate (rule.take_alternate).
    alternate: bool = False

    def __post_init__(self) -> None:
        if self.k > MAX_ASK:
            raise ProtocolError(f"verdict: want {self.k} above {MAX_ASK}")
        check_probability(self.keep_min, "verdict: keep_min")

    def check(self, n_vocab: int) -> list[int]:
        """The verdict's own tokens, checked against the drafter's vocabulary."""
        return check_tokens(self.tokens, n_vocab, "verdict")


@dataclass(slots=True)
class Close:
    """Ends a session."""


@dataclass(slots=True)
class Alternate:
    """A pre-drafted branch: tokens[0], the draft's second choice at absolute position
    `at`, takes the place of the branch's token there; the rest continue it."""

    at: int
    tokens: list[int]


@dataclass(slots=True)
class Chunk:
    """Draft tokens of branch `gen` from absolute position `start`.

    In rejection mode `sparse` holds each token's q, padded to the session's
    top_k_q entries (pad_sparse) so that every q looks the same on both ends.
    """

    gen: int
    start: int
    tokens: list[int]
    sparse: list[SparseDraft] | None = None
    done: bool = False  # pipelined: the drafter stops here until the next verdict
    busy_us: int = 0  # Open.timing: microseconds the drafter worked on this chunk
    # A session's first chunk only: history tokens found cached, and to evaluate (or, on a
    # later empty chunk of a synchronous session catching up, still to evaluate).
    cache_n: int | None = None
    prompt_n: int | None = None
    # Open.alternates: second choices at positions of this branch already sent or sent
    # in this chunk, each with its continuation.
    alternates: list[Alternate] = field(default_factory=list)
    # The node's batch, where it changed since the session's previous chunk: (sessions,
    # alternates) its last decode of this session's tokens held (node/steps.py).
    step: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if len(self.alternates) > MAX_ALTERNATES:
            raise ProtocolError(
                f"chunk with {len(self.alternates)} alternates (limit {MAX_ALTERNATES})")
        for a in self.alternates:
            if not 1 <= len(a.tokens) <= MAX_ALTERNATE_TOKENS:
                raise ProtocolError(
                    f"alternate of {len(a.tokens)} tokens (1..{MAX_ALTERNATE_TOKENS})")
            if a.at >= self.end:
                raise ProtocolError(f"alternate at {a.at}, past its chunk's end {self.end}")
        if len(self.tokens) > MAX_CHUNK_TOKENS:
            raise ProtocolError(
                f"chunk of {len(self.tokens)} tokens (limit {MAX_CHUNK_TOKENS})")
        if self.sparse is not None and len(self.sparse) != len(self.tokens):
            raise ProtocolError(f"chunk of {len(self.tokens)} tokens with "
                                f"{len(self.sparse)} q distributions")

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def check(self, n_vocab: int, max_position: int) -> None:
        """What the target checks: positions before max_position, ids in its vocabulary,
        and each q one distribution over distinct ids that holds its token."""
        if self.end > max_position:
            raise ProtocolError(
                f"chunk at positions {self.start}..{self.end} beyond {max_position}")
        check_tokens(self.tokens, n_vocab, "draft chunk")
        for a in self.alternates:
            check_tokens(a.tokens, n_vocab, "alternate")
        if self.sparse:
            _check_sparse(self.sparse, self.start, n_vocab)


@dataclass(slots=True)
class Failure:
    """The drafter ends the session: why (a peer's mistake, or its own failure)."""

    message: str = field(default="")


TargetMessage = Open | Verdict | Close
DraftMessage = Chunk | Failure


def check_tokens(tokens, n_vocab: int, what: str) -> list[int]:
    out = list(tokens)
    for t in out:
        if not 0 <= t < n_vocab:
            raise ProtocolError(f"{what}: token id {t} outside the vocabulary (0..{n_vocab - 1})")
    return out


def check_probability(x: float, what: str) -> None:
    if not (math.isfinite(x) and 0.0 <= x <= 1.0):
        raise ProtocolError(f"{what} {x} outside [0, 1]")


def f32_sampling(s: SamplingParams) -> SamplingParams:
    """The settings as the link carries them, in float32: both ends then filter alike
    (an in-process drafter too). Settings that round out of range raise ProtocolError."""
    bias = tuple((t, -math.inf if b < -F32_MAX else f32(b)) for t, b in check_bias(s.logit_bias))
    try:
        return replace(s, temperature=f32(s.temperature), top_p=f32(s.top_p),
                       min_p=f32(s.min_p), repeat_penalty=f32(s.repeat_penalty),
                       presence_penalty=f32(s.presence_penalty),
                       frequency_penalty=f32(s.frequency_penalty), logit_bias=bias)
    except ConfigError as e:
        raise ProtocolError(f"sampling settings: {e}") from None


def check_bias(bias: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """A logit bias is a float32 number or -inf (a ban): NaN or +inf would poison the
    drafter's logits."""
    if any(math.isnan(b) or b > F32_MAX for _, b in bias):
        raise ProtocolError("sampling settings: a logit bias is NaN, +inf or beyond float32")
    return bias


F32_MAX = float(np.finfo(np.float32).max)


def f32(x: float) -> float:
    return float(np.float32(x))


def pad_sparse(sparse: list[SparseDraft], k: int) -> list[SparseDraft]:
    """Each q padded to exactly k entries with zero mass (ids the q does not hold), as
    int64 ids and float32 probabilities: the form the wire carries."""
    out = []
    for sd in sparse:
        ids = [int(i) for i in sd.ids]
        have = set(ids)
        pad = [i for i in range(k + len(ids)) if i not in have][: k - len(ids)]
        probs = np.zeros(len(ids) + len(pad), dtype=np.float32)
        probs[: len(ids)] = sd.probs
        out.append(SparseDraft(sd.token, np.asarray(ids + pad, dtype=np.int64), probs))
    return out


def _check_sparse(sparse: list[SparseDraft], start: int, n_vocab: int) -> None:
    ids = np.concatenate([sd.ids for sd in sparse])
    bad = np.flatnonzero((ids < 0) | (ids >= n_vocab))
    if bad.size:
        check_tokens([int(ids[bad[0]])], n_vocab, "q_ids")
    for i, sd in enumerate(sparse):
        p = sd.probs
        if not np.all(np.isfinite(p)) or p.min() < 0.0 or abs(float(p.sum()) - 1.0) > 1e-3:
            raise ProtocolError(f"q for position {start + i} is not a distribution")
        row = sd.ids.tolist()
        if sd.token not in row or len(set(row)) != len(row):
            raise ProtocolError(f"q for position {start + i} does not contain its token once")
