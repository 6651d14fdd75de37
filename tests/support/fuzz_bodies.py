"""Hypothesis strategies of request bodies and paths for the server's fuzz tests (hostile
values, raw bytes, hostile constraints), and the check every answer must pass: no 5xx, an
error body naming the problem."""

from __future__ import annotations

import httpx
from hypothesis import strategies as st

POSTS = ["/completion", "/completions", "/v1/completions", "/v1/chat/completions",
         "/chat/completions", "/tokenize", "/detokenize", "/v1/messages",
         "/v1/messages/count_tokens", "/v1/responses"]


GETS = ["/health", "/v1/models", "/models", "/props", "/metrics", "/v1/models/x", "/nowhere"]


FIELDS = ["prompt", "messages", "content", "tokens", "n_predict", "max_tokens",
          "max_completion_tokens", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
          "repeat_last_n", "seed", "stop", "stream", "stream_options", "speculative",
          "speculative.n_max", "speculative.n_min", "speculative.p_min", "ignore_eos",
          "return_tokens", "n", "best_of", "logprobs", "n_probs", "echo", "model",
          "presence_penalty", "frequency_penalty", "response_format", "add_special",
          "parse_special", "with_pieces", "grammar", "tools", "json_schema", "tool_choice",
          "logit_bias", "system", "stop_sequences", "thinking", "input", "instructions",
          "max_output_tokens", "previous_response_id", "store", "text", "background"]


# Text with everything JSON can carry, lone surrogates included (json.dumps escapes them):
# generated text seldom draws one of the 2048 surrogates, so some are mixed in on purpose.
text = st.one_of(st.text(st.characters(codec=None, exclude_categories=()), max_size=40),
                 st.tuples(st.text(max_size=8), st.sampled_from(["\ud800", "\udfff", "\ud83d"]),
                           st.text(max_size=8)).map("".join))


extreme = st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63, 2**64 - 1, 2**64, -1, 0, 10**25,
                           10**400, -(10**400), 1e-46, 1e-300, 1e308, -1e308, 0.5])


numbers = st.one_of(st.integers(-3, 300), extreme, st.integers(),
                    st.floats(allow_nan=False, allow_infinity=False))


scalars = st.one_of(st.none(), st.booleans(), numbers, text)


values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.one_of(text, st.sampled_from(FIELDS)),
                                                 inner, max_size=5)), max_leaves=20)


# JSON nested deeper than any parser's patience, written inside a string (issue 23)
deep_text = st.builds(lambda n, o: (o[0] * n) + "1" * (o[0] == '{"a": ') + (o[1] * n),
                      st.integers(1, 6000), st.sampled_from([("[", "]"), ('{"a": ', "}")]))


counts = st.one_of(st.integers(0, 2100), st.sampled_from([30000, 10**7, -1, 2.5, "9", None]))


schemas = st.recursive(
    st.one_of(st.builds(lambda k, n: {"type": "string", k: n},
                        st.sampled_from(["minLength", "maxLength"]), counts),
              st.builds(lambda n: {"type": "string", "pattern": f"^a{{0,{n}}}$"}, counts),
              st.builds(lambda n: {"type": "string", "pattern": "^" + "(" * n + "a" + ")" * n
                                   + "$"}, st.integers(1, 3000)),
              st.fixed_dictionaries({"type": st.sampled_from(["integer", "boolean", "nah"])})),
    lambda inner: st.one_of(
        st.builds(lambda i, n: {"type": "array", "items": i, "maxItems": n}, inner, counts),
        st.builds(lambda p: {"type": "object", "properties": p},
                  st.dictionaries(st.sampled_from(["a", "b", "maxLength"]), inner, max_size=3)),
        st.builds(lambda a: {"anyOf": a}, st.lists(inner, max_size=3))), max_leaves=6)


grammars = st.one_of(
    st.builds(lambda n: "root ::= " + "(" * n + '"a"' + ")" * n, st.integers(1, 100_000)),
    st.builds(lambda n, m: f'root ::= "{"x" * n}"{{{m}}}', st.integers(1, 3000), counts),
    st.builds(lambda n: "\n".join(f"r{i} ::= r{i + 1} | r{i + 1}" for i in range(n))
              + f'\nr{n} ::= "a"', st.integers(1, 80)),
    st.builds(lambda n: "root ::= " + " ".join(['"a"'] * n), st.integers(1, 3000)), text)


tool_calls_ = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.one_of(st.just("f"), text, st.none(), numbers),
         "arguments": st.one_of(deep_text, text, values)})}),
    st.fixed_dictionaries({"function": st.one_of(text, numbers, st.none(), values)}),
    text, values), max_size=3)


messages = st.lists(st.one_of(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["system", "user", "assistant"]), text),
     "content": st.one_of(text, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text", "image_url"]), "text": text}), max_size=2), values,
         deep_text)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none(),
                           "tool_calls": st.one_of(tool_calls_, text, values)})),
    max_size=3)


# Anthropic's content blocks and the Responses API's items, right and wrong
blocks = st.lists(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": st.one_of(text, values)}),
    st.fixed_dictionaries({"type": st.just("tool_use"), "id": st.one_of(text, values),
                           "name": st.one_of(st.just("f"), text, values),
                           "input": st.one_of(values, st.dictionaries(text, values))}),
    st.fixed_dictionaries({"type": st.just("tool_result"),
                           "tool_use_id": st.one_of(st.just("f"), text, values),
                           "content": st.one_of(text, values, deep_text),
                           "is_error": st.one_of(st.booleans(), values)}),
    st.fixed_dictionaries({"type": st.sampled_from(["thinking", "image", "document"]),
                           "thinking": text}),
    values), max_size=3)


anthropic_messages = st.lists(st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "assistant"]), text),
     "content": st.one_of(text, blocks, values)}), max_size=3)


items = st.one_of(text, st.lists(st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "developer", "tool"]),
                           "content": st.one_of(text, values, st.lists(st.fixed_dictionaries(
                               {"type": st.sampled_from(["input_text", "input_image"]),
                                "text": text}), max_size=2))}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.one_of(text, values),
                           "name": st.one_of(st.just("f"), text, values),
                           "arguments": st.one_of(deep_text, text, values)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"),
                           "call_id": st.one_of(text, values),
                           "output": st.one_of(text, values, deep_text)}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "x"])}),
    values), max_size=3))


tools = st.lists(st.one_of(
    st.builds(lambda s: {"type": "function", "function": {"name": "f", "parameters": s}},
              schemas), values), max_size=2)


plausible = {
    "prompt": st.one_of(text, st.lists(st.one_of(st.integers(-5, 300000), text), max_size=6)),
    "messages": messages,
    "tokens": st.lists(st.one_of(st.integers(-5, 300000), numbers), max_size=6),
    "stop": st.one_of(text, st.lists(text, max_size=20)),
    "stream": st.booleans(),
    "speculative": st.one_of(st.booleans(), st.dictionaries(
        st.sampled_from(["n_max", "n_min", "p_min"]), numbers, max_size=3)),
    "json_schema": schemas,
    "grammar": grammars,
    "response_format": st.one_of(
        st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}},
                  schemas),
        st.builds(lambda s: {"type": "json_object", "schema": s}, schemas)),
    "tools": tools,
    "tool_choice": st.sampled_from(["auto", "required", "none", {"type": "any"},
                                    {"type": "tool", "name": "f"},
                                    {"type": "function", "name": "f"}]),
    "system": st.one_of(text, blocks),
    "stop_sequences": st.lists(text, max_size=20),
    "input": items,
    "thinking": st.one_of(st.fixed_dictionaries(
        {"type": st.sampled_from(["enabled", "disabled", "x"]), "budget_tokens": numbers}),
        values),
    "logit_bias": st.one_of(st.dictionaries(st.integers(0, 300000).map(str), numbers,
                                            max_size=5),
                            st.builds(lambda n: {str(i): 1 for i in range(n)},
                                      st.integers(290, 310))),
}


BASES = {"/tokenize": {"content": "Hello"}, "/detokenize": {"tokens": [2, 100]},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2},
         "/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
         "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
         "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
         "/v1/responses": {"input": "Hi", "max_output_tokens": 2}}


PROMPT_BASE = {"prompt": "Hello", "n_predict": 2, "temperature": 0}


@st.composite
def bodies(draw, path: str) -> dict:
    """A valid body for `path` with one to three fields changed, added or dropped: wrong
    values must meet the checks one at a time, not hide behind an earlier refusal."""
    body = dict(BASES.get(path, PROMPT_BASE))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.one_of(st.sampled_from(FIELDS), st.sampled_from(sorted(body) or FIELDS),
                             text))
        if draw(st.integers(0, 9)) == 0:
            body.pop(key, None)
        elif key in plausible and draw(st.booleans()):
            body[key] = draw(_plausible(path, key))
        else:
            body[key] = draw(st.one_of(numbers, text, values))
    return body


def _raw_bodies() -> st.SearchStrategy[bytes]:
    return st.one_of(
        st.binary(max_size=64),
        st.builds(lambda n: b"[" * n + b"]" * n, st.integers(1, 200_000)),
        st.builds(lambda d: b'{"prompt": "hi", "n_predict": ' + b"7" * d + b"}",
                  st.integers(1, 6000)),
        st.builds(lambda d: b'{"prompt": "hi", "top_p": 1' + b"0" * d + b"}",
                  st.integers(1, 6000)),
        # /tokenize and /detokenize past a context (-c 256) of tokens, by length or count
        st.builds(lambda n: b'{"content": "' + b"z " * n + b'", "with_pieces": true}',
                  st.integers(100, 400_000)),
        st.builds(lambda n: b'{"tokens": [' + b"9," * n + b'9]}', st.integers(100, 400_000)),
        st.sampled_from([b'{"prompt": NaN}', b'{"prompt": "hi", "temperature": -Infinity}',
                         b'{"prompt": "\\udfff"}', b'{"content": "\\ud800\\u0041"}',
                         b'{"prompt": "hi", "seed": 1e999}', b"\xef\xbb\xbf{}", b"null"]))


def _plausible(path: str, key: str) -> st.SearchStrategy:
    """A plausible value of `key` in `path`'s API: messages are blocks on Anthropic's route."""
    if key == "messages" and path.startswith("/v1/messages"):
        return anthropic_messages
    if key == "tools" and path.startswith("/v1/messages"):
        return st.lists(st.one_of(st.builds(lambda s: {"name": "f", "input_schema": s},
                                            schemas), values), max_size=2)
    if key == "tools" and path == "/v1/responses":
        return st.lists(st.one_of(st.builds(
            lambda s: {"type": "function", "name": "f", "parameters": s}, schemas), values),
            max_size=2)
    return plausible[key]


def _check(r: httpx.Response, what: str, path: str = "") -> None:
    """No 5xx, and an error body in the route's API's shape (Anthropic's on its routes)."""
    assert r.status_code < 500, f"{what} -> {r.status_code}: {r.text[:500]}"
    if r.status_code >= 400 and r.status_code != 499:
        if path.startswith("/v1/messages"):
            body = r.json()
            assert body["type"] == "error", r.text
            err = body["error"]
            assert err["message"] and err["type"], r.text
        else:
            err = r.json()["error"]
            assert err["code"] == r.status_code and err["message"] and err["type"], r.text
    assert '"server_error"' not in r.text and '"api_error"' not in r.text, \
        f"{what}: {r.text[:500]}"


segment = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E,
                                exclude_characters="?#%/"), min_size=1, max_size=12)


@st.composite
def constrained(draw) -> tuple[str, dict]:
    """A generation request carrying a hostile constraint or history (issue 23's shapes):
    huge repetition counts, deep nesting, long chains, malformed tool calls, nested JSON
    inside strings."""
    route = draw(st.sampled_from(["chat", "completion", "messages", "responses"]))
    if route == "messages":
        body = {"messages": draw(st.one_of(anthropic_messages, st.just(
            [{"role": "user", "content": "Hi"}]))), "max_tokens": 2}
        if draw(st.booleans()):
            body["tools"] = draw(_plausible("/v1/messages", "tools"))
            body["tool_choice"] = draw(st.sampled_from([{"type": "auto"}, {"type": "any"}]))
        return "/v1/messages", body
    if route == "responses":
        body = {"input": draw(st.one_of(items, st.just("Hi"))), "max_output_tokens": 2}
        if draw(st.booleans()):
            body["tools"] = draw(_plausible("/v1/responses", "tools"))
            body["tool_choice"] = draw(st.sampled_from(["auto", "required"]))
        else:
            body["text"] = {"format": {"type": "json_schema", "schema": draw(schemas)}}
        return "/v1/responses", body
    if route == "chat":
        body = {"messages": draw(st.one_of(messages, st.just(
            [{"role": "user", "content": "Hi"}]))), "max_tokens": 2}
        key = draw(st.sampled_from(["response_format", "tools", "messages"]))
        if key == "tools":
            body["tools"] = draw(tools)
            body["tool_choice"] = draw(st.sampled_from(["auto", "required"]))
        elif key == "response_format":
            body[key] = draw(plausible[key])
        return draw(st.sampled_from(["/v1/chat/completions", "/chat/completions"])), body
    body = dict(PROMPT_BASE)
    key = draw(st.sampled_from(["json_schema", "grammar", "response_format"]))
    body[key] = draw(plausible[key])
    return draw(st.sampled_from(["/completion", "/v1/completions"])), body
