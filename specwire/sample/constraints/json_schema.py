"""JSON schemas and JSON mode -> GBNF, with llama-cpp-python's port of llama.cpp's converter.

`response_format: {"type": "json_object"}` constrains to any JSON object;
`{"type": "json_schema", "json_schema": {"schema": ...}}` and /completion's
`json_schema` to documents matching the schema. An invalid schema is refused
with a ConfigError that names the field it came from.

Its repetition counts are checked first (bounds.check_schema). The converter writes a
repetition `x{0,n}` as n nested groups `(x (x ...)?)?`, which llama.cpp's parser recurses
through; `converter()` has it write `x{0,n}`, which llama.cpp expands without recursion
(the form llama.cpp's own converter writes).
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from specwire.config import ConfigError
from specwire.sample.constraints.bounds import check_schema
from specwire.sample.constraints.grammar import GrammarSpec

#: Any JSON object (OpenAI's json_object mode answers with an object, never a bare value).
JSON_OBJECT_SCHEMA: dict = {"type": "object"}


def schema_grammar(schema: Any, origin: str = "json_schema") -> GrammarSpec:
    """The GBNF grammar of documents that validate against `schema` (a dict)."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ConfigError(f"{origin}: must be a JSON schema object")
    check_schema(schema, origin)
    json_schema_to_gbnf = converter().json_schema_to_gbnf
    try:
        text = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds on bad input
        raise ConfigError(f"{origin}: unsupported or invalid JSON schema: "
                          f"{type(e).__name__}: {e}") from None
    return GrammarSpec(text, "root", origin)


def build_repetition(item_rule: str, min_items: int, max_items: int | None,
                     separator_rule: str | None = None,
                     item_rule_is_literal: bool = False) -> str:
    """GBNF for min..max repetitions of item_rule (max None: unbounded), flat.

    A port of build_repetition in llama.cpp's common/json-schema-to-grammar.cpp;
    item_rule_is_literal is the Python converter's argument, which needs nothing here.
    """
    if max_items == 0:
        return ""
    if min_items == 0 and max_items == 1:
        return f"{item_rule}?"
    if not separator_rule:
        if min_items == 1 and max_items is None:
            return f"{item_rule}+"
        if min_items == 0 and max_items is None:
            return f"{item_rule}*"
        return f"{item_rule}{{{min_items},{'' if max_items is None else max_items}}}"
    result = item_rule + " " + build_repetition(
        f"({separator_rule} {item_rule})", max(min_items - 1, 0),
        None if max_items is None else max_items - 1)
    return f"({result})?" if min_items == 0 else result


def converter() -> ModuleType:
    """llama-cpp-python's converter module, writing repetitions flat (see above)."""
    from llama_cpp import llama_grammar

    llama_grammar._build_repetition = build_repetition
    return llama_grammar


JSON_OBJECT = schema_grammar(JSON_OBJECT_SCHEMA, "response_format")
