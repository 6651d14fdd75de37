"""Mistral / Mistral Nemo: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]`."""

from __future__ import annotations

from specwire.text.tools.base import (
    Parsed,
    Tool,
    ToolCall,
    ToolFormat,
    call_from,
    calls_after,
    json_values,
)
from specwire.text.tools.gbnf import Builder
from specwire.text.tools.hermes import call_schema

_TAG = "[TOOL_CALLS]"


class Mistral(ToolFormat):
    name = "mistral"
    start = _TAG

    def parse(self, text: str, known: set[str]) -> Parsed:
        def calls(at: int) -> list[ToolCall | None]:
            found = json_values(text, at + len(_TAG))
            if not found or not isinstance(found[0][2], list | dict):
                return []
            items = found[0][2] if isinstance(found[0][2], list) else [found[0][2]]
            return [call_from(x, known=known) for x in items]
        return calls_after(text, _TAG, calls)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        alts = " | ".join(b.schema(call_schema(t), "call") for t in tools)
        call = b.rule("call", f"({alts})")
        items = f'{call} ("," " "? {call})*' if parallel else call
        return b.text(f'{b.literal(_TAG)} "[" {items} "]"')
