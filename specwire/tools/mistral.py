"""Mistral / Mistral Nemo: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`."""

from __future__ import annotations

from specwire.tools.base import Parsed, Tool, ToolFormat, call_from, json_values
from specwire.tools.gbnf import Builder
from specwire.tools.hermes import call_schema

_TAG = "[TOOL_CALLS]"


class Mistral(ToolFormat):
    name = "mistral"
    start = _TAG

    def parse(self, text: str, known: set[str]) -> Parsed:
        at = text.find(_TAG)
        if at < 0:
            return Parsed(text)
        found = json_values(text, at + len(_TAG))
        if not found or not isinstance(found[0][2], list | dict):
            return Parsed(text)
        items = found[0][2] if isinstance(found[0][2], list) else [found[0][2]]
        calls = [call_from(x, known=known) for x in items]
        if not calls or any(c is None for c in calls):
            return Parsed(text)
        return Parsed(text[:at].strip(), calls)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        alts = " | ".join(b.schema(call_schema(t), "call") for t in tools)
        call = b.rule("call", f"({alts})")
        items = f'{call} ("," " "? {call})*' if parallel else call
        return b.text(f'{b.literal(_TAG)} "[" {items} "]"')
