"""DeepSeek V3 / R1 (and V3.1's shorter form):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

import re

from specwire.text.tools.base import (
    Parsed,
    Tool,
    ToolCall,
    ToolFormat,
    as_arguments,
    calls_after,
    loads,
)
from specwire.text.tools.gbnf import Builder

BEGIN, END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_CALL = re.compile(re.escape(CALL) + r"(?:function)?" + re.escape(SEP) +
                   r"\s*([^\n`{]+?)\s*(?:```json)?\s*(\{.*?\})\s*(?:```)?\s*" +
                   re.escape(CALL_END), re.S)


class DeepSeek(ToolFormat):
    name = "deepseek"
    start = BEGIN

    def parse(self, text: str, known: set[str]) -> Parsed:
        def call(m: re.Match) -> ToolCall | None:
            name = m.group(1).strip()
            try:
                args = as_arguments(loads(m.group(2)))
            except ValueError:
                return None
            return ToolCall(name, args) if name in known and args is not None else None
        return calls_after(text, BEGIN, lambda at: map(call, _CALL.finditer(text, at)))

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        b = Builder()
        alts = " | ".join(
            f'{b.literal(CALL + "function" + SEP + t.name)} "\\n```json\\n" {b.args(t)} '
            f'"\\n```" {b.literal(CALL_END)}' for t in tools)
        call = b.rule("call", f"({alts})")
        body = f"{call} ({call})*" if parallel else call
        return b.text(f"{b.literal(BEGIN)} {body} {b.literal(END)}")
