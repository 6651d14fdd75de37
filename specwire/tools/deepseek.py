"""DeepSeek V3 / R1 (and V3.1's shorter form):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import json
import re

from specwire.tools.base import Parsed, Tool, ToolCall, ToolFormat, as_arguments
from specwire.tools.gbnf import Builder

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL) + r"(?:function)?" + re.escape(SEP) +
                   r"\s*([^\n`{]+?)\s*(?:```json)?\s*(\{.*?\})\s*(?:```)?\s*" +
                   re.escape(CALL_END), re.S)


class DeepSeek(ToolFormat):
    name = "deepseek"
    start = BEGIN

    def parse(self, text: str, known: set[str]) -> Parsed:
        at = text.find(BEGIN)
        if at < 0:
            return Parsed(text)
        calls = []
        for m in _CALL.finditer(text, at):
            name = m.group(1).strip()
            try:
                args = as_arguments(json.loads(m.group(2)))
            except ValueError:
                args = None
            if name not in known or args is None:
                return Parsed(text)
            calls.append(ToolCall(name, args))
        if not calls:
            return Parsed(text)
        return Parsed(text[:at].strip(), calls)

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        alts = " | ".join(
            f'{b.literal(CALL + "function" + SEP + t.name)} "\\n```json\\n" {b.args(t)} '
            f'"\\n```" {b.literal(CALL_END)}' for t in tools)
        call = b.rule("call", f"({alts})")
        body = f"{call} ({call})*" if parallel else call
        return b.text(f"{b.literal(BEGIN)} {body} {b.literal(END)}")
