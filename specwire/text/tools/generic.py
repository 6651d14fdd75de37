"""llama-server's generic format, for chat templates that know no tools.

The tools and the expected reply are described in a system message, and the
reply is one JSON document: {"tool_calls": [{"name", "arguments", "id"}...]}
(or {"tool_call": {...}} when parallel calls are off) to call tools, or
{"response": "..."} to answer. As llama-server does, the reply is constrained
to that form whenever tools are offered.
"""

from __future__ import annotations

from specwire.text.tools.base import Parsed, Tool, ToolFormat, call_from, dumps, loads
from specwire.text.tools.gbnf import Builder
from specwire.text.tools.hermes import call_schema


class Generic(ToolFormat):
    name = "generic"
    start = ""
    native = False

    def parse(self, text: str, known: set[str]) -> Parsed:
        try:
            doc = loads(text)
        except ValueError:
            return Parsed(text)
        if not isinstance(doc, dict):
            return Parsed(text)
        if isinstance(doc.get("response"), str) and len(doc) == 1:
            return Parsed(doc["response"])
        items = doc.get("tool_calls") if "tool_calls" in doc else (
            [doc["tool_call"]] if "tool_call" in doc else None)
        if not isinstance(items, list) or not items:
            return Parsed(text)
        calls = [call_from(x, known=known) for x in items]
        if any(c is None for c in calls):
            return Parsed(text)
        return Parsed("", calls)

    def grammar(self, tools: list[Tool], parallel: bool, allow_response: bool = False) -> str:
        b = Builder()
        one = {"anyOf": [call_schema(t) for t in tools]} if len(tools) > 1 else \
            call_schema(tools[0])
        calls = ({"type": "object", "properties": {"tool_calls": {
                      "type": "array", "items": one, "minItems": 1}},
                  "required": ["tool_calls"], "additionalProperties": False} if parallel else
                 {"type": "object", "properties": {"tool_call": one},
                  "required": ["tool_call"], "additionalProperties": False})
        schema = calls if not allow_response else {"anyOf": [calls, {
            "type": "object", "properties": {"response": {"type": "string"}},
            "required": ["response"], "additionalProperties": False}]}
        return b.text(b.schema(schema, "reply"))

    def system_prompt(self, tools: list[Tool], parallel: bool, forced: bool) -> str:
        """The instructions a template without tools gets, in a system message."""
        key = "tool_calls" if parallel else "tool_call"
        shape = ('{"tool_calls": [{"name": "<function>", "arguments": {...}}]}' if parallel
                 else '{"tool_call": {"name": "<function>", "arguments": {...}}}')
        answer = "" if forced else ' or {"response": "<your answer>"} to answer directly'
        return ("You can call these functions:\n"
                + "\n".join(dumps(t.openai()["function"]) for t in tools)
                + f"\n\nReply with one JSON object: {shape} to call "
                + ("them" if parallel else "one") + f"{answer}. Use the key {key!r} exactly.")
