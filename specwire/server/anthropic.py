"""Anthropic's POST /v1/messages (and /v1/messages/count_tokens) -> a chat request.

A thin translation: the body becomes the OpenAI chat body that says the same thing, and
that body goes through schemas.chat_completion like any /v1/chat/completions request (the
same template, tool-call parsing, constraints, limits and speculation), so one
conversation sent to either route is the same prompt and generates the same tokens.

- `system` (a string or text blocks) is the first message, text blocks joined by a blank line;
- `messages`: text blocks (joined the same way); an assistant's `tool_use` blocks are its
  tool_calls; a user's `tool_result` blocks are `tool` messages (named after the call they
  answer), in order, before the user's text; `thinking` blocks of earlier turns are dropped
  (the reply's own thinking is parsed out of the text, as on the chat route);
- `tools` [{name, description, input_schema}] are function tools; `tool_choice`
  auto / any / tool / none is auto / required / named / none, `disable_parallel_tool_use`
  turns parallel calls off;
- `max_tokens`, `temperature`, `top_p`, `top_k` keep their names, `stop_sequences` is `stop`,
  `thinking` {type: enabled | disabled} is chat_template_kwargs' enable_thinking;
- llama-server's own fields (`speculative`, `seed`, `cache_prompt`, ...) pass through.

Anything it cannot say (images, server tools) is a 400 naming the field, never dropped.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from specwire.server import limits, schemas
from specwire.server.errors import bad_request
from specwire.server.settings import ServerSettings

#: Fields with the same name and meaning on both routes, and llama-server's extensions.
PASSTHROUGH = ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "seed",
               "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
               "frequency_penalty", "logit_bias", "speculative", "cache_prompt", "cache_salt",
               "n_keep", "ignore_eos", "grammar", "json_schema", "lora", "chat_template_kwargs")

#: Text blocks of one turn are joined with this (Anthropic's blocks are separate paragraphs).
JOIN = "\n\n"


def to_chat(body: Any) -> dict:
    """The OpenAI chat body saying what this Messages body says (400 naming what is wrong)."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    chat = {k: v for k, v in body.items()
            if k in PASSTHROUGH or k.startswith("speculative.")}
    calls: dict[str, str] = {}          # tool_use id -> tool name, for the results
    system = _system(body.get("system"))
    chat["messages"] = ([{"role": "system", "content": system}] if system is not None else []) \
        + _messages(body.get("messages"), calls)
    _tools(body, chat)
    stops = body.get("stop_sequences")
    if stops is not None:
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise bad_request("stop_sequences: must be an array of strings")
        chat["stop"] = stops
    _thinking(body.get("thinking"), chat)
    return chat


def stop_sequences(body: dict) -> list[str]:
    """The request's own stop sequences (a stop on one of them is stop_reason stop_sequence)."""
    stops = body.get("stop_sequences")
    return list(stops) if isinstance(stops, list) else []


def parse(body: dict, backend: Any, settings: ServerSettings,
          names: Sequence[str]) -> schemas.Completion:
    """POST /v1/messages: the chat route's Completion, with what the answer repeats."""
    spec = schemas.chat_completion(to_chat(body), backend, settings, names)
    spec.echo = {"stop_sequences": stop_sequences(body)}
    return spec


def count_tokens(body: dict, backend: Any, settings: ServerSettings) -> dict:
    """POST /v1/messages/count_tokens: the prompt's length as /v1/messages would send it."""
    _, text, _ = schemas.rendered(to_chat(body), backend, settings)
    schemas.check_fits_bound(limits.fewest_tokens(text, backend), backend.n_ctx)
    return {"input_tokens": len(backend.tokenize(text, add_special=False, parse_special=True))}


# -- the parts ---------------------------------------------------------------------------------


def _system(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return JOIN.join(_texts(_blocks(value, "system"), "system"))


def _blocks(content: Any, where: str) -> list[dict]:
    """A content field as blocks: a string is one text block."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: must be a string or an array of content blocks")
    for j, b in enumerate(content):
        if not (isinstance(b, dict) and isinstance(b.get("type"), str)):
            raise bad_request(f"{where}[{j}]: must be a content block {{\"type\": ...}}")
    return content


def _texts(blocks: list[dict], where: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """The text of text blocks; blocks of `allowed` types are skipped, any other is a 400."""
    out = []
    for j, b in enumerate(blocks):
        if b["type"] == "text":
            if not isinstance(b.get("text"), str):
                raise bad_request(f"{where}[{j}].text: required, a string")
            out.append(b["text"])
        elif b["type"] not in allowed:
            raise bad_request(f"{where}[{j}]: {b['type']!r} blocks are not supported here "
                              "(text only)")
    return out


def _messages(raw: Any, calls: dict[str, str]) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages: must be a non-empty array of {role, content} objects")
    out: list[dict] = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where}: must be an object with role and content")
        role = m.get("role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "assistant":
            out.append(_assistant(blocks, f"{where}.content", calls))
        elif role == "user":
            out += _user(blocks, f"{where}.content", calls)
        else:
            raise bad_request(f"{where}.role: must be \"user\" or \"assistant\", got "
                              f"{str(role)[:40]!r}")
    return out


def _assistant(blocks: list[dict], where: str, calls: dict[str, str]) -> dict:
    """An assistant turn: its text, and its tool_use blocks as tool_calls."""
    texts = _texts(blocks, where, ("tool_use", "thinking", "redacted_thinking"))
    tool_calls = [_tool_use(b, f"{where}[{j}]", calls)
                  for j, b in enumerate(blocks) if b["type"] == "tool_use"]
    msg: dict = {"role": "assistant", "content": JOIN.join(texts) if texts else None}
    if tool_calls:
        msg["tool_calls"] = tool_calls
    elif msg["content"] is None:
        msg["content"] = ""
    return msg


def _tool_use(b: dict, where: str, calls: dict[str, str]) -> dict:
    ident, name, args = b.get("id"), b.get("name"), b.get("input", {})
    if not isinstance(ident, str) or not isinstance(name, str) or not name:
        raise bad_request(f"{where}: a tool_use block needs id and name (strings)")
    if not isinstance(args, dict):
        raise bad_request(f"{where}.input: must be an object")
    calls[ident] = name
    try:
        text = json.dumps(args, ensure_ascii=False)
    except (ValueError, RecursionError):
        raise bad_request(f"{where}.input: cannot be written as JSON") from None
    return {"id": ident, "type": "function", "function": {"name": name, "arguments": text}}


def _user(blocks: list[dict], where: str, calls: dict[str, str]) -> list[dict]:
    """A user turn: each tool_result a tool message, in order, then the text."""
    out: list[dict] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        if b["type"] == "tool_result":
            if texts:                   # text before a result: its own user turn, in order
                out.append({"role": "user", "content": JOIN.join(texts)})
                texts = []
            out.append(_tool_result(b, f"{where}[{j}]", calls))
        else:
            texts += _texts([b], where)
    if texts or not out:
        out.append({"role": "user", "content": JOIN.join(texts)})
    return out


def _tool_result(b: dict, where: str, calls: dict[str, str]) -> dict:
    ident = b.get("tool_use_id")
    if not isinstance(ident, str):
        raise bad_request(f"{where}.tool_use_id: required, a string")
    content = b.get("content", "")
    text = JOIN.join(_texts(_blocks(content, f"{where}.content"), f"{where}.content"))
    if b.get("is_error") is True:
        text = f"Error: {text}"
    msg = {"role": "tool", "tool_call_id": ident, "content": text}
    if ident in calls:
        msg["name"] = calls[ident]
    return msg


def _tools(body: dict, chat: dict) -> None:
    """tools and tool_choice, in the chat route's terms."""
    raw = body.get("tools")
    if raw is not None:
        if not isinstance(raw, list):
            raise bad_request("tools: must be an array of {name, description, input_schema}")
        chat["tools"] = [_tool(i, t) for i, t in enumerate(raw)]
    choice = body.get("tool_choice")
    if choice is None:
        return
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "auto" or kind == "none":
        chat["tool_choice"] = kind
    elif kind == "any":
        chat["tool_choice"] = "required"
    elif kind == "tool" and isinstance(choice.get("name"), str):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    else:
        raise bad_request('tool_choice: must be {"type": "auto"}, {"type": "any"}, '
                          '{"type": "none"} or {"type": "tool", "name": ...}')
    if choice.get("disable_parallel_tool_use") is True:
        chat["parallel_tool_calls"] = False


def _tool(i: int, t: Any) -> dict:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise bad_request(f"{where}: must be an object {{name, description, input_schema}}")
    if t.get("type") not in (None, "custom"):
        raise bad_request(f"{where}.type: {str(t.get('type'))[:40]!r} is a server tool, not "
                          "supported here; client tools only ({name, description, "
                          "input_schema})")
    schema = t.get("input_schema", {"type": "object", "properties": {}})
    fn: dict = {"name": t.get("name"), "parameters": schema}
    if t.get("description") is not None:
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _thinking(value: Any, chat: dict) -> None:
    """thinking {type: enabled | adaptive | disabled} -> the template's enable_thinking."""
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request('thinking: must be {"type": "enabled", "budget_tokens": N} or '
                          '{"type": "disabled"}')
    kwargs = chat.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        return                          # the chat route names the wrong field
    chat["chat_template_kwargs"] = {"enable_thinking": kind != "disabled", **(kwargs or {})}
