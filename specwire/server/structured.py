"""The request fields that shape sampling beyond llama.cpp's basic knobs.

* grammar (GBNF) and json_schema on /completion, response_format (json_object,
  json_schema) on the OpenAI endpoints -> one GrammarSpec, compiled here once
  so that an invalid one is a 400 naming the field before the request queues;
* presence_penalty, frequency_penalty and logit_bias (OpenAI's {"id": bias}
  object, or llama-server's [[id or "text", bias or false], ...]);
* logprobs/top_logprobs (chat), logprobs (completions), n_probs and
  post_sampling_probs (/completion) -> a LogprobsSpec.
"""

from __future__ import annotations

import math
from typing import Any

from specwire.config import ConfigError
from specwire.sample.constraints import JSON_OBJECT, Grammar, GrammarSpec, schema_grammar
from specwire.sample.logprobs import MAX_N_PROBS, LogprobsSpec
from specwire.server.errors import bad_request
from specwire.server.limits import MAX_LOGIT_BIAS

#: OpenAI's limits: top_logprobs up to 20 (chat), logprobs up to 5 (completions).
MAX_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5


def grammar_spec(body: dict, backend: Any, tool_grammar: GrammarSpec | None = None,
                 default: GrammarSpec | None = None) -> GrammarSpec | None:
    """The request's constraint, if any, checked by compiling it for the model.

    tool_grammar: the constraint of a forced tool call (tool_calls.py), which
    cannot be combined with another one. default: the server's --grammar or
    --json-schema, for a request with neither (compiled once at startup).
    """
    spec = _spec(body)
    if spec is not None and tool_grammar is not None:
        raise bad_request(f"{spec.origin} and tool_choice: a forced tool call cannot be "
                          "combined with another constraint")
    spec = spec or tool_grammar
    if spec is None:
        return default
    try:
        Grammar.for_backend(spec, backend).close()
    except ConfigError as e:
        raise bad_request(str(e)) from None
    return spec


def _spec(body: dict) -> GrammarSpec | None:
    given = [n for n in ("grammar", "json_schema", "response_format")
             if body.get(n) not in (None, "", {})]
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in
                                (None, "text", "json_object", "json_schema")):
        raise bad_request('response_format: must be {"type": "text"}, {"type": "json_object"} '
                          'or {"type": "json_schema", "json_schema": {"schema": {...}}}')
    if isinstance(fmt, dict) and fmt.get("type") in (None, "text"):
        given = [n for n in given if n != "response_format"]
    if len(given) > 1:
        raise bad_request(f"{given[0]} and {given[1]}: give only one constraint per request")
    if not given:
        return None
    name = given[0]
    value = body[name]
    try:
        if name == "grammar":
            if not isinstance(value, str):
                raise bad_request("grammar: must be a string (GBNF)")
            return GrammarSpec(value, "root", "grammar")
        if name == "json_schema":
            return schema_grammar(value, "json_schema")
        if value.get("type") == "json_object":
            schema = value.get("schema")   # llama-server also takes a schema here
            return schema_grammar(schema, "response_format.schema") if schema else JSON_OBJECT
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict):
            raise bad_request("response_format.json_schema.schema: required, a JSON schema object")
        return schema_grammar(inner["schema"], "response_format.json_schema.schema")
    except ConfigError as e:
        raise bad_request(str(e)) from None


def penalties(body: dict, backend: Any, max_bias: int = MAX_LOGIT_BIAS) -> dict[str, Any]:
    """SamplingParams changes for presence/frequency penalties and logit_bias."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise bad_request(f"{name}: must be a number")
        out[name] = float(v)
    bias = body.get("logit_bias")
    if bias:
        out["logit_bias"] = logit_bias(bias, backend, max_bias)
    return out


def logit_bias(value: Any, backend: Any,
               max_bias: int = MAX_LOGIT_BIAS) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} or llama-server's [[id | "text", bias | false], ...].

    A text entry biases every token of the text; false bans (bias -inf). At most
    max_bias entries, and as many tokens once texts are tokenized: every sampled token
    of the request pays for each, on the target and on a draft node.
    """
    if isinstance(value, dict | list) and len(value) > max_bias:
        raise bad_request(f"logit_bias: {len(value)} entries, at most {max_bias} "
                          "(serve --logit-bias-max)")
    if isinstance(value, dict):
        pairs = list(value.items())
    elif isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise bad_request('logit_bias: must be an object {"token id": bias} or an array of '
                          '[token id or text, bias or false] pairs')
    merged: dict[int, float] = {}
    for key, bias in pairs:
        if bias is False:
            b = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, int | float):
            raise bad_request(f"logit_bias[{key!r}]: the bias must be a number or false")
        else:
            b = float(bias)
        for t in _bias_tokens(key, backend):
            merged[t] = b
        if len(merged) > max_bias:
            raise bad_request(f"logit_bias: its texts are more than {max_bias} tokens "
                              "(serve --logit-bias-max)")
    return tuple(sorted(merged.items()))


def _bias_tokens(key: Any, backend: Any) -> list[int]:
    if isinstance(key, str) and key.lstrip("-").isdigit():
        key = int(key)
    if isinstance(key, int) and not isinstance(key, bool):
        if not 0 <= key < backend.n_vocab:
            raise bad_request(f"logit_bias: token id {key} is outside the vocabulary "
                              f"(0..{backend.n_vocab - 1})")
        return [key]
    if isinstance(key, str) and key:
        return backend.tokenize(key, add_special=False, parse_special=False)
    raise bad_request(f"logit_bias: {key!r} is neither a token id nor a text")


def logprobs_spec(body: dict, dialect: str) -> LogprobsSpec | None:
    """What probabilities the request wants; dialect: "chat", "completions" or "llama"."""
    def count(name: str, limit: int) -> int:
        v = body.get(name)
        if v is None:
            return 0
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
            raise bad_request(f"{name}: must be an integer in [0, {limit}]")
        return v

    if dialect == "chat":
        on = body.get("logprobs")
        if on not in (None, True, False):
            raise bad_request("logprobs: must be true or false")
        n = count("top_logprobs", MAX_TOP_LOGPROBS)
        if n and not on:
            raise bad_request("top_logprobs: needs logprobs: true")
        return LogprobsSpec(n) if on else None
    if dialect == "completions":
        v = body.get("logprobs")
        if v is None or v is False:
            return None
        return LogprobsSpec(count("logprobs", MAX_COMPLETION_LOGPROBS))
    n = count("n_probs", MAX_N_PROBS)
    post = body.get("post_sampling_probs", False)
    if not isinstance(post, bool):
        raise bad_request("post_sampling_probs: must be true or false")
    return LogprobsSpec(n, post) if n else None
