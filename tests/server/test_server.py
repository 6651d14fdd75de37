"""The HTTP server: llama-server's and OpenAI's APIs, queueing, cancellation, errors.

Three layers:
* pure units: stop strings, the job queue, request parsing;
* the app in-process (uvicorn on a thread) over a toy engine that counts
  "abc..." slowly: deterministic checks of streaming, stop strings, 429 and
  of a dropped client freeing its slot and drafter at once;
* `python -m specwire serve` on the bundled models as a subprocess (module
  fixture), driven by the official `openai` client and by plain HTTP.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import bundled
import httpx
import pytest
from serve_process import run_serve
from toy_server import SpyDrafter, ToyBackend, _ignore, _metric, _sse, serve_app

from specwire.config import DraftParams, SamplingParams
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app, schemas
from specwire.server.errors import ApiError
from specwire.server.slots import JobQueue, QueueFull
from specwire.server.stops import StopMatcher

# ------------------------------------------------------------------------------ stop strings


def _feed(stops: list[str], pieces: list[str]) -> tuple[list[str], StopMatcher]:
    m = StopMatcher(stops)
    out = [m.push(p) for p in pieces]
    out.append(m.finish())
    return out, m


def test_stop_across_pieces_is_cut_and_never_leaks() -> None:
    out, m = _feed(["\n\n"], ["Hello", "\n", "\nWorld"])
    assert "".join(out) == "Hello" == m.text
    assert m.word == "\n\n"
    assert all("\n" not in o for o in out)


def test_held_tail_is_released_when_it_does_not_match() -> None:
    out, m = _feed(["END"], ["abc E", "N", "d more"])
    assert out[:2] == ["abc ", ""]          # "E", then "EN", could start "END"
    assert "".join(out) == "abc ENd more" and not m.stopped


def test_earliest_stop_wins_and_tail_released_at_finish() -> None:
    out, m = _feed(["world", "lo w"], ["hello world"])
    assert m.text == "hel" and m.word == "lo w"
    out, m = _feed(["xyz"], ["abcx"])
    assert out == ["abc", "x"]


# ------------------------------------------------------------------------------- job queue


def test_queue_counts_only_jobs_that_really_wait() -> None:
    q = JobQueue(capacity=1)
    jobs = [object() for _ in range(3)]
    q.put(jobs[0])                           # nobody idle: it waits
    with pytest.raises(QueueFull):
        q.put(jobs[1])
    got: list = []
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    t.join(2)
    assert got == [jobs[0]] and len(q) == 0
    # a worker blocked in get() takes the next job at once: it does not count as waiting
    t = threading.Thread(target=lambda: got.append(q.get()))
    t.start()
    time.sleep(0.1)
    q.put(jobs[1])
    q.put(jobs[2])
    t.join(2)
    assert got[1] is jobs[1] and len(q) == 1
    assert q.remove(jobs[2]) and len(q) == 0
    assert q.close() == []


# --------------------------------------------------------------------------------- parsing


class _ParseBackend:
    name, n_vocab, n_ctx = "toy.gguf", 128, 64

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list:
        return ([1] if add_special else []) + [min(ord(c), 127) for c in text]

    def detokenize(self, tokens: list) -> bytes:
        return bytes(t for t in tokens if t != 1)


def _parse(body: dict, **settings) -> schemas.Completion:
    return schemas.completion(body, _ParseBackend(), ServerSettings(**settings), ["toy"])


def test_speculative_settings_flat_nested_and_off() -> None:
    base = DraftParams(n_max=8, n_min=2, p_min=0.5)
    r = _parse({"prompt": "hi", "speculative.n_max": 3, "speculative.p_min": 0.1}, draft=base)
    assert (r.request.draft.n_max, r.request.draft.n_min, r.request.draft.p_min) == (3, 2, 0.1)
    r = _parse({"prompt": "hi", "speculative": {"n_max": 1}}, draft=base)
    assert (r.request.draft.n_max, r.request.draft.n_min) == (1, 1)   # n_min clamped
    assert r.request.draft.enabled
    assert not _parse({"prompt": "hi", "speculative": False}, draft=base).request.draft.enabled
    assert not _parse({"prompt": "hi", "speculative.n_max": 0}, draft=base).request.draft.enabled
    with pytest.raises(ApiError, match="speculative.n_max"):
        _parse({"prompt": "hi", "speculative.n_max": 65})


def test_parse_defaults_limits_and_prompts() -> None:
    r = _parse({"prompt": "hi", "temperature": 0, "seed": 7, "stop": "x"},
               sampling=SamplingParams(top_k=5))
    assert r.request.sampling.temperature == 0 and r.request.sampling.top_k == 5
    assert r.request.sampling.seed == 7 and r.stops == ["x"]
    assert r.request.prompt == [1, ord("h"), ord("i")]
    assert r.request.n_predict == 64                         # -1: up to the context
    assert _parse({"prompt": "hi"}, n_predict=10).request.n_predict == 10
    # the server's -n is the default only: the request's own value wins (llama-server)
    assert _parse({"prompt": "hi", "max_tokens": 50}, n_predict=10).request.n_predict == 50
    assert _parse({"prompt": [5, 6, "ab"]}).request.prompt == [5, 6, 97, 98]
    assert _parse({"prompt": ["ab"]}).request.prompt == [1, 97, 98]
    with pytest.raises(ApiError) as e:
        _parse({"prompt": "x" * 100})
    assert e.value.type == "exceed_context_size_error" and e.value.extra["n_ctx"] == 64


# ------------------------------------------------------------- the app over a toy engine


@pytest.fixture
def toy() -> Iterator[tuple[str, SpyDrafter]]:
    spy = SpyDrafter()
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0), queue_size=1)
    with serve_app(create_app(Engine(ToyBackend(), spy), settings)) as url:
        yield url, spy


def test_toy_stream_and_stop_string_across_tokens(toy) -> None:
    url, _ = toy
    body = {"prompt": "z", "n_predict": 10, "stop": ["def", "q"], "stream": True,
            "return_tokens": True}
    with httpx.stream("POST", url + "/completion", json=body, timeout=10) as r:
        events = list(_sse(r.iter_lines()))
    assert "[DONE]" not in events                                # llama-server's /completion
    text = "".join(e["content"] for e in events)
    assert text == "abc"                                         # "d", "de" were held back
    last = events[-1]
    assert last["stop"] and last["stop_type"] == "word" and last["stopping_word"] == "def"
    assert set(last["timings"]) >= {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms",
                                    "predicted_per_second", "draft_n", "draft_n_accepted"}
    # a held tail that never completes a stop string comes out at the end
    r = httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 6, "stop": "fgh"})
    assert r.json()["content"] == "abcdef" and r.json()["stop_type"] == "limit"


def test_toy_dropped_stream_frees_slot_and_drafter_at_once(toy) -> None:
    url, spy = toy
    body = {"prompt": "z", "n_predict": 3000, "stream": True}     # ~30 s if left running
    with httpx.stream("POST", url + "/completion", json=body, timeout=10) as r:
        lines = r.iter_lines()
        assert next(_sse(lines))["content"]
    assert spy.ended.wait(2.0), "the drafter's sequence was not ended"
    t0 = time.monotonic()
    r = httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 3}, timeout=10)
    assert r.status_code == 200 and r.json()["content"] == "abc"
    assert time.monotonic() - t0 < 2.0
    assert _metric(url, 'requests_finished_total{outcome="cancelled"}') == 1


def test_toy_slots_show_a_running_requests_keep_discard_and_lora(toy) -> None:
    """GET /slots lists a processing slot's n_keep, n_discard and LoRA scales among its
    params, as llama-server does (the toy target has no adapters: an empty list)."""
    url, _ = toy
    body = {"prompt": "z", "n_predict": 3000, "stream": True, "n_keep": 1, "n_discard": 2}
    with httpx.stream("POST", url + "/completion", json=body, timeout=10) as r:
        events = _sse(r.iter_lines())
        assert next(events)["content"]
        (slot,) = [s for s in httpx.get(url + "/slots", timeout=10).json() if s["is_processing"]]
    params = slot["params"]
    assert (params["n_keep"], params["n_discard"], params["lora"]) == (1, 2, [])


@pytest.mark.slow
def test_toy_queue_full_then_waiting_client_leaves(toy) -> None:
    url, _ = toy
    long = {"prompt": "z", "n_predict": 3000, "stream": True}
    with httpx.stream("POST", url + "/completion", json=long, timeout=10) as running:
        events = _sse(running.iter_lines())     # kept: dropping the iterator closes the stream
        next(events)                                             # the slot is busy
        waiting = threading.Thread(target=lambda: _ignore(httpx.post, url + "/completion",
                                                          json={"prompt": "z"}, timeout=0.6))
        waiting.start()
        deadline = time.monotonic() + 3
        while _metric(url, "requests_deferred") < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(url, "requests_deferred") == 1
        r = httpx.post(url + "/v1/completions", json={"prompt": "z"}, timeout=5)
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error"
        waiting.join()                                           # its client timed out...
        deadline = time.monotonic() + 3
        while _metric(url, "requests_deferred") > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _metric(url, "requests_deferred") == 0            # ...so it left the queue
    assert _metric(url, "requests_rejected_total") == 1


def test_toy_parallel_slots_and_no_waiting_room() -> None:
    engines = [Engine(ToyBackend(), SpyDrafter()) for _ in range(2)]
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0), queue_size=0)
    long = {"prompt": "z", "n_predict": 3000, "stream": True}
    with serve_app(create_app(engines, settings)) as url, \
            httpx.stream("POST", url + "/completion", json=long, timeout=10) as a, \
            httpx.stream("POST", url + "/completion", json=long, timeout=10) as b:
        events_a, events_b = _sse(a.iter_lines()), _sse(b.iter_lines())
        assert next(events_a)["content"] and next(events_b)["content"]
        assert _metric(url, "requests_processing") == 2
        r = httpx.post(url + "/completion", json={"prompt": "z"}, timeout=5)
        assert r.status_code == 429


def test_serve_refuses_bad_flags_before_loading_models() -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    for argv, match in ((["--chat-template", "nope"], "unknown name"),
                        (["--queue-size", "-1"], "queue-size"),
                        (["-np", "0"], "-np"),
                        (["--top-p", "2"], "--top-p")):
        args = parser.parse_args(["serve", "-m", "/nonexistent.gguf", *argv])
        with pytest.raises(CliError, match=match):
            args.func(args)


# -------------------------------------------------------------------- the real server (slow)

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """`python -m specwire serve` with no model flags: the bundled pair."""
    from specwire.assets import models
    bundled.target()
    models.default_draft()
    with run_serve("-t", "1", "-td", "1", "-c", "512", "--queue-size", "3",
                   "--api-key", KEY) as (url, log):
        assert f"listening on {url}" in log()
        yield url


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server: str):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


TIMINGS = {"prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
           "draft_n", "draft_n_accepted"}


@pytest.mark.slow
def test_serves_bundled_pair_and_needs_the_key(server: str, http: httpx.Client) -> None:
    assert httpx.get(server + "/health").json() == {"status": "ok"}    # open without a key
    for path in ("/v1/models", "/metrics", "/props"):
        r = httpx.get(server + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(server + "/completion", json={"prompt": "hi"},
                   headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["message"]
    card = http.get("/v1/models").json()["data"][0]
    assert card["id"] == bundled.target().name
    assert card["meta"]["drafter"].split(":", 1) in (
        ["model", "gemma-3-270m-q2_k-q4e.gguf"], ["threaded", "gemma-3-270m-q2_k-q4e.gguf"])
    assert card["meta"]["chat_template"] == "gemma"


@pytest.mark.slow
def test_openai_completions(oai) -> None:
    model = oai.models.list().data[0].id
    kw = dict(model=model, prompt="The capital of France is", max_tokens=12, temperature=0)
    whole = oai.completions.create(**kw)
    text = whole.choices[0].text
    assert text and whole.choices[0].finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens <= 12
    assert set(whole.to_dict()["timings"]) >= TIMINGS
    chunks = list(oai.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert set(chunks[-1].to_dict()["timings"]) >= TIMINGS


@pytest.mark.slow
def test_openai_chat(oai) -> None:
    model = oai.models.list().data[0].id
    kw = dict(model=model, messages=[{"role": "user", "content": "Name a colour."}],
              max_tokens=12, temperature=0)
    whole = oai.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert set(whole.to_dict()["timings"]) >= TIMINGS
    chunks = list(oai.chat.completions.create(**kw, stream=True,
                                              stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == msg.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert set(chunks[-1].to_dict()["timings"]) >= TIMINGS
    # any model name is served, as llama-server serves its one model (agents send theirs)
    other = oai.chat.completions.create(**{**kw, "model": "no-such-model"})
    assert other.choices[0].message.content == msg.content


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_same_tokens_with_and_without_draft(http: httpx.Client, temperature: float) -> None:
    body = {"prompt": "Here is a short story about a fox:", "n_predict": 20, "ignore_eos": True,
            "temperature": temperature, "seed": 1234, "return_tokens": True,
            "speculative.p_min": 0.0}
    plain = http.post("/completion", json={**body, "speculative": False}).json()
    assert plain["timings"]["draft_n"] == 0 and len(plain["tokens"]) == 20
    drafted = 0
    for n_max in (1, 3, 8):
        r = http.post("/completion", json={**body, "speculative": {"n_max": n_max}}).json()
        assert r["tokens"] == plain["tokens"], f"n_max={n_max}"
        assert r["content"] == plain["content"]
        assert r["generation_settings"]["speculative.n_max"] == n_max
        drafted += r["timings"]["draft_n"]
    assert drafted > 0


@pytest.mark.slow
def test_completion_stream_and_stop_string(http: httpx.Client) -> None:
    body = {"prompt": "1, 2, 3, 4,", "n_predict": 16, "temperature": 0, "return_tokens": True}
    whole = http.post("/completion", json=body).json()
    tokens, text = whole["tokens"], whole["content"]
    with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        events = list(_sse(r.iter_lines()))
    assert "".join(e["content"] for e in events) == text
    assert [t for e in events for t in e["tokens"]] == tokens
    assert events[-1]["stop"] and set(events[-1]["timings"]) >= TIMINGS
    # a stop string that spans two tokens: from the end of token 3 into token 4
    pieces = [http.post("/detokenize", json={"tokens": [t]}).json()["content"] for t in tokens]
    cut = len("".join(pieces[:4]))
    stop = text[cut - 1:cut + 2]
    want = text[:text.index(stop)]
    r = http.post("/completion", json={**body, "stop": [stop]}).json()
    assert (r["content"], r["stop_type"], r["stopping_word"]) == (want, "word", stop)
    with http.stream("POST", "/completion", json={**body, "stop": [stop], "stream": True}) as s:
        events = list(_sse(s.iter_lines()))
    assert "".join(e["content"] for e in events) == want
    assert events[-1]["stop_type"] == "word"


@pytest.mark.slow
def test_dropped_client_frees_the_slot(server: str, http: httpx.Client) -> None:
    before = _metric(server, 'requests_finished_total{outcome="cancelled"}', AUTH)
    body = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json={**body, "max_tokens": 400}) as r:
        events = _sse(r.iter_lines())
        next(events)
        next(events)
    t0 = time.monotonic()
    r = http.post("/completion", json={"prompt": "Hello", "n_predict": 4})
    assert r.status_code == 200
    assert time.monotonic() - t0 < 10, "the dropped request kept the slot"
    assert _metric(server, 'requests_finished_total{outcome="cancelled"}', AUTH) == before + 1


@pytest.mark.slow
def test_concurrent_clients_all_served(http: httpx.Client) -> None:
    def one(i: int) -> httpx.Response:
        return http.post("/completion", json={"prompt": f"Number {i} is", "n_predict": 6,
                                              "temperature": 0})
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(one, range(4)))
    assert [r.status_code for r in results] == [200] * 4
    assert all(r.json()["tokens_predicted"] > 0 for r in results)


@pytest.mark.slow
def test_queue_full_is_429(server: str, http: httpx.Client) -> None:
    def one(i: int) -> httpx.Response:
        return http.post("/completion", json={"prompt": f"Story {i}:", "n_predict": 16,
                                              "ignore_eos": True})
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    codes = sorted(r.status_code for r in results)
    assert set(codes) == {200, 429} and codes.count(200) >= 4, codes
    for r in results:
        if r.status_code == 429:
            assert r.json()["error"]["type"] == "rate_limit_error"
    assert _metric(server, "requests_rejected_total", AUTH) >= 1


LONG_PROMPT = "word " * 600      # > -c 512 tokens
BAD = [
    ("/completion", b"{not json", 400),
    ("/completion", b"", 400),
    ("/completion", b"[1, 2]", 400),
    ("/completion", {"prompt": 5}, 400),
    ("/completion", {"prompt": ""}, 400),
    ("/completion", {"prompt": []}, 400),
    ("/completion", {}, 400),
    ("/completion", {"prompt": [1, "a", None]}, 400),
    ("/completion", {"prompt": [10**9]}, 400),
    ("/completion", {"prompt": "hi", "n_predict": -5}, 400),
    ("/completion", {"prompt": "hi", "n_predict": "many"}, 400),
    ("/completion", {"prompt": "hi", "n_predict": 2.5}, 400),
    ("/completion", {"prompt": "hi", "top_p": 2}, 400),
    ("/completion", {"prompt": "hi", "temperature": "hot"}, 400),
    ("/completion", {"prompt": "hi", "top_k": -1}, 400),
    ("/completion", {"prompt": "hi", "seed": -7}, 400),
    ("/completion", {"prompt": "hi", "stop": 3}, 400),
    ("/completion", {"prompt": "hi", "stream": "yes"}, 400),
    ("/completion", {"prompt": "hi", "speculative.n_max": -1}, 400),
    ("/completion", {"prompt": "hi", "speculative": {"p_min": 3}}, 400),
    ("/completion", {"prompt": "hi", "speculative": "fast"}, 400),
    ("/completion", {"prompt": LONG_PROMPT}, 400),
    ("/completion", {"prompt": "hi", "model": 4}, 400),
    ("/v1/completions", {"prompt": "hi", "n": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 9}, 400),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400),
    ("/v1/chat/completions", {"messages": "hi"}, 400),
    ("/v1/chat/completions", {"messages": []}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": -3}, 400),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400),
    ("/tokenize", {"content": 5}, 400),
    ("/tokenize", {}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/nowhere", {}, 404),
]


@pytest.mark.slow
@pytest.mark.parametrize("path, body, status", BAD, ids=[f"{p}:{b!s:.40}" for p, b, _ in BAD])
def test_bad_requests_get_error_bodies(http: httpx.Client, path: str, body, status: int) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    if isinstance(body, dict) and body.get("prompt") == LONG_PROMPT:
        assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 512


@pytest.mark.slow
def test_tokenize_roundtrip_and_metrics(server: str, http: httpx.Client) -> None:
    toks = http.post("/tokenize", json={"content": "Hello world"}).json()["tokens"]
    assert toks and http.post("/detokenize", json={"tokens": toks}).json()["content"] == \
        "Hello world"
    with_bos = http.post("/tokenize", json={"content": "Hello", "add_special": True}).json()
    assert with_bos["tokens"][0] == 2
    text = http.get("/metrics").text
    for name in ("requests_total", "prompt_tokens_total", "tokens_predicted_total",
                 "draft_tokens_total", "draft_tokens_accepted_total", "draft_acceptance_ratio",
                 'round_seconds_total{phase="verify"}', 'round_seconds_total{phase="network"}',
                 "requests_deferred", "requests_processing"):
        assert f"specwire:{name}" in text, name
    assert _metric(server, "tokens_predicted_total", AUTH) > 0
    assert _metric(server, "draft_tokens_accepted_total", AUTH) > 0
