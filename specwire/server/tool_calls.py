"""Chat requests with tools: OpenAI's fields -> the prompt, the constraint, the output plan.

`tools`, `tool_choice` ("auto", "none", "required" or a named function: exactly one call
to it) and `parallel_tool_calls` (off unless the request or --parallel-tool-calls turns it
on, as in llama-server). The model's own chat template renders the tools when it knows them
(specwire.text.tools recognises its format); otherwise llama-server's generic JSON format
describes them in a system message. A forced call, and every reply in the generic format,
is constrained by a grammar built from the call syntax and the tool's argument schema, so
that even a small model emits a valid one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from specwire.config import ConfigError
from specwire.sample.constraints import GrammarSpec, schema_grammar
from specwire.server.chat_output import ChatPlan
from specwire.server.errors import bad_request
from specwire.text.tools import Generic, Tool, ToolFormat, detect
from specwire.text.tools.base import MAX_JSON_DEPTH, TooDeep, depth_within, loads


@dataclass(slots=True)
class ToolRequest:
    tools: list[Tool]
    choice: str                 # auto | none | required | named
    named: str | None
    parallel: bool
    fmt: ToolFormat

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def offered(self) -> list[Tool]:
        return [t for t in self.tools if self.named is None or t.name == self.named]


def parse(body: dict, template: str, parallel_default: bool = False) -> ToolRequest | None:
    """The request's tools, or None when it has none; 400 naming what is wrong."""
    raw = body.get("tools")
    if body.get("functions"):
        raise bad_request("functions: the legacy field is not supported; use tools")
    if raw is None or raw == []:
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise bad_request("tool_choice: needs tools")
        return None
    if not isinstance(raw, list):
        raise bad_request("tools: must be an array of {\"type\": \"function\", \"function\": "
                          "{name, description, parameters}}")
    tools = [_tool(i, t) for i, t in enumerate(raw)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: two tools have the same name")
    choice, named = _choice(body.get("tool_choice"), set(names))
    parallel = body.get("parallel_tool_calls")
    if parallel is None:
        parallel = parallel_default
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls: must be true or false")
    if choice == "named":     # a call to that function: one, not one or more
        parallel = False
    fmt = detect(template, tools)
    return ToolRequest(tools, choice, named, parallel, fmt)


def _tool(i: int, t: Any) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function":
        raise bad_request(f"{where}: must be {{\"type\": \"function\", \"function\": {{...}}}}")
    fn = t.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function.name: required, a string")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise bad_request(f"{where}.function.parameters: must be a JSON schema object")
    desc = fn.get("description", "")
    return Tool(fn["name"], desc if isinstance(desc, str) else "", params)


def _choice(value: Any, names: set[str]) -> tuple[str, str | None]:
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        return value, None
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(
            value.get("function"), dict) and isinstance(value["function"].get("name"), str):
        name = value["function"]["name"]
        if name not in names:
            raise bad_request(f"tool_choice: unknown function {name!r}; the tools are "
                              f"{', '.join(sorted(names))}")
        return "named", name
    raise bad_request('tool_choice: must be "auto", "none", "required" or '
                      '{"type": "function", "function": {"name": ...}}')


def messages_for(req: ToolRequest | None, messages: list) -> list:
    """The history as the template should see it.

    Assistant tool_calls get their arguments as objects (templates write them
    with tojson). A template that knows no tools (generic format) gets the tool
    instructions as a system message, earlier calls as the JSON it would have
    written, and tool results as user turns.
    """
    check_history(messages)
    out = []
    for m in messages if isinstance(messages, list) else []:
        if isinstance(m, dict) and isinstance(m.get("tool_calls"), list):
            m = {**m, "tool_calls": [_call_for_template(c) for c in m["tool_calls"]]}
        out.append(m)
    if req is None or req.choice == "none" or req.fmt.native:
        return out
    fmt: Generic = req.fmt  # type: ignore[assignment]
    instructions = fmt.system_prompt(req.offered(), req.parallel, req.forced)
    converted = []
    for m in out:
        if not isinstance(m, dict):
            converted.append(m)
        elif m.get("role") == "assistant" and m.get("tool_calls"):
            calls = [{"name": c["function"]["name"],
                      "arguments": c["function"].get("arguments", {})}
                     for c in m["tool_calls"] if isinstance(c, dict) and "function" in c]
            converted.append({"role": "assistant", "content": json.dumps(
                {"tool_calls": calls} if req.parallel else {"tool_call": calls[0]}
                if calls else {"response": ""}, ensure_ascii=False)})
        elif m.get("role") == "tool":
            name = m.get("name") or m.get("tool_call_id") or "the tool"
            converted.append({"role": "user", "content": f"Result of {name}: "
                              f"{m.get('content') or ''}"})
        else:
            converted.append(m)
    if converted and isinstance(converted[0], dict) and converted[0].get("role") == "system":
        first = converted[0]
        content = first.get("content") if isinstance(first.get("content"), str) else ""
        return [{**first, "content": f"{content}\n\n{instructions}".strip()}, *converted[1:]]
    return [{"role": "system", "content": instructions}, *converted]


def check_history(messages: Any) -> None:
    """Earlier tool calls in the history are well formed: a 400 naming the first that is not.

    Each is {"function": {"name": ..., "arguments": JSON text or an object}}; arguments
    nested deeper than the request body may be (MAX_JSON_DEPTH) are refused here, before
    the template's tojson and the JSON parser recurse through them.
    """
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls is None:
            continue
        where = f"messages[{i}].tool_calls"
        if not isinstance(calls, list):
            raise bad_request(f"{where}: must be an array of tool calls")
        for j, c in enumerate(calls):
            _check_call(c, f"{where}[{j}]")


def _check_call(c: Any, where: str) -> None:
    if not isinstance(c, dict):
        raise bad_request(f"{where}: must be an object {{\"type\": \"function\", "
                          "\"function\": {name, arguments}}")
    fn = c.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"{where}.function: must be an object {{name, arguments}}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad_request(f"{where}.function.name: required, a string")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            loads(args)
        except TooDeep as e:
            raise bad_request(f"{where}.function.arguments: {e}") from None
        except ValueError:
            pass             # not JSON: the template gets the text as it is
    elif isinstance(args, dict):
        if not depth_within(args):
            raise bad_request(f"{where}.function.arguments: nested deeper than "
                              f"{MAX_JSON_DEPTH} levels")
    elif args is not None:
        raise bad_request(f"{where}.function.arguments: must be a JSON string or an object")


def _call_for_template(c: Any) -> Any:
    if not (isinstance(c, dict) and isinstance(c.get("function"), dict)):
        return c
    args = c["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = loads(args)
        except ValueError:
            return c
        if isinstance(parsed, dict):
            return {**c, "function": {**c["function"], "arguments": parsed}}
    return c


def template_variables(req: ToolRequest | None) -> dict:
    if req is None or req.choice == "none" or not req.fmt.native:
        return {}
    return {"tools": [t.openai() for t in req.offered()]}


def grammar(req: ToolRequest | None) -> GrammarSpec | None:
    """The constraint for a forced call (and for every generic-format reply)."""
    if req is None or req.choice == "none":
        return None
    try:
        offered = req.offered()
        for i, t in enumerate(req.tools):  # a bad schema is named by its place
            if t in offered:
                schema_grammar(t.parameters or {"type": "object"},
                               f"tools[{i}].function.parameters")
        if isinstance(req.fmt, Generic):
            text = req.fmt.grammar(req.offered(), req.parallel, allow_response=not req.forced)
        elif req.forced:
            text = req.fmt.grammar(req.offered(), req.parallel)
        else:
            return None
    except ConfigError as e:
        raise bad_request(str(e)) from None
    return GrammarSpec(text, "root", "tools")


def plan(req: ToolRequest | None, split_reasoning: bool, think_opened: bool) -> ChatPlan:
    if req is None or req.choice == "none":
        return ChatPlan(None, set(), split_reasoning, think_opened)
    return ChatPlan(req.fmt, {t.name for t in req.offered()}, split_reasoning, think_opened)
