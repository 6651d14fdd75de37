"""Text a peer wrote (error messages, model names), made safe to log and to show.

A draft node's error text reaches the target's log and its live page; a hostile node
could send megabytes, or terminal escapes and line breaks that forge log lines. Every
such text passes through `peer_text`: control and format characters become `?`, and
what is longer than PEER_TEXT_MAX characters is cut, with an ellipsis.
"""

from __future__ import annotations

import unicodedata

PEER_TEXT_MAX = 300


def peer_text(text: object, limit: int = PEER_TEXT_MAX) -> str:
    """`text` as one printable line of at most `limit` characters (plus an ellipsis)."""
    s = text if isinstance(text, str) else str(text)
    cut = len(s) > limit
    s = s[:limit]
    if not s.isprintable():
        s = "".join(c if c == " " or unicodedata.category(c)[0] not in "CZ" else "?"
                    for c in s)
    return s + "..." if cut else s
