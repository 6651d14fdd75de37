"""How many frames of each kind that carry no gRPC data a peer may send per second.

Some HTTP/2 frames must be answered (PING, SETTINGS), some ignored (PRIORITY, unknown
types, empty DATA), and streams may be reset at will: each is cheap to send and costs a
parse. An honest draft link sends a handful per connection; a peer sending hundreds a
second is attacking and gets ENHANCE_YOUR_CALM (as nghttp2, Go and Envoy answer). Frames
are counted from their headers as bytes arrive, before h2. The scan also tells
datapath.py when bytes may skip h2 (`settled`).
"""

from __future__ import annotations

import time

#: Frames of each kind a peer may send in any one-second window.
LIMITS = {
    "PING": 100,
    "SETTINGS": 50,
    "RST_STREAM": 100,
    "HEADERS": 100,
    "CONTINUATION": 200,  # h2 also ends a header block of more than 64
    "WINDOW_UPDATE": 1000,
    "ignored": 500,  # PRIORITY, unknown types, empty DATA
}
_KINDS = {1: "HEADERS", 2: "ignored", 3: "RST_STREAM", 4: "SETTINGS", 6: "PING",
          8: "WINDOW_UPDATE", 9: "CONTINUATION"}


class FloodError(Exception):
    """A peer sent more frames of one kind than LIMITS allows."""


class FloodLimits:
    """Scans the frame headers of a byte stream and counts them per kind, in fixed
    one-second windows. `skip`: bytes before the first frame (a server's preface)."""

    __slots__ = ("_counts", "_since", "_head", "_left", "_in_block")

    def __init__(self, skip: int = 0) -> None:
        self._counts = dict.fromkeys(LIMITS, 0)
        self._since = time.monotonic()
        self._head = b""  # a frame header split across reads
        self._left = skip  # payload bytes of the current frame still to come
        self._in_block = False  # a HEADERS or PUSH_PROMISE awaits its CONTINUATIONs

    @property
    def settled(self) -> bool:
        """The next byte starts a frame, and no header block is open."""
        return not (self._left or self._head or self._in_block)

    def scan(self, data: bytes) -> None:
        """Count the frames whose headers are in data; FloodError past a limit."""
        i, n = min(self._left, len(data)), len(data)
        self._left -= i
        while i < n:
            if self._head or n - i < 9:
                take = 9 - len(self._head)
                self._head += data[i : i + take]
                i += take
                if len(self._head) < 9:
                    return
                head, self._head = self._head, b""
            else:
                head = data[i : i + 9]
                i += 9
            length = int.from_bytes(head[:3], "big")
            kind = head[3]
            if kind in (1, 5, 9):  # HEADERS, PUSH_PROMISE, CONTINUATION: END_HEADERS closes
                self._in_block = not head[4] & 4
            if kind > 9 or (length == 0 and kind == 0 and not head[4] & 1):
                self._note("ignored")
            elif kind in _KINDS:
                self._note(_KINDS[kind])
            skip = min(length, n - i)
            i += skip
            self._left = length - skip

    def _note(self, kind: str) -> None:
        now = time.monotonic()
        if now - self._since >= 1.0:
            self._counts = dict.fromkeys(LIMITS, 0)
            self._since = now
        n = self._counts[kind] = self._counts[kind] + 1
        if n > LIMITS[kind]:
            raise FloodError(f"flood: more than {LIMITS[kind]} {kind} frames a second")
