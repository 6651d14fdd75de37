"""Stop strings, found in the generated text rather than in tokens.

A stop string rarely lines up with token boundaries ("\\n\\n" may arrive as
"\\n" + "\\nThe"), so the matcher keeps the text generated so far, searches
the part a new piece could complete, and cuts the content where the earliest
stop string begins. While streaming, the tail that could still turn into a
stop string is held back, so a client never sees half of one.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces in order; get back what is safe to send."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)
        self.text = ""        # everything kept so far (cut at the stop string once found)
        self.sent = 0         # how much of text has been handed out
        self.word: str | None = None

    @property
    def stopped(self) -> bool:
        return self.word is not None

    def push(self, piece: str) -> str:
        """Add generated text; return the new text that can be sent now."""
        if self.word is not None or not piece:
            return ""
        # A new match must end inside `piece`, so it starts at most longest-1 chars earlier.
        start = max(0, len(self.text) - self._longest + 1)
        self.text += piece
        hit = self._find(start)
        if hit is not None:
            pos, self.word = hit
            self.text = self.text[:pos]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._held())

    def finish(self) -> str:
        """The generation is over: release the held-back tail."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        end = max(end, self.sent)
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def _find(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self.stops:
            pos = self.text.find(s, start)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _held(self) -> int:
        """Length of the longest unsent tail that is a prefix of some stop string."""
        unsent = len(self.text) - self.sent
        held = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, unsent), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
