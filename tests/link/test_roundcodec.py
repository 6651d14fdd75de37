"""link/transport/roundcodec.py against protobuf: the same bytes out, the same messages in, and
anything outside its shape left to protobuf."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from specwire.link.messages import Alternate, Chunk, ProtocolError, Verdict
from specwire.link.transport import protocol, roundcodec
from specwire.link.transport import specwire_pb2 as pb
from specwire.sample.sampling import SparseDraft

u32 = st.integers(0, 2**32 - 1)
small = st.one_of(st.integers(0, 300), u32)
tokens = st.lists(st.integers(0, 2**31 - 1), max_size=8)
verdicts = st.builds(Verdict, small, small, tokens, gen=small, k=st.integers(0, 256),
                     keep_min=st.one_of(st.just(0.0), st.floats(0, 1, width=32)),
                     alternate=st.booleans())
chunks = st.builds(Chunk, small, small, tokens, done=st.booleans(), busy_us=small,
                   cache_n=st.one_of(st.none(), small), prompt_n=st.one_of(st.none(), small),
                   step=st.one_of(st.none(), st.tuples(small, small)))


def _pb_verdict(data: bytes) -> Verdict:
    return protocol.verdict_from_pb(pb.TargetMessage.FromString(data).verdict)


def _pb_chunk(data: bytes) -> Chunk:
    return protocol.draft_from_pb(pb.DraftMessage.FromString(data))


@given(verdicts)
def test_a_verdict_is_written_as_protobuf_writes_it_and_read_back(v: Verdict) -> None:
    data = roundcodec.verdict_bytes(v)
    assert data == protocol.target_to_pb(v).SerializeToString()
    assert roundcodec.verdict_from_bytes(data) == _pb_verdict(data) == v


@given(chunks)
def test_a_chunk_is_written_as_protobuf_writes_it_and_read_back(c: Chunk) -> None:
    data = roundcodec.chunk_bytes(c)
    assert data == protocol.draft_to_pb(c).SerializeToString()
    assert roundcodec.chunk_from_bytes(data) == _pb_chunk(data) == c


def test_what_it_cannot_write_is_left_to_protobuf() -> None:
    sparse = [SparseDraft(5, np.array([5, 1]), np.array([0.5, 0.5], dtype=np.float32))]
    assert roundcodec.chunk_bytes(Chunk(0, 1, [5], sparse=sparse)) is None
    assert roundcodec.chunk_bytes(Chunk(0, 1, [5], alternates=[Alternate(1, [2, 3])])) is None
    assert roundcodec.chunk_bytes(Chunk(0, 1, [-5])) is None
    assert roundcodec.chunk_bytes(Chunk(2**32, 1, [5])) is None
    assert roundcodec.verdict_bytes(Verdict(1, 0, [2**31])) is None
    assert roundcodec.verdict_bytes(Verdict(-1, 0, [3])) is None


@pytest.mark.parametrize("data", [
    b"\x12\x02\x08\x05\x08\x06",  # a field twice (protobuf: the last wins)
    b"\x12\x04\x10\x01\x08\x05",  # fields out of order
    b"\x12\x04\x18\x05\x18\x06",  # tokens not packed
    b"\x12\x0d\x1a\x0a" + b"\xff" * 9 + b"\x01",  # a negative token (10-byte varint)
    b"\x12\x06\x08\x80\x80\x80\x80\x10",  # position past uint32 (protobuf truncates)
    b"\x12\x02\x38\x02",  # a bool written as 2
    b"\x12\x02\x60\x01",  # an unknown field
    b"\x12\x03\x08\x05",  # truncated
    b"\x12\x01\x08\x05",  # a length that ends inside a field
    b"\x12\x00\x00",  # bytes after the message
    b"\x1a\x00",  # a Close
    b"",
])
def test_verdicts_outside_its_shape_are_left_to_protobuf(data: bytes) -> None:
    assert roundcodec.verdict_from_bytes(data) is None


@given(st.binary(max_size=40))
@settings(max_examples=3000)
def test_any_bytes_read_as_protobuf_reads_them_or_left_to_it(data: bytes) -> None:
    _agrees(roundcodec.verdict_from_bytes, _pb_verdict, b"\x12" + data)
    _agrees(roundcodec.chunk_from_bytes, _pb_chunk, b"\x0a" + data)


@given(st.one_of(verdicts.map(roundcodec.verdict_bytes), chunks.map(roundcodec.chunk_bytes)),
       st.integers(0, 60), st.integers(0, 255))
def test_a_valid_message_with_one_byte_changed_reads_as_protobuf_reads_it(
        data: bytes, at: int, byte: int) -> None:
    data = bytearray(data)
    data[at % len(data)] = byte
    _agrees(roundcodec.verdict_from_bytes, _pb_verdict, bytes(data))
    _agrees(roundcodec.chunk_from_bytes, _pb_chunk, bytes(data))


def _agrees(fast, slow, data: bytes) -> None:
    """Where the fast decoder answers, protobuf's path gives the same message or the same
    ProtocolError; where it does not, protobuf decides."""
    try:
        got = fast(data)
    except ProtocolError as e:
        with pytest.raises(ProtocolError, match=str(e)[:20]):
            slow(data)
        return
    if got is not None:
        try:
            assert slow(data) == got
        except DecodeError:
            pytest.fail(f"protobuf cannot parse what the fast path read: {data!r}")


def test_the_node_takes_a_verdict_the_port_decoded_but_never_first() -> None:
    from types import SimpleNamespace

    from specwire.node.server import SessionCall, _decode

    v = Verdict(3, 0, [1])
    assert _decode(roundcodec.verdict_bytes(v)) == v
    close = pb.TargetMessage(close=pb.Close())
    assert _decode(close.SerializeToString()) == close
    with pytest.raises(ProtocolError, match="undecodable"):
        _decode(b"\xff\xff\xff")
    sent: list[tuple[bytes, bool]] = []
    service = SimpleNamespace(_admit=lambda *a: "", _close=lambda s: None,
                              _release=lambda: None, quotas=SimpleNamespace(leave=lambda who: None))
    call = SessionCall(service, lambda data, last=False: sent.append((data, last)),
                       SimpleNamespace(peer=lambda: "test"))
    assert not call.take(roundcodec.verdict_bytes(v))
    assert "unexpected verdict" in pb.DraftMessage.FromString(sent[0][0]).error.message
