"""Property: no body, however wrong, gets a 5xx, on the toy engine (fast, hypothesis).

support/fuzz_bodies.py's strategies against the app over support/toy_server.py's toy engine
(no model), in this process through Starlette's TestClient: the request checks are the
server's, whatever the engine. Derandomized and bounded, so the fast suite runs the same
examples every time in about a second; the slow file sends them, random and many, to a
real `specwire serve` on the bundled pair, draft node included.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from fuzz_bodies import GETS, POSTS, _check, _raw_bodies, bodies, constrained, segment
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from toy_server import ToyBackend

from specwire.config import SamplingParams
from specwire.drafters.base import NoDrafter
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app

FAST = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    """The toy app with the slow file's server flags: -n 4, --queue-size 8, a 1 MiB body;
    reached as localhost (TestClient's own host name would meet the Host check's 403)."""
    settings_ = ServerSettings(sampling=SamplingParams(temperature=0.0), n_predict=4,
                               queue_size=8, max_body=1 << 20)
    with TestClient(create_app(Engine(ToyBackend(delay=0.0), NoDrafter()), settings_),
                    base_url="http://localhost") as c:
        yield c


@settings(FAST, max_examples=15)
@given(path=st.sampled_from(POSTS), data=st.data())
def test_generated_bodies_never_get_a_5xx(http: TestClient, path: str, data) -> None:
    raw = json.dumps(data.draw(bodies(path))).encode()
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, f"POST {path} {raw[:300]!r}", path)


@FAST
@given(path=st.sampled_from(POSTS), raw=_raw_bodies())
def test_raw_bytes_never_get_a_5xx(http: TestClient, path: str, raw: bytes) -> None:
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, f"POST {path} {raw[:300]!r}", path)


@settings(FAST, max_examples=15)
@given(path=st.one_of(st.sampled_from(GETS),
                      st.lists(segment, max_size=3).map(lambda parts: "/" + "/".join(parts))))
def test_gets_never_get_a_5xx(http: TestClient, path: str) -> None:
    _check(http.get(path), f"GET {path}", path)


@settings(FAST, max_examples=25)
@given(case=constrained())
def test_hostile_constraints_never_get_a_5xx(http: TestClient, case) -> None:
    path, body = case
    raw = json.dumps(body).encode()
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    _check(r, f"POST {path} {raw[:300]!r}", path)
