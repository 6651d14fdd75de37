"""What a request may hold (server/limits.py) and the figures of /metrics, over real HTTP.

The app runs in-process under uvicorn over the toy engine of support/toy_server.py (no
model needed): every hostile body below must get one 4xx with an OpenAI-style
error body naming the problem, never a 500; the server's limits answer before
the work they guard (a full queue before the body is parsed, an obviously
too long prompt before it is tokenized).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from toy_server import SpyDrafter, ToyBackend, _ignore, _metric, _sse, serve_app

from specwire.backend import llama
from specwire.config import SamplingParams
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app
from specwire.server.metrics import parse_figures

JSON = {"Content-Type": "application/json"}


def _toy_app(**settings):
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0), **settings)
    return create_app(Engine(ToyBackend(), SpyDrafter()), settings)


@pytest.fixture
def toy_url():
    app = _toy_app(queue_size=1)
    with serve_app(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def shared_toy():
    """One server and client for every hostile body: each is refused before any work, so
    none leaves anything behind (a server and a client each cost the fast suite seconds)."""
    with serve_app(_toy_app(queue_size=1)) as url, httpx.Client(base_url=url) as client:
        yield client


def _error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    return err["message"]


def test_body_over_the_cap_is_413_declared_or_streamed() -> None:
    with serve_app(_toy_app(max_body=4096)) as url:
        _body_over_the_cap(url)


def _body_over_the_cap(url: str) -> None:
    big = json.dumps({"prompt": "a" * 5000}).encode()
    msg = _error(httpx.post(url + "/completion", content=big, headers=JSON), 413)
    assert "4096 bytes" in msg and "--max-body" in msg

    def chunks():          # no Content-Length: the cap is counted as the body arrives
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]
    assert "--max-body" in _error(httpx.post(url + "/v1/completions", content=chunks(),
                                             headers=JSON), 413)
    assert httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 2}).status_code \
        == 200


def _history(call: object) -> bytes:
    """A chat body whose assistant turn holds `call` as its one tool call."""
    return json.dumps({"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "1", "content": "ok"}], "max_tokens": 2}).encode()


HOSTILE = [
    # (path, raw body, status, what the message must name)
    ("/completion", b'{"prompt": "z", "n_predict": ' + b"9" * 5000 + b"}", 400, "digits"),
    ("/completion", b"[" * 50_000 + b"]" * 50_000, 400, "nested deeper"),
    ("/completion", b'{"prompt": "z", "x": ' + b"[" * 40 + b"]" * 40 + b"}", 400,
     "nested deeper"),
    ("/completion", b'{"prompt": "z", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature"),
    ("/completion", b'{"prompt": "z", "temperature": 1e400}', 400, "out of range"),
    ("/completion", b'{"prompt": "z", "top_p": NaN}', 400, "NaN"),
    ("/completion", b'{"prompt": "\\ud800 lone"}', 400, "surrogate"),
    ("/completion", b'{"prompt": "z", "stop": ["ok", "\\udfff"]}', 400, "stop[1]"),
    ("/v1/chat/completions",
     b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', 400, "messages[0].content"),
    ("/v1/completions", b'{"prompt": "z", "model": "\\ud800"}', 400, "model"),
    ("/tokenize", b'{"content": "\\udc00"}', 400, "content"),
    ("/completion", b'{"prompt": "z", "x": {"\\ud800": 1}}', 400, "x.<key>"),
    ("/completion", b'{"prompt": "z", "top_k": 4294967296}', 400, "top_k"),
    ("/completion", b'{"prompt": "z", "top_k": 2147483648}', 400, "top_k"),
    ("/completion", b'{"prompt": "z", "repeat_last_n": 2147483648}', 400, "repeat_last_n"),
    ("/completion", b'{"prompt": "z", "n_predict": 2147483648}', 400, "n_predict"),
    ("/completion", b'{"prompt": "z", "seed": 18446744073709551616}', 400, "seed"),
    ("/completion", b'{"prompt": "z", "top_p": 1e-50}', 400, "float32"),
    ("/completion", b'{"prompt": "z", "repeat_penalty": 1e-46}', 400, "repeat_penalty"),
    ("/completion", b'{"prompt": "z", "logit_bias": {"97": 1e39}}', 400, "logit bias"),
    ("/completion", json.dumps({"prompt": "z", "stop": ["s"] * 17}).encode(), 400, "at most 16"),
    ("/completion", json.dumps({"prompt": "z", "stop": "s" * 513}).encode(), 400, "stop[0]"),
    ("/completion", json.dumps({"prompt": [5] * 5000}).encode()[:4000], 400, "invalid JSON"),
    ("/completion", b'{"prompt": "z", "n_predict": ' + b"1" * 4000 + b"}", 400, "n_predict"),
    ("/detokenize", b'{"tokens": [1, 18446744073709551616]}', 400, "tokens[1]"),
    # earlier tool calls in a chat history (issue 23: each was a 500 with a traceback)
    ("/v1/chat/completions", _history({"type": "function", "function": {
        "name": "f", "arguments": "[" * 5000 + "]" * 5000}}), 400,
     "messages[1].tool_calls[0].function.arguments: nested deeper"),
    ("/v1/chat/completions", _history({"type": "function", "function": {
        "name": "f", "arguments": '{"a": ' * 70 + "1" + "}" * 70}}), 400,
     "messages[1].tool_calls[0].function.arguments: nested deeper"),
    ("/v1/chat/completions", _history({"type": "function", "function": "x"}), 400,
     "messages[1].tool_calls[0].function: must be an object"),
    ("/v1/chat/completions", _history({"type": "function", "function": {"arguments": "{}"}}),
     400, "messages[1].tool_calls[0].function.name: required"),
    ("/v1/chat/completions", _history("call"), 400, "messages[1].tool_calls[0]: must be"),
    ("/v1/chat/completions", _history({"function": {"name": "f", "arguments": 5}}), 400,
     "messages[1].tool_calls[0].function.arguments: must be"),
]


@pytest.mark.parametrize("path, raw, status, names", HOSTILE,
                         ids=[f"{p}:{n}" for p, _, _, n in HOSTILE])
def test_hostile_bodies_get_one_clear_4xx(shared_toy, path: str, raw: bytes, status: int,
                                          names: str) -> None:
    r = shared_toy.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert names in _error(r, status)


def test_long_prompt_refused_by_its_length_before_tokenizing() -> None:
    """A text prompt whose bytes alone prove it cannot fit (each toy token is one byte)
    is refused with the exceed-context error, saying "at least"; token ids likewise."""
    with serve_app(_toy_app()) as url:
        for prompt in ("z" * 9000, [97] * 4097):
            r = httpx.post(url + "/completion", json={"prompt": prompt})
            assert "at least" in _error(r, 400)
            assert r.json()["error"]["type"] == "exceed_context_size_error"


def test_tokenize_and_detokenize_take_at_most_a_context(toy_url) -> None:
    """/tokenize refuses content longer than a context (-c) of tokens, by its length before
    tokenizing when that proves it, else by its count; /detokenize more ids than that."""
    url, app = toy_url
    n_ctx = 4096   # ToyBackend's: one token per byte
    for content, bound in (("z" * 9000, "at least "), ("z" * (n_ctx + 1), "")):
        r = httpx.post(url + "/tokenize", json={"content": content, "with_pieces": True})
        assert f"content: {bound}" in _error(r, 400)
        assert r.json()["error"]["type"] == "exceed_context_size_error"
    r = httpx.post(url + "/detokenize", json={"tokens": [97] * (n_ctx + 1)})
    assert "tokens: 4097 tokens" in _error(r, 400)
    r = httpx.post(url + "/tokenize", json={"content": "z" * n_ctx})
    assert r.status_code == 200 and len(r.json()["tokens"]) == n_ctx
    r = httpx.post(url + "/detokenize", json={"tokens": [97] * n_ctx})
    assert r.status_code == 200 and r.json()["content"] == "a" * n_ctx


def test_full_queue_answers_429_before_reading_the_body(toy_url) -> None:
    url, _ = toy_url
    long = {"prompt": "z", "n_predict": 3000, "stream": True}
    with httpx.stream("POST", url + "/completion", json=long, timeout=10) as running:
        events = _sse(running.iter_lines())
        next(events)                                     # the slot is busy
        waiting = threading.Thread(target=lambda: _ignore(httpx.post, url + "/completion",
                                                          json={"prompt": "z"}, timeout=0.6))
        waiting.start()
        deadline = time.monotonic() + 3
        while _metric(url, "requests_deferred") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        # the queue is full: refused as busy even though the body is not JSON at all
        r = httpx.post(url + "/completion", content=b"{not json", timeout=5)
        assert _error(r, 429) and r.json()["error"]["type"] == "rate_limit_error"
        waiting.join()


def test_metrics_histograms_process_and_python_figures(toy_url) -> None:
    url, app = toy_url
    for n in (1, 5):
        assert httpx.post(url + "/completion", json={"prompt": "z", "n_predict": n}).json()[
            "content"]
    text = httpx.get(url + "/metrics").text
    figures = parse_figures(text)
    assert figures["specwire:time_to_first_token_seconds_count"] == 2
    assert figures["specwire:time_per_output_token_seconds_count"] == 1   # n=1 has none
    assert figures["specwire:round_duration_seconds_count"] == 4          # 5 tokens, 1/round
    assert figures["specwire:requests_total{endpoint=\"/completion\"}"] == 2
    assert figures["process_resident_memory_bytes"] > 1e6
    assert figures["process_open_fds"] > 0
    # the toy engine opens no llama.cpp context: the gauge shows only other tests' contexts
    assert figures['specwire:contexts_open{side="target"}'] == llama.open_contexts()
    # Python threads by name, digits left out: the batch thread, the server's own
    assert figures['specwire:threads{name="batch"}'] >= 1
    assert figures['specwire:threads{name="MainThread"}'] == 1
    assert "# TYPE specwire:requests_total counter" in text
    live = app.state.metrics.figures()          # the same figures as Python numbers
    for key in ("specwire:tokens_predicted_total", "specwire:time_to_first_token_seconds_count",
                'specwire:requests_finished_total{outcome="limit"}'):
        assert live[key] == figures[key], key


def test_max_body_flag_is_checked() -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "-m", "/nonexistent.gguf", "--max-body", "0"])
    with pytest.raises(CliError, match="--max-body"):
        args.func(args)
    assert parser.parse_args(["serve"]).max_body == 8 << 20


def test_post_bodies_must_hold_json(shared_toy) -> None:
    """As llama-server, a generation route reads a body typed text/plain, form-urlencoded or
    untyped (curl -d) as JSON; other types are 415. The state-changing admin routes take
    application/json only (test_llama_server_semantics.py)."""
    body = json.dumps({"prompt": "z", "n_predict": 1}).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": ctype} if ctype else {}
        r = shared_toy.post("/completion", content=body, headers=headers)
        assert r.status_code == 200, (ctype, r.text)
    r = shared_toy.post("/completion", content=body, headers={"Content-Type":
                                                              "multipart/form-data"})
    assert "Content-Type: must be application/json" in _error(r, 415)
    r = shared_toy.post("/completion", content=b"prompt=z", headers={"Content-Type": "text/plain"})
    assert "invalid JSON" in _error(r, 400)
    r = shared_toy.post("/completion", content=body,
                        headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200


def test_host_must_be_an_address_localhost_or_allowed_without_a_key() -> None:
    """DNS rebinding: a page on evil.example, its name pointed at this server, sends
    Host: evil.example. Without --api-key that is a 403; addresses, localhost and
    --allowed-host names pass; with a key nothing is checked (the key is the guard)."""
    body = {"prompt": "z", "n_predict": 1}
    with serve_app(_toy_app(allowed_hosts=("llm.lan",))) as url:
        for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "llm.lan.x"):
            r = httpx.post(url + "/completion", json=body, headers={"Host": host})
            assert "is not this server's" in _error(r, 403), host
            assert httpx.get(url + "/props", headers={"Host": host}).status_code == 403
        for host in ("127.0.0.1:8080", "localhost", "LOCALHOST:1", "[::1]:8080", "10.0.0.7",
                     "llm.lan", "llm.lan:8080", "a.localhost"):
            assert httpx.post(url + "/completion", json=body,
                              headers={"Host": host}).status_code == 200, host
        assert httpx.get(url + "/health", headers={"Host": "evil.example"}).status_code == 200
    with serve_app(_toy_app(api_key="k")) as url:
        r = httpx.post(url + "/completion", json=body,
                       headers={"Host": "evil.example", "Authorization": "Bearer k"})
        assert r.status_code == 200


def test_logit_bias_is_capped_and_converted_once() -> None:
    from specwire.sample.sampling import bias_arrays

    many = {str(i): 1.0 for i in range(301)}
    with serve_app(_toy_app()) as url:
        r = httpx.post(url + "/completion", json={"prompt": "z", "logit_bias": many})
        assert "logit_bias: 301 entries, at most 300" in _error(r, 400)
    many = {str(i): 1.0 for i in range(11)}       # the toy vocabulary has 128 tokens
    with serve_app(_toy_app(logit_bias_max=10)) as url:   # a text entry counts its tokens
        assert "at most 10 (serve --logit-bias-max)" in _error(
            httpx.post(url + "/completion", json={"prompt": "z", "logit_bias": many}), 400)
        ok = {str(i): 1.0 for i in range(10)}
        assert httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 1,
                                                     "logit_bias": ok}).status_code == 200
        r = httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 1,
                                                  "logit_bias": [["abcdefghijkl", 1]]})
        assert "logit_bias: its texts are more than 10 tokens" in _error(r, 400)
    bias = tuple((i, 0.5) for i in range(50))
    ids, values = bias_arrays(bias)
    again = bias_arrays(bias)
    assert again[0] is ids and again[1] is values and ids.tolist() == list(range(50))
    assert bias_arrays(tuple(bias))[0] is ids          # the same tuple object
    other = bias_arrays(tuple((i, 0.5) for i in range(50)))
    assert other[0] is not ids and other[0].tolist() == ids.tolist()


def test_new_serve_flags_are_checked() -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "-m", "/nonexistent.gguf", "--logit-bias-max", "-1"])
    with pytest.raises(CliError, match="--logit-bias-max"):
        args.func(args)
    a = parser.parse_args(["serve", "--allowed-host", "a.lan", "--allowed-host", "b.lan"])
    assert a.allowed_host == ["a.lan", "b.lan"] and a.logit_bias_max == 300
    assert serve._named("myhost.lan") == ("myhost.lan",) and serve._named("0.0.0.0") == ()
    assert serve._named("::") == ()
