"""Structured output stays lossless on the real bundled models.

A JSON schema (llama.cpp's grammar engine), presence/frequency penalties with a
logit bias, and the target's token probabilities: with every drafter and draft
length, greedy and seeded, the tokens (and the probabilities) equal plain
decoding under the same settings. The draft model follows the grammar itself;
the pipelined draft (its own thread), n-gram and random drafts do not and are
still exact, only less accepted.
"""

from __future__ import annotations

import json
from dataclasses import replace

import bundled
import pytest
from invariance_checks import LOGPROB_TOLERANCE, same_alternatives

from specwire.assets import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.drafters.random import RandomDrafter
from specwire.engine.engine import Engine, Request
from specwire.link.threaded import ThreadedDrafter
from specwire.sample.constraints import GrammarSpec, schema_grammar
from specwire.sample.logprobs import LogprobsSpec

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]

PROMPT = ("<start_of_turn>user\nDescribe a person named Ann, aged 31, who lives in Oslo, "
          "as JSON.<end_of_turn>\n<start_of_turn>model\n")
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}},
          "required": ["name", "age", "city"]}
N_PREDICT = 40
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.05, seed=77)
DRAFT_LENGTHS = (1, 3, 8)


def _two_lengths(i: int) -> tuple[int, ...]:
    """The i-th drafter's two of DRAFT_LENGTHS, taking turns: each drafter at two lengths,
    each length with most drafters (docs/testing.md: the cross product doubled the time)."""
    return tuple(DRAFT_LENGTHS[(i + j) % len(DRAFT_LENGTHS)] for j in range(2))


@pytest.fixture(scope="module")
def target() -> LlamaBackend:
    return LlamaBackend(ModelParams(str(bundled.target()), n_ctx=512))


@pytest.fixture(scope="module")
def drafters(target):
    p = ModelParams(str(models.default_draft()), n_ctx=512)
    return {"q2k": ModelDrafter(LlamaBackend(p, load_model(p))),
            "threaded": ThreadedDrafter(LlamaBackend(p, load_model(p))),
            "ngram": NgramDrafter(), "random": RandomDrafter(target.n_vocab)}


def run(target, drafter, sampling, k=4, grammar=None, logprobs=None, prompt=PROMPT):
    dp = DraftParams(n_max=k, p_min=0.0, enabled=drafter is not None)
    req = Request(target.tokenize(prompt, True, True), N_PREDICT, sampling, dp,
                  grammar=grammar, logprobs=logprobs)
    gen = Engine(target, drafter).generate(req)
    gen.run()
    return gen


@pytest.mark.parametrize("sampling", [
    pytest.param(GREEDY, id="greedy", marks=pytest.mark.extended),
    pytest.param(SEEDED, id="seeded")])
def test_json_schema_output_is_the_same_with_every_drafter(target, drafters, sampling):
    grammar = schema_grammar(SCHEMA)
    ref = run(target, None, sampling, grammar=grammar)
    doc = json.loads(target.detokenize(ref.tokens).decode())
    assert set(doc) == {"name", "age", "city"} and isinstance(doc["age"], int)
    for name, drafter in drafters.items():
        for k in DRAFT_LENGTHS:
            gen = run(target, drafter, sampling, k, grammar)
            assert gen.tokens == ref.tokens, (name, k)
            if name == "random":
                assert gen.stats.draft_n > 0
    # the draft model follows the grammar: its drafts are mostly kept
    gen = run(target, drafters["q2k"], sampling, 8, grammar)
    assert gen.stats.draft_n_accepted >= 0.5 * gen.stats.draft_n, gen.stats.to_dict()


def test_a_gbnf_grammar_shapes_greedy_output(target, drafters):
    grammar = GrammarSpec('root ::= "Answer: " ("yes" | "no") "."')
    ref = run(target, None, GREEDY, grammar=grammar)
    text = target.detokenize(ref.tokens).decode()
    assert text in ("Answer: yes.", "Answer: no.") and ref.stop_type == "eos"
    assert run(target, drafters["ngram"], GREEDY, 4, grammar).tokens == ref.tokens


@pytest.mark.parametrize("sampling", [
    pytest.param(GREEDY, id="greedy", marks=pytest.mark.extended),
    pytest.param(SEEDED, id="seeded")])
def test_penalties_and_logit_bias_are_lossless(target, drafters, sampling):
    banned = target.tokenize(" the", False, False)[0]
    s = replace(sampling, presence_penalty=0.6, frequency_penalty=0.4, repeat_penalty=1.1,
                logit_bias=((banned, float("-inf")),))
    prompt = "Write a short story about the sea and the wind:"
    ref = run(target, None, s, prompt=prompt)
    assert banned not in ref.tokens
    plain = run(target, None, sampling, prompt=prompt)
    assert plain.tokens != ref.tokens          # the settings do change the output
    for i, (name, drafter) in enumerate(drafters.items()):
        for k in _two_lengths(i):
            assert run(target, drafter, s, k, prompt=prompt).tokens == ref.tokens, (name, k)


@pytest.mark.parametrize("post", [False, True], ids=["pre", "post"])
def test_logprobs_are_the_targets_with_and_without_a_draft(target, drafters, post):
    spec = LogprobsSpec(n=5, post_sampling=post)
    ref = run(target, None, SEEDED, logprobs=spec)
    assert len(ref.probs) >= len(ref.tokens) > 0
    for name in ("q2k", "ngram"):
        gen = run(target, drafters[name], SEEDED, 4, logprobs=spec)
        assert gen.tokens == ref.tokens
        for a, b in zip(ref.probs[: len(ref.tokens)], gen.probs, strict=False):
            assert a.token == b.token
            assert abs(a.logprob - b.logprob) <= LOGPROB_TOLERANCE, (name, a, b)
            same_alternatives(a.top, b.top)


