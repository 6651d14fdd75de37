"""OpenAI's POST /v1/responses -> a chat request.

A thin translation, as anthropic.py's: the body becomes the chat body saying the same
thing, parsed by schemas.chat_completion like any /v1/chat/completions request.

- `input`: a string is one user message; items are messages (`input_text`/`output_text`
  parts, joined by a blank line; the `developer` role is `system`), `function_call`
  (an assistant's tool_calls, consecutive calls in one turn) and `function_call_output`
  (a `tool` message named after its call); `reasoning` items of earlier turns are dropped;
- `instructions` and leading system/developer messages are one system message;
- `tools` (function tools: {type: function, name, description, parameters}),
  `tool_choice` (auto, none, required, {type: function, name}), `parallel_tool_calls`,
  `max_output_tokens` (max_tokens), `temperature`, `top_p`, `stream`, `text.format`
  (json_schema, json_object: response_format); llama-server's own fields pass through.

This server holds no state between requests: `previous_response_id`, `conversation`,
`store: true`, `background` and item references are refused with a 400 saying so (send the
whole conversation in `input`, as stateless clients do with `store: false`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specwire.server import schemas
from specwire.server.anthropic import JOIN
from specwire.server.errors import bad_request
from specwire.server.settings import ServerSettings

#: Fields with the same name and meaning on both routes, and llama-server's extensions.
PASSTHROUGH = ("model", "temperature", "top_p", "top_k", "stream", "parallel_tool_calls",
               "seed", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
               "frequency_penalty", "logit_bias", "speculative", "cache_prompt", "cache_salt",
               "n_keep", "ignore_eos", "grammar", "json_schema", "lora", "chat_template_kwargs",
               "stop")

#: Server-held state, which this server does not keep: the field and why it is refused.
STATEFUL = {
    "previous_response_id": "this server holds no earlier responses",
    "conversation": "this server holds no conversations",
}

#: Text content part types, in and out.
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def to_chat(body: Any) -> dict:
    """The OpenAI chat body saying what this Responses body says (400 naming what is wrong)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    refuse_state(body)
    chat = {k: v for k, v in body.items()
            if k in PASSTHROUGH or k.startswith("speculative.")}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions: must be a string")
    chat["messages"] = _leading_system(instructions, _input(body.get("input")))
    _tools(body, chat)
    _text_format(body.get("text"), chat)
    return chat


def refuse_state(body: dict) -> None:
    """A 400 for each field that needs responses held by the server."""
    for name, why in STATEFUL.items():
        if body.get(name) is not None:
            raise bad_request(f"{name}: not supported: {why}; send the whole conversation in "
                              "input")
    if body.get("store") is True:
        raise bad_request("store: true is not supported: this server keeps no responses; "
                          "send store: false (or leave it out) and the whole conversation")
    if body.get("background") is True:
        raise bad_request("background: true is not supported: this server keeps no "
                          "responses to poll")


def parse(body: dict, backend: Any, settings: ServerSettings,
          names: Sequence[str]) -> schemas.Completion:
    """POST /v1/responses: the chat route's Completion, with what the answer repeats."""
    spec = schemas.chat_completion(to_chat(body), backend, settings, names)
    spec.echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "temperature",
                                          "top_p", "tools", "tool_choice",
                                          "parallel_tool_calls", "text", "reasoning")}
    return spec


# -- the parts ---------------------------------------------------------------------------------


def _input(value: Any) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad_request("input: must be a string or a non-empty array of items")
    out: list[dict] = []
    calls: dict[str, str] = {}          # call_id -> function name, for the outputs
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: must be an item object")
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            _function_call(item, where, out, calls)
        elif kind == "function_call_output":
            out.append(_function_output(item, where, calls))
        elif kind == "reasoning":
            continue
        elif kind == "item_reference":
            raise bad_request(f"{where}: item references are not supported: this server holds "
                              "no items; send the item itself")
        else:
            raise bad_request(f"{where}.type: {str(kind)[:40]!r} items are not supported here "
                              "(message, function_call, function_call_output, reasoning)")
    return out


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise bad_request(f"{where}.role: must be user, assistant, system or developer, got "
                          f"{str(role)[:40]!r}")
    return {"role": "system" if role == "developer" else role,
            "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A content field's text: a string, or text parts joined by a blank line."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or an array of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise bad_request(f"{where}[{j}]: only text parts ({{\"type\": \"input_text\", "
                              "\"text\": ...}) are supported")
    return JOIN.join(texts)


def _function_call(item: dict, where: str, out: list[dict], calls: dict[str, str]) -> None:
    """A function_call item: a tool call of the assistant turn before it, or a new turn."""
    ident, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(ident, str) or not isinstance(name, str) or not name:
        raise bad_request(f"{where}: a function_call needs call_id and name (strings)")
    if not isinstance(args, str):
        raise bad_request(f"{where}.arguments: must be a string of JSON")
    calls[ident] = name
    call = {"id": ident, "type": "function", "function": {"name": name, "arguments": args}}
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
        if not last["content"]:
            last["content"] = None
    else:
        out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _function_output(item: dict, where: str, calls: dict[str, str]) -> dict:
    ident = item.get("call_id")
    if not isinstance(ident, str):
        raise bad_request(f"{where}.call_id: required, a string")
    msg = {"role": "tool", "tool_call_id": ident,
           "content": _text(item.get("output", ""), f"{where}.output")}
    if ident in calls:
        msg["name"] = calls[ident]
    return msg


def _leading_system(instructions: str | None, messages: list[dict]) -> list[dict]:
    """instructions and the system messages that open the input, as one system message
    (templates take one, at the start)."""
    texts = [instructions] if instructions else []
    rest = list(messages)
    while rest and rest[0]["role"] == "system":
        texts.append(rest.pop(0)["content"])
    return ([{"role": "system", "content": JOIN.join(texts)}] if texts else []) + rest


def _tools(body: dict, chat: dict) -> None:
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise bad_request("tools: must be an array of function tools")
        chat["tools"] = [_tool(i, t) for i, t in enumerate(raw)]
    choice = body.get("tool_choice")
    if choice is None:
        return
    if choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice
    elif (isinstance(choice, dict) and choice.get("type") == "function"
          and isinstance(choice.get("name"), str)):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request('tool_choice: must be "auto", "none", "required" or '
                          '{"type": "function", "name": ...}')


def _tool(i: int, t: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise bad_request(f"{where}: only function tools are supported here "
                          f"({{\"type\": \"function\", \"name\": ...}}), got {str(kind)[:40]!r}")
    fn: dict = {"name": t.get("name")}
    for src, dst in (("description", "description"), ("parameters", "parameters")):
        if t.get(src) is not None:
            fn[dst] = t[src]
    return {"type": "function", "function": fn}


def _text_format(text: Any, chat: dict) -> None:
    """text.format: json_schema / json_object as the chat route's response_format."""
    if text is None:
        return
    fmt = text.get("format") if isinstance(text, dict) else None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return
    if kind == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.get("name", "response"), "schema": fmt.get("schema")}}
    else:
        raise bad_request('text.format: must be {"type": "text"}, {"type": "json_object"} or '
                          '{"type": "json_schema", "schema": ...}')
