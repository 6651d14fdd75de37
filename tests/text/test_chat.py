"""Chat templates: the named fallbacks, the GGUF's own template, and refusals.

Fast tests use a stand-in backend; one slow test checks the bundled Gemma
GGUF (which carries no template) falls back to `gemma` and tokenizes the turn
markers as special tokens.
"""

from __future__ import annotations

import bundled
import pytest

from specwire.config import ConfigError
from specwire.text import chat

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "2+2?"},
]


class _Model:
    bos, eos = 2, 1

    def token_text(self, t: int) -> str:
        return {2: "<s>", 1: "</s>"}[t]


class FakeBackend:
    def __init__(self, name: str = "model.gguf", template: str | None = None) -> None:
        self.name, self._template, self.model = name, template, _Model()

    def chat_template(self) -> str | None:
        return self._template


EXPECTED = {
    "chatml": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
              "<|im_start|>assistant\n",
    "gemma": "<s><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
             "Hello!<end_of_turn>\n<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n",
    "llama3": "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
              "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama2": "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s>"
              "<s>[INST] 2+2? [/INST]",
    "mistral-v7": "<s>[SYSTEM_PROMPT] Be brief.[/SYSTEM_PROMPT][INST] Hi[/INST] Hello!</s>"
                  "[INST] 2+2?[/INST]",
    "phi3": "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello!<|end|>\n"
            "<|user|>\n2+2?<|end|>\n<|assistant|>\n",
    "zephyr": "<|system|>\nBe brief.<|endoftext|>\n<|user|>\nHi<|endoftext|>\n<|assistant|>\n"
              "Hello!<|endoftext|>\n<|user|>\n2+2?<|endoftext|>\n<|assistant|>\n",
    "vicuna": "Be brief.\n\nUSER: Hi\nASSISTANT: Hello!</s>\nUSER: 2+2?\nASSISTANT:",
}


def test_required_names_exist() -> None:
    assert set(EXPECTED) <= set(chat.TEMPLATES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_named_template(name: str) -> None:
    assert chat.render_for(FakeBackend(), MESSAGES, name) == EXPECTED[name]


def test_gguf_template_is_used_when_no_name_given() -> None:
    own = "{% for m in messages %}[{{ m.role }}:{{ m.content }}]{% endfor %}" \
          "{% if add_generation_prompt %}[assistant:{% endif %}{{ eos_token }}"
    be = FakeBackend(template=own)
    assert chat.render_for(be, MESSAGES[1:2], None) == "[user:Hi][assistant:</s>"
    # an explicit --chat-template overrides the GGUF's, as in llama.cpp
    assert chat.render_for(be, MESSAGES, "chatml") == EXPECTED["chatml"]


def test_default_by_family() -> None:
    assert chat.template_for(FakeBackend("gemma-3-270m-f32.gguf"), None)[0] == "gemma"
    label, _ = chat.template_for(FakeBackend("other.gguf"), None)
    assert label == chat.DEFAULT_TEMPLATE == "chatml"


def test_jinja_source_as_name() -> None:
    assert chat.render_for(FakeBackend(), MESSAGES[1:2], "{{ messages[0].content }}!") == "Hi!"


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    msgs = [{"role": "user", "content": parts}]
    assert "user\nab<|im_end|>" in chat.render_for(FakeBackend(), msgs, "chatml")


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty"),
    ("hi", "non-empty"),
    ([{"content": "x"}], "role"),
    ([{"role": "wizard", "content": "x"}], "role"),
    ([{"role": "user", "content": 5}], "content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "text parts"),
    (["just a string"], "object"),
])
def test_bad_messages(messages, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        chat.render_for(FakeBackend(), messages, "chatml")


def test_unknown_name() -> None:
    with pytest.raises(ConfigError, match="unknown name 'nope'.*chatml"):
        chat.render_for(FakeBackend(), MESSAGES, "nope")


def test_template_errors_become_config_errors() -> None:
    be = FakeBackend(template="{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ConfigError, match="roles must alternate"):
        chat.render_for(be, MESSAGES, None)
    with pytest.raises(ConfigError, match="TemplateSyntaxError"):
        chat.render_for(FakeBackend(template="{% for %}"), MESSAGES, None)


def test_sandbox() -> None:
    be = FakeBackend(template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ConfigError, match="unsafe"):
        chat.render_for(be, MESSAGES, None)


def test_hf_helpers() -> None:
    src = "{{ messages[0] | tojson }}{% for m in messages %}{% if loop.index > 1 %}{% break %}" \
          "{% endif %}{{ m.role }}{% endfor %}"
    out = chat.render_for(FakeBackend(template=src), [{"role": "user", "content": "é<"}], None)
    assert out == '{"role": "user", "content": "é<"}user'


@pytest.mark.slow
def test_bundled_gemma_falls_back_to_gemma() -> None:
    from specwire.backend.llama import LlamaBackend
    from specwire.config import ModelParams

    be = LlamaBackend(ModelParams(str(bundled.target()), n_ctx=64))
    try:
        assert be.chat_template() is None
        label, _ = chat.template_for(be, None)
        assert label == "gemma"
        text = chat.render_for(be, [{"role": "user", "content": "Hi"}], None)
        assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        tokens = be.tokenize(text, add_special=False, parse_special=True)
        assert tokens[0] == be.model.bos
        assert be.is_eog(be.tokenize("<end_of_turn>", False, True)[0])
    finally:
        be.close()
