"""Structured output over HTTP: `specwire serve` on the bundled pair, the official client.

JSON schema replies that validate and do not change with the draft on or off,
logprobs that are the target's with and without a draft, a GBNF grammar on
/completion, penalties and logit bias, and 400s that name the problem.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from invariance_checks import LOGPROB_TOLERANCE, same_alternatives
from serve_process import run_serve

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]   # the tests' fast target (bundled.py)

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe Ann, aged 31, as JSON with her name and age."}]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with run_serve("-t", "1", "-td", "1", "-c", "1024", "--draft-p-min", "0") as (url, _):
        yield url


@pytest.fixture(scope="module")
def oai(server: str):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=300) as c:
        yield c


def test_json_schema_reply_validates_and_is_the_same_without_a_draft(oai) -> None:
    import jsonschema
    fmt = {"type": "json_schema",
           "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    replies = []
    for extra in ({}, {"speculative": False}):
        r = oai.chat.completions.create(model=oai.models.list().data[0].id,
                                        messages=ASK, response_format=fmt, temperature=0,
                                        max_tokens=200, extra_body=extra)
        replies.append(r)
    text = replies[0].choices[0].message.content
    assert replies[0].choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert replies[1].choices[0].message.content == text
    assert replies[0].timings["draft_n"] > 0 and replies[1].timings["draft_n"] == 0
    # JSON mode: any object (the small model rambles on: a document cut at max_tokens)
    objs = [oai.chat.completions.create(model=oai.models.list().data[0].id, messages=ASK,
                                        response_format={"type": "json_object"}, temperature=0,
                                        max_tokens=40, extra_body=extra).choices[0]
            for extra in ({}, {"speculative": False})]
    assert objs[0].message.content.startswith("{")
    assert objs[0].message.content == objs[1].message.content


def test_logprobs_are_the_targets_with_and_without_a_draft(oai) -> None:
    model = oai.models.list().data[0].id
    got = []
    for extra in ({}, {"speculative": False}):
        r = oai.chat.completions.create(model=model, messages=ASK, temperature=0.8, seed=5,
                                        max_tokens=24, logprobs=True, top_logprobs=3,
                                        extra_body=extra)
        got.append(r.choices[0].logprobs.content)
    a, b = got
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x.token == y.token
        assert abs(x.logprob - y.logprob) <= LOGPROB_TOLERANCE
        assert len(x.top_logprobs) == 3 and x.logprob <= 0
        same_alternatives([(t.token, t.logprob) for t in x.top_logprobs],
                          [(t.token, t.logprob) for t in y.top_logprobs])
    # streamed deltas carry the same tokens' logprobs
    stream = oai.chat.completions.create(model=model, messages=ASK, temperature=0.8, seed=5,
                                         max_tokens=24, logprobs=True, top_logprobs=3,
                                         stream=True)
    streamed = [t for ch in stream for c in ch.choices if c.logprobs for t in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in a]
    comp = oai.completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                  temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and len(lp.top_logprobs[0]) == 2


def test_gbnf_grammar_and_n_probs_on_completion(http: httpx.Client) -> None:
    grammar = 'root ::= "The answer is " ("yes" | "no") "."'
    r = http.post("/completion", json={"prompt": "Is the sky blue?", "grammar": grammar,
                                       "n_predict": 20, "temperature": 0, "n_probs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] in ("The answer is yes.", "The answer is no.")
    assert body["stop_type"] == "eos"
    probs = body["completion_probabilities"]
    assert len(probs) == body["tokens_predicted"] and len(probs[0]["top_logprobs"]) == 2
    r = http.post("/completion", json={"prompt": "Is the sky blue?", "grammar": grammar,
                                       "n_predict": 20, "temperature": 0, "n_probs": 2,
                                       "post_sampling_probs": True})
    assert r.json()["completion_probabilities"][0]["prob"] == 1.0     # greedy: the argmax
    r = http.post("/completion", json={"prompt": "A number:", "n_predict": 12,
                                       "json_schema": {"type": "integer"}, "temperature": 0})
    assert r.json()["content"].strip().lstrip("-").isdigit()


def test_penalties_and_logit_bias(http: httpx.Client) -> None:
    base = {"prompt": "List the days of the week: Monday, Tuesday,", "n_predict": 16,
            "temperature": 0}
    plain = http.post("/completion", json=base).json()["content"]
    banned = http.post("/completion", json={**base, "logit_bias": [[" Wednesday", False]]})
    assert banned.status_code == 200 and "Wednesday" not in banned.json()["content"]
    assert "Wednesday" in plain
    pen = http.post("/completion", json={**base, "frequency_penalty": 1.5,
                                         "presence_penalty": 1.0}).json()
    assert pen["generation_settings"]["frequency_penalty"] == 1.5
    same = http.post("/completion", json={**base, "frequency_penalty": 1.5,
                                          "presence_penalty": 1.0, "speculative": False}).json()
    assert same["content"] == pen["content"]


BAD = [
    ({"grammar": "root ::= foo"}, "Undefined rule identifier 'foo'"),
    ({"json_schema": {"type": "nonsense"}}, "json_schema: unsupported or invalid JSON schema"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "string"}}, "only one constraint"),
    ({"n_probs": 1000}, "n_probs"),
    ({"logit_bias": {"999999999": 1}}, "outside the vocabulary"),
    ({"presence_penalty": 5}, "presence_penalty"),
]


@pytest.mark.parametrize("extra, message", BAD, ids=[m for _, m in BAD])
def test_bad_constraints_are_400_naming_the_problem(http, extra, message) -> None:
    r = http.post("/completion", json={"prompt": "hi", "n_predict": 4, **extra})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_bad_response_format_is_400(http) -> None:
    r = http.post("/v1/chat/completions", json={
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {}}})
    assert r.status_code == 400 and "response_format.json_schema.schema" in r.text
