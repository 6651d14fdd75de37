"""Incremental detokenisation that never splits a UTF-8 character.

A token can end in the middle of a multi-byte character; printing its bytes
as they come would show replacement characters. This holds back the
incomplete tail until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
    def __init__(self, detokenize: Callable[[Sequence[int]], bytes]) -> None:
        self._detok = detokenize
        self._pending = b""
        self._parts: list[str] = []

    def push(self, tokens: Sequence[int]) -> str:
        """New printable text after these tokens (possibly empty)."""
        data = self._pending + self._detok(tokens)
        cut = _complete_prefix(data)
        self._pending = data[cut:]
        text = data[:cut].decode("utf-8", errors="replace")
        self._parts.append(text)
        return text

    def flush(self) -> str:
        """Whatever is held back, decoded as best it can be."""
        text = self._pending.decode("utf-8", errors="replace")
        self._pending = b""
        self._parts.append(text)
        return text

    def text(self) -> str:
        """Everything so far, the held-back tail included."""
        return "".join(self._parts) + self._pending.decode("utf-8", errors="replace")


def _complete_prefix(data: bytes) -> int:
    """Length of the longest prefix that does not end inside a UTF-8 sequence."""
    n = len(data)
    for back in range(1, min(4, n) + 1):
        b = data[n - back]
        if b & 0xC0 == 0x80:          # continuation byte: keep looking for the lead
            continue
        need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
        return n if need <= back else n - back
    return n
