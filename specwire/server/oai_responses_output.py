"""A chat reply -> OpenAI's response object: reasoning, message and function_call items.

The reply is split exactly as on the chat route (chat_output); this module writes what
that gives as the Responses API's output items, whole or as its event stream:
response.created, response.in_progress, then per item response.output_item.added, its
deltas (response.reasoning_text.delta, response.content_part.added +
response.output_text.delta, response.function_call_arguments.delta), their .done events
and response.output_item.done, and at the end response.completed (response.incomplete
when max_output_tokens cut the reply short). Every event carries a sequence_number.
"""

from __future__ import annotations

import uuid

from specwire.server import chat_output
from specwire.server.chat_output import ChatOutput, ChatPlan
from specwire.server.errors import ApiError
from specwire.server.responses import Dialect
from specwire.server.schemas import Completion
from specwire.server.slots import Result, TextChunk
from specwire.text.tools.base import ToolCall


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(r: Result) -> dict:
    """The Responses API's usage of a finished generation."""
    return {"input_tokens": r.tokens_evaluated,
            "input_tokens_details": {"cached_tokens": int(r.timings.get("cache_n", 0) or 0)},
            "output_tokens": r.tokens_predicted,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": r.tokens_evaluated + r.tokens_predicted}


def reasoning_item(text: str, ident: str | None = None) -> dict:
    return {"type": "reasoning", "id": ident or _id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(text: str, ident: str | None = None, status: str = "completed") -> dict:
    return {"type": "message", "id": ident or _id("msg"), "status": status, "role": "assistant",
            "content": [_text_part(text)] if text or status == "completed" else []}


def call_item(call: ToolCall, ident: str | None = None, status: str = "completed") -> dict:
    return {"type": "function_call", "id": ident or _id("fc"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if status == "completed" else "",
            "status": status}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def output(message: chat_output.Message) -> list[dict]:
    """A whole reply's output items: reasoning, the message, then each function call."""
    items = [reasoning_item(message.reasoning)] if message.reasoning else []
    if message.content or not message.calls:
        items.append(message_item(message.content))
    return items + [call_item(c) for c in message.calls]


class OpenAIResponses(Dialect):
    """OpenAI's POST /v1/responses, whole or streamed."""

    done_marker = False
    named_events = True

    def __init__(self, spec: Completion, model: str) -> None:
        super().__init__(spec, model)
        self.id = _id("resp")
        self.plan = spec.chat or ChatPlan()
        self.out = ChatOutput(self.plan)
        self.seq = 0
        self.items: list[dict] = []     # the stream's output items so far
        self.open: dict | None = None   # the item being streamed (reasoning or message)
        self.text = ""                  # its text so far

    def response(self, status: str, items: list[dict], r: Result | None = None) -> dict:
        """The response object, with the request's settings as the API repeats them."""
        e = self.spec.echo
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        body = {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": None, "incomplete_details": incomplete,
                "instructions": e.get("instructions"), "model": self.model, "output": items,
                "max_output_tokens": e.get("max_output_tokens"),
                "parallel_tool_calls": bool(e.get("parallel_tool_calls")),
                "previous_response_id": None, "store": False,
                "temperature": e.get("temperature"), "top_p": e.get("top_p"),
                "tools": e.get("tools") or [], "tool_choice": e.get("tool_choice") or "auto",
                "text": e.get("text") or {"format": {"type": "text"}},
                "reasoning": e.get("reasoning"), "truncation": "disabled", "metadata": {},
                "usage": usage(r) if r is not None else None}
        if r is not None:
            body["timings"] = r.timings
        return body

    def _status(self, r: Result, calls: bool) -> str:
        return "incomplete" if r.stop_type == "limit" and not calls else "completed"

    def whole(self, r: Result) -> dict:
        msg = chat_output.whole(self.plan, r.content)
        return self.response(self._status(r, bool(msg.calls)), output(msg), r)

    # -- the stream ------------------------------------------------------------------------

    def opening(self) -> list[dict]:
        start = self.response("in_progress", [])
        return [self._event("response.created", response=start),
                self._event("response.in_progress", response=start)]

    def chunks(self, c: TextChunk) -> list[dict]:
        return self._deltas(self.out.push(c.text))

    def closing(self, r: Result) -> list[dict]:
        events = self._deltas(self.out.finish()) + self._close()
        for call in self.out.calls:
            item = call_item(call, status="in_progress")
            at = len(self.items)
            self.items.append(call_item(call, item["id"]))
            events += [
                self._event("response.output_item.added", output_index=at, item=item),
                self._event("response.function_call_arguments.delta", item_id=item["id"],
                            output_index=at, delta=call.arguments),
                self._event("response.function_call_arguments.done", item_id=item["id"],
                            output_index=at, arguments=call.arguments),
                self._event("response.output_item.done", output_index=at,
                            item=self.items[at])]
        if not self.items:                  # an empty reply is one empty message
            events += self._open(message_item("", status="in_progress")) + self._close()
        status = self._status(r, bool(self.out.calls))
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=self.response(status, self.items, r))]

    def error_event(self, e: ApiError) -> dict:
        return self._event("error", code=e.type, message=e.message, param=None)

    def _event(self, kind: str, **fields: object) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _deltas(self, deltas: list[dict]) -> list[dict]:
        """ChatOutput's deltas as item events: thinking and text, each its own item."""
        events: list[dict] = []
        for d in deltas:
            if d.get("reasoning_content"):
                if self.open is None or self.open["type"] != "reasoning":
                    events += self._close() + self._open(reasoning_item(""))
                events.append(self._delta("response.reasoning_text.delta",
                                          d["reasoning_content"]))
            if d.get("content"):
                if self.open is None or self.open["type"] != "message":
                    events += self._close() + self._open(message_item("",
                                                                      status="in_progress"))
                events.append(self._delta("response.output_text.delta", d["content"]))
        return events

    def _open(self, item: dict) -> list[dict]:
        self.open, self.text = item, ""
        at = len(self.items)
        self.items.append(item)
        events = [self._event("response.output_item.added", output_index=at, item=item)]
        if item["type"] == "message":
            events.append(self._event("response.content_part.added", item_id=item["id"],
                                      output_index=at, content_index=0, part=_text_part("")))
        return events

    def _delta(self, kind: str, text: str) -> dict:
        self.text += text
        extra = {"logprobs": []} if kind == "response.output_text.delta" else {}
        return self._event(kind, item_id=self.open["id"], output_index=len(self.items) - 1,
                           content_index=0, delta=text, **extra)

    def _close(self) -> list[dict]:
        """The open item's .done events; it is replaced by its finished form."""
        if self.open is None:
            return []
        item, text, at = self.open, self.text, len(self.items) - 1
        self.open = None
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(text, item["id"])
            events = [self._event("response.reasoning_text.done", **ids, text=text)]
        else:
            done = message_item(text, item["id"])
            events = [self._event("response.output_text.done", **ids, text=text, logprobs=[]),
                      self._event("response.content_part.done", **ids, part=_text_part(text))]
        self.items[at] = done
        return [*events, self._event("response.output_item.done", output_index=at, item=done)]
