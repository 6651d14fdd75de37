"""Hermes / Qwen 2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

from __future__ import annotations

import re

from specwire.text.tools.base import (
    Parsed,
    Tool,
    ToolCall,
    ToolFormat,
    call_from,
    calls_among,
    loads,
)
from specwire.text.tools.gbnf import Builder

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def call_schema(tool: Tool, args_key: str = "arguments") -> dict:
    """The JSON object form of a call to this tool."""
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             args_key: tool.parameters or {"type": "object"}},
            "required": ["name", args_key], "additionalProperties": False}


class Hermes(ToolFormat):
    name = "hermes"
    start = "<tool_call>"

    def parse(self, text: str, known: set[str]) -> Parsed:
        def call(m: re.Match) -> ToolCall | None:
            try:
                return call_from(loads(m.group(1)), known=known)
            except ValueError:
                return None
        return calls_among(text, _BLOCK, call)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        alts = " | ".join(b.schema(call_schema(t), "call") for t in tools)
        block = b.rule("tool-call", f'{b.literal("<tool_call>")} "\\n" ({alts}) "\\n" '
                                    f'{b.literal("</tool_call>")}')
        return b.text(f'{block} ("\\n" {block})*' if parallel else block)
