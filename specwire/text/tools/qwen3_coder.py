"""Qwen3-Coder's XML form:

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

A value is raw text for a string parameter and JSON for any other type.
"""

from __future__ import annotations

import re

from specwire.text.tools.base import Parsed, Tool, ToolCall, ToolFormat, calls_among, dumps, loads
from specwire.text.tools.gbnf import Builder

_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)",
                   re.S)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3Coder(ToolFormat):
    name = "qwen3-coder"
    start = "<tool_call>"

    def __init__(self, tools: list[Tool] | None = None) -> None:
        self.tools = {t.name: t for t in tools or []}

    def parse(self, text: str, known: set[str]) -> Parsed:
        def call(m: re.Match) -> ToolCall | None:
            name = m.group(1).strip()
            if name not in known:
                return None
            props = (self.tools.get(name) or Tool(name)).parameters.get("properties", {})
            args = {}
            for p in _PARAM.finditer(m.group(2)):
                key = p.group(1).strip()
                args[key] = _value(p.group(2), props.get(key, {}))
            return ToolCall(name, dumps(args))
        return calls_among(text, _CALL, call)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        text_value = b.rule("xml-text", '([^<] | "<" [^/])*')
        funcs = []
        for t in tools:
            props = (t.parameters or {}).get("properties", {})
            required = set((t.parameters or {}).get("required", []))
            parts = []
            for key, schema in props.items():
                value = text_value if schema.get("type") == "string" else b.schema(schema, key)
                param = (f'{b.literal(f"<parameter={key}>")} "\\n" {value} "\\n" '
                         f'{b.literal("</parameter>")} "\\n"')
                parts.append(f"({param})" if key in required else f"({param})?")
            funcs.append(f'{b.literal(f"<function={t.name}>")} "\\n" {" ".join(parts)} '
                         f'{b.literal("</function>")}')
        block = b.rule("tool-call", f'{b.literal("<tool_call>")} "\\n" ({" | ".join(funcs)}) '
                                    f'"\\n" {b.literal("</tool_call>")}')
        return b.text(f'{block} ("\\n" {block})*' if parallel else block)


def _value(raw: str, schema: dict):
    if schema.get("type") == "string":
        return raw
    try:
        return loads(raw)
    except ValueError:
        return raw
