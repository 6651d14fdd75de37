"""The bounds on a constraint (sample/constraints/bounds.py), checked without llama.cpp.

Each hostile shape that crashed or stalled llama.cpp's grammar parser (issue 23) is
refused with a ConfigError naming the field, fast and without recursion; the grammars
the converter writes for ordinary schemas and the repository's example grammars pass.
"""

from __future__ import annotations

import time

import pytest

from specwire.config import ConfigError
from specwire.sample.constraints import schema_grammar
from specwire.sample.constraints.bounds import (
    MAX_CHAIN,
    MAX_ELEMENTS,
    MAX_GBNF_CHARS,
    MAX_NESTING,
    MAX_REPETITION,
    check_gbnf,
    check_pattern,
    check_schema,
)
from specwire.sample.constraints.json_schema import build_repetition

ARITHMETIC = """
root  ::= (expr "=" ws term "\\n")+
expr  ::= term ([-+*/] term)*
term  ::= ident | num | "(" ws expr ")" ws
ident ::= [a-z] [a-z0-9_]* ws
num   ::= [0-9]+ ws
ws    ::= [ \\t\\n]*   # a comment (with a ")" in it
"""


@pytest.mark.parametrize("schema, names", [
    ({"type": "string", "maxLength": 30000}, "json_schema.maxLength: 30000"),
    ({"type": "string", "maxLength": 10**7}, "json_schema.maxLength: 10000000"),
    ({"type": "string", "minLength": 2001}, "json_schema.minLength: 2001"),
    ({"type": "array", "maxItems": 5000}, "json_schema.maxItems"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3000}}},
     "json_schema.properties.a.minItems"),
    ({"anyOf": [{"type": "string"}, {"type": "string", "maxLength": 2001}]},
     "json_schema.anyOf[1].maxLength"),
    ({"type": "string", "pattern": "^a{0,30000}$"}, "json_schema.pattern"),
    ({"type": "string", "pattern": "^(ab){2001}$"}, "json_schema.pattern"),
    ({"type": "string", "pattern": "^x{99999999999999999999,}$"}, "json_schema.pattern"),
    ({"type": "string", "maxLength": -1}, "json_schema.maxLength: must be a non-negative"),
    ({"type": "string", "maxLength": 2.5}, "json_schema.maxLength: must be a non-negative"),
])
def test_schema_repetitions_over_llamas_limit_are_refused(schema, names: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="^" + names.replace("[", r"\[").replace(".", r"\.")):
        schema_grammar(schema, "json_schema")
    assert time.perf_counter() - t0 < 1.0     # refused before the converter builds anything


def test_schema_data_and_property_names_are_not_keywords() -> None:
    check_schema({"type": "object", "properties": {"maxLength": {"type": "integer"}},
                  "enum": [{"maxLength": 99999}], "default": {"minItems": -4}}, "json_schema")
    check_pattern(r"^[{]9999[}]\{9999\}$", "p")       # a class and escapes are no quantifier
    with pytest.raises(ConfigError, match=r"p: the repetition \{3000\}"):
        check_pattern("^(a|b){3000}$", "p")


def test_converted_repetitions_are_flat() -> None:
    """maxLength 2000 (the most allowed) converts to char{0,2000}, not 2000 nested groups."""
    text = schema_grammar({"type": "string", "maxLength": MAX_REPETITION}).text
    assert "char{0,2000}" in text and "((" not in text
    check_gbnf(text, "json_schema")
    items = schema_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 0,
                            "maxItems": MAX_REPETITION}).text
    check_gbnf(items, "json_schema")
    assert '("," space integer){0,1999}' in items
    assert build_repetition("a", 0, 1) == "a?" and build_repetition("a", 1, None) == "a+"
    assert build_repetition("a", 2, 5, '","') == 'a ("," a){1,4}'
    assert build_repetition("a", 0, 3, '","') == '(a ("," a){0,2})?'
    assert build_repetition("a", 0, 0) == ""


@pytest.mark.parametrize("text, why", [
    ("root ::= " + "(" * 60000 + '"a"' + ")" * 60000, f"deeper than {MAX_NESTING}"),
    ("root ::= " + "(" * (MAX_NESTING + 1) + '"a"' + ")" * (MAX_NESTING + 1), "deeper"),
    ('root ::= "' + "x" * 1000 + '"{2000}', f"over {MAX_ELEMENTS} elements"),
    ('root ::= "a"{0,3000}', "over 2000"),
    ('root ::= "a"{2001,}', "over 2000"),
    ('root ::= "a"{' + "9" * 5000 + "}", "over 2000"),
    ("\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(MAX_CHAIN + 10)) + '\nr9999 ::= "a"',
     f"chain of {MAX_CHAIN + 11} rules"),
    ("\n".join(f"r{i} ::= r{i + 1} | r{i + 1}" for i in range(60)) + '\nr60 ::= "a"',
     "paths"),
    ('e ::= | "a"\nf ::= | e{0,2000}\nroot ::= f{0,2000}', "chain of 400"),
    ("root ::= " + "x" * (MAX_GBNF_CHARS + 1), "characters"),
])
def test_hostile_gbnf_is_refused_quickly(text: str, why: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match="^grammar: ") as e:
        check_gbnf(text, "grammar")
    assert why in str(e.value)
    assert time.perf_counter() - t0 < 2.0


def test_ordinary_grammars_pass() -> None:
    check_gbnf(ARITHMETIC, "grammar")
    check_gbnf('root ::= "a" | \nx ::= ("b" | )', "grammar")
    check_gbnf("root ::= " + "(" * MAX_NESTING + '"a"' + ")" * MAX_NESTING, "grammar")
    check_gbnf('root ::= ("a"?){0,2000} [0-9]{2000}', "grammar")
    for schema in ({"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
            "when": {"type": "string", "format": "date-time"},
            "n": {"type": "integer", "minimum": -5, "maximum": 900}},
            "required": ["name"]},
            {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3,6}$"}, {}):
        check_gbnf(schema_grammar(schema).text, "json_schema")


def test_syntax_errors_are_left_to_llama() -> None:
    """A grammar llama.cpp cannot parse passes the bounds: llama.cpp names the error."""
    for text in ("root ::= (", "root :: x", 'root ::= "a" ) ((((', "root ::= [a-", "a ::= b_c"):
        check_gbnf(text, "grammar")
