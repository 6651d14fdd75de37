"""The two messages of a synchronous round, encoded and decoded without protobuf objects.

A round's Verdict and DraftChunk are converted right after its wait, with every cache
cold; written and read here in protobuf's wire format directly, the four conversions take
29-43% less time cold (docs/protocol.md, `python -m benchmarks.stacks --codec-only`).
Only the common shape is taken (no q or alternates, fields in order, each once); for
anything else the decoders return None and the caller parses with specwire_pb2.
tests/link/test_roundcodec.py checks both directions against protobuf.
"""

from __future__ import annotations

import struct

from specwire.link.messages import Chunk, Verdict

_INT32 = 1 << 31
_UINT32 = 1 << 32
_F32 = struct.Struct("<f")


def _varint(n: int, out: bytearray) -> None:
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)


def _uint32s(*values: int) -> bool:
    return all(0 <= x < _UINT32 for x in values)


def _packed(field_tag: int, values: list[int], out: bytearray) -> bool:
    """A packed repeated int32 of non-negative values; False if one is out of range."""
    body = bytearray()
    for t in values:
        if not 0 <= t < _INT32:
            return False
        _varint(t, body)
    out.append(field_tag)
    _varint(len(body), out)
    out += body
    return True


def _put(tag: int, value: int, b: bytearray) -> None:
    """A varint field: its tag byte, then the value."""
    b.append(tag)
    _varint(value, b)


def _wrapped(outer: int, body: bytearray) -> bytes:
    """body as the one submessage, in field tag `outer`, of the message sent."""
    head = bytearray((outer,))
    _varint(len(body), head)
    return bytes(head + body)


def verdict_bytes(v: Verdict) -> bytes | None:
    """TargetMessage{verdict: v} as protobuf writes it; None for a value out of its field's
    range (protobuf then says what is wrong)."""
    if not _uint32s(v.position, v.accepted, v.gen, v.k):
        return None
    b = bytearray()
    if v.position:
        _put(0x08, v.position, b)
    if v.accepted:
        _put(0x10, v.accepted, b)
    if v.tokens and not _packed(0x1A, v.tokens, b):
        return None
    if v.gen:
        _put(0x20, v.gen, b)
    if v.k:
        _put(0x28, v.k, b)
    if v.keep_min:
        b.append(0x35)
        b += _F32.pack(v.keep_min)
    if v.alternate:
        b += b"\x38\x01"
    return _wrapped(0x12, b)


def chunk_bytes(c: Chunk) -> bytes | None:
    """DraftMessage{chunk: c} as protobuf writes it; None for a chunk with q or alternates,
    or a value out of its field's range."""
    step = c.step or (0, 0)
    if c.sparse is not None or c.alternates or \
            not _uint32s(c.gen, c.start, c.busy_us, c.cache_n or 0, c.prompt_n or 0, *step):
        return None
    b = bytearray()
    if c.gen:
        _put(0x08, c.gen, b)
    if c.start:
        _put(0x10, c.start, b)
    if c.tokens and not _packed(0x1A, c.tokens, b):
        return None
    if c.done:
        b += b"\x38\x01"
    if c.busy_us:
        _put(0x40, c.busy_us, b)
    if c.cache_n is not None:
        _put(0x48, c.cache_n, b)
    if c.prompt_n is not None:
        _put(0x50, c.prompt_n, b)
    if c.step is not None:
        _put(0x60, step[0], b)
        _put(0x68, step[1], b)
    return _wrapped(0x0A, b)


def _fields(data: bytes, outer: int, allowed: dict[int, int]) -> dict[int, object] | None:
    """The fields of `data`, a message holding one submessage in field tag `outer`: varints
    (uint32) and packed int32 lists by field number. None for anything but that shape."""
    n = len(data)
    if n < 2 or data[0] != outer:
        return None
    size, i = _read(data, 1, n)
    if size is None or i + size != n:
        return None
    out: dict[int, object] = {}
    last = 0
    while i < n:
        tag = data[i]
        i += 1
        field, kind = tag >> 3, tag & 7
        if tag > 0x7F or field <= last or allowed.get(field) != kind:
            return None
        last = field
        if kind == 0:
            value, i = _read(data, i, n)
            if value is None:
                return None
            out[field] = value
        elif kind == 5:
            if i + 4 > n:
                return None
            out[field] = _F32.unpack_from(data, i)[0]
            i += 4
        else:  # a packed int32 list of values in 0..2^31-1
            size, i = _read(data, i, n)
            if size is None or i + size > n:
                return None
            end, values = i + size, []
            while i < end:
                value, i = _read(data, i, end)
                if value is None or value >= _INT32:
                    return None
                values.append(value)
            out[field] = values
    return out


def _read(data: bytes, i: int, end: int) -> tuple[int | None, int]:
    """A varint of at most 5 bytes below 2^32 at data[i:end]; (None, i) otherwise."""
    value = shift = 0
    while i < end and shift < 35:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return (value, i) if value < _UINT32 else (None, i)
        shift += 7
    return None, i


#: Field number -> wire type (0 varint, 2 packed, 5 float) of each fast-path message.
_VERDICT = {1: 0, 2: 0, 3: 2, 4: 0, 5: 0, 6: 5, 7: 0}
_CHUNK = {1: 0, 2: 0, 3: 2, 7: 0, 8: 0, 9: 0, 10: 0, 12: 0, 13: 0}


def verdict_from_bytes(data: bytes) -> Verdict | None:
    """The Verdict a TargetMessage holds, if it has the common shape (else None: parse it
    with protobuf). Raises ProtocolError as Verdict does for what it checks."""
    f = _fields(data, 0x12, _VERDICT)
    if f is None or f.get(7, 0) > 1:
        return None
    return Verdict(f.get(1, 0), f.get(2, 0), f.get(3) or [], gen=f.get(4, 0),
                   k=f.get(5, 0), keep_min=f.get(6, 0.0), alternate=bool(f.get(7)))


def chunk_from_bytes(data: bytes) -> Chunk | None:
    """The Chunk a DraftMessage holds, if it has the common shape (else None: parse it
    with protobuf). Raises ProtocolError as Chunk does for what it checks."""
    f = _fields(data, 0x0A, _CHUNK)
    if f is None or f.get(7, 0) > 1:
        return None
    if (12 in f) != (13 in f):
        return None
    return Chunk(f.get(1, 0), f.get(2, 0), f.get(3) or [], done=bool(f.get(7)),
                 busy_us=f.get(8, 0), cache_n=f.get(9), prompt_n=f.get(10),
                 step=(f[12], f[13]) if 12 in f else None)
