"""Request bodies -> validated engine requests, with llama-server's field names.

Bodies are checked field by field rather than through pydantic models: llama-server
accepts loosely typed bodies (a prompt may be a string, token ids or a mix; speculative
settings come as dotted keys or a nested object), and each refusal names the field and
what was expected, as llama-server and OpenAI do. Range checks are the config
dataclasses' own (a ConfigError becomes a 400). Unknown keys are ignored; features not
implemented (n > 1, echo, legacy `functions`) are refused, never silently dropped.
`completion` lists the conventions; grammars, penalties and logprobs are structured.py's.
"""

from __future__ import annotations

import hashlib
import logging
import math
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from specwire.config import ConfigError, DraftParams, SamplingParams
from specwire.engine.engine import Request
from specwire.link.transport import protocol
from specwire.sample.constraints import GrammarSpec
from specwire.server import infill as infill_prompt
from specwire.server import limits, structured, tool_calls
from specwire.server.chat_output import ChatPlan
from specwire.server.errors import ApiError, bad_request
from specwire.server.settings import ServerSettings
from specwire.text import chat, reasoning

log = logging.getLogger("specwire.serve")


@dataclass(slots=True)
class Completion:
    """A generation request, checked and tokenized, ready for a slot."""

    request: Request
    stops: list[str]
    stream: bool = False
    return_tokens: bool = False
    include_usage: bool = False
    piece: Callable[[int], bytes] | None = None     # a token's bytes (for logprobs)
    chat: ChatPlan | None = None                     # chat only: reasoning and tool calls
    #: what the answer repeats of a request translated onto the chat route (Anthropic's
    #: stop_sequences, the Responses API's tools...): see anthropic.py, oai_responses.py
    echo: dict = field(default_factory=dict)
    id_slot: int = -1                                # the slot asked for (-1: any)
    return_progress: bool = False                    # stream prompt_progress objects

    def settings(self) -> dict:
        """llama-server's `generation_settings` for this request."""
        r = self.request
        return {"n_predict": r.n_predict, **r.sampling.to_dict(), "ignore_eos": r.ignore_eos,
                "stop": list(self.stops), "speculative": r.draft.enabled,
                "speculative.n_max": r.draft.n_max, "speculative.n_min": r.draft.n_min,
                "speculative.p_min": r.draft.p_min}


def parse_json(raw: bytes, kind: type = dict) -> Any:
    """The body as a JSON object (kind list: an array), or a 400 that says why not (see
    limits.py)."""
    return limits.parse_json(raw, kind)


class Fields:
    """Typed access to a JSON object's fields; a wrong type is a 400 naming the field."""

    def __init__(self, body: dict, where: str = "") -> None:
        self.body, self.where = body, where

    def find(self, *names: str) -> tuple[str, Any]:
        """(name, value) of the first of `names` present and not null, else (names[0], None)."""
        for n in names:
            if self.body.get(n) is not None:
                return n, self.body[n]
        return names[0], None

    def int(self, *names: str, default: int | None = None) -> int | None:
        name, v = self.find(*names)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer() and abs(v) < 2**63:
            return int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.wrong(name, "an integer", v)
        return v

    def float(self, *names: str, default: float | None = None) -> float | None:
        name, v = self.find(*names)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.wrong(name, "a number", v)
        return float(v)

    def bool(self, *names: str, default: bool = False) -> bool:
        name, v = self.find(*names)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.wrong(name, "true or false", v)
        return v

    def str(self, *names: str, default: str | None = None) -> str | None:
        name, v = self.find(*names)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self.wrong(name, "a string", v)
        return v

    def wrong(self, name: str, expected: str, v: Any) -> ApiError:
        return bad_request(f"{self.where}{name}: must be {expected}, got {_kind(v)}")


# -- the parts of a generation request ----------------------------------------------------------


def sampling(f: Fields, defaults: SamplingParams) -> SamplingParams:
    changes: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
        v = f.float(name)
        if v is not None:
            changes[name] = v
    for name in ("top_k", "repeat_last_n"):
        v = f.int(name)
        if v is not None:
            changes[name] = v
    seed = f.int("seed")
    if seed is not None:
        changes["seed"] = secrets.randbits(32) if seed == -1 else seed
    try:
        return replace(defaults, **changes)
    except ConfigError as e:
        raise bad_request(str(e)) from None


def as_the_link_carries(params: SamplingParams) -> SamplingParams:
    """A remote drafter gets the settings (penalties and logit bias included) as float32:
    what rounds out of range there is refused here."""
    try:
        protocol.wire_sampling(params)
    except ValueError as e:
        raise bad_request(f"{str(e).removeprefix('sampling settings: ')} once rounded to "
                          "float32, as the draft link carries it") from None
    return params


#: Longest cache_salt accepted (vLLM sets none; the node sees a fixed-size digest).
MAX_SALT = 1024


def cache_scope(f: Fields) -> str:
    """The draft node's cache scope of a request (vLLM's cache_salt): requests share cached
    history on the node only with requests of the same salt. The node gets a digest of it,
    never the salt; no salt is the scope "", shared by every request without one."""
    salt = f.str("cache_salt")
    if salt is None:
        return ""
    if not salt or len(salt) > MAX_SALT:
        raise bad_request(f"cache_salt: must be 1 to {MAX_SALT} characters, got {len(salt)}")
    data = salt.encode("utf-8", "surrogatepass")   # JSON may carry a lone surrogate
    return hashlib.sha256(b"specwire cache_salt\0" + data).hexdigest()[:32]


def key_scope(key: bytes) -> str:
    """The draft node's cache scope of an API key's requests: clients holding different keys
    of one server share nothing cached on the node (the node sees a digest, never the key)."""
    return hashlib.sha256(b"specwire api key\0" + key).hexdigest()[:32]


def joined_scope(key: str, salt: str = "") -> str:
    """The cache scope of a request of API key scope `key` (key_scope's; "" without keys)
    and cache_salt scope `salt` (cache_scope's)."""
    if not key:
        return salt
    return hashlib.sha256(f"{key}\0{salt}".encode()).hexdigest()[:32]


def scope_by_key(request: Request, scope: str) -> None:
    """Narrow a request's cache scope (its cache_salt's, or "") to its API key's."""
    if scope:
        joined = joined_scope(scope, request.draft.cache_scope)
        request.draft = replace(request.draft, cache_scope=joined)


def draft(body: dict, defaults: DraftParams) -> DraftParams:
    """Per-request speculative settings on top of the server's (see the module docstring)."""
    nested = body.get("speculative")
    if nested is False:
        return replace(defaults, enabled=False)
    if nested is None or nested is True:
        nested = {}
    if not isinstance(nested, dict):
        raise bad_request(f"speculative: must be an object or false, got {_kind(nested)}")
    flat = {k.split(".", 1)[1]: v for k, v in body.items()
            if k.startswith("speculative.") and v is not None}
    f = Fields({**flat, **nested}, "speculative.")
    changes: dict[str, Any] = {}
    n_max, n_min, p_min = f.int("n_max"), f.int("n_min"), f.float("p_min")
    if n_max is not None:
        changes["n_max"] = n_max
        if n_min is None and n_max >= 0:
            changes["n_min"] = min(defaults.n_min, n_max)
    if n_min is not None:
        changes["n_min"] = n_min
    if p_min is not None:
        changes["p_min"] = p_min
    if n_max == 0:
        changes["enabled"] = False
    try:
        return replace(defaults, **changes)
    except ConfigError as e:
        field, _, msg = str(e).partition(": ")
        names = {"draft_max": "n_max", "draft_min": "n_min", "draft_p_min": "p_min"}
        name = names.get(field, field)
        raise bad_request(f"speculative.{name}: {msg}") from None


def n_predict(f: Fields, settings: ServerSettings, n_ctx: int) -> int:
    name, _ = f.find("n_predict", "max_tokens", "max_completion_tokens")
    n = f.int("n_predict", "max_tokens", "max_completion_tokens", default=settings.n_predict)
    if n < -1:
        raise bad_request(f"{name}: must be >= 0, or -1 for no limit, got {n}")
    if n > limits.INT32_MAX:
        raise bad_request(f"{name}: must be at most {limits.INT32_MAX} (llama.cpp's int32), "
                          f"got {n}")
    if n == -1:   # with context shift, as llama-server: until EOS (int32's limit)
        n = limits.INT32_MAX if settings.context_shift else n_ctx
    return n     # the server's -n is the default only: the request's value wins (llama-server)


def stop_strings(f: Fields) -> list[str]:
    _, v = f.find("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise f.wrong("stop", "a string or an array of strings", v)
    if len(v) > limits.MAX_STOPS:
        raise bad_request(f"stop: at most {limits.MAX_STOPS} strings, got {len(v)}")
    for i, s in enumerate(v):
        if len(s) > limits.MAX_STOP_CHARS:
            raise bad_request(f"stop[{i}]: at most {limits.MAX_STOP_CHARS} characters, "
                              f"got {len(s)}")
    return [s for s in v if s]


def prompt_tokens(value: Any, backend: Any, name: str = "prompt") -> list[int]:
    """llama-server's prompt forms: text, token ids, or a mix of both in one array.

    Text is tokenized with BOS and special tokens parsed, as llama-server does;
    token ids are used as given. An array of several texts would be several
    prompts, which this server does not batch: refused.
    """
    if value is None:
        raise bad_request(f"{name}: required")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise bad_request(f"{name}: is empty")
        check_fits_bound(limits.fewest_tokens(value, backend), backend.n_ctx)
        return backend.tokenize(value, add_special=True, parse_special=True)
    if not isinstance(value, list):
        raise bad_request(f"{name}: must be a string or an array of token ids, got {_kind(value)}")
    if not value:
        raise bad_request(f"{name}: is empty")
    check_fits_bound(sum(map(_is_int, value)) + sum(limits.fewest_tokens(x, backend)
                                                    for x in value if isinstance(x, str)),
                     backend.n_ctx)
    if sum(isinstance(x, str) for x in value) > 1 and not any(_is_int(x) for x in value):
        raise bad_request(f"{name}: several prompts in one request are supported on "
                          "/completion only (a list of results); send one request per prompt")
    tokens: list[int] = []
    for i, x in enumerate(value):
        if isinstance(x, str):
            tokens += backend.tokenize(x, add_special=i == 0, parse_special=True)
        elif _is_int(x):
            tokens.append(x)
        else:
            raise bad_request(f"{name}[{i}]: must be a token id or a string, got {_kind(x)}")
    return check_token_ids(tokens, backend.n_vocab, name)


def check_token_ids(tokens: Sequence[Any], n_vocab: int, name: str) -> list[int]:
    for i, t in enumerate(tokens):
        if not _is_int(t):
            raise bad_request(f"{name}[{i}]: must be a token id (integer), got {_kind(t)}")
        if not 0 <= t < n_vocab:
            raise bad_request(f"{name}[{i}]: token id {t} is outside the vocabulary "
                              f"(0..{n_vocab - 1})")
    return list(tokens)


def check_fits(tokens: Sequence[int], n_predict_: int, n_ctx: int) -> None:
    needed = len(tokens) + (1 if n_predict_ else 0)
    if needed > n_ctx:
        raise _exceeds(f"{len(tokens)} tokens", len(tokens), n_ctx)


def check_fits_bound(at_least: int, n_ctx: int) -> None:
    """The cheap check, before tokenizing: a prompt known to have more than n_ctx tokens."""
    if at_least > n_ctx:
        raise _exceeds(f"at least {at_least} tokens", at_least, n_ctx)


def _check_within_context(field: str, n: int, n_ctx: int, bound: str = "") -> None:
    """/tokenize and /detokenize take what a prompt could hold: at most n_ctx tokens."""
    if n > n_ctx:
        raise ApiError(400, f"{field}: {bound}{n} tokens, more than the context of {n_ctx} "
                       "(-c) that any prompt can hold", "exceed_context_size_error",
                       n_prompt_tokens=n, n_ctx=n_ctx)


def _exceeds(what: str, n_prompt: int, n_ctx: int) -> ApiError:
    return ApiError(400, f"the request exceeds the available context size: the prompt has "
                    f"{what} and the context {n_ctx} (-c)", "exceed_context_size_error",
                    n_prompt_tokens=n_prompt, n_ctx=n_ctx)


def refuse_unsupported(f: Fields, chat_: bool = False) -> None:
    """A feature the client relies on but this server lacks is an error, not a silent no-op."""
    n = f.int("n", default=1)
    if n != 1:
        raise bad_request(f"n: only 1 choice per request is supported, got {n}")
    best_of = f.int("best_of", default=1)
    if best_of != 1:
        raise bad_request(f"best_of: only 1 is supported, got {best_of}")
    if f.bool("echo"):
        raise bad_request("echo: not supported")
    for name in ("functions",) if chat_ else ("tools", "functions"):
        if f.body.get(name):
            raise bad_request(f"{name}: not supported" + ("" if chat_ else
                                                          " here; use /v1/chat/completions"))


def check_model(f: Fields, names: Sequence[str]) -> None:
    """OpenAI clients name a model: any name is served, as llama-server serves its one
    model whatever a client calls it (agents send their own names); a non-string is 400."""
    f.str("model")


# -- whole requests ---------------------------------------------------------------------------


def completion(body: dict, backend: Any, settings: ServerSettings, names: Sequence[str],
               prompt_key: str = "prompt", dialect: str = "llama"
               ) -> Completion | list[Completion]:
    """POST /completion (dialect "llama") and /v1/completions ("completions").

    llama-server's conventions: n_predict (alias max_tokens, max_completion_tokens) -1 runs
    until the context is full (with --context-shift: no limit), default the server's -n;
    n_keep (default --keep) and n_discard shape a context shift; lora [{"id", "scale"}]
    sets this request's adapter scales (unnamed adapters off); seed -1 is a random seed;
    "speculative.n_max/n_min/p_min" or {"speculative": {...}}, and "speculative": false or
    n_max 0 turns drafting off; a prompt longer than the context is a 400
    "exceed_context_size_error" with n_prompt_tokens and n_ctx. A list of prompts
    (/completion) is a list of Completions, answered as a list of results."""
    f = Fields(body)
    check_model(f, names)
    refuse_unsupported(f)
    _, prompt = f.find(prompt_key)
    several = several_prompts(prompt) if dialect == "llama" else None
    if several is not None:
        if f.bool("stream"):
            raise bad_request(f"{prompt_key}: several prompts with stream: true are not "
                              "supported; send them without streaming, or one request each")
        return [_finish(f, body, prompt_tokens(p, backend, f"{prompt_key}[{i}]"), backend,
                        settings, [], dialect) for i, p in enumerate(several)]
    tokens = prompt_tokens(prompt, backend, prompt_key)
    return _finish(f, body, tokens, backend, settings, [], dialect)


#: most prompts one /completion request may list (each is a job in the queue).
MAX_PROMPTS = 64


def several_prompts(value: Any) -> list | None:
    """llama-server's list of prompts: an array of several texts or token arrays (not
    token ids mixed with text, which is one prompt); None for one prompt."""
    if not (isinstance(value, list) and len(value) > 1
            and all(isinstance(x, str | list) for x in value)):
        return None
    if len(value) > MAX_PROMPTS:
        raise bad_request(f"prompt: at most {MAX_PROMPTS} prompts in one request, got "
                          f"{len(value)}")
    return value


def chat_completion(body: dict, backend: Any, settings: ServerSettings,
                    names: Sequence[str]) -> Completion:
    """POST /v1/chat/completions: render the messages with the chat template, then as above.

    Tools, tool_choice and the reasoning split: see tool_calls.py and reasoning.py.
    """
    f = Fields(body)
    check_model(f, names)
    refuse_unsupported(f, chat_=True)
    label, text, tools = rendered(body, backend, settings)
    check_fits_bound(limits.fewest_tokens(text, backend), backend.n_ctx)
    tokens = backend.tokenize(text, add_special=False, parse_special=True)
    if not tokens:
        raise bad_request("messages: the rendered prompt is empty")
    spec = _finish(f, body, tokens, backend, settings, chat.TEMPLATE_STOPS.get(label, []),
                   "chat", tool_calls.grammar(tools))
    spec.chat = tool_calls.plan(tools, settings.reasoning_format != "none",
                                text.rstrip().endswith(reasoning.OPEN))
    return spec


def rendered(body: dict, backend: Any, settings: ServerSettings
             ) -> tuple[str, str, tool_calls.ToolRequest | None]:
    """A chat body's messages (and tools) through the chat template: (template label,
    prompt text, the tools asked for)."""
    _, messages = Fields(body).find("messages")
    if messages is None:
        raise bad_request("messages: required")
    try:
        label, source = chat.template_for(backend, settings.chat_template)
    except ConfigError as e:
        raise bad_request(str(e)) from None
    tools = tool_calls.parse(body, source, settings.parallel_tool_calls)
    variables = {**tool_calls.template_variables(tools),
                 **template_kwargs(body, settings.reasoning_budget,
                                   settings.template_kwargs)}
    try:
        text = chat.render_for(backend, tool_calls.messages_for(tools, messages),
                               settings.chat_template, settings.prefill_assistant,
                               **variables)
    except ConfigError as e:
        where = "tools: the chat template cannot render this request: " if tools else ""
        raise bad_request(where + str(e)) from None
    return label, text, tools


def apply_template(body: dict, backend: Any, settings: ServerSettings) -> dict:
    """POST /apply-template: {messages, tools?, chat_template_kwargs?} -> {prompt}, the text
    /v1/chat/completions would give the model, as llama-server answers it."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    _, text, _ = rendered(body, backend, settings)
    return {"prompt": text}


#: template variables a request's chat_template_kwargs may not set (the server sets them).
RESERVED_KWARGS = frozenset({"messages", "tools", "bos_token", "eos_token",
                             "add_generation_prompt"})


def template_kwargs(body: dict, reasoning_budget: int = -1,
                    defaults: Mapping[str, Any] | None = None) -> dict:
    """chat_template_kwargs (e.g. {"enable_thinking": false}) over the server's
    --chat-template-kwargs; --reasoning-budget 0 turns thinking off as llama-server does,
    unless the request or the server's kwargs say otherwise."""
    kw = body.get("chat_template_kwargs")
    if kw is None:
        kw = {}
    if not isinstance(kw, dict):
        raise bad_request(f"chat_template_kwargs: must be an object, got {_kind(kw)}")
    clash = RESERVED_KWARGS & set(kw)
    if clash:
        raise bad_request(f"chat_template_kwargs: {sorted(clash)[0]!r} cannot be set here")
    kw = {**(defaults or {}), **kw}
    if reasoning_budget == 0:
        kw = {"enable_thinking": False, **kw}
    return kw


def _finish(f: Fields, body: dict, tokens: list[int], backend: Any, settings: ServerSettings,
            extra_stops: list[str], dialect: str,
            tool_grammar: GrammarSpec | None = None) -> Completion:
    n = n_predict(f, settings, backend.n_ctx)
    check_fits(tokens, n, backend.n_ctx)
    if settings.verbose_prompt:
        log_prompt(tokens, backend)
    sp = sampling(f, settings.sampling)
    try:
        sp = replace(sp, **structured.penalties(body, backend, settings.logit_bias_max))
    except ConfigError as e:
        raise bad_request(str(e)) from None
    sp = as_the_link_carries(sp)
    logprobs = structured.logprobs_spec(body, dialect)
    grammar = structured.grammar_spec(body, backend, tool_grammar, settings.grammar)
    dp = draft(body, settings.draft)
    stops = stop_strings(f)
    stops += [s for s in extra_stops if s not in stops]
    ignore_eos = f.bool("ignore_eos")
    stream = f.bool("stream")
    return_tokens = f.bool("return_tokens")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise bad_request(f"stream_options: must be an object, got {_kind(opts)}")
    include_usage = Fields(opts or {}, "stream_options.").bool("include_usage")
    cache_prompt = f.bool("cache_prompt", default=True)
    dp = replace(dp, cache_scope=cache_scope(f), cache_store=cache_prompt)
    lora = lora_scales(body, backend, settings.lora_scale_max)
    n_keep = f.int("n_keep", default=settings.n_keep)
    n_discard = f.int("n_discard", default=0)
    try:
        req = Request(tokens, n, sp, dp, ignore_eos, grammar, logprobs,
                      cache_prompt=cache_prompt, n_keep=n_keep, n_discard=n_discard,
                      lora=lora)
    except ConfigError as e:
        raise bad_request(str(e)) from None
    return Completion(req, stops, stream, return_tokens, include_usage,
                      lambda t: backend.detokenize([t]), id_slot=f.int("id_slot", default=-1),
                      return_progress=f.bool("return_progress"))


def lora_scales(body: dict, backend: Any,
                scale_max: float = limits.LORA_SCALE_MAX) -> tuple[float, ...] | None:
    """The request's `lora` as llama-server reads it: every loaded adapter's scale, 0 for
    those it does not name; None without the field (the server's scales). A scale beyond
    +-scale_max (--lora-scale-max) is refused: activations overflow far beyond."""
    v = body.get("lora")
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_request(f'lora: must be an array of {{"id": N, "scale": X}}, got {_kind(v)}')
    n = len(getattr(backend, "lora_scales", ()))
    scales = [0.0] * n
    for i, entry in enumerate(v):
        if not isinstance(entry, dict):
            raise bad_request(f'lora[{i}]: must be an object {{"id": N, "scale": X}}, got '
                              f"{_kind(entry)}")
        ident, scale = entry.get("id"), entry.get("scale", 0.0)
        if not _is_int(ident):
            raise bad_request(f"lora[{i}].id: must be an adapter id (integer), got "
                              f"{_kind(ident)}")
        if not 0 <= ident < n:
            raise bad_request(f"lora[{i}].id: no adapter {ident}; this server has {n} "
                              "(--lora)")
        if (isinstance(scale, bool) or not isinstance(scale, int | float)
                or not math.isfinite(scale)):
            raise bad_request(f"lora[{i}].scale: must be a finite number, got {_kind(scale)}")
        check_lora_scale(scale, f"lora[{i}].scale", scale_max)
        scales[ident] = float(scale)
    return tuple(scales)


def check_lora_scale(scale: float, where: str, scale_max: float) -> None:
    """A 400 for a LoRA scale beyond +-scale_max (--lora-scale-max)."""
    if not -scale_max <= scale <= scale_max:
        raise bad_request(f"{where}: {scale:g} is outside -{scale_max:g}..{scale_max:g} "
                          "(serve --lora-scale-max widens it)")


def lora_adapter_scales(body: object, current: Sequence[float],
                        scale_max: float = limits.LORA_SCALE_MAX) -> list[float]:
    """POST /lora-adapters [{"id", "scale"}, ...] -> every adapter's new scale (one not
    named keeps its own); a 400 names what is wrong."""
    shape = 'the body must be [{"id": N, "scale": X}, ...]'
    if not isinstance(body, list):
        raise bad_request(f"{shape}, got {_kind(body)}")
    scales = [float(x) for x in current]
    for i, x in enumerate(body):
        if not isinstance(x, dict):
            raise bad_request(f"[{i}]: {shape}, got {_kind(x)}")
        ident, scale = x.get("id"), x.get("scale")
        if not _is_int(ident):
            raise bad_request(f"[{i}].id: must be an adapter id (integer), got {_kind(ident)}")
        if not 0 <= ident < len(scales):
            raise bad_request(f"[{i}].id: no adapter {ident}; this server has {len(scales)} "
                              "(--lora)")
        if (isinstance(scale, bool) or not isinstance(scale, int | float)
                or not math.isfinite(scale)):
            raise bad_request(f"[{i}].scale: must be a finite number, got {_kind(scale)}")
        check_lora_scale(scale, f"[{i}].scale", scale_max)
        scales[ident] = float(scale)
    return scales


def infill(body: dict, backend: Any, settings: ServerSettings,
           names: Sequence[str]) -> Completion:
    """POST /infill: llama-server's fields (input_prefix, input_suffix, input_extra, prompt)
    -> the FIM prompt (infill.py), then a completion like /completion's."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    f = Fields(body)
    check_model(f, names)
    refuse_unsupported(f, chat_=False)
    texts = {name: f.str(name, default="") for name in ("input_prefix", "input_suffix")}
    typed = f.str("prompt", default="")
    check_fits_bound(limits.fewest_tokens(typed, backend), backend.n_ctx)   # kept whole
    extra = infill_prompt.parse_extra(body.get("input_extra"))
    n_batch = getattr(getattr(backend, "params", None), "n_batch", 512)
    tokens = infill_prompt.prompt_tokens(
        backend, texts["input_prefix"], texts["input_suffix"], typed, extra, n_batch,
        backend.n_ctx, min(backend.n_ctx, max(0, n_predict(f, settings, backend.n_ctx))),
        settings.spm_infill)
    return _finish(f, body, tokens, backend, settings, [], "completion")


def log_prompt(tokens: Sequence[int], backend: Any) -> None:
    """--verbose-prompt: the prompt's tokens, each with its text, as llama.cpp prints them."""
    def piece(t: int) -> str:
        try:
            raw = backend.detokenize([t], special=True)   # special tokens by their text
        except TypeError:                                  # a backend without the option
            raw = backend.detokenize([t])
        return raw.decode(errors="replace")

    pieces = (piece(t) for t in tokens)
    log.info("prompt: %d tokens: %s", len(tokens),
             " ".join(f"{t}:{p!r}" for t, p in zip(tokens, pieces, strict=True)))


def tokenize(body: dict, backend: Any) -> dict:
    """POST /tokenize: {content, add_special=false, parse_special=true, with_pieces=false}.

    Like a prompt, content may hold at most a context of tokens (-c): a text whose length
    alone proves more is refused before it is tokenized, as a completion's prompt is."""
    f = Fields(body)
    content = f.str("content")
    if content is None:
        raise bad_request("content: required")
    _check_within_context("content", limits.fewest_tokens(content, backend), backend.n_ctx,
                          "at least ")
    tokens = backend.tokenize(content, add_special=f.bool("add_special"),
                              parse_special=f.bool("parse_special", default=True))
    _check_within_context("content", len(tokens), backend.n_ctx)
    if not f.bool("with_pieces"):
        return {"tokens": tokens}
    pieces = []
    for t in tokens:
        raw = backend.detokenize([t])
        try:
            piece: Any = raw.decode("utf-8")
        except UnicodeDecodeError:
            piece = list(raw)
        pieces.append({"id": t, "piece": piece})
    return {"tokens": pieces}


def detokenize(body: dict, backend: Any) -> dict:
    """POST /detokenize: {tokens} -> {content}."""
    tokens = body.get("tokens")
    if tokens is None:
        raise bad_request("tokens: required")
    if not isinstance(tokens, list):
        raise bad_request(f"tokens: must be an array of token ids, got {_kind(tokens)}")
    _check_within_context("tokens", len(tokens), backend.n_ctx)
    ids = check_token_ids(tokens, backend.n_vocab, "tokens")
    return {"content": backend.detokenize(ids).decode("utf-8", errors="replace")}


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _kind(v: Any) -> str:
    """A JSON type name for messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int | float):
        return f"a number ({v})"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__
