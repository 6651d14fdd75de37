"""Prompt sets for `specwire bench`: JSONL files, one prompt (or chat) per line.

Each line is an object with either "prompt" (plain text) or "messages" (a list
of {role, content}, rendered with the model's chat template), plus optional
"id", "category" and "max_tokens". A bad line is refused with its file and line
number, because a benchmark that silently skips prompts measures something else
than what its prompt file says.

`--prompts` takes paths or the names of the shipped sets (code, prose, qa),
comma separated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

SHIPPED = ("code", "prose", "qa")
_KEYS = {"id", "category", "prompt", "messages", "max_tokens"}


class PromptError(ValueError):
    """A prompt file or line is unusable; the message starts with FILE:LINE."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One benchmark prompt: text or chat messages, a budget and a category."""

    id: str
    category: str
    text: str | None = None
    messages: tuple[dict, ...] | None = None
    max_tokens: int | None = None
    source: str = ""               # FILE:LINE, for messages

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def shipped_path(name: str) -> Path:
    """The packaged JSONL of a shipped set."""
    return Path(str(resources.files("specwire.bench") / "prompts" / f"{name}.jsonl"))


def resolve(spec: str, limit: int | None = None) -> list[Prompt]:
    """Comma list of set names or paths -> prompts; `limit` applies to each set."""
    items = [s.strip() for s in spec.split(",") if s.strip()]
    if not items:
        raise PromptError("--prompts: no prompt set given")
    out: list[Prompt] = []
    for item in items:
        path = shipped_path(item) if item in SHIPPED else Path(item)
        prompts = load_file(path)
        out.extend(prompts[:limit] if limit is not None else prompts)
    _check_unique(out)
    return out


def load_file(path: str | Path) -> list[Prompt]:
    """Every prompt of one JSONL file (blank lines and # comments are skipped)."""
    p = Path(path)
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        hint = f" (shipped sets: {', '.join(SHIPPED)})" if p.suffix != ".jsonl" else ""
        raise PromptError(f"{p}: no such prompt file{hint}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"{p}: cannot read: {e}") from None
    prompts = [parse_line(line, p, i) for i, line in enumerate(lines, 1)
               if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise PromptError(f"{p}: no prompts in the file")
    return prompts


def parse_line(line: str, path: Path, lineno: int) -> Prompt:
    """One JSONL line -> Prompt; PromptError naming FILE:LINE and the problem."""
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(f"{where}: not valid JSON: {e.msg} (column {e.colno})") from None
    if not isinstance(obj, dict):
        raise PromptError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise PromptError(f"{where}: unknown key(s) {', '.join(unknown)}; "
                          f"expected {', '.join(sorted(_KEYS))}")
    text, messages = obj.get("prompt"), obj.get("messages")
    if (text is None) == (messages is None):
        raise PromptError(f"{where}: give exactly one of \"prompt\" and \"messages\"")
    if text is not None and (not isinstance(text, str) or not text):
        raise PromptError(f"{where}: \"prompt\" must be a non-empty string")
    return Prompt(
        id=_str_field(obj, "id", where, f"{path.stem}-{lineno}"),
        category=_str_field(obj, "category", where, path.stem),
        text=text,
        messages=None if messages is None else _messages(messages, where),
        max_tokens=_max_tokens(obj.get("max_tokens"), where),
        source=where,
    )


def _str_field(obj: dict, key: str, where: str, default: str) -> str:
    value = obj.get(key, default)
    if not isinstance(value, str) or not value:
        raise PromptError(f"{where}: \"{key}\" must be a non-empty string")
    return value


def _messages(value: Any, where: str) -> tuple[dict, ...]:
    """Checked with the server's rules, so a chat that bench accepts serve accepts too."""
    from specwire.config import ConfigError
    from specwire.text.chat import normalize_messages
    try:
        return tuple(normalize_messages(value))
    except ConfigError as e:
        raise PromptError(f"{where}: {e}") from None


def _max_tokens(value: Any, where: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PromptError(f"{where}: \"max_tokens\" must be a positive integer, got {value!r}")
    return value


def _check_unique(prompts: list[Prompt]) -> None:
    """Per-prompt pairing across modes goes by id, so ids must not repeat."""
    seen: dict[str, str] = {}
    for p in prompts:
        if p.id in seen:
            raise PromptError(f"{p.source}: id {p.id!r} already used at {seen[p.id]}")
        seen[p.id] = p.source


def tokenize(prompt: Prompt, target: Any, chat_template: str | None = None) -> list[int]:
    """Token ids as `generate` would feed them: BOS for text, the template's own for chats."""
    if prompt.messages is not None:
        from specwire.text.chat import render_for
        text = render_for(target, list(prompt.messages), chat_template)
        return target.tokenize(text, add_special=False, parse_special=True)
    return target.tokenize(prompt.text, add_special=True, parse_special=False)
