"""Chat messages -> one prompt string, the way llama.cpp renders them.

A GGUF's own Jinja chat template (`tokenizer.chat_template`) is the truth for its model
and is used as is, in a sandboxed Jinja environment with the variables HF templates
expect. A GGUF without one (the bundled base Gemma-3-270M) needs a named template:
TEMPLATES holds a few of llama.cpp's built-ins under llama.cpp's names, as Jinja (tools
and chat_template_kwargs reach them); every other name of llama.cpp's list
(builtin_names(): command-r, deepseek3, gpt-oss...) is rendered by llama.cpp itself
(llama_chat_apply_template), as llama-server renders it without --jinja. The choice, as
llama.cpp makes it: `--chat-template` (a name or a Jinja template) over the GGUF's own,
else DEFAULT_TEMPLATE's family default ("gemma" for Gemma, "chatml" otherwise).
Rendering errors become ConfigError, so the server answers 400 and the CLI prints a line.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from specwire.config import ConfigError

#: Fallback for a GGUF without a template whose family is not recognised.
DEFAULT_TEMPLATE = "chatml"

#: Model families (GGUF general.architecture prefix) -> their template name.
FAMILY_TEMPLATES = {"gemma": "gemma", "llama": "llama3", "phi3": "phi3", "mistral": "mistral-v7"}

_CHATML = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Gemma has no system role: a system message is prepended to the first user turn.
_GEMMA = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + m['content'] | trim"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)

_LLAMA3 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

# Meta's original format: <s>[INST] <<SYS>>\n..\n<</SYS>>\n\nuser [/INST] answer </s>
_LLAMA2 = (
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\n' + messages[0]['content'] + '\n<</SYS>>\n\n' %}"
    "{% set loop_messages = messages[1:] %}"
    "{% else %}{% set system = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for m in loop_messages %}"
    "{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (system if loop.first else '') + m['content'] | trim"
    " + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'] | trim + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

_MISTRAL_V7 = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '[SYSTEM_PROMPT] ' + m['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif m['role'] == 'user' %}{{ '[INST] ' + m['content'] + '[/INST]' }}"
    "{% else %}{{ ' ' + m['content'] + eos_token }}{% endif %}"
    "{% endfor %}"
)

_PHI3 = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_ZEPHYR = (
    "{% for m in messages %}"
    "{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|endoftext|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_VICUNA = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] + '\n\n' }}"
    "{% elif m['role'] == 'user' %}{{ 'USER: ' + m['content'] + '\n' }}"
    "{% else %}{{ 'ASSISTANT: ' + m['content'] + eos_token + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

#: llama.cpp's built-in template names -> Jinja source.
TEMPLATES: dict[str, str] = {
    "chatml": _CHATML,
    "gemma": _GEMMA,
    "llama3": _LLAMA3,
    "llama2": _LLAMA2,
    "mistral-v7": _MISTRAL_V7,
    "phi3": _PHI3,
    "zephyr": _ZEPHYR,
    "vicuna": _VICUNA,
}

#: End-of-turn markers of the named templates, added as stop strings to chat requests: a
#: model whose vocabulary lacks them as special (end-of-generation) tokens would
#: otherwise write the marker as text and go on with the next turn.
TEMPLATE_STOPS: dict[str, list[str]] = {
    "chatml": ["<|im_end|>"],
    "gemma": ["<end_of_turn>"],
    "llama3": ["<|eot_id|>"],
    "phi3": ["<|end|>"],
    "zephyr": ["<|endoftext|>"],
    "vicuna": ["\nUSER:"],
}

_ROLES = ("system", "user", "assistant", "tool", "developer")


def normalize_messages(messages: Any) -> list[dict]:
    """Check OpenAI-style messages; flatten text content parts into one string.

    Content may be a string, null (an assistant turn with tool calls), or a list
    of {"type": "text", "text": ...} parts; anything else (images) is refused.
    """
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages: must be a non-empty array of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ConfigError(f"messages[{i}]: must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise ConfigError(f"messages[{i}].role: must be one of {', '.join(_ROLES)}, "
                              f"got {role!r}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise ConfigError(f"messages[{i}].content[{j}]: only text parts "
                                      "({\"type\": \"text\", \"text\": ...}) are supported")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ConfigError(f"messages[{i}].content: must be a string or an array of text parts")
        out.append({**m, "role": role, "content": content})
    return out


def render(template: str, messages: list[dict], bos_token: str = "", eos_token: str = "",
           add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render a Jinja chat template, sandboxed: a GGUF's template is untrusted input.

    variables: more template variables, e.g. `tools` (OpenAI's function list) or a
    request's chat_template_kwargs (`enable_thinking`...).
    """
    env = _environment()
    try:
        tmpl = env.from_string(template)
        return tmpl.render(**variables, messages=messages, bos_token=bos_token,
                           eos_token=eos_token, add_generation_prompt=add_generation_prompt)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any template failure is the input's fault
        raise ConfigError(f"chat template: {type(e).__name__}: {e}") from None


def is_jinja(text: str) -> bool:
    """Whether a --chat-template value is Jinja source rather than a template's name."""
    return "{{" in text or "{%" in text


#: template_for's "source" of a template llama.cpp renders (no Jinja of specwire's own).
BUILTIN_SOURCE = "(llama.cpp's built-in template {name}, rendered by llama_chat_apply_template)"

_builtins: tuple[str, ...] | None = None


def builtin_names() -> tuple[str, ...]:
    """llama.cpp's built-in template names (llama_chat_builtin_templates), and TEMPLATES'."""
    global _builtins
    if _builtins is None:
        names: list[str] = []
        try:
            import ctypes

            import llama_cpp as C
            arr = (ctypes.c_char_p * 256)()
            n = C.llama_chat_builtin_templates(arr, len(arr))
            names = [arr[i].decode() for i in range(min(n, len(arr)))]
        except Exception:  # noqa: BLE001 - no llama.cpp: the Jinja ones only
            names = []
        _builtins = tuple(sorted({*names, *TEMPLATES}))
    return _builtins


def is_known(name: str) -> bool:
    """Whether --chat-template NAME names a template (TEMPLATES' or llama.cpp's)."""
    return name in TEMPLATES or name in builtin_names()


def template_for(backend: Any, template_name: str | None) -> tuple[str, str]:
    """(label, Jinja source) of the template render_for would use for this backend (for
    a name only llama.cpp renders: BUILTIN_SOURCE)."""
    if template_name:
        if template_name in TEMPLATES:
            return template_name, TEMPLATES[template_name]
        if is_jinja(template_name):
            return "custom", template_name
        if template_name in builtin_names():
            return template_name, BUILTIN_SOURCE.format(name=template_name)
        raise ConfigError(f"chat template: unknown name {template_name!r}; "
                          f"known: {', '.join(builtin_names())}")
    own = backend.chat_template()
    if own:
        return "gguf", own
    name = default_template_name(backend)
    return name, TEMPLATES[name]


def default_template_name(backend: Any) -> str:
    """The named template for a GGUF without one: by its architecture, else chatml."""
    arch = (_architecture(backend) or backend.name or "").lower()
    for family, name in FAMILY_TEMPLATES.items():
        if arch.startswith(family):
            return name
    return DEFAULT_TEMPLATE


def render_for(backend: Any, messages: list[dict], template_name: str | None,
               prefill: bool = False, **variables: Any) -> str:
    """The prompt text for `messages` on this backend's model (tokenize it with
    add_special=False, parse_special=True: the template writes BOS itself).

    prefill: a chat ending in an assistant message continues that message, as
    llama-server does: the messages before it are rendered with the generation prompt,
    and its content follows, with no end of turn."""
    msgs = normalize_messages(messages)
    last = None
    if prefill and msgs and msgs[-1]["role"] == "assistant":
        last = msgs.pop()
        if msgs and msgs[-1]["role"] == "assistant":
            raise ConfigError("messages: cannot have 2 or more assistant messages at the end "
                              "of the list (the last one is continued)")
    label, source = template_for(backend, template_name)
    bos, eos = _special_texts(backend)
    if source == BUILTIN_SOURCE.format(name=label):
        text = _apply_builtin(label, msgs, bos if _adds_bos(backend) else "")
    else:
        text = render(source, msgs, bos_token=bos, eos_token=eos, add_generation_prompt=True,
                      **variables)
    return text if last is None else text + last["content"]


def _apply_builtin(name: str, msgs: list[dict], bos: str) -> str:
    """llama.cpp's own rendering of its built-in template `name` (llama-server's without
    --jinja); BOS is prepended as its tokenizer would add it."""
    import ctypes

    import llama_cpp as C
    keep = [(m["role"].encode(), m["content"].encode()) for m in msgs]
    arr = (C.llama_chat_message * max(len(keep), 1))()
    for i, (role, content) in enumerate(keep):
        arr[i].role, arr[i].content = role, content
    size = 4096 + sum(len(r) + len(c) for r, c in keep) * 2
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = C.llama_chat_apply_template(name.encode(), arr, len(keep), True, buf, size)
        if n < 0:
            raise ConfigError(f"chat template {name}: llama.cpp cannot render these messages")
        if n <= size:
            text = buf.raw[:n].decode("utf-8", errors="replace")
            return text if not bos or text.startswith(bos) else bos + text
        size = n + 1
    raise ConfigError(f"chat template {name}: llama.cpp's output kept growing")


def _adds_bos(backend: Any) -> bool:
    try:
        return bool(backend.tokenize("", add_special=True))
    except Exception:  # noqa: BLE001 - a backend without a vocabulary
        return False


# -- helpers ---------------------------------------------------------------------------------


class _TemplateError(ConfigError):
    pass


def _raise_exception(message: str) -> None:
    raise _TemplateError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    # HF's tojson: no HTML escaping, unicode kept (jinja2's own escapes '<' for HTML).
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_env = None


def _environment():
    global _env
    if _env is None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _env = env
    return _env


def _special_texts(backend: Any) -> tuple[str, str]:
    model = getattr(backend, "model", None)
    try:
        return model.token_text(model.bos), model.token_text(model.eos)
    except Exception:  # noqa: BLE001 - a backend without a vocabulary (tests, remote)
        return "", ""


def _architecture(backend: Any) -> str | None:
    """general.architecture from the GGUF metadata, when the backend is llama.cpp's."""
    model = getattr(backend, "model", None)
    ptr = getattr(model, "ptr", None)
    if not ptr:
        return None
    try:
        import ctypes

        import llama_cpp as C
        buf = ctypes.create_string_buffer(128)
        n = C.llama_model_meta_val_str(ptr, b"general.architecture", buf, len(buf))
        return buf.value.decode(errors="replace") if n > 0 else None
    except Exception:  # noqa: BLE001 - metadata is a hint only
        return None
