"""Llama 3.1-3.3 JSON tool calls: `{"name": ..., "parameters": {...}}`, maybe after a python tag."""

from __future__ import annotations

from specwire.text.tools.base import Parsed, Tool, ToolFormat, call_from, loads
from specwire.text.tools.gbnf import Builder
from specwire.text.tools.hermes import call_schema

_TAG = "<|python_tag|>"


class Llama3(ToolFormat):
    name = "llama3"
    start = "{"

    def parse(self, text: str, known: set[str]) -> Parsed:
        body = text.strip()
        if body.startswith(_TAG):
            body = body[len(_TAG):].strip()
        if not body.startswith("{"):
            return Parsed(text)
        calls = []
        for part in body.split(";"):      # several calls come separated by semicolons
            try:
                obj = loads(part)
            except ValueError:
                return Parsed(text)
            call = call_from(obj, args_keys=("parameters", "arguments"), known=known)
            if call is None:
                return Parsed(text)
            calls.append(call)
        return Parsed("", calls)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        alts = " | ".join(b.schema(call_schema(t, "parameters"), "call") for t in tools)
        call = b.rule("call", f"({alts})")
        return b.text(f'{call} ("; " {call})*' if parallel else call)
