"""Anthropic's /v1/messages and OpenAI's /v1/responses are lossless under speculation, for
every drafter kind: `specwire serve` on the bundled pair drafting (a) with the in-process
draft model, (b) through a draft node (--draft-url), (c) with the n-gram drafter
(--draft-ngram). On each route, greedy and seeded, the text (and its token count) equals
the same request's with `"speculative": false` (which both routes pass through to the chat
route), and the drafted answer's timings show drafts (draft_n > 0) where the plain one's
show none.

--draft-policy fixed with --draft-p-min 0: the drafters draft whatever this machine's speed
(the adaptive policy may decide on a slow machine that drafting does not pay, and draft
nothing). The prompt is a repeating pattern, which the bundled target copies, greedy and
seeded, so the n-gram lookup finds matches (on a prose question its answer repeats nothing
and the lookup drafts nothing); the seeded answers differ from the greedy ones and reject
some drafts, so rejections are verified too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import bundled
import httpx
import pytest
from serve_process import run_serve
from wire_helpers import node_process

pytestmark = pytest.mark.slow

PROMPT = "Continue the pattern: A B C A B C A B C A B C"
N = 12
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 1234}


@pytest.fixture(scope="module", params=["draft-model", "draft-node", "ngram"])
def server(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from specwire.assets import models
    bundled.target()
    models.default_draft()
    with contextlib.ExitStack() as stack:
        if request.param == "draft-model":
            drafting = ["-td", "1"]
        elif request.param == "draft-node":
            node = stack.enter_context(node_process(tmp_path_factory.mktemp("lossless-node")))
            drafting = ["-td", "1", "--draft-url", node.url]
        else:
            drafting = ["--draft-ngram"]
        url, _ = stack.enter_context(run_serve(
            "-t", "1", "-c", "512", "--draft-policy", "fixed", "--draft-p-min", "0",
            *drafting, no_traceback=True))
        yield url


def _messages(c: httpx.Client, sampling: dict, **extra) -> tuple[str, int, dict]:
    r = c.post("/v1/messages", json={
        "model": "gemma", "max_tokens": N, **sampling, **extra,
        "messages": [{"role": "user", "content": PROMPT}]})
    assert r.status_code == 200, r.text
    body = r.json()
    text = "".join(b["text"] for b in body["content"] if b["type"] == "text")
    return text, body["usage"]["output_tokens"], body["timings"]


def _responses(c: httpx.Client, sampling: dict, **extra) -> tuple[str, int, dict]:
    r = c.post("/v1/responses", json={
        "model": "gemma", "max_output_tokens": N, "store": False, **sampling, **extra,
        "input": PROMPT})
    assert r.status_code == 200, r.text
    body = r.json()
    text = "".join(p["text"] for i in body["output"] if i["type"] == "message"
                   for p in i["content"] if p["type"] == "output_text")
    return text, body["usage"]["output_tokens"], body["timings"]


def test_drafted_text_equals_plain_decoding(server: str) -> None:
    with httpx.Client(base_url=server, timeout=300) as c:
        for route in (_messages, _responses):
            for name, sampling in (("greedy", GREEDY), ("seeded", SEEDED)):
                case = f"{route.__name__[1:]} {name}"
                drafted, n_drafted, timings = route(c, sampling)
                plain, n_plain, plain_timings = route(c, sampling, speculative=False)
                print(f"{case}: {drafted!r}; drafted {timings.get('draft_n')}, "
                      f"kept {timings.get('draft_n_accepted')}")
                assert plain and drafted == plain, case
                assert n_drafted == n_plain, case
                assert timings.get("draft_n", 0) > 0, (case, timings)
                assert plain_timings.get("draft_n", 0) == 0, (case, plain_timings)
