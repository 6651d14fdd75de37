"""Tool calls without a model: rendering tools with each family's template, parsing each
format's calls (whole and streamed), the forced-call grammars, and the reasoning split.

The templates in tests/support/templates are small ones written for these tests in the
style of each family (they are not the vendors' templates); what is checked is
that specwire recognises the family, hands the template its tools and history,
and reads the family's call syntax back.
"""

from __future__ import annotations

import json
import re

import pytest
from tool_outputs import OUTPUTS, WEATHER, _request

from specwire.server import tool_calls
from specwire.server.chat_output import ChatOutput, ChatPlan, whole
from specwire.server.errors import ApiError
from specwire.text import chat, reasoning
from specwire.text.tools import Generic, Tool, detect

HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
    {"role": "user", "content": "And in Bergen?"},
]

WANT = [("get_weather", {"city": "Bergen", "days": 2}), ("get_time", {"zone": "CET"})]


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_each_family_is_recognised_rendered_and_parsed(family: str) -> None:
    req, source = _request(family)
    assert req.fmt.name == family
    text = chat.render(source, chat.normalize_messages(
        tool_calls.messages_for(req, HISTORY)), **tool_calls.template_variables(req))
    assert "get_weather" in text and "get_time" in text     # the tools are shown
    assert "Bergen" in text and "12 C, rain" in text         # the history too
    if family != "generic":
        assert '"city": "Oslo"' in text or "Oslo\n</parameter>" in text   # an earlier call
    reply, prefix = OUTPUTS[family][1], OUTPUTS[family][2]
    plan = tool_calls.plan(req, False, False)
    msg = whole(plan, reply)
    assert [(c.name, json.loads(c.arguments)) for c in msg.calls] == WANT
    assert msg.content == prefix
    # streamed in small pieces: the same calls, the same content, no call text leaked
    out = ChatOutput(plan)
    deltas = [d for i in range(0, len(reply), 3) for d in out.push(reply[i:i + 3])]
    deltas += out.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert content.strip() == prefix
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == WANT
    assert [c["index"] for c in calls] == [0, 1]


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_not_a_valid_call_is_content(family: str) -> None:
    req, _ = _request(family)
    plan = tool_calls.plan(req, False, False)
    for reply in ("Just an answer.", "<tool_call>\n{broken json\n</tool_call>",
                  '{"name": "unknown_tool", "parameters": {}}',
                  '[TOOL_CALLS][{"name": "nope", "arguments": {}}]'):
        msg = whole(plan, reply)
        assert msg.calls == [] and msg.content == reply, (family, reply)


@pytest.mark.parametrize("family", ["hermes", "qwen3-coder", "mistral", "deepseek"])
def test_one_invalid_call_among_valid_ones_makes_the_reply_content(family: str) -> None:
    """The shared readers (text/tools/base.py: calls among content, calls after a tag): a later
    call to an unknown tool spoils the reply, and text after blocks stays content."""
    fmt = _request(family)[0].fmt
    reply = OUTPUTS[family][1]
    spoilt = reply.replace("get_time", "no_such_tool")
    parsed = fmt.parse(spoilt, {"get_weather", "get_time"})
    assert parsed.calls == [] and parsed.content == spoilt
    parsed = fmt.parse(reply + "\nDone.", {"get_weather", "get_time"})
    assert [c.name for c in parsed.calls] == ["get_weather", "get_time"]
    tail = family in ("hermes", "qwen3-coder")     # blocks among content; a tag ends it
    assert parsed.content.split() == (["Checking.", "Done."] if tail else ["Checking."])


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_forced_call_grammars_are_built_for_each_family(family: str) -> None:
    req, _ = _request(family, tool_choice={"type": "function", "function": {"name": "get_time"}})
    spec = tool_calls.grammar(req)
    assert spec is not None and "root ::=" in spec.text and "get_time" in spec.text
    assert "get_weather" not in spec.text          # only the named function is offered
    auto, _ = _request(family)
    assert (tool_calls.grammar(auto) is not None) == (family == "generic")


def test_tool_choice_and_tools_errors_name_the_problem() -> None:
    src = chat.TEMPLATES["gemma"]
    cases = [({"tools": [WEATHER], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}},
              "tool_choice: unknown function 'nope'"),
             ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice: must be"),
             ({"tools": {"a": 1}}, "tools: must be an array"),
             ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
             ({"tools": [WEATHER, WEATHER]}, "same name"),
             ({"tool_choice": "required"}, "tool_choice: needs tools"),
             ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls")]
    for body, message in cases:
        with pytest.raises(ApiError, match=re.escape(message)):
            tool_calls.parse(body, src)
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "nah"}}}
    req = tool_calls.parse({"tools": [bad_schema], "tool_choice": "required"}, src)
    with pytest.raises(ApiError,
                       match=re.escape("tools[0].function.parameters: unsupported or invalid")):
        tool_calls.grammar(req)


def test_none_hides_the_tools_and_generic_explains_them() -> None:
    req, _ = _request("hermes", tool_choice="none")
    assert tool_calls.template_variables(req) == {} and tool_calls.grammar(req) is None
    gen, _ = _request("generic", tool_choice="required")
    msgs = tool_calls.messages_for(gen, [{"role": "user", "content": "hi"}])
    assert msgs[0]["role"] == "system" and "get_weather" in msgs[0]["content"]
    assert "response" not in msgs[0]["content"]          # forced: no plain answer offered
    assert isinstance(gen.fmt, Generic)
    assert detect("{{ messages }}").name == "generic"
    assert detect("<tool_call>{{ tools }}", [Tool("x")]).name == "hermes"


def test_reasoning_split_whole_and_streamed() -> None:
    text = "<think>\nThe user greets me.\n</think>\n\nHello there!"
    s = reasoning.split(text)
    assert (s.reasoning, s.content) == ("The user greets me.", "Hello there!")
    s = reasoning.split("I opened it.</think>Hi", opened=True)
    assert (s.reasoning, s.content) == ("I opened it.", "Hi")
    assert reasoning.split("No thinking here.").content == "No thinking here."
    plan = ChatPlan(None, set(), True, False)
    out = ChatOutput(plan)
    deltas = [d for i in range(0, len(text), 2) for d in out.push(text[i:i + 2])] + out.finish()
    assert "".join(d.get("reasoning_content", "") for d in deltas).strip() == \
        "The user greets me."
    assert "".join(d.get("content", "") for d in deltas) == "Hello there!"
    msg = whole(plan, text).openai()
    assert msg["reasoning_content"] == "The user greets me." and msg["content"] == "Hello there!"


def test_a_template_that_cannot_render_tools_is_a_400_naming_it() -> None:
    from specwire.server import ServerSettings, schemas

    class Backend:
        name, n_vocab, n_ctx = "toy.gguf", 128, 256

        def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True):
            return [min(ord(c), 127) for c in text]

        def detokenize(self, tokens) -> bytes:
            return bytes(tokens)

    template = ("{% if tools %}{{ raise_exception('this model has no tools') }}{% endif %}"
                "<tool_call>{% for m in messages %}{{ m.content }}{% endfor %}")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    with pytest.raises(ApiError, match="tools: the chat template cannot render this request: "
                                       "chat template: this model has no tools"):
        schemas.chat_completion(body, Backend(), ServerSettings(chat_template=template), ["toy"])
    ok = schemas.chat_completion({**body, "tool_choice": "none"}, Backend(),
                                 ServerSettings(chat_template=template), ["toy"])
    assert ok.chat is not None and ok.chat.tool_format is None


DEEP = "[" * 5000 + "]" * 5000
DEEP_OBJ = '{"a": ' * 3000 + "1" + "}" * 3000


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_output_nested_past_the_recursion_limit_is_content(family: str) -> None:
    """Model output nested 3000-5000 deep, where each family's reader parses JSON, is
    content (or a call whose arguments hold it as text), never a RecursionError."""
    req, _ = _request(family)
    plan = tool_calls.plan(req, False, False)
    for deep in (DEEP, DEEP_OBJ):
        for reply in (deep, f"<tool_call>\n{deep}\n</tool_call>",
                      '{"name": "get_weather", "arguments": ' + deep + "}",
                      '{"name": "get_weather", "parameters": ' + deep + "}",
                      "[TOOL_CALLS]" + deep,
                      "<tool_call>\n<function=get_weather>\n<parameter=days>\n" + deep +
                      "\n</parameter>\n</function>\n</tool_call>",
                      "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
                      "get_weather\n```json\n" + deep + "\n```<｜tool▁call▁end｜>"
                      "<｜tool▁calls▁end｜>"):
            msg = whole(plan, reply)
            for c in msg.calls:       # qwen3-coder keeps a parameter it cannot parse as text
                assert isinstance(json.loads(c.arguments)["days"], str), (family, reply[:60])
            out = ChatOutput(plan)
            for i in range(0, len(reply), 997):
                out.push(reply[i:i + 997])
            out.finish()


def test_history_tool_calls_are_checked_before_rendering() -> None:
    src = chat.TEMPLATES["gemma"]
    req = tool_calls.parse({"tools": [WEATHER]}, src)
    bad = [
        ({"function": {"name": "get_weather", "arguments": DEEP}}, "arguments: nested deeper"),
        ({"function": "x"}, "[0].function: must be an object"),
        ({"function": {"arguments": "{}"}}, "[0].function.name: required"),
        ({"function": {"name": "f", "arguments": [1]}}, "arguments: must be a JSON string"),
        ("x", "tool_calls[0]: must be an object"),
    ]
    for call, message in bad:
        history = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
        for r in (req, None):
            with pytest.raises(ApiError, match=re.escape("messages[1].tool_calls" + "")):
                tool_calls.messages_for(r, history)
            with pytest.raises(ApiError, match=re.escape(message)):
                tool_calls.messages_for(r, history)
    history = [HISTORY[0], {"role": "assistant", "tool_calls": "x"}]
    with pytest.raises(ApiError, match=re.escape("messages[1].tool_calls: must be an array")):
        tool_calls.messages_for(req, history)
    ok = [HISTORY[0], {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": "not json"}},
        {"function": {"name": "get_weather"}}]}]
    assert len(tool_calls.messages_for(req, ok)) == 3
