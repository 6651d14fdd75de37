"""Tool-call outputs as each model family writes them (two calls: get_weather, get_time), and
a parsed request of those tools under that family's template."""

from __future__ import annotations

from pathlib import Path

from specwire.server import tool_calls
from specwire.text import chat

TEMPLATES = Path(__file__).resolve().parent / "templates"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


#: family -> (template file, a reply with two calls, the text that precedes them)
OUTPUTS = {
    "hermes": ("hermes.jinja", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
               '{"city": "Bergen", "days": 2}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
               '"arguments": {"zone": "CET"}}\n</tool_call>', "Checking."),
    "qwen3-coder": ("qwen3_coder.jinja", "Checking.\n<tool_call>\n<function=get_weather>\n"
                    "<parameter=city>\nBergen\n</parameter>\n<parameter=days>\n2\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                    "<parameter=zone>\nCET\n</parameter>\n</function>\n</tool_call>",
                    "Checking."),
    "llama3": ("llama3.jinja", '{"name": "get_weather", "parameters": {"city": "Bergen", '
               '"days": 2}}; {"name": "get_time", "parameters": {"zone": "CET"}}', ""),
    "mistral": ("mistral.jinja", 'Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": '
                '{"city": "Bergen", "days": 2}}, {"name": "get_time", "arguments": '
                '{"zone": "CET"}}]', "Checking."),
    "deepseek": ("deepseek.jinja", "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
                 "<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Bergen\", \"days\": 2}\n```"
                 "<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
                 "{\"zone\": \"CET\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "Checking."),
    "generic": (None, '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Bergen", '
                '"days": 2}}, {"name": "get_time", "arguments": {"zone": "CET"}}]}', ""),
}


def _request(family: str, **body) -> tuple[tool_calls.ToolRequest, str]:
    file = OUTPUTS[family][0]
    source = (TEMPLATES / file).read_text() if file else chat.TEMPLATES["gemma"]
    req = tool_calls.parse({"tools": [WEATHER, TIME], **body}, source)
    return req, source
