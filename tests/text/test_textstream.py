"""Incremental detokenisation: a UTF-8 character split across tokens is held back,
never printed as replacement characters, and the pieces add up to the text."""

from __future__ import annotations

import numpy as np
import pytest

from specwire.text.stream import TextStream

TEXT = "naïve café: 3€ — 𝄞 ♫ 日本語 👩‍💻 ok"


def _bytes_as_tokens(data: bytes) -> list[int]:
    return list(data)


def _detok(tokens) -> bytes:
    return bytes(tokens)


@pytest.mark.parametrize("seed", range(20))
def test_random_byte_splits_never_show_replacement_chars(seed: int) -> None:
    """Tokens are single bytes pushed in random groups (1-5), cutting characters anywhere:
    every piece is replacement-free and the pieces join to the text."""
    gen = np.random.default_rng(seed)
    toks = _bytes_as_tokens(TEXT.encode())
    ts = TextStream(_detok)
    pieces, i = [], 0
    while i < len(toks):
        n = int(gen.integers(1, 6))
        pieces.append(ts.push(toks[i:i + n]))
        i += n
    pieces.append(ts.flush())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == TEXT
    assert ts.text() == TEXT


def test_every_prefix_is_held_back_to_a_character_boundary() -> None:
    """One byte at a time: the text printed so far is always the longest complete prefix."""
    data = TEXT.encode()
    ts = TextStream(_detok)
    shown = ""
    for i, b in enumerate(data):
        shown += ts.push([b])
        want = data[:i + 1].decode("utf-8", errors="ignore")
        assert shown == want
        assert data[:i + 1].startswith(shown.encode())


def test_multibyte_token_pieces_split_mid_character() -> None:
    """A byte-fallback vocabulary whose pieces end inside characters (2, 3 and 4 bytes)."""
    vocab = {0: b"caf\xc3", 1: b"\xa9 \xe2", 2: b"\x82", 3: b"\xac \xf0\x9f", 4: b"\x98\x80!"}
    ts = TextStream(lambda toks: b"".join(vocab[t] for t in toks))
    out = [ts.push([t]) for t in range(5)]
    assert out == ["caf", "é ", "", "€ ", "😀!"]
    assert ts.flush() == ""


def test_an_incomplete_tail_is_flushed_as_best_it_can_be() -> None:
    """At the end an unfinished character is emitted (as a replacement), not lost, once."""
    ts = TextStream(_detok)
    assert ts.push(list(b"ab" + "€".encode()[:2])) == "ab"
    assert ts.flush() == "\ufffd"
    assert ts.flush() == ""


def test_invalid_bytes_do_not_block_the_stream() -> None:
    """A stray continuation byte or an 0xFF is passed on at once; later text still flows."""
    ts = TextStream(_detok)
    assert ts.push([0x80]) == "\ufffd"
    assert ts.push(list(b"abc")) == "abc"
    ts2 = TextStream(_detok)
    assert ts2.push([0xFF, 0x41]) == "\ufffdA"
