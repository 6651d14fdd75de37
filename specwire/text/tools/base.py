"""What every tool-call format shares: tools, calls, and the format interface.

A format knows three things about one family of models: how a call looks in
the model's output (`parse`, and `start`, the text that opens a call so that a
stream can hold it back), and the GBNF grammar of a valid call for `required`
or a named function (`grammar`), so that even a small model emits one whose
arguments match the tool's schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class Tool:
    """One function the model may call: name, description, JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def openai(self) -> dict:
        """The OpenAI form, which chat templates receive as `tools`."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(slots=True)
class ToolCall:
    """A parsed call: arguments is the JSON text, as OpenAI returns it."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def openai(self, index: int | None = None) -> dict:
        d: dict = {"id": self.id, "type": "function",
                   "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass(slots=True)
class Parsed:
    """A model's reply split into its text content and its tool calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


#: Nesting deeper than this, in model output or in a history's arguments, is not a call:
#: Python's parser and printer recurse per level (RecursionError at about 1000).
MAX_JSON_DEPTH = 64


class TooDeep(ValueError):
    """JSON nested deeper than MAX_JSON_DEPTH."""


def depth_within(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a parsed JSON value nests at most `limit` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            if d > limit:
                return False
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return True


def loads(text: str) -> Any:
    """json.loads for untrusted text: nesting past MAX_JSON_DEPTH is a TooDeep (a ValueError),
    never a RecursionError."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise TooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    if not depth_within(value):
        raise TooDeep(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


def as_arguments(value: Any) -> str | None:
    """A call's arguments as JSON text (an object), or None if they are not an object."""
    if isinstance(value, str):
        try:
            value = loads(value)
        except ValueError:
            return None
    elif not depth_within(value):
        return None
    return dumps(value) if isinstance(value, dict) else None


def json_values(text: str, start: int = 0) -> list[tuple[int, int, Any]]:
    """Every top-level JSON object or array in text from start: (begin, end, value)."""
    dec, out, i = json.JSONDecoder(), [], start
    while True:
        j = min((p for p in (text.find("{", i), text.find("[", i)) if p >= 0), default=-1)
        if j < 0:
            return out
        try:
            value, end = dec.raw_decode(text, j)
        except (ValueError, RecursionError):
            i = j + 1
            continue
        if not depth_within(value):
            i = end
            continue
        out.append((j, end, value))
        i = end


def call_from(obj: Any, name_key: str = "name", args_keys: tuple[str, ...] = ("arguments",
                                                                              "parameters"),
              known: set[str] | None = None) -> ToolCall | None:
    """{"name": ..., "arguments": {...}} -> a ToolCall, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get(name_key), str):
        return None
    if known is not None and obj[name_key] not in known:
        return None
    for k in args_keys:
        if k in obj:
            args = as_arguments(obj[k])
            if args is None:
                return None
            call = ToolCall(obj[name_key], args)
            if isinstance(obj.get("id"), str) and obj["id"]:
                call.id = obj["id"]
            return call
    return ToolCall(obj[name_key], "{}") if len(obj) == 1 else None


def calls_among(text: str, block: re.Pattern,
                call: Callable[[re.Match], ToolCall | None]) -> Parsed:
    """Calls written as blocks among the content (Hermes, Qwen3-Coder): each match of
    `block` is one call and the text around the blocks is the content. One block that is
    not a valid call (`call` returns None) makes the whole reply content."""
    calls, content, last = [], [], 0
    for m in block.finditer(text):
        c = call(m)
        if c is None:
            return Parsed(text)
        calls.append(c)
        content.append(text[last:m.start()])
        last = m.end()
    content.append(text[last:])
    return Parsed("".join(content).strip() if calls else text, calls)


def calls_after(text: str, tag: str,
                calls: Callable[[int], Iterable[ToolCall | None]]) -> Parsed:
    """Calls after a tag that ends the content (DeepSeek, Mistral): `calls(at)` reads
    them from the tag at `at` on. No tag, no call, or one that is not valid (None) makes
    the whole reply content."""
    at = text.find(tag)
    if at < 0:
        return Parsed(text)
    found = list(calls(at))
    if not found or any(c is None for c in found):
        return Parsed(text)
    return Parsed(text[:at].strip(), found)


class ToolFormat:
    """One family's tool-call syntax. Subclasses set name and start, and implement parse."""

    name = "base"
    #: text that opens a tool call in the output ("" : the whole output is one JSON document)
    start = ""
    #: whether the chat template itself renders `tools` (else they go in a system message)
    native = True

    def parse(self, text: str, known: set[str]) -> Parsed:
        raise NotImplementedError

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        raise NotImplementedError
