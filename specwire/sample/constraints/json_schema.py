"""JSON schemas and JSON mode -> GBNF, with llama-cpp-python's port of llama.cpp's converter.

`response_format: {"type": "json_object"}` constrains to any JSON object;
`{"type": "json_schema", "json_schema": {"schema": ...}}` and /completion's
`json_schema` to documents matching the schema. An invalid schema is refused
with a ConfigError that names the field it came from.
"""

from __future__ import annotations

import json
from typing import Any

from specwire.config import ConfigError
from specwire.sample.constraints.grammar import GrammarSpec

#: Any JSON object (OpenAI's json_object mode answers with an object, never a bare value).
JSON_OBJECT_SCHEMA: dict = {"type": "object"}


def schema_grammar(schema: Any, origin: str = "json_schema") -> GrammarSpec:
    """The GBNF grammar of documents that validate against `schema` (a dict)."""
    if isinstance(schema, bool) or not isinstance(schema, dict):
        raise ConfigError(f"{origin}: must be a JSON schema object")
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    try:
        text = json_schema_to_gbnf(json.dumps(schema))
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds on bad input
        raise ConfigError(f"{origin}: unsupported or invalid JSON schema: "
                          f"{type(e).__name__}: {e}") from None
    return GrammarSpec(text, "root", origin)


JSON_OBJECT = schema_grammar(JSON_OBJECT_SCHEMA, "response_format")
