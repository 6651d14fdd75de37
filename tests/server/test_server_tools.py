"""Tools and reasoning over HTTP: `specwire serve` on the bundled pair, the official client.

The bundled Gemma template knows no tools, so the server speaks llama-server's
generic JSON format to it; a forced call is constrained by a grammar built from
the tool's schema, so even this 270M model emits a valid call. The reasoning
split runs on a server started with a template file of ours that opens a
<think> block. Plus: every family's forced-call grammar compiles in llama.cpp.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import bundled
import httpx
import pytest
from serve_process import run_serve
from tool_outputs import OUTPUTS, _request

from specwire.server import tool_calls

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]   # the tests' fast target (bundled.py)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def _serve(*flags: str) -> Iterator[str]:
    with run_serve("-t", "1", "-td", "1", "-c", "1024", "--draft-p-min", "0", *flags) as (url, _):
        yield url


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    yield from _serve()


def _client(url: str):
    from openai import OpenAI
    return OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(server: str):
    return _client(server)


def _call_args(call) -> dict:
    import jsonschema
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    return args


@pytest.mark.parametrize("choice", [   # a named choice: also test_named_tool_choice_...
    pytest.param("required", id="required"),
    pytest.param({"type": "function", "function": {"name": "get_weather"}}, id="named",
                 marks=pytest.mark.extended)])
def test_forced_call_has_schema_valid_arguments_and_streams_the_same(oai, choice) -> None:
    """One call (parallel calls off: the small model, free to add calls, repeats its call)."""
    kw = {"model": oai.models.list().data[0].id, "messages": ASK, "tools": [WEATHER],
          "tool_choice": choice, "parallel_tool_calls": False, "temperature": 0,
          "max_tokens": 120}
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    args = _call_args(call)
    # streamed: the deltas assemble to the same call
    parts: dict[int, dict] = {}
    finish = None
    for ch in oai.chat.completions.create(**kw, stream=True):
        for ci in ch.choices:
            finish = ci.finish_reason or finish
            for d in ci.delta.tool_calls or []:
                p = parts.setdefault(d.index, {"name": "", "arguments": ""})
                p["name"] += d.function.name or ""
                p["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == \
        [("get_weather", args)]
    # the same call without a draft
    plain = oai.chat.completions.create(**kw, extra_body={"speculative": False})
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert r.timings["draft_n"] > 0 and plain.timings["draft_n"] == 0


def _streamed_calls(stream) -> tuple[list[tuple[str, str]], str | None, str]:
    parts: dict[int, dict] = {}
    finish, content = None, ""
    for ch in stream:
        for ci in ch.choices:
            finish = ci.finish_reason or finish
            content += ci.delta.content or ""
            for d in ci.delta.tool_calls or []:
                p = parts.setdefault(d.index, {"name": "", "arguments": ""})
                p["name"] += d.function.name or ""
                p["arguments"] += d.function.arguments or ""
    return [(p["name"], p["arguments"]) for p in parts.values()], finish, content


@pytest.mark.parametrize("parallel", [None, True], ids=["default", "parallel-on"])
def test_named_tool_choice_is_exactly_one_call(oai, parallel) -> None:
    """An agent forcing a function gets one call to it, whether or not it allows parallel
    calls (the small model, left free, would repeat the call until max_tokens); streamed
    the same, and the same tokens with and without a draft."""
    kw = {"model": "any-name", "messages": ASK, "tools": [WEATHER], "temperature": 0,
          "max_tokens": 200,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    if parallel is not None:
        kw["parallel_tool_calls"] = parallel
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c.message.content
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather"
    _call_args(call)
    assert r.usage.completion_tokens < 200
    calls, finish, _ = _streamed_calls(oai.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and [n for n, _ in calls] == ["get_weather"]
    assert json.loads(calls[0][1]) == json.loads(call.function.arguments)
    plain = oai.chat.completions.create(**kw, extra_body={"speculative": False})
    assert plain.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
    assert r.timings["draft_n"] > 0 and plain.timings["draft_n"] == 0


def test_parallel_tool_calls_defaults_to_off(oai) -> None:
    """As in llama-server: "required" without parallel_tool_calls is one call."""
    kw = {"model": "x", "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
          "temperature": 0, "max_tokens": 200}
    r = oai.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(r.choices[0].message.tool_calls) == 1


def test_auto_tool_choice_streams_and_is_lossless(oai) -> None:
    """tool_choice auto: a call or an answer, the same streamed, with and without a draft."""
    kw = {"model": "x", "messages": ASK, "tools": [WEATHER], "temperature": 0,
          "max_tokens": 80}
    r = oai.chat.completions.create(**kw)
    m = r.choices[0].message
    whole = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    calls, finish, content = _streamed_calls(oai.chat.completions.create(**kw, stream=True))
    assert finish == r.choices[0].finish_reason
    assert [(n, json.loads(a)) for n, a in calls] == [(n, json.loads(a)) for n, a in whole]
    assert content == (m.content or "")
    plain = oai.chat.completions.create(**kw, extra_body={"speculative": False}).choices[0]
    assert plain.message.content == m.content
    assert [(t.function.name, t.function.arguments) for t in plain.message.tool_calls or []] \
        == whole


def test_history_with_tool_results_and_auto(oai) -> None:
    model = oai.models.list().data[0].id
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"}]
    r = oai.chat.completions.create(model=model, messages=history, tools=[WEATHER],
                                    temperature=0, max_tokens=60)
    c = r.choices[0]
    # auto: either a call whose arguments validate, or a plain answer as content
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        _call_args(c.message.tool_calls[0])
    else:
        assert isinstance(c.message.content, str)
    none = oai.chat.completions.create(model=model, messages=ASK, tools=[WEATHER],
                                       tool_choice="none", temperature=0, max_tokens=20)
    assert not none.choices[0].message.tool_calls


def test_tool_errors_are_400(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:
        r = http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
        assert r.status_code == 400 and "unknown function 'get_time'" in r.text
        r = http.post("/v1/chat/completions", json={
            "messages": ASK, "tools": [WEATHER], "tool_choice": "required",
            "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "cannot be combined" in r.text
        r = http.post("/completion", json={"prompt": "hi", "tools": [WEATHER]})
        assert r.status_code == 400 and "tools" in r.text


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_every_family_grammar_compiles_in_llama_cpp(family: str) -> None:
    from specwire.backend.llama import load_model
    from specwire.config import ModelParams
    from specwire.sample.constraints import Grammar

    vocab = load_model(ModelParams(str(bundled.target()))).vocab
    for parallel in (False, True):
        req, _ = _request(family, tool_choice="required", parallel_tool_calls=parallel)
        Grammar.compile(tool_calls.grammar(req), vocab).close()


# ------------------------------------------------------------------------------ reasoning

THINK_TEMPLATE = Path(__file__).resolve().parents[1] / "support" / "templates" / "gemma_think.jinja"
SHAPE = 'root ::= "The user says hello, so I greet back." "\\n</think>\\n\\n" "Hello! How are you?"'


@pytest.fixture(scope="module")
def thinking() -> Iterator[str]:
    yield from _serve("--chat-template-file", str(THINK_TEMPLATE), "--jinja",
                      "--reasoning-format", "deepseek")


def test_reasoning_is_split_whole_and_streamed(thinking: str) -> None:
    oai = _client(thinking)
    model = oai.models.list().data[0].id
    hi = [{"role": "user", "content": "Hello!"}]
    r = oai.chat.completions.create(model=model, messages=hi, max_tokens=40, temperature=0,
                                    extra_body={"grammar": SHAPE})
    m = r.choices[0].message
    assert m.reasoning_content == "The user says hello, so I greet back."
    assert m.content == "Hello! How are you?"
    stream = oai.chat.completions.create(model=model, messages=hi, max_tokens=40, temperature=0,
                                         stream=True, extra_body={"grammar": SHAPE})
    reasoning, content = "", ""
    for ch in stream:
        for c in ch.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning.strip(), content) == (m.reasoning_content, m.content)
    # thinking off through chat_template_kwargs: the template opens no <think>, nothing split
    off = oai.chat.completions.create(model=model, messages=hi, max_tokens=12, temperature=0,
                                      extra_body={"chat_template_kwargs":
                                                  {"enable_thinking": False}})
    assert not getattr(off.choices[0].message, "reasoning_content", None)
    assert off.choices[0].message.content
