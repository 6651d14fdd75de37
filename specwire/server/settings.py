"""Server-wide settings: the defaults a request starts from, and the server's limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specwire.config import DraftParams, SamplingParams
from specwire.sample.constraints import GrammarSpec
from specwire.server.deadlines import BODY_TIMEOUT_S, MAX_READING_BYTES
from specwire.server.limits import LORA_SCALE_MAX, MAX_BODY_BYTES, MAX_LOGIT_BIAS


@dataclass(slots=True, frozen=True)
class ServerSettings:
    """What `specwire serve` was started with, apart from the models themselves.

    sampling, draft: the defaults every request overrides field by field.
    alias:         the model name /v1/models lists (default: the target's file name); a
                   comma list gives more names (llama-server's -a). Any `model` a request
                   names is served, as llama-server serves its one model.
    chat_template: named template (llama.cpp names) or Jinja source; None = the GGUF's own,
                   else gemma for Gemma models, chatml otherwise (see specwire.text.chat).
    api_key:       when set, every endpoint but /health wants `Authorization: Bearer KEY`:
                   a comma list of keys (--api-key), or a tuple of keys taken whole
                   (--api-key-file's lines, which may hold commas).
    queue_size:    requests allowed to wait for a slot; one more is refused with 429.
    n_predict:     the tokens a request gets when it names none (-1: up to the context
                   size); a request's own n_predict / max_tokens wins, as in llama-server.
    webui:         serve the live page at GET / and its figures at /stats.json.
    max_body:      bytes a request body may have; more is refused with 413 (limits.py).
    reasoning_format: "none" keeps <think> blocks in the content; "deepseek"/"auto" move
                   them to reasoning_content (llama-server's --reasoning-format).
    reasoning_budget: -1 unlimited thinking, 0 thinking off (enable_thinking false).
    slot_prompt_similarity: a request goes to the idle slot whose cache shares the longest
                   prefix with its prompt if that is more than this share of the prompt,
                   else to the least recently used slot (0: always the latter).
    logit_bias_max: entries a request's logit_bias may have (OpenAI's 300 by default).
    lora_scale_max: the largest |scale| of a LoRA adapter, in a request's `lora` and in
                   POST /lora-adapters (--lora-scale-max; limits.LORA_SCALE_MAX).
    body_timeout_s: seconds a request body may take to arrive (408 past it).
    max_reading:   bytes of request bodies read at once, all requests together (503 past).
    allowed_hosts: without api_key, the Host names a request may use besides IP addresses
                   and localhost (DNS rebinding: a web page's own name that resolves here).
    slot_save_path: the folder POST /slots/{id}?action=save|restore uses (--slot-save-path).
    slot_save_files, slot_save_bytes: what each API key (or the server, without keys) may
                   keep there (--slot-save-files, --slot-save-bytes); a save past either is
                   a 403.
    spm_infill:    /infill puts the suffix before the prefix (--spm-infill).
    slots:         serve GET /slots (--no-slots: 404), as llama-server does by default.
    metrics:       serve GET /metrics (on by default here; llama-server needs --metrics).
    special:       generated special tokens print their text (llama-server's --special).
    threads_http:  threads that parse, tokenize and render requests (-1: the default pool).
    template_kwargs: --chat-template-kwargs, the defaults of a request's chat_template_kwargs.
    verbose_prompt: log each request's prompt tokens (--verbose-prompt).
    grammar:       --grammar / --json-schema: the constraint of every request that has none
                   of its own (a request's grammar, json_schema, response_format or forced
                   tool call wins).
    parallel_tool_calls: the default of a request's parallel_tool_calls
                   (--parallel-tool-calls, ik_llama.cpp's flag; off as in llama-server).
    n_keep:        the default of a request's n_keep (--keep): the prompt tokens a context
                   shift keeps (-1: all of them).
    context_shift: a full context is shifted and generation goes on (--context-shift); then
                   n_predict -1 means no limit, as in llama-server, instead of the context.
    cors_origins:  origins a browser may call from (CORS, as llama-server answers it: "*"
                   any; () none, no CORS headers); a preflight needs no API key.
    cors_methods, cors_headers, cors_credentials: the preflight's answers.
    prefill_assistant: a chat ending in an assistant message continues that message
                   (llama-server's default; --no-prefill-assistant starts a new turn).
    """

    sampling: SamplingParams = SamplingParams()
    draft: DraftParams = DraftParams()
    alias: str | None = None
    chat_template: str | None = None
    api_key: str | tuple[str, ...] | None = None
    queue_size: int = 16
    n_predict: int = -1
    webui: bool = True
    max_body: int = MAX_BODY_BYTES
    reasoning_format: str = "auto"
    reasoning_budget: int = -1
    slot_prompt_similarity: float = 0.1
    logit_bias_max: int = MAX_LOGIT_BIAS
    lora_scale_max: float = LORA_SCALE_MAX
    body_timeout_s: float = BODY_TIMEOUT_S
    max_reading: int = MAX_READING_BYTES
    allowed_hosts: tuple[str, ...] = ()
    metrics: bool = True
    special: bool = False
    threads_http: int = -1
    template_kwargs: Mapping[str, object] = field(default_factory=dict)
    verbose_prompt: bool = False
    grammar: GrammarSpec | None = None
    parallel_tool_calls: bool = False
    slots: bool = True
    spm_infill: bool = False
    slot_save_path: str | None = None
    slot_save_files: int = 16
    slot_save_bytes: int = 8 << 30
    n_keep: int = 0
    context_shift: bool = False
    cors_origins: tuple[str, ...] = ("*",)
    cors_methods: tuple[str, ...] = ("GET", "POST")
    cors_headers: tuple[str, ...] = ("*",)
    cors_credentials: bool = False
    prefill_assistant: bool = True
