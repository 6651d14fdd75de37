"""A chat reply -> Anthropic's message: thinking, text and tool_use blocks, stop_reason, usage.

The reply is split exactly as on the chat route (chat_output: the reasoning split and the
tool-call parser); this module only writes what that gives in Anthropic's shapes, whole
or as its event stream: message_start, ping, then per block content_block_start,
content_block_delta (thinking_delta, text_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason, stop_sequence, usage) and message_stop.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from specwire.server import chat_output
from specwire.server.chat_output import ChatOutput, ChatPlan
from specwire.server.errors import ApiError
from specwire.server.responses import Dialect
from specwire.server.schemas import Completion
from specwire.server.slots import Result, TextChunk
from specwire.text.tools.base import ToolCall


def stop_reason(r: Result, calls: bool, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): tool_use, max_tokens, stop_sequence (one of the
    request's own; the template's end-of-turn strings are end_turn) or end_turn."""
    if calls:
        return "tool_use", None
    if r.stop_type == "limit":
        return "max_tokens", None
    if r.stop_type == "word" and r.stopping_word in stop_sequences:
        return "stop_sequence", r.stopping_word
    return "end_turn", None


def tool_use_id(call: ToolCall) -> str:
    """Anthropic's id for a parsed call (toolu_..., as its clients expect)."""
    return "toolu_" + call.id.removeprefix("call_")


def tool_input(arguments: str) -> dict:
    """A call's arguments as the object tool_use.input is (a non-object is wrapped)."""
    try:
        value: Any = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def blocks(message: chat_output.Message) -> list[dict]:
    """A whole reply's content blocks: thinking, text, then each tool_use."""
    out: list[dict] = []
    if message.reasoning:
        out.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    if message.content:
        out.append({"type": "text", "text": message.content})
    out += [{"type": "tool_use", "id": tool_use_id(c), "name": c.name,
             "input": tool_input(c.arguments)} for c in message.calls]
    return out


class AnthropicMessages(Dialect):
    """Anthropic's POST /v1/messages, whole or streamed."""

    done_marker = False
    named_events = True

    def __init__(self, spec: Completion, model: str) -> None:
        super().__init__(spec, model)
        self.id = "msg_" + uuid.uuid4().hex
        self.plan = spec.chat or ChatPlan()
        self.out = ChatOutput(self.plan)
        self.stops: list[str] = spec.echo.get("stop_sequences", [])
        self.index = -1                 # the stream's current block
        self.open: str | None = None    # its type while open

    def _usage(self, r: Result) -> dict:
        return {"input_tokens": r.tokens_evaluated, "output_tokens": r.tokens_predicted}

    def whole(self, r: Result) -> dict:
        msg = chat_output.whole(self.plan, r.content)
        reason, word = stop_reason(r, bool(msg.calls), self.stops)
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": blocks(msg), "stop_reason": reason, "stop_sequence": word,
                "usage": self._usage(r), "timings": r.timings}

    # -- the stream ------------------------------------------------------------------------

    def opening(self) -> list[dict]:
        start = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                 "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": len(self.spec.request.prompt), "output_tokens": 0}}
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def chunks(self, c: TextChunk) -> list[dict]:
        return self._deltas(self.out.push(c.text))

    def closing(self, r: Result) -> list[dict]:
        events = self._deltas(self.out.finish())
        for call in self.out.calls:
            events += self._start({"type": "tool_use", "id": tool_use_id(call),
                                   "name": call.name, "input": {}})
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": call.arguments}))
        events += self._stop()
        reason, word = stop_reason(r, bool(self.out.calls), self.stops)
        events.append({"type": "message_delta",
                       "delta": {"stop_reason": reason, "stop_sequence": word},
                       "usage": self._usage(r), "timings": r.timings})
        events.append({"type": "message_stop"})
        return events

    def error_event(self, e: ApiError) -> dict:
        return e.anthropic_body()

    def _deltas(self, deltas: list[dict]) -> list[dict]:
        """ChatOutput's deltas as block events: thinking and text, each in its own block."""
        events: list[dict] = []
        for d in deltas:
            if d.get("reasoning_content"):
                if self.open != "thinking":
                    events += self._start({"type": "thinking", "thinking": "", "signature": ""})
                events.append(self._delta({"type": "thinking_delta",
                                           "thinking": d["reasoning_content"]}))
            if d.get("content"):
                if self.open != "text":
                    events += self._start({"type": "text", "text": ""})
                events.append(self._delta({"type": "text_delta", "text": d["content"]}))
        return events

    def _start(self, block: dict) -> list[dict]:
        events = self._stop()
        self.index += 1
        self.open = block["type"]
        return [*events, {"type": "content_block_start", "index": self.index,
                          "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _stop(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]
