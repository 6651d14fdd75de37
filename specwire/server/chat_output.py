"""A chat reply -> OpenAI's message: reasoning_content, content and tool_calls.

The plan (ChatPlan) is made when the request is parsed: which tool-call format
to look for and which tools exist, and whether thinking is split off. The
ChatOutput then turns the generated text into deltas while streaming (content
is sent as it comes until a tool call may be starting; from there on it is
held and parsed at the end) or into one message. A reply that is not a valid
call is content, never an error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specwire.text import reasoning
from specwire.text.tools.base import Parsed, ToolCall, ToolFormat


@dataclass(slots=True)
class ChatPlan:
    tool_format: ToolFormat | None = None          # None: no tools offered (or tool_choice none)
    tool_names: set[str] = field(default_factory=set)
    split_reasoning: bool = False
    think_opened: bool = False                     # the prompt ends inside <think>


@dataclass(slots=True)
class Message:
    content: str
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def openai(self) -> dict:
        m: dict = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.calls:
            m["tool_calls"] = [c.openai() for c in self.calls]
        return m


def whole(plan: ChatPlan, text: str) -> Message:
    r, content = "", text
    if plan.split_reasoning:
        s = reasoning.split(text, plan.think_opened)
        r, content = s.reasoning, s.content
    if plan.tool_format is None:
        return Message(content, r)
    parsed: Parsed = plan.tool_format.parse(content, plan.tool_names)
    return Message(parsed.content, r, parsed.calls)


class ChatOutput:
    """Streaming: push text pieces, get delta dicts; finish() gives the last ones."""

    def __init__(self, plan: ChatPlan) -> None:
        self.plan = plan
        self.splitter = reasoning.Splitter(plan.think_opened) if plan.split_reasoning else None
        self.content = ""          # all content so far (after the reasoning split)
        self.sent = 0              # how much of it was sent as content deltas
        self.held = False          # a tool call may have started: hold the rest
        self.calls: list[ToolCall] = []

    def push(self, piece: str) -> list[dict]:
        deltas = []
        if self.splitter is not None:
            r, piece = self.splitter.push(piece)
            if r:
                deltas.append({"reasoning_content": r})
        return deltas + self._content(piece)

    def finish(self) -> list[dict]:
        deltas = []
        piece = ""
        if self.splitter is not None:
            r, piece = self.splitter.finish()
            if r:
                deltas.append({"reasoning_content": r})
        self.content += piece
        fmt = self.plan.tool_format
        rest = self.content[self.sent:]
        if fmt is not None and self.held:
            parsed = fmt.parse(rest, self.plan.tool_names)
            if parsed.calls:
                self.calls = parsed.calls
                rest = parsed.content
        self.sent = len(self.content)
        if rest:
            deltas.append({"content": rest})
        if self.calls:
            deltas.append({"tool_calls": [c.openai(i) for i, c in enumerate(self.calls)]})
        return deltas

    def _content(self, piece: str) -> list[dict]:
        self.content += piece
        fmt = self.plan.tool_format
        if fmt is None:
            out, self.sent = self.content[self.sent:], len(self.content)
            return [{"content": out}] if out else []
        if self.held:
            return []
        if not fmt.start:                 # the whole reply is one JSON document
            self.held = True
            return []
        at = self.content.find(fmt.start, self.sent)
        if at >= 0:
            self.held = True
            end = at
        else:
            end = len(self.content) - reasoning._partial(self.content, fmt.start)
        out, self.sent = self.content[self.sent:end], max(self.sent, end)
        return [{"content": out}] if out else []
