"""What both ends of the draft link agree on: version, limits, conversions, checks.

Everything read from the wire passes through a `check_*` function here before
it touches the engine; a violation raises ProtocolError naming the field, and
the reader drops the peer. Verification makes a hostile drafter harmless to
the output; these checks make it harmless to the process.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import numpy as np

from specwire.config import ConfigError, SamplingParams, VerifyMode
from specwire.sampling import SparseDraft
from specwire.wire import specwire_pb2 as pb

PROTOCOL_VERSION = 2
MAX_CHUNK_TOKENS = 256  # tokens in one draft chunk
MAX_Q_K = 256  # sparse q entries per token
MAX_HISTORY = 1 << 20  # tokens in an Open message
MAX_MESSAGE_BYTES = 16 << 20
AUTH_HEADER = "authorization"
#: Call metadata naming the target process, so that a node keeps a calibration per target.
TARGET_HEADER = "specwire-target"
TARGET_ID = secrets.token_hex(8)  # random per process: one target, one id
#: A session that must evaluate more history tokens than this before its first draft
#: says so at once, in an empty first chunk with cache_n and prompt_n: a synchronous
#: target then decodes plainly instead of waiting for drafts until the node catches up.
NOTICE_AFTER = 256
SESSION_PATH = f"/{pb.DESCRIPTOR.services_by_name['DraftNode'].full_name}/Session"

_MODES = {
    VerifyMode.GREEDY: pb.VERIFY_GREEDY,
    VerifyMode.COUPLED: pb.VERIFY_COUPLED,
    VerifyMode.REJECTION: pb.VERIFY_REJECTION,
}
_MODES_BACK = {v: k for k, v in _MODES.items()}


class ProtocolError(ValueError):
    """A peer sent something outside the protocol; the message says what."""


def mode_to_pb(mode: VerifyMode) -> int:
    return _MODES[mode]


def mode_from_pb(value: int) -> VerifyMode:
    try:
        return _MODES_BACK[value]
    except KeyError:
        raise ProtocolError(f"unknown verify mode {value}") from None


def sampling_to_pb(s: SamplingParams) -> pb.Sampling:
    return pb.Sampling(
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        repeat_penalty=s.repeat_penalty,
        repeat_last_n=s.repeat_last_n,
        seed=s.seed,
    )


def sampling_from_pb(m: pb.Sampling) -> SamplingParams:
    """float32 on the wire: round-trip through it so both ends filter identically."""
    try:
        return SamplingParams(
            temperature=_f32(m.temperature),
            top_k=m.top_k,
            top_p=_f32(m.top_p),
            min_p=_f32(m.min_p),
            repeat_penalty=_f32(m.repeat_penalty),
            repeat_last_n=m.repeat_last_n,
            seed=m.seed,
        )
    except ConfigError as e:
        raise ProtocolError(f"sampling settings: {e}") from None


def wire_sampling(s: SamplingParams) -> SamplingParams:
    """The settings as the other end will see them after float32 transport."""
    return sampling_from_pb(sampling_to_pb(s))


def _f32(x: float) -> float:
    return float(np.float32(x))


def check_tokens(tokens, n_vocab: int, what: str) -> list[int]:
    out = list(tokens)
    for t in out:
        if not 0 <= t < n_vocab:
            raise ProtocolError(f"{what}: token id {t} outside the vocabulary (0..{n_vocab - 1})")
    return out


@dataclass(slots=True)
class Chunk:
    """A checked DraftChunk."""

    gen: int
    start: int
    tokens: list[int]
    sparse: list[SparseDraft] | None
    done: bool


def check_chunk(m: pb.DraftChunk, n_vocab: int, max_position: int) -> Chunk:
    """Validate a draft chunk from the node; positions must lie before max_position."""
    if len(m.tokens) > MAX_CHUNK_TOKENS:
        raise ProtocolError(f"chunk of {len(m.tokens)} tokens (limit {MAX_CHUNK_TOKENS})")
    if m.start + len(m.tokens) > max_position:
        raise ProtocolError(
            f"chunk at positions {m.start}..{m.start + len(m.tokens)} beyond {max_position}"
        )
    tokens = check_tokens(m.tokens, n_vocab, "draft chunk")
    sparse = None
    if m.q_k or m.q_ids or m.q_probs:
        sparse = _check_sparse(m, tokens, n_vocab)
    return Chunk(m.gen, m.start, tokens, sparse, m.done)


def _check_sparse(m: pb.DraftChunk, tokens: list[int], n_vocab: int) -> list[SparseDraft]:
    k = m.q_k
    if not 1 <= k <= MAX_Q_K:
        raise ProtocolError(f"q_k {k} outside 1..{MAX_Q_K}")
    if len(m.q_ids) != k * len(tokens) or len(m.q_probs) != k * len(tokens):
        raise ProtocolError(
            f"q arrays of {len(m.q_ids)}/{len(m.q_probs)} entries, expected {k * len(tokens)}"
        )
    ids = np.asarray(check_tokens(m.q_ids, n_vocab, "q_ids"), dtype=np.int64).reshape(-1, k)
    probs = np.asarray(m.q_probs, dtype=np.float32).reshape(-1, k)
    out = []
    for i, tok in enumerate(tokens):
        p = probs[i]
        if not np.all(np.isfinite(p)) or p.min() < 0.0 or abs(float(p.sum()) - 1.0) > 1e-3:
            raise ProtocolError(f"q for position {m.start + i} is not a distribution")
        if tok not in ids[i] or len(set(ids[i].tolist())) != k:
            raise ProtocolError(f"q for position {m.start + i} does not contain its token once")
        out.append(SparseDraft(token=tok, ids=ids[i], probs=p))
    return out


def sparse_to_pb(chunk: pb.DraftChunk, sparse: list[SparseDraft], k: int) -> None:
    """Append each position's q, padded to exactly k entries with zero mass."""
    for sd in sparse:
        ids, probs = sd.ids.tolist(), sd.probs.tolist()
        pad = [i for i in range(k + len(ids)) if i not in set(ids)][: k - len(ids)]
        chunk.q_ids.extend(ids + pad)
        chunk.q_probs.extend(probs + [0.0] * len(pad))
    chunk.q_k = k


def check_open(m: pb.Open, n_vocab: int, n_ctx: int) -> None:
    if not m.history:
        raise ProtocolError("open: empty history")
    if len(m.history) > min(MAX_HISTORY, n_ctx):
        raise ProtocolError(
            f"open: history of {len(m.history)} tokens exceeds the node's context ({n_ctx})"
        )
    check_tokens(m.history, n_vocab, "open history")
    if m.lookahead > 256 or m.want > 256 or m.top_k_q > MAX_Q_K:
        raise ProtocolError("open: lookahead, want or top_k_q above 256")
    for name in ("p_min", "keep_min"):
        check_probability(getattr(m, name), f"open: {name}")


def check_probability(x: float, what: str) -> None:
    if not (math.isfinite(x) and 0.0 <= x <= 1.0):
        raise ProtocolError(f"{what} {x} outside [0, 1]")


def message_bytes(msg) -> int:
    """Bytes a message takes in a gRPC frame: payload plus the 5-byte prefix."""
    return msg.ByteSize() + 5
