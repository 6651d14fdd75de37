"""Issue 40's LoRA findings: a hostile client of a shared `serve --lora`.

1. A LoRA scale far beyond what an adapter is trained for (1e5) overflows the target's
   activations: NaN lands in the request's KV cells, and llama.cpp neither clears a
   removed sequence's cells nor leaves masked cells out of the attention product (0 x NaN),
   so every later request of every tenant got only token 0 or a 500. Scales are bounded
   (--lora-scale-max, in a request's `lora` and in POST /lora-adapters) and finite; and
   behind that bound, a decode whose logits are not finite drops its sequences' cells,
   zeroes the cache's buffers (the other sequences kept) and fails that request alone.
6. POST /lora-adapters read its body past every defence (Content-Type, --max-body's
   reader without --max-reading or --body-timeout, plain json.loads on the event loop):
   it now takes the path of every other POST route.

The bounds and the body path run on the toy engine (fast); the NaN defence on the tiny
MoE and its adapter (slow), in-process, one server for the module.
"""

from __future__ import annotations

import asyncio
import json
import socket
from types import SimpleNamespace

import httpx
import pytest
from toy_server import ToyBackend, serve_app

from specwire.config import SamplingParams
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app, limits, schemas

JSON = {"Content-Type": "application/json"}


class LoraToy(ToyBackend):
    """The toy with one LoRA adapter (llama.py's lora_scales and setters, no effect)."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.params = SimpleNamespace(loras=(("toy-lora.gguf", 1.0),))
        self.lora_scales = [1.0]
        self.applied: list[list[float]] = []

    def set_lora_scales(self, scales) -> None:
        self.lora_scales = [float(s) for s in scales]

    def apply_lora(self, scales) -> None:
        self.applied.append(list(scales))


def _app(**settings):
    s = ServerSettings(sampling=SamplingParams(temperature=0.0), **settings)
    engine = Engine(LoraToy())
    return create_app(engine, s), engine.target


@pytest.fixture(scope="module")
def toy():
    """One toy server (one adapter, scale 1) for every hostile body: each is refused
    before anything changes, and the test that changes the scale sets it back."""
    app, target = _app(max_body=5000, max_reading=9000, body_timeout_s=0.5)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client, target, url


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"]
    return err["message"]


# ---------------------------------------------------------------- 1: scales bounded, finite


@pytest.mark.parametrize("scale", [1e5, -1e5, 4.5, -4.01, 1e300])
def test_a_requests_lora_scale_beyond_the_bound_is_a_400(toy, scale) -> None:
    client, target, _ = toy
    r = client.post("/completion", json={"prompt": "ab", "n_predict": 2,
                                         "lora": [{"id": 0, "scale": scale}]})
    msg = _error(r, 400)
    assert "lora[0].scale" in msg and "--lora-scale-max" in msg
    assert target.lora_scales == [1.0]


@pytest.mark.parametrize("scale", [4, -4, 0.5, 0, 2.0])
def test_a_requests_lora_scale_within_the_bound_is_served(toy, scale) -> None:
    client, target, _ = toy
    r = client.post("/completion", json={"prompt": "ab", "n_predict": 2,
                                         "lora": [{"id": 0, "scale": scale}]})
    assert r.status_code == 200, r.text
    assert target.applied[-1] == [float(scale)]


HOSTILE = {
    "nan": b'[{"id": 0, "scale": NaN}]', "inf": b'[{"id": 0, "scale": Infinity}]',
    "-inf": b'[{"id": 0, "scale": -Infinity}]', "1e400": b'[{"id": 0, "scale": 1e400}]',
    "1e5": b'[{"id": 0, "scale": 1e5}]', "-5": b'[{"id": 0, "scale": -5}]',
    "bool": b'[{"id": 0, "scale": true}]', "str": b'[{"id": 0, "scale": "1"}]',
    "no-scale": b'[{"id": 0}]', "no-adapter": b'[{"id": 1, "scale": 1}]',
    "float-id": b'[{"id": 0.5, "scale": 1}]', "not-object": b"[0]",
    "object": b'{"id": 0}', "bad-json": b"[]]", "empty": b"",
    "deep": b"[" * 2400 + b"]" * 2400,
    "400-digit-id": b'[{"id": ' + b"9" * 400 + b', "scale": 1}]',
    "400-digit-scale": b'[{"id": 0, "scale": ' + b"9" * 400 + b"}]",
    "surrogate": b'[{"id": 0, "scale": 1, "x": "\\ud800"}]',
}


@pytest.mark.parametrize("raw", HOSTILE.values(), ids=HOSTILE.keys())
def test_post_lora_adapters_refuses_with_a_400_and_keeps_the_scale(toy, raw) -> None:
    """Before: NaN, Infinity and 1e400 (plain json.loads) were set as the scale, 1e5 too;
    deep nesting and a 400-digit integer were a 500 with a traceback."""
    client, target, _ = toy
    _error(client.post("/lora-adapters", content=raw, headers=JSON), 400)
    assert target.lora_scales == [1.0]
    assert client.get("/lora-adapters").json() == [
        {"id": 0, "path": "toy-lora.gguf", "scale": 1.0}]


def test_post_lora_adapters_within_the_bound_sets_the_scale(toy) -> None:
    client, target, _ = toy
    try:
        for scale in (4, -4, 0.25):
            r = client.post("/lora-adapters", json=[{"id": 0, "scale": scale}])
            assert r.status_code == 200 and r.json()[0]["scale"] == scale, r.text
            assert target.lora_scales == [scale]
    finally:
        client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}])
    assert target.lora_scales == [1.0]


def test_lora_scale_max_widens_the_bound() -> None:
    app, target = _app(lora_scale_max=1e6)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as client:
        r = client.post("/completion", json={"prompt": "ab", "n_predict": 2,
                                             "lora": [{"id": 0, "scale": 1e5}]})
        assert r.status_code == 200 and target.applied[-1] == [1e5], r.text
        r = client.post("/lora-adapters", json=[{"id": 0, "scale": -1e5}])
        assert r.status_code == 200 and target.lora_scales == [-1e5], r.text
        assert "1e+06" in _error(client.post("/lora-adapters",
                                             json=[{"id": 0, "scale": 2e6}]), 400)


def test_schemas_bound_the_scales_alone() -> None:
    backend = SimpleNamespace(lora_scales=[1.0, 1.0])
    assert schemas.lora_scales({"lora": [{"id": 1, "scale": -4}]}, backend) == (0.0, -4.0)
    with pytest.raises(schemas.ApiError, match="-4..4"):
        schemas.lora_scales({"lora": [{"id": 1, "scale": 4.5}]}, backend)
    assert schemas.lora_scales({"lora": [{"id": 0, "scale": 9}]}, backend, 10) == (9.0, 0.0)
    assert schemas.lora_adapter_scales([{"id": 1, "scale": 2}], [1.0, 0.5]) == [1.0, 2.0]
    for bad in ([{"id": 1, "scale": float("nan")}], [{"id": 1, "scale": 5}], {"id": 1}):
        with pytest.raises(schemas.ApiError):
            schemas.lora_adapter_scales(bad, [1.0, 0.5])


def test_serve_checks_lora_scale_max() -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve

    assert serve.LORA_SCALE_MAX == limits.LORA_SCALE_MAX
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    for argv, match in ((["--lora-scale-max", "-1"], "--lora-scale-max"),
                        (["--lora-scale-max", "inf"], "--lora-scale-max"),
                        (["--lora-scale-max", "nan"], "--lora-scale-max"),
                        (["--lora-scaled", "a.gguf:5"], "beyond --lora-scale-max 4")):
        args = parser.parse_args(["serve", "-m", "/nonexistent.gguf", *argv])
        with pytest.raises(CliError, match=match):
            args.func(args)
    a = parser.parse_args(["serve", "--lora-scale-max", "100"])
    assert a.lora_scale_max == 100.0


# ----------------------------------------------------- 6: POST /lora-adapters' body path


def test_post_lora_adapters_wants_json(toy) -> None:
    """A web page may POST text/plain anywhere without a preflight: 415, nothing set."""
    client, target, _ = toy
    for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
        r = client.post("/lora-adapters", content=b'[{"id": 0, "scale": 0}]',
                        headers={"Content-Type": ctype})
        assert "application/json" in _error(r, 415)
    assert target.lora_scales == [1.0]


def test_post_lora_adapters_body_over_max_body_is_413(toy) -> None:
    client, target, _ = toy
    big = b'[{"id": 0, "scale": 0}' + b" " * 6000 + b"]"
    assert "--max-body" in _error(client.post("/lora-adapters", content=big,
                                              headers=JSON), 413)

    def chunks():      # no Content-Length: counted as it arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]
    assert "--max-body" in _error(client.post("/lora-adapters", content=chunks(),
                                              headers=JSON), 413)
    assert target.lora_scales == [1.0]


def _slow_body(url: str, sent: bytes, declared: int) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    c = socket.create_connection((host, int(port)))
    c.sendall(b"POST /lora-adapters HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
              b"application/json\r\nContent-Length: " + str(declared).encode() +
              b"\r\n\r\n" + sent)
    return c


def _status(c: socket.socket) -> tuple[int, bytes]:
    c.settimeout(10)
    data = b""
    while b"}" not in data.partition(b"\r\n\r\n")[2]:
        chunk = c.recv(4096)
        if not chunk:
            break
        data += chunk
    c.close()
    return int(data.split(b" ", 2)[1]), data


def test_post_lora_adapters_bodies_count_in_max_reading_and_time_out(toy) -> None:
    """Two stalled uploads to /lora-adapters: whichever arrives second would pass
    --max-reading (503), the other runs out of --body-timeout (408). Before: neither
    applied here."""
    _, target, url = toy
    stalled = [_slow_body(url, b" " * 4800, 5000) for _ in range(2)]
    answers = sorted(_status(c) for c in stalled)
    assert [status for status, _ in answers] == [408, 503], answers
    assert b"--body-timeout" in answers[0][1] and b"--max-reading" in answers[1][1]
    assert target.lora_scales == [1.0]


def test_post_lora_adapters_parses_off_the_event_loop(toy, monkeypatch) -> None:
    client, _, _ = toy
    where = []
    parse = schemas.parse_json

    def spy(raw, kind=dict):
        try:
            asyncio.get_running_loop()
            where.append("event loop")
        except RuntimeError:
            where.append("worker thread")
        return parse(raw, kind)

    monkeypatch.setattr(schemas, "parse_json", spy)
    r = client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}])
    assert r.status_code == 200 and where == ["worker thread"], (r.text, where)


# ------------------------------------------- 1: non-finite logits, on llama.cpp (slow)


PROMPT = [2, 1000, 2000, 3000, 4000, 5000]
PLAIN = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "speculative": False,
         "return_tokens": True}


def _ask(client: httpx.Client, key: str, **body) -> httpx.Response:
    return client.post("/completion", json=body, headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def moe_server():
    """The tiny MoE with its adapter, two slots, keys A and B, the scale bound widened so
    that an overflowing scale reaches llama.cpp: the defence behind the bound. Flash
    attention off: the CPU flash-attention kernel skips masked cells, the plain
    attention path (and GPU kernels) multiplies them in, which is how NaN spreads."""
    from specwire.assets.moe import MoeSpec, ensure_moe, ensure_moe_lora
    from specwire.backend.llama import LlamaBackend
    from specwire.config import ModelParams

    pair, lora = ensure_moe(MoeSpec()), str(ensure_moe_lora(MoeSpec()))
    target = LlamaBackend(ModelParams(str(pair.target), n_ctx=128, n_threads=1,
                                      flash_attn="off", loras=((lora, 1.0),)), n_seq=2)
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0), api_key="A,B",
                              lora_scale_max=1e6)
    try:
        with serve_app(create_app(Engine(target), settings)) as url, \
                httpx.Client(base_url=url, timeout=120) as client:
            first = _ask(client, "A", **PLAIN, cache_prompt=False)   # before any attack
            assert first.status_code == 200, first.text
            assert len(set(first.json()["tokens"])) > 1
            yield client, target, first.json()["tokens"]
    finally:
        target.close()


@pytest.mark.slow
def test_an_overflowing_lora_scale_fails_its_request_alone(moe_server) -> None:
    """Key B's request at scale 1e5 (within the widened bound) gets a 500 of its own;
    key A's requests before and after get the same tokens (its cache, in the other slot,
    kept through the scrub and reused), a sampled one a 200, /lora-adapters' scale is
    untouched. Before: B got a 200 of garbage and A only token 0 (greedy) or a 500."""
    client, target, want = moe_server
    before = _ask(client, "A", **PLAIN)     # A's prompt in a slot's cache
    assert before.status_code == 200 and before.json()["tokens"] == want, before.text
    hostile = _ask(client, "B", prompt=[2, 7000, 8000, 9000], n_predict=6, temperature=0,
                   speculative=False, cache_prompt=False, lora=[{"id": 0, "scale": 1e5}])
    after = _ask(client, "A", **PLAIN)
    fresh = _ask(client, "A", **PLAIN, cache_prompt=False)
    sampled = _ask(client, "A", prompt=PROMPT, n_predict=6, temperature=0.8, seed=3)
    assert after.status_code == 200 and after.json()["tokens"] == want, after.text
    assert fresh.status_code == 200 and fresh.json()["tokens"] == want, fresh.text
    assert sampled.status_code == 200, sampled.text
    msg = _error(hostile, 500)
    assert "inf/NaN" in msg and "cache was dropped" in msg
    assert after.json()["timings"]["cache_n"] > 0        # A's cache survived the scrub
    assert _ask(client, "B", **PLAIN).json()["tokens"] == want
    assert target.lora_scales == [1.0]


@pytest.mark.slow
def test_an_overflowing_server_scale_is_answered_and_set_back(moe_server) -> None:
    """POST /lora-adapters to 1e5 (within the widened bound): every request then fails
    with a 500 (not a 200 of zeros); back at 1.0 the answers are the baseline again.
    Before: after the reset to 1.0 the answers were still zeros."""
    client, target, want = moe_server
    auth = {"Authorization": "Bearer B"}
    try:
        r = client.post("/lora-adapters", json=[{"id": 0, "scale": 1e5}], headers=auth)
        assert r.status_code == 200, r.text
        at_1e5 = _ask(client, "A", **PLAIN)
    finally:
        client.post("/lora-adapters", json=[{"id": 0, "scale": 1.0}], headers=auth)
    for key in ("A", "B"):
        r = _ask(client, key, **PLAIN)
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
    assert "inf/NaN" in _error(at_1e5, 500)


def test_the_toy_stays_json(toy) -> None:     # the module's server still serves
    client, _, _ = toy
    r = client.post("/completion", content=json.dumps({"prompt": "ab", "n_predict": 2}),
                    headers=JSON)
    assert r.status_code == 200, r.text
