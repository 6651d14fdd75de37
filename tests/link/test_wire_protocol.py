"""The draft link's protocol checks (link/transport/protocol.py), directly, on
malformed and random messages."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
from wire_helpers import GREEDY, SEEDED, _random_chunk

from specwire.link.messages import Chunk
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.protocol import ProtocolError

V = 262144          # the bundled Gemma vocabulary; only the pure checks below use it


# ============================================================================ protocol checks


def _dc(**kw) -> pb.DraftChunk:
    return pb.DraftChunk(**kw)


def check_chunk(m: pb.DraftChunk, n_vocab: int, max_position: int) -> Chunk:
    """What a target does with a chunk off the wire: convert it (link/transport/protocol.py), then
    check it against its vocabulary and history (BranchDrafter._on_chunk)."""
    c = protocol.chunk_from_pb(m)
    c.check(n_vocab, max_position)
    return c


def test_check_chunk_accepts_a_well_formed_chunk() -> None:
    """A valid chunk (with a sparse q) comes back as a Chunk with the same fields."""
    m = _dc(gen=3, start=10, tokens=[5, 7], q_k=2, q_ids=[5, 9, 7, 1],
            q_probs=[0.75, 0.25, 1.0, 0.0], done=True)
    c = check_chunk(m, V, max_position=20)
    assert (c.gen, c.start, c.tokens, c.done) == (3, 10, [5, 7], True)
    assert [sd.token for sd in c.sparse] == [5, 7]
    assert c.sparse[0].ids.tolist() == [5, 9]
    assert check_chunk(_dc(start=5, tokens=[1]), V, 20).sparse is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"tokens": [V]}, "token id 262144 outside the vocabulary"),
    ({"tokens": [3, -1]}, "token id -1 outside the vocabulary"),
    ({"tokens": [1] * (protocol.MAX_CHUNK_TOKENS + 1)}, "chunk of 257 tokens"),
    ({"start": 2**32 - 1, "tokens": [1]}, "beyond 1000"),
    ({"start": 999, "tokens": [1, 2]}, "positions 999..1001 beyond 1000"),
    ({"tokens": [5], "q_k": 0, "q_ids": [5], "q_probs": [1.0]}, "q_k 0 outside"),
    ({"tokens": [5], "q_k": 10**6, "q_ids": [5], "q_probs": [1.0]}, "q_k 1000000 outside"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5], "q_probs": [1.0]}, "q arrays of 1/1 entries"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, 6], "q_probs": [1.0]}, "q arrays of 2/1 entries"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, 6], "q_probs": [math.nan, 1.0]}, "not a distribution"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, 6], "q_probs": [math.inf, 0.0]}, "not a distribution"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, 6], "q_probs": [1.5, -0.5]}, "not a distribution"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, 6], "q_probs": [0.5, 0.2]}, "not a distribution"),
    ({"tokens": [5], "q_k": 2, "q_ids": [6, 7], "q_probs": [0.5, 0.5]}, "contain its token once"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, 5], "q_probs": [0.5, 0.5]}, "contain its token once"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, V], "q_probs": [1.0, 0.0]}, "q_ids: token id 262144"),
    ({"tokens": [5], "q_k": 2, "q_ids": [5, -7], "q_probs": [1.0, 0.0]}, "q_ids: token id -7"),
])
def test_check_chunk_refuses_malformed_chunks(fields: dict, message: str) -> None:
    """Every malformed field raises ProtocolError with a message naming the problem."""
    with pytest.raises(ProtocolError, match=message.replace(".", r"\.").replace("(", r"\(")):
        check_chunk(_dc(**fields), V, max_position=1000)


def test_sparse_q_by_position() -> None:
    """A chunk's q arrays become one SparseDraft per token; NaN mass is refused by position."""
    m = _dc(start=40, tokens=[5, 7], q_k=2, q_ids=[5, 6, 8, 7], q_probs=[0.5, 0.5, 0.1, 0.9])
    out = check_chunk(m, V, 1000).sparse
    assert [sd.token for sd in out] == [5, 7]
    assert np.allclose(out[1].probs, [0.1, 0.9])
    bad = _dc(start=40, tokens=[5, 7], q_k=2, q_ids=[5, 6, 8, 7], q_probs=[0.5, 0.5, math.nan, 1])
    with pytest.raises(ProtocolError, match="q for position 41 is not a distribution"):
        check_chunk(bad, V, 1000)


def test_check_chunk_on_random_chunks_raises_only_protocol_error() -> None:
    """2000 random chunks (fixed seed): each is refused with ProtocolError or passes with
    every invariant the client relies on (ids in the vocabulary, positions bounded, one
    finite distribution over distinct ids containing its token per position)."""
    rng, n_vocab, max_position = random.Random(20240607), 1000, 1000
    passed = refused = 0
    for _ in range(2000):
        m = _random_chunk(rng, n_vocab)
        try:
            c = check_chunk(m, n_vocab, max_position)
        except ProtocolError:
            refused += 1
            continue
        passed += 1
        assert all(0 <= t < n_vocab for t in c.tokens)
        assert c.start + len(c.tokens) <= max_position
        assert len(c.tokens) <= protocol.MAX_CHUNK_TOKENS
        if c.sparse is not None:
            assert len(c.sparse) == len(c.tokens)
            for sd, t in zip(c.sparse, c.tokens, strict=True):
                assert sd.token == t and t in sd.ids.tolist()
                assert len(set(sd.ids.tolist())) == len(sd.ids)
                assert np.all((sd.ids >= 0) & (sd.ids < n_vocab))
                assert np.all(np.isfinite(sd.probs)) and abs(sd.probs.sum() - 1) < 1e-3
    assert passed > 100 and refused > 100, (passed, refused)


def _open(**kw) -> pb.Open:
    kw.setdefault("history", [2, 100, 200])
    kw.setdefault("sampling", protocol.sampling_to_pb(GREEDY))
    return pb.Open(**kw)


def check_open(m: pb.Open, n_vocab: int, n_ctx: int) -> None:
    """What a node does with an Open off the wire: convert it, then check it against its
    model (node/server.py)."""
    protocol.open_from_pb(m).check(n_vocab, n_ctx)


def test_check_open_accepts_a_well_formed_open() -> None:
    """A plain pipelined Open passes."""
    check_open(_open(pipelined=True, lookahead=16, want=8, p_min=0.75, top_k_q=8),
                        V, 1024)


@pytest.mark.parametrize(("fields", "message"), [
    ({"history": []}, "open: empty history"),
    ({"history": [1] * 1025}, "history of 1025 tokens exceeds the node's context"),
    ({"history": [1, V]}, "open history: token id 262144 outside"),
    ({"history": [1, -5]}, "open history: token id -5 outside"),
    ({"lookahead": 257}, "lookahead, want or top_k_q above 256"),
    ({"lookahead": 2**32 - 1}, "lookahead, want or top_k_q above 256"),
    ({"want": 10**6}, "lookahead, want or top_k_q above 256"),
    ({"top_k_q": 257}, "lookahead, want or top_k_q above 256"),
    ({"p_min": math.nan}, "p_min nan outside"),
    ({"p_min": 1.5}, "p_min 1.5 outside"),
    ({"p_min": -0.25}, "p_min -0.25 outside"),
    ({"keep_min": math.nan}, "keep_min nan outside"),
    ({"keep_min": 1.5}, "keep_min 1.5 outside"),
])
def test_check_open_refuses_malformed_opens(fields: dict, message: str) -> None:
    """Each malformed Open raises ProtocolError naming the field."""
    with pytest.raises(ProtocolError, match=message.replace(".", r"\.").replace("(", r"\(")):
        check_open(_open(**fields), V, 1024)


def test_sampling_and_mode_from_the_wire_are_checked() -> None:
    """Bad sampling values and unknown modes become ProtocolError, not ConfigError/KeyError."""
    with pytest.raises(ProtocolError, match="sampling settings: temperature"):
        protocol.sampling_from_pb(pb.Sampling(temperature=math.nan, top_p=1.0, repeat_penalty=1))
    with pytest.raises(ProtocolError, match="sampling settings: top_p"):
        protocol.sampling_from_pb(pb.Sampling(temperature=0.5, top_p=0.0, repeat_penalty=1))
    with pytest.raises(ProtocolError, match="unknown verify mode 7"):
        protocol.mode_from_pb(7)
    s = protocol.wire_sampling(SEEDED)
    assert s == protocol.sampling_from_pb(protocol.sampling_to_pb(s))   # float32 fixed point


def test_the_generated_code_names_its_proto_and_the_wire_names_stay() -> None:
    """specwire_pb2 comes from the .proto beside it (its descriptor names that file), and the
    names a gRPC peer sees are protocol version 1's: any node or target still interoperates."""
    d = pb.DESCRIPTOR
    assert d.name == "specwire/link/transport/specwire.proto"
    assert (Path(__file__).resolve().parents[2] / d.name).is_file()
    assert d.package == "specwire.v1"
    assert [m.full_name for m in d.services_by_name["DraftNode"].methods] == [
        "specwire.v1.DraftNode.Hello", "specwire.v1.DraftNode.Session",
        "specwire.v1.DraftNode.Ping"]
    assert protocol.SESSION_PATH == "/specwire.v1.DraftNode/Session"
    assert sorted(d.message_types_by_name) == [
        "Alternate", "Close", "DraftChunk", "DraftError", "DraftMessage", "HelloReply",
        "HelloRequest", "Open", "PingMessage", "Pong", "Sampling", "TargetMessage", "Verdict"]
