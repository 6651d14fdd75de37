"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

Fast: the translation onto the chat route (anthropic.py), the answer's shapes whole and
streamed (anthropic_output.py) over the toy engine, errors in Anthropic's shape and the
x-api-key header. Slow: the official `anthropic` client against one `specwire serve` on
the bundled pair: text, a stream, a forced tool call and its result over two turns, a
stop sequence and max_tokens, each the same tokens as the chat route without a draft.
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
from specwire.server import ServerSettings, anthropic, create_app
from specwire.server.anthropic_output import AnthropicMessages
from specwire.server.chat_output import ChatPlan
from specwire.server.errors import ApiError
from specwire.server.slots import Result, TextChunk
from specwire.text.tools import Generic

WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "enum": ["Oslo", "Paris"]}},
               "required": ["city"], "additionalProperties": False}}
OAI_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": WEATHER["input_schema"]}}


# ------------------------------------------------------------------ the translation (pure)


def test_a_conversation_with_tools_is_the_chat_body_saying_the_same() -> None:
    body = {"model": "m", "max_tokens": 9, "system": [{"type": "text", "text": "Be brief."},
                                                      {"type": "text", "text": "Be kind."}],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "s"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                     "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1",
                     "content": [{"type": "text", "text": "12 C"}]},
                    {"type": "text", "text": "And Paris?"}]}],
            "tools": [WEATHER], "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["\n\n"], "temperature": 0, "top_k": 3, "speculative": False,
            "metadata": {"user_id": "x"}}
    chat = anthropic.to_chat(body)
    assert chat == {
        "model": "m", "max_tokens": 9, "temperature": 0, "top_k": 3, "speculative": False,
        "messages": [
            {"role": "system", "content": "Be brief.\n\nBe kind."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather",
             "content": "12 C"},
            {"role": "user", "content": "And Paris?"}],
        "tools": [OAI_WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
        "stop": ["\n\n"]}


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required"),
    ({"type": "tool", "name": "get_weather"},
     {"type": "function", "function": {"name": "get_weather"}})])
def test_tool_choice(choice: dict, expected) -> None:
    chat = anthropic.to_chat({"messages": [{"role": "user", "content": "x"}],
                              "tools": [WEATHER], "tool_choice": choice})
    assert chat["tool_choice"] == expected and "parallel_tool_calls" not in chat


def test_thinking_reaches_the_template_and_errors_name_the_field() -> None:
    ask = {"messages": [{"role": "user", "content": "x"}]}
    assert anthropic.to_chat({**ask, "thinking": {"type": "disabled"}})[
        "chat_template_kwargs"] == {"enable_thinking": False}
    assert anthropic.to_chat({**ask, "thinking": {"type": "enabled", "budget_tokens": 99}})[
        "chat_template_kwargs"] == {"enable_thinking": True}
    for bad, field in [({"messages": []}, "messages"),
                       ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
                       ({**ask, "system": 3}, "system"),
                       ({"messages": [{"role": "user", "content": [
                           {"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
                       ({**ask, "tools": [{"type": "web_search_20250305", "name": "w"}]},
                        "tools[0].type"),
                       ({**ask, "tool_choice": "any"}, "tool_choice"),
                       ({**ask, "stop_sequences": "x"}, "stop_sequences"),
                       ({**ask, "thinking": True}, "thinking"),
                       ({"messages": [{"role": "user", "content": [
                           {"type": "tool_result"}]}]}, "tool_use_id")]:
        with pytest.raises(ApiError, match=field.replace("[", r"\[").replace("]", r"\]")):
            anthropic.to_chat(bad)


# --------------------------------------------------------------------- over the toy engine

KEY = "toy-key"


@pytest.fixture(scope="module")
def toy() -> Iterator[TestClient]:
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0), n_predict=6,
                              api_key=KEY)
    app = create_app(Engine(ToyBackend(delay=0.0), NoDrafter()), settings)
    with TestClient(app, headers={"x-api-key": KEY}) as c:
        yield c


ASK = {"model": "any", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def _events(text: str) -> list[tuple[str, dict]]:
    """A stream's (event name, data) pairs, checking each name is its data's type."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert lines["event"] == data["type"]
        out.append((lines["event"], data))
    return out


def test_toy_whole_and_streamed_with_the_key_in_x_api_key(toy: TestClient) -> None:
    whole = toy.post("/v1/messages", json=ASK).json()
    assert whole["type"] == "message" and whole["role"] == "assistant"
    assert whole["content"] == [{"type": "text", "text": "abcde"}]
    assert whole["stop_reason"] == "max_tokens" and whole["stop_sequence"] is None
    assert whole["usage"]["output_tokens"] == 5 and whole["usage"]["input_tokens"] > 0
    stopped = toy.post("/v1/messages", json={**ASK, "stop_sequences": ["cd"]}).json()
    assert stopped["content"][0]["text"] == "ab"
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "cd")
    events = _events(toy.post("/v1/messages", json={**ASK, "stream": True}).text)
    names = [n for n, _ in events]
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") \
        == "abcde"
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2][1]["usage"]["output_tokens"] == 5
    counted = toy.post("/v1/messages/count_tokens", json=ASK).json()
    assert counted == {"input_tokens": whole["usage"]["input_tokens"]}
    metrics = toy.get("/metrics").text
    for route in ("/v1/messages", "/v1/messages/count_tokens"):
        assert f'specwire:requests_total{{endpoint="{route}"}}' in metrics


def test_toy_errors_are_anthropic_shaped(toy: TestClient) -> None:
    r = toy.post("/v1/messages", json={**ASK, "messages": "hi"})
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages:")
    r = toy.post("/v1/messages", json=ASK, headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = toy.post("/v1/messages", content=b"{", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = toy.post("/v1/messages", content=b"{}", headers={"Content-Type": "application/xml"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"
    r = toy.post("/v1/messages/count_tokens", json={"messages": []})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert toy.post("/v1/chat/completions", json={"messages": []}).json()["error"]["code"] == 400


def _spec(body: dict, tools: bool = False):
    """A parsed request; with tools, the plan of one offered in the generic format (the toy
    backend applies no grammar, which a request with tools would need)."""
    spec = anthropic.parse(body, ToyBackend(), ServerSettings(), ["toy"])
    if tools:
        spec.chat = ChatPlan(Generic(), {"get_weather"})
    return spec


def _result(content: str, stop_type: str = "eos", word: str = "") -> Result:
    return Result(content, [], stop_type, word, False, 10, 4, {}, 0, "none")


def test_a_tool_call_whole_and_streamed() -> None:
    """The toy cannot call tools: the generic format's reply is fed to the dialect."""
    reply = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Oslo"}}}'
    whole = AnthropicMessages(_spec(ASK, tools=True), "m").whole(_result(reply))
    (use,) = whole["content"]
    assert use["type"] == "tool_use" and use["id"].startswith("toolu_")
    assert (use["name"], use["input"], whole["stop_reason"]) == \
        ("get_weather", {"city": "Oslo"}, "tool_use")
    d = AnthropicMessages(_spec(ASK, tools=True), "m")
    events = d.opening() + [e for i in range(0, len(reply), 7)
                            for e in d.chunks(TextChunk(reply[i:i + 7], []))]
    events += d.closing(_result(reply))
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert events[2]["content_block"]["type"] == "tool_use"
    assert json.loads(events[3]["delta"]["partial_json"]) == {"city": "Oslo"}
    assert events[5]["delta"]["stop_reason"] == "tool_use"


def test_thinking_then_text_are_two_blocks() -> None:
    spec = _spec(ASK)
    spec.chat.split_reasoning = True
    reply = "<think>Let me see.</think>Hello."
    whole = AnthropicMessages(spec, "m").whole(_result(reply))
    assert whole["content"] == [{"type": "thinking", "thinking": "Let me see.", "signature": ""},
                                {"type": "text", "text": "Hello."}]
    d = AnthropicMessages(spec, "m")
    events = [e for c in reply for e in d.chunks(TextChunk(c, []))] + d.closing(_result(reply))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thought = "".join(e["delta"].get("thinking", "") for e in events
                      if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events
                   if e["type"] == "content_block_delta")
    assert (thought.strip(), text) == ("Let me see.", "Hello.")
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]


# ------------------------------------------------------------- the real server (slow)


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
def client(server: str):
    import anthropic as sdk
    return sdk.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def chat(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=300) as c:
        yield c


def _plain(chat: httpx.Client, body: dict) -> dict:
    """The chat route's answer to the same request without a draft."""
    r = chat.post("/v1/chat/completions",
                  json={**anthropic.to_chat(body), "speculative": False, "stream": False})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_sdk_text_stream_stop_and_limit_equal_plain_decoding(client, chat) -> None:
    ask = {"model": "gemma", "max_tokens": 12,
           "messages": [{"role": "user", "content": "Count from one to twenty in words."}]}
    m = client.messages.create(**ask)
    plain = _plain(chat, ask)
    assert m.content[0].text == plain["choices"][0]["message"]["content"]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    assert m.usage.input_tokens == plain["usage"]["prompt_tokens"]
    assert m.model_extra["timings"]["draft_n"] > 0          # it did speculate
    with client.messages.stream(**ask) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == m.content[0].text and final.stop_reason == "max_tokens"
    # a stop sequence inside that text: cut there, stop_reason stop_sequence
    word = m.content[0].text.split()[2]
    stopped = client.messages.create(**ask, stop_sequences=[word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == m.content[0].text[:m.content[0].text.index(word)]
    assert client.messages.count_tokens(model="x", messages=ask["messages"]).input_tokens \
        == m.usage.input_tokens
    import anthropic as sdk
    with pytest.raises(sdk.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=4, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"


@pytest.mark.slow
def test_sdk_forced_tool_then_its_result_equal_plain_decoding(client, chat) -> None:
    ask = {"model": "gemma", "max_tokens": 40, "tools": [WEATHER],
           "tool_choice": {"type": "tool", "name": "get_weather"},
           "messages": [{"role": "user", "content": "What is the weather in Oslo?"}]}
    m = client.messages.create(**ask)
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input["city"] in ("Oslo", "Paris")
    plain = _plain(chat, ask)["choices"][0]["message"]["tool_calls"][0]["function"]
    assert json.loads(plain["arguments"]) == use.input
    with client.messages.stream(**ask) as s:
        final = s.get_final_message()
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(use.name, use.input)]
    # the second turn: the call and its result in the history
    turn = {**ask, "max_tokens": 12, "tool_choice": {"type": "auto"}, "messages": [
        *ask["messages"], {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "12 degrees and rain"}]}]}
    second = client.messages.create(**turn)
    again = _plain(chat, turn)["choices"][0]
    text = "".join(b.text for b in second.content if b.type == "text")
    if second.stop_reason == "tool_use":
        assert again["finish_reason"] == "tool_calls"
    else:
        assert text == again["message"]["content"]


def test_toy_the_sdks_stream_helper_assembles_the_message(toy: TestClient) -> None:
    """The official client's accumulating stream, over the toy app (no model, no process)."""
    import anthropic as sdk
    client = sdk.Anthropic(base_url="http://localhost", api_key=KEY, http_client=toy,
                           max_retries=0)
    with client.messages.stream(**ASK) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text == final.content[0].text == "abcde" and final.stop_reason == "max_tokens"
    with pytest.raises(sdk.BadRequestError) as e:
        client.messages.create(model="toy", max_tokens=3, messages=[])
    assert e.value.body["error"]["type"] == "invalid_request_error"
