"""Tool calling: one module per format family, and which family a chat template speaks.

The formats (see each module): Hermes/Qwen `<tool_call>` JSON, Qwen3-Coder's
XML, Llama 3.x JSON, Mistral `[TOOL_CALLS]`, DeepSeek V3/R1, and llama-server's
generic JSON for templates that know no tools.
"""

from __future__ import annotations

from specwire.text.tools.base import Parsed, Tool, ToolCall, ToolFormat
from specwire.text.tools.deepseek import DeepSeek
from specwire.text.tools.generic import Generic
from specwire.text.tools.hermes import Hermes
from specwire.text.tools.llama3 import Llama3
from specwire.text.tools.mistral import Mistral
from specwire.text.tools.qwen3_coder import Qwen3Coder

__all__ = ["DeepSeek", "Generic", "Hermes", "Llama3", "Mistral", "Parsed", "Qwen3Coder", "Tool",
           "ToolCall", "ToolFormat", "detect"]


def detect(template: str, tools: list[Tool] | None = None) -> ToolFormat:
    """The format a chat template's model emits, from what the template writes."""
    knows_tools = "tools" in template or "tool_calls" in template
    if "<function=" in template and "<tool_call>" in template:
        return Qwen3Coder(tools)
    if "<tool_call>" in template:
        return Hermes()
    if "[TOOL_CALLS]" in template:
        return Mistral()
    if "tool▁calls▁begin" in template:
        return DeepSeek()
    if "<|start_header_id|>" in template and knows_tools:
        return Llama3()
    return Generic()
