"""GBNF for tool calls, built with llama-cpp-python's JSON-schema converter.

One converter holds every rule: each tool's argument schema becomes a rule of
its own (`args(tool)`), and a format writes the call syntax around them with
literals and its own rules, then `text(root)` gives the grammar.
"""

from __future__ import annotations

import json

from specwire.config import ConfigError
from specwire.text.tools.base import Tool


class Builder:
    def __init__(self) -> None:
        from specwire.sample.constraints.json_schema import converter

        self._c = converter().SchemaConverter(prop_order={}, allow_fetch=False, dotall=False,
                                  raw_pattern=False)
        self._n = 0

    def schema(self, schema: dict, hint: str) -> str:
        """A rule for JSON documents matching schema; returns its name."""
        self._n += 1
        try:
            resolved = self._c.resolve_refs(json.loads(json.dumps(schema)), "tools")
            return self._c.visit(resolved, f"{hint}-{self._n}")
        except Exception as e:  # noqa: BLE001 - the converter raises many kinds on bad input
            raise ConfigError(f"tools: the parameters of {hint!r} are not a usable JSON "
                              f"schema: {type(e).__name__}: {e}") from None

    def args(self, tool: Tool) -> str:
        return self.schema(tool.parameters or {"type": "object"}, _safe(tool.name))

    def literal(self, text: str) -> str:
        return self._c._format_literal(text)

    def rule(self, name: str, body: str) -> str:
        return self._c._add_rule(name, body)

    def text(self, root: str) -> str:
        self._c._add_rule("root", root)
        return self._c.format_grammar()


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in name) or "tool"


def one_or_more(rule: str, parallel: bool, sep: str = "") -> str:
    """rule, or rule (sep rule)* when parallel calls are allowed."""
    return f"{rule} ({sep} {rule})*" if parallel and sep else (
        f"{rule}+" if parallel else rule)
