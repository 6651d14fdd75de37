"""Property: no body, however wrong, gets a 5xx from `specwire serve` (hypothesis).

A real server on the bundled pair (-c 256, -n 4 so generations stay short) is sent
generated requests on every endpoint: bodies built from the API's field names with
values of every JSON type (right, wrong, huge, nested, lone surrogates written as
JSON escapes), raw byte strings, and GETs; and generation requests with hostile
constraints and histories (JSON schemas and GBNF with huge repetition counts, deep
nesting and long rule chains, malformed assistant tool_calls, JSON nested thousands deep
inside strings). Every answer must be below 500, an error must have the OpenAI-style
body, and a stream must not carry a server error.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator

import bundled
import httpx
import pytest
from fuzz_bodies import GETS, POSTS, _check, _raw_bodies, bodies, constrained, segment
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_process import run_serve
from wire_helpers import node_process

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]
EXAMPLES = int(os.environ.get("SPECWIRE_FUZZ_EXAMPLES", "150"))


@pytest.fixture(scope="module", params=[
    pytest.param("local-draft", marks=pytest.mark.extended), "draft-node"])
def server(request, tmp_path_factory) -> Iterator[str]:
    """The bundled pair, drafting in-process, or through a draft node (sampling settings
    then cross the link as protobuf fields: what they cannot hold must be a 400 first)."""
    from specwire.assets import models
    bundled.target()
    models.default_draft()
    with contextlib.ExitStack() as stack:
        draft = []
        if request.param == "draft-node":
            node = stack.enter_context(node_process(tmp_path_factory.mktemp("fuzz-node")))
            draft = ["--draft-url", node.url]
        yield stack.enter_context(_serve(draft))


@contextlib.contextmanager
def _serve(draft: list[str]) -> Iterator[str]:
    with run_serve("-t", "1", "-td", "1", "-c", "256", "-n", "4", "--queue-size", "8",
                   "--max-body", str(1 << 20), *draft, no_traceback=True) as (url, _):
        yield url


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=120) as c:
        yield c


FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(path=st.sampled_from(POSTS), data=st.data())
def test_generated_bodies_never_get_a_5xx(http: httpx.Client, path: str, data) -> None:
    # json.dumps keeps ensure_ascii: a lone surrogate goes out as its \\udXXX escape
    raw = json.dumps(data.draw(bodies(path))).encode()
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, f"POST {path} {raw[:300]!r}", path)


@FUZZ
@given(path=st.sampled_from(POSTS), raw=_raw_bodies())
def test_raw_bytes_never_get_a_5xx(http: httpx.Client, path: str, raw: bytes) -> None:
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, f"POST {path} {raw[:300]!r}", path)


@settings(max_examples=max(10, EXAMPLES // 4), deadline=None)
@given(path=st.one_of(st.sampled_from(GETS),
                      st.lists(segment, max_size=3).map(lambda parts: "/" + "/".join(parts))))
def test_gets_never_get_a_5xx(http: httpx.Client, path: str) -> None:
    _check(http.get(path), f"GET {path}", path)


@FUZZ
@given(case=constrained())
def test_hostile_constraints_never_get_a_5xx(http: httpx.Client, case) -> None:
    path, body = case
    raw = json.dumps(body).encode()
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, f"POST {path} {raw[:300]!r}", path)
