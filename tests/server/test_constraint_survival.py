"""One request must not kill the target: hostile constraints on every route that takes one.

`specwire serve` on the bundled pair is sent issue 23's payloads: a JSON schema with
maxLength 30000 (llama.cpp's parser recursed 30000 deep and the server segfaulted) and
10^7 (the converter first built 80 MB of GBNF), a GBNF grammar of 60000 nested groups, a
pattern repeating 30000 times, a long literal repeated 2000 times, a chain of leftmost
rules, through /completion (grammar, json_schema), /v1/completions, /v1/chat/completions
(response_format, tools). Each gets a 400 that names its field within seconds, the
process stays up, and a normal constrained request is still answered. (/infill takes
the same constraints, checked by the same code; the bundled target has no FIM tokens, so
test_serve_flags.py sends them to /infill on a toy target that has.)
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from serve_process import run_serve

pytestmark = pytest.mark.slow

NESTED = "root ::= " + "(" * 60000 + '"a"' + ")" * 60000
CHAIN = "\n".join(f'r{i} ::= r{i + 1} "a"' for i in range(5000)) + '\nr5000 ::= "a"\nroot ::= r0'
LONG = 'root ::= "' + "x" * 2000 + '"{2000}'
WIDE = {"type": "string", "maxLength": 30000}
HUGE = {"type": "string", "maxLength": 10**7}
PATTERN = {"type": "string", "pattern": "^a{0,30000}$"}
CHAT = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}


def _tool(schema: dict) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": schema}, "required": ["x"]}}}


ATTACKS = [
    # (path, body, the field the 400 must name)
    ("/completion", {"prompt": "Name:", "n_predict": 8, "json_schema": WIDE},
     "json_schema.maxLength"),
    ("/completion", {"prompt": "Name:", "n_predict": 8, "json_schema": HUGE},
     "json_schema.maxLength"),
    ("/completion", {"prompt": "Name:", "n_predict": 8, "json_schema": PATTERN},
     "json_schema.pattern"),
    ("/completion", {"prompt": "Name:", "n_predict": 8, "grammar": NESTED}, "grammar: "),
    ("/completion", {"prompt": "Name:", "n_predict": 8, "grammar": CHAIN}, "grammar: "),
    ("/completion", {"prompt": "Name:", "n_predict": 8, "grammar": LONG}, "grammar: "),
    ("/v1/completions", {"prompt": "Name:", "max_tokens": 8, "json_schema": WIDE},
     "json_schema.maxLength"),
    ("/v1/completions", {"prompt": "Name:", "max_tokens": 8, "grammar": NESTED}, "grammar: "),
    ("/v1/completions", {"prompt": "Name:", "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": WIDE}}},
     "response_format.json_schema.schema.maxLength"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": WIDE}}},
     "response_format.json_schema.schema.maxLength"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": HUGE}}},
     "response_format.json_schema.schema.maxLength"),
    ("/v1/chat/completions", {**CHAT, "response_format": {
        "type": "json_object", "schema": PATTERN}}, "response_format.schema.pattern"),
    ("/v1/chat/completions", {**CHAT, "tools": [_tool(WIDE)], "tool_choice": "required"},
     "tools[0].function.parameters.properties.x.maxLength"),
    ("/v1/chat/completions", {**CHAT, "tools": [_tool({"type": "string"}), {
        **_tool(HUGE), "function": {**_tool(HUGE)["function"], "name": "g"}}],
        "tool_choice": "required"}, "tools[1].function.parameters.properties.x.maxLength"),
]


@pytest.fixture(scope="module")
def server():
    with run_serve("-t", "1", "-td", "1", "-c", "512", "--draft-max", "4",
                   no_traceback=True) as (url, log):
        yield url, log


@pytest.mark.parametrize("path, body, names", ATTACKS,
                         ids=[f"{i}:{p}:{n}" for i, (p, _, n) in enumerate(ATTACKS)])
def test_hostile_constraint_is_a_400_naming_its_field(server, path: str, body: dict,
                                                       names: str) -> None:
    url, _ = server
    t0 = time.monotonic()
    r = httpx.post(url + path, content=json.dumps(body), timeout=120,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text[:500]
    message = r.json()["error"]["message"]
    assert names in message, message
    assert time.monotonic() - t0 < 30
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_still_answers_after_the_attacks(server) -> None:
    url, _ = server
    for path, body, _ in ATTACKS:      # all of them again, back to back
        httpx.post(url + path, json=body, timeout=120)
    r = httpx.post(url + "/completion", json={
        "prompt": "Name:", "n_predict": 6, "temperature": 0,
        "json_schema": {"type": "string", "maxLength": 2000}}, timeout=120)
    assert r.status_code == 200 and r.json()["content"].startswith('"'), r.text
    r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "temperature": 0}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None
