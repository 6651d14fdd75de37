"""Thinking models: `<think>...</think>` split off the reply into `reasoning_content`.

--reasoning-format (llama-server's flag): "none" leaves the thinking in the
content; "deepseek" and "auto" move it to reasoning_content (whole replies and
streamed deltas alike). A template that opens the think block itself (the
prompt ends with "<think>") makes the reply start inside it.
"""

from __future__ import annotations

from dataclasses import dataclass

OPEN, CLOSE = "<think>", "</think>"
FORMATS = ("none", "deepseek", "auto")


@dataclass(slots=True)
class Split:
    reasoning: str
    content: str


def split(text: str, opened: bool = False) -> Split:
    """A whole reply: the thinking and the rest."""
    body = text.lstrip() if not opened else text
    if not opened:
        if not body.startswith(OPEN):
            return Split("", text)
        body = body[len(OPEN):]
    end = body.find(CLOSE)
    if end < 0:                       # cut short while thinking
        return Split(body.strip(), "")
    return Split(body[:end].strip(), body[end + len(CLOSE):].lstrip())


class Splitter:
    """The same split on a stream: push text pieces, get (reasoning, content) deltas.

    The beginning is held until it is clear whether a think block opens, and a
    tail that could be the start of "</think>" is held until the next piece.
    """

    def __init__(self, opened: bool = False) -> None:
        self.state = "thinking" if opened else "start"
        self.buf = ""
        self.trim = False            # drop the whitespace between </think> and the answer

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        reasoning = content = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(OPEN):
                self.buf, self.state = head[len(OPEN):].lstrip(), "thinking"
            elif OPEN.startswith(head):
                return "", ""          # could still become "<think>"
            else:
                self.state = "content"
        if self.state == "thinking":
            end = self.buf.find(CLOSE)
            if end >= 0:
                reasoning, rest = self.buf[:end], self.buf[end + len(CLOSE):].lstrip()
                self.buf, self.state, self.trim = rest, "content", True
            else:
                keep = _partial(self.buf, CLOSE)
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf)
                                                                               - keep:]
                return reasoning, ""
        if self.state == "content":
            if self.trim:
                self.buf = self.buf.lstrip()
                self.trim = not self.buf
            content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buf = self.buf, ""
        return (rest, "") if self.state == "thinking" else ("", rest)


def _partial(text: str, marker: str) -> int:
    """Length of the longest tail of text that is a proper prefix of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
