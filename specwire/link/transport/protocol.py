"""The edge of the draft link: protobuf to and from the domain messages, and the
version, limits and headers both ends agree on.

This is the only module that converts: everything read from the wire becomes a
checked message of specwire/link/messages.py here (a violation raises
ProtocolError naming the field, and the reader drops the peer), and nothing
past here sees protobuf. Verification makes a hostile drafter harmless to the
output; these checks make it harmless to the process.
"""

from __future__ import annotations

import secrets

import numpy as np

from specwire.config import ConfigError, SamplingParams, VerifyMode
from specwire.link.messages import (
    MAX_CHUNK_TOKENS,
    MAX_HISTORY,
    MAX_Q_K,
    NOTICE_AFTER,
    Alternate,
    Chunk,
    Close,
    DraftMessage,
    Failure,
    Open,
    ProtocolError,
    TargetMessage,
    Verdict,
    check_bias,
    check_probability,
    check_tokens,
    f32,
)
from specwire.link.messages import f32_sampling as wire_sampling
from specwire.link.transport import specwire_pb2 as pb
from specwire.sample.sampling import SparseDraft

__all__ = ["MAX_CHUNK_TOKENS", "MAX_HISTORY", "MAX_Q_K", "NOTICE_AFTER", "ProtocolError",
           "check_probability", "check_tokens", "wire_sampling"]

PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 16 << 20
AUTH_HEADER = "authorization"
#: Call metadata naming the target process, so that a node keeps a calibration per target.
TARGET_HEADER = "specwire-target"
TARGET_ID = secrets.token_hex(8)  # random per process: one target, one id
_SERVICE = pb.DESCRIPTOR.services_by_name["DraftNode"].full_name
SESSION_PATH = f"/{_SERVICE}/Session"
HELLO_PATH = f"/{_SERVICE}/Hello"
PING_PATH = f"/{_SERVICE}/Ping"

_MODES = {
    VerifyMode.GREEDY: pb.VERIFY_GREEDY,
    VerifyMode.COUPLED: pb.VERIFY_COUPLED,
    VerifyMode.REJECTION: pb.VERIFY_REJECTION,
}
_MODES_BACK = {v: k for k, v in _MODES.items()}


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
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        logit_bias_ids=[t for t, _ in s.logit_bias],
        logit_bias_values=[b for _, b in s.logit_bias],
    )


def sampling_from_pb(m: pb.Sampling) -> SamplingParams:
    """float32 on the wire: round-trip through it so both ends filter identically. A
    target that sends no presence/frequency penalty or logit bias (an older one) means
    none; the bias's token ids are checked against the vocabulary by Open.check."""
    if len(m.logit_bias_ids) != len(m.logit_bias_values):
        raise ProtocolError(f"sampling settings: {len(m.logit_bias_ids)} logit bias ids "
                            f"but {len(m.logit_bias_values)} values")
    bias = check_bias(tuple(zip(m.logit_bias_ids, map(f32, m.logit_bias_values), strict=True)))
    try:
        return SamplingParams(
            temperature=f32(m.temperature),
            top_k=m.top_k,
            top_p=f32(m.top_p),
            min_p=f32(m.min_p),
            repeat_penalty=f32(m.repeat_penalty),
            repeat_last_n=m.repeat_last_n,
            seed=m.seed,
            presence_penalty=f32(m.presence_penalty),
            frequency_penalty=f32(m.frequency_penalty),
            logit_bias=bias,
        )
    except ConfigError as e:
        raise ProtocolError(f"sampling settings: {e}") from None


# -- the target's messages ---------------------------------------------------------


def open_to_pb(o: Open) -> pb.Open:
    return pb.Open(history=o.history, sampling=sampling_to_pb(o.sampling),
                   mode=mode_to_pb(o.mode), pipelined=o.pipelined, lookahead=o.lookahead,
                   want=o.k, p_min=o.p_min, top_k_q=o.top_k_q, timing=o.timing,
                   calibrated=o.calibrated, keep_min=o.keep_min, alternates=o.alternates,
                   alternate_len=o.alternate_len, cache_scope=o.cache_scope,
                   no_store=o.no_store, tree=o.tree,
                   second_choices=o.second_choices)


def open_from_pb(m: pb.Open) -> Open:
    return Open(list(m.history), sampling_from_pb(m.sampling), mode_from_pb(m.mode),
                pipelined=m.pipelined, lookahead=m.lookahead, k=m.want, p_min=m.p_min,
                top_k_q=m.top_k_q, timing=m.timing, calibrated=m.calibrated,
                keep_min=m.keep_min, alternates=m.alternates, alternate_len=m.alternate_len,
                cache_scope=m.cache_scope, no_store=m.no_store, tree=m.tree,
                second_choices=m.second_choices)


def verdict_from_pb(m: pb.Verdict) -> Verdict:
    return Verdict(m.position, m.accepted, list(m.tokens), gen=m.gen, k=m.want,
                   keep_min=m.keep_min, alternate=m.alternate)


def target_to_pb(msg: TargetMessage) -> pb.TargetMessage:
    """One message for the Session stream. Zero fields send no byte (proto3)."""
    if isinstance(msg, Verdict):
        out = pb.TargetMessage(verdict={"position": msg.position, "accepted": msg.accepted,
                                        "tokens": msg.tokens})
        v = out.verdict  # filled in place: a Verdict built apart is copied into the message
        if msg.gen:
            v.gen = msg.gen
        if msg.k:
            v.want = msg.k
        if msg.keep_min:
            v.keep_min = msg.keep_min
        if msg.alternate:
            v.alternate = True
        return out
    if isinstance(msg, Open):
        return pb.TargetMessage(open=open_to_pb(msg))
    if isinstance(msg, Close):
        return pb.TargetMessage(close=pb.Close())
    raise TypeError(f"not a target message: {type(msg).__name__}")


def target_from_pb(m: pb.TargetMessage) -> TargetMessage:
    kind = m.WhichOneof("kind")
    if kind == "verdict":
        return verdict_from_pb(m.verdict)
    if kind == "open":
        return open_from_pb(m.open)
    if kind == "close":
        return Close()
    raise ProtocolError("target message with neither an open, a verdict nor a close")


# -- the drafter's messages ---------------------------------------------------------


def draft_to_pb(msg: DraftMessage) -> pb.DraftMessage:
    if isinstance(msg, Failure):
        return pb.DraftMessage(error=pb.DraftError(message=msg.message))
    out = pb.DraftMessage(chunk={"gen": msg.gen, "start": msg.start, "tokens": msg.tokens,
                                 "done": msg.done})
    c = out.chunk  # filled in place, as above
    if msg.busy_us:
        c.busy_us = msg.busy_us
    if msg.sparse:
        c.q_k = len(msg.sparse[0].ids)
        c.q_ids.extend(np.concatenate([sd.ids for sd in msg.sparse]).tolist())
        c.q_probs.extend(np.concatenate([sd.probs for sd in msg.sparse]).tolist())
    if msg.cache_n is not None:
        c.cache_n = msg.cache_n
    if msg.prompt_n is not None:
        c.prompt_n = msg.prompt_n
    for a in msg.alternates:
        c.alternates.add(at=a.at, tokens=a.tokens)
    if msg.step is not None:
        c.step_sessions, c.step_alternates = msg.step
    return out


def draft_from_pb(m: pb.DraftMessage) -> DraftMessage:
    kind = m.WhichOneof("kind")
    if kind == "chunk":
        return chunk_from_pb(m.chunk)
    if kind == "error":
        return Failure(m.error.message)
    raise ProtocolError("draft message with neither a chunk nor an error")


def chunk_from_pb(m: pb.DraftChunk) -> Chunk:
    """The chunk as sent; its content is checked by the target (Chunk.check)."""
    c = Chunk(m.gen, m.start, list(m.tokens), done=m.done, busy_us=m.busy_us,
              cache_n=m.cache_n if m.HasField("cache_n") else None,
              prompt_n=m.prompt_n if m.HasField("prompt_n") else None,
              alternates=_alternates_from_pb(m),
              step=(m.step_sessions, m.step_alternates) if m.HasField("step_sessions")
              else None)
    if m.q_k or m.q_ids or m.q_probs:
        c.sparse = _sparse_from_pb(m, c.tokens)
    return c


def _alternates_from_pb(m: pb.DraftChunk) -> list[Alternate]:
    return [Alternate(a.at, list(a.tokens)) for a in m.alternates]


def _sparse_from_pb(m: pb.DraftChunk, tokens: list[int]) -> list[SparseDraft]:
    k = m.q_k
    if not 1 <= k <= MAX_Q_K:
        raise ProtocolError(f"q_k {k} outside 1..{MAX_Q_K}")
    if len(m.q_ids) != k * len(tokens) or len(m.q_probs) != k * len(tokens):
        raise ProtocolError(
            f"q arrays of {len(m.q_ids)}/{len(m.q_probs)} entries, expected {k * len(tokens)}"
        )
    ids = np.asarray(m.q_ids, dtype=np.int64).reshape(-1, k)
    probs = np.asarray(m.q_probs, dtype=np.float32).reshape(-1, k)
    return [SparseDraft(token=tok, ids=ids[i], probs=probs[i]) for i, tok in enumerate(tokens)]


def message_bytes(msg) -> int:
    """Bytes a message takes in a gRPC frame: payload plus the 5-byte prefix."""
    return msg.ByteSize() + 5
