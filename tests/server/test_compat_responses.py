"""OpenAI's Responses API (POST /v1/responses).

Fast: the translation onto the chat route (oai_responses.py), the response object and its
event stream (oai_responses_output.py) over the toy engine, the refusal of server-held
state. Slow: the official `openai` client against one `specwire serve` on the bundled
pair: text, a stream, a forced function call and its output over two turns, each the same
tokens as the chat route without a draft; and one conversation sent through
/v1/chat/completions, /v1/messages and /v1/responses generating the same text.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import bundled
import httpx
import pytest
from fastapi.testclient import TestClient
from toy_server import ToyBackend

from specwire.config import SamplingParams
from specwire.drafters.base import NoDrafter
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, anthropic, create_app, oai_responses
from specwire.server.chat_output import ChatPlan
from specwire.server.errors import ApiError
from specwire.server.oai_responses_output import OpenAIResponses
from specwire.server.slots import Result, TextChunk
from specwire.text.tools import Generic

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]}},
          "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": PARAMS}
OAI_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city", "parameters": PARAMS}}


# ------------------------------------------------------------------ the translation (pure)


def test_items_are_the_chat_body_saying_the_same() -> None:
    body = {"model": "m", "instructions": "Be brief.", "max_output_tokens": 9,
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                 "arguments": '{"city": "Oslo"}'},
                {"type": "function_call_output", "call_id": "call_1", "output": "12 C"},
                {"role": "user", "content": "And Paris?"}],
            "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
            "temperature": 0, "parallel_tool_calls": False, "store": False,
            "text": {"format": {"type": "json_object"}}, "speculative": False}
    assert oai_responses.to_chat(body) == {
        "model": "m", "max_tokens": 9, "temperature": 0, "parallel_tool_calls": False,
        "speculative": False,
        "messages": [
            {"role": "system", "content": "Be brief.\n\nUse tools."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "name": "get_weather",
             "content": "12 C"},
            {"role": "user", "content": "And Paris?"}],
        "tools": [OAI_WEATHER],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "response_format": {"type": "json_object"}}
    assert oai_responses.to_chat({"input": "Hi"})["messages"] == [
        {"role": "user", "content": "Hi"}]


def test_server_held_state_and_bad_items_are_refused_naming_the_field() -> None:
    for bad, field in [({"input": "x", "previous_response_id": "resp_1"},
                        "previous_response_id: not supported: this server holds"),
                       ({"input": "x", "store": True}, "store: true is not supported"),
                       ({"input": "x", "conversation": "c"}, "conversation"),
                       ({"input": "x", "background": True}, "background"),
                       ({"input": [{"type": "item_reference", "id": "x"}]}, "item references"),
                       ({"input": []}, "input"),
                       ({"input": 3}, "input"),
                       ({"input": [{"role": "tool", "content": "x"}]}, "role"),
                       ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
                        "only text parts"),
                       ({"input": "x", "tools": [{"type": "web_search"}]}, "function tools"),
                       ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
                       ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
                       ({"input": "x", "instructions": 3}, "instructions"),
                       ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format")]:
        with pytest.raises(ApiError, match=field):
            oai_responses.to_chat(bad)


# --------------------------------------------------------------------- over the toy engine


@pytest.fixture(scope="module")
def toy() -> Iterator[TestClient]:
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0), n_predict=6)
    app = create_app(Engine(ToyBackend(delay=0.0), NoDrafter()), settings)
    with TestClient(app, base_url="http://localhost") as c:
        yield c


ASK = {"model": "any", "max_output_tokens": 5, "input": "hi", "instructions": "Be brief."}


def _events(text: str) -> list[dict]:
    """A stream's events, checking each name is its data's type and the numbering."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"] and data["sequence_number"] == len(out)
        out.append(data)
    return out


def test_toy_whole_and_streamed(toy: TestClient) -> None:
    whole = toy.post("/v1/responses", json=ASK).json()
    assert whole["object"] == "response" and whole["status"] == "incomplete"
    assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = whole["output"]
    assert item["type"] == "message" and item["content"][0]["text"] == "abcde"
    assert whole["usage"]["output_tokens"] == 5 and whole["instructions"] == "Be brief."
    done = toy.post("/v1/responses", json={**ASK, "stop": ["cd"]}).json()
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "ab"
    events = _events(toy.post("/v1/responses", json={**ASK, "stream": True}).text)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") \
        == "abcde"
    assert events[-1]["response"]["output"] == [events[-2]["item"]]
    metrics = toy.get("/metrics").text
    assert 'specwire:requests_total{endpoint="/v1/responses"}' in metrics
    r = toy.post("/v1/responses", json={**ASK, "previous_response_id": "resp_1"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "holds no earlier responses" in r.json()["error"]["message"]


def _spec(body: dict, tools: bool = False):
    spec = oai_responses.parse(body, ToyBackend(), ServerSettings(), ["toy"])
    if tools:       # the toy backend applies no grammar, which tools would need
        spec.chat = ChatPlan(Generic(), {"get_weather"})
    return spec


def _result(content: str, stop_type: str = "eos") -> Result:
    return Result(content, [], stop_type, "", False, 10, 4, {}, 0, "none")


def test_a_function_call_whole_and_streamed() -> None:
    reply = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    whole = OpenAIResponses(_spec(ASK, tools=True), "m").whole(_result(reply, "limit"))
    (call,) = whole["output"]
    assert whole["status"] == "completed"
    assert (call["type"], call["name"], json.loads(call["arguments"])) == \
        ("function_call", "get_weather", {"city": "Oslo"})
    d = OpenAIResponses(_spec(ASK, tools=True), "m")
    events = d.opening() + [e for c in reply for e in d.chunks(TextChunk(c, []))]
    events += d.closing(_result(reply))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta",
                     "response.function_call_arguments.done", "response.output_item.done",
                     "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert json.loads(events[3]["delta"]) == {"city": "Oslo"}
    assert events[-1]["response"]["output"][0]["call_id"] == events[2]["item"]["call_id"]


def test_reasoning_then_text_are_two_items() -> None:
    spec = _spec(ASK)
    spec.chat.split_reasoning = True
    reply = "<think>Let me see.</think>Hello."
    whole = OpenAIResponses(spec, "m").whole(_result(reply))
    assert [i["type"] for i in whole["output"]] == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "Let me see."
    d = OpenAIResponses(spec, "m")
    events = [e for c in reply for e in d.chunks(TextChunk(c, []))] + d.closing(_result(reply))
    done = [e["item"]["type"] for e in events if e["type"] == "response.output_item.done"]
    assert done == ["reasoning", "message"]
    assert events[-1]["response"]["output"][1]["content"][0]["text"] == "Hello."


# ------------------------------------------------------------- the real server (slow)

KEY = "responses-key"


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    from serve_process import run_serve

    from specwire.assets import models
    bundled.target()
    models.default_draft()
    with run_serve("-t", "1", "-td", "1", "-c", "512", "--temp", "0", "--draft-p-min", "0",
                   # a draft every round whatever the machine's load: these tests check
                   # that the routes speculate (draft_n > 0), which an adaptive policy
                   # pricing a loaded core may decline for a 12-token reply
                   "--draft-policy", "fixed", "--draft-mode", "sync",
                   "--api-key", KEY) as (url, _):
        yield url


@pytest.fixture(scope="module")
def oai(server: str):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=300) as c:
        yield c


def _plain(chat: httpx.Client, body: dict) -> dict:
    r = chat.post("/v1/chat/completions",
                  json={**oai_responses.to_chat(body), "speculative": False, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_sdk_text_and_stream_equal_plain_decoding(oai, chat) -> None:
    ask = {"model": "gemma", "max_output_tokens": 12, "instructions": "Answer in English.",
           "input": "Count from one to twenty in words."}
    r = oai.responses.create(**ask)
    plain = _plain(chat, ask)
    assert r.output_text == plain["choices"][0]["message"]["content"]
    assert r.status == "incomplete" and r.usage.output_tokens == 12
    assert r.usage.input_tokens == plain["usage"]["prompt_tokens"]
    assert r.model_extra["timings"]["draft_n"] > 0
    deltas, final = "", None
    for e in oai.responses.create(**ask, stream=True):
        if e.type == "response.output_text.delta":
            deltas += e.delta
        elif e.type in ("response.completed", "response.incomplete"):
            final = e.response
    assert deltas == r.output_text and final.output_text == r.output_text
    with pytest.raises(Exception) as e:
        oai.responses.create(**ask, previous_response_id="resp_1")
    assert getattr(e.value, "status_code", None) == 400


@pytest.mark.slow
def test_sdk_forced_function_then_its_output_equal_plain_decoding(oai, chat) -> None:
    ask = {"model": "gemma", "max_output_tokens": 40, "tools": [WEATHER],
           "tool_choice": {"type": "function", "name": "get_weather"},
           "input": [{"role": "user", "content": "What is the weather in Oslo?"}]}
    r = oai.responses.create(**ask)
    (call,) = [i for i in r.output if i.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Oslo", "Paris")
    plain = _plain(chat, ask)["choices"][0]["message"]["tool_calls"][0]["function"]
    assert plain["arguments"] == call.arguments
    args = "".join(e.delta for e in oai.responses.create(**ask, stream=True)
                   if e.type == "response.function_call_arguments.delta")
    assert json.loads(args) == json.loads(call.arguments)
    turn = {**ask, "max_output_tokens": 12, "tool_choice": "auto", "input": [
        *ask["input"], {"type": "function_call", "call_id": call.call_id, "name": call.name,
                        "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id,
         "output": "12 degrees and rain"}]}
    second = oai.responses.create(**turn)
    again = _plain(chat, turn)["choices"][0]
    if any(i.type == "function_call" for i in second.output):
        assert again["finish_reason"] == "tool_calls"
    else:
        assert second.output_text == again["message"]["content"]


@pytest.mark.slow
def test_one_conversation_through_three_routes_is_the_same_text(chat) -> None:
    """The same history with a tool call and its result, in each API's own words: the same
    prompt, so the same tokens (with the draft on each, against the chat route without)."""
    args = '{"city": "Oslo"}'
    ask, result = "What is the weather in Oslo? Answer briefly.", "12 degrees and rain"
    common = {"model": "gemma", "temperature": 0}
    as_chat = {**common, "max_tokens": 14, "tools": [OAI_WEATHER], "messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": ask},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": result}]}
    as_messages = {**common, "max_tokens": 14, "system": "You are terse.",
                   "tools": [{"name": "get_weather", "description": WEATHER["description"],
                              "input_schema": PARAMS}],
                   "messages": [
                       {"role": "user", "content": ask},
                       {"role": "assistant", "content": [
                           {"type": "tool_use", "id": "c1", "name": "get_weather",
                            "input": {"city": "Oslo"}}]},
                       {"role": "user", "content": [
                           {"type": "tool_result", "tool_use_id": "c1", "content": result}]}]}
    as_responses = {**common, "max_output_tokens": 14, "instructions": "You are terse.",
                    "tools": [WEATHER], "input": [
                        {"role": "user", "content": ask},
                        {"type": "function_call", "call_id": "c1", "name": "get_weather",
                         "arguments": args},
                        {"type": "function_call_output", "call_id": "c1", "output": result}]}
    assert anthropic.to_chat(as_messages) == oai_responses.to_chat(as_responses) == {
        **as_chat, "max_tokens": 14}
    plain = chat.post("/v1/chat/completions", json={**as_chat, "speculative": False}).json()
    text = plain["choices"][0]["message"]["content"]
    drafted = chat.post("/v1/chat/completions", json=as_chat).json()
    m = chat.post("/v1/messages", json=as_messages).json()
    r = chat.post("/v1/responses", json=as_responses).json()
    assert text and drafted["choices"][0]["message"]["content"] == text
    assert "".join(b.get("text", "") for b in m["content"]) == text
    assert "".join(p["text"] for i in r["output"] if i["type"] == "message"
                   for p in i["content"]) == text
    assert plain["usage"]["completion_tokens"] == m["usage"]["output_tokens"] \
        == r["usage"]["output_tokens"] == drafted["usage"]["completion_tokens"]
    assert plain["usage"]["prompt_tokens"] == m["usage"]["input_tokens"] \
        == r["usage"]["input_tokens"]
    assert m["timings"]["draft_n"] + r["timings"]["draft_n"] > 0


def test_toy_the_sdks_stream_helper_assembles_the_response(toy: TestClient) -> None:
    """The official client's accumulating stream, over the toy app (no model, no process)."""
    from openai import OpenAI
    client = OpenAI(base_url="http://localhost/v1", api_key="none", http_client=toy,
                    max_retries=0)
    with client.responses.stream(model="toy", input="hi", max_output_tokens=5,
                                 extra_body={"stop": ["d"]}) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert deltas == final.output_text == "abc" and final.status == "completed"
    assert client.responses.create(model="toy", input="hi", max_output_tokens=3).output_text \
        == "abc"
