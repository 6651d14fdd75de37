"""Where `specwire serve` once differed from llama-server, it now behaves as llama-server
does (issue 38): a user switching servers keeps their command line, their clients and
their dashboards. Fast: flags, request parsing and toy apps; slow: one real `serve`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging

import httpx
import pytest

from specwire.cli.args import CliError
from specwire.cli.commands import serve
from specwire.cli.main import build_parser
from specwire.server import ServerSettings, schemas


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def toy_app():
    from toy_server import SpyDrafter, ToyBackend, serve_app

    from specwire.config import SamplingParams
    from specwire.engine.engine import Engine
    from specwire.server import create_app

    @contextlib.contextmanager
    def run(n_seq: int = 1, **settings):
        engines = [Engine(ToyBackend(delay=0), SpyDrafter()) for _ in range(n_seq)]
        settings.setdefault("chat_template", "chatml")
        s = ServerSettings(sampling=SamplingParams(temperature=0.0), **settings)
        with serve_app(create_app(engines, s)) as url:
            yield url
    return run


# ------------------------------------------------------------------------ flags (fast)


def test_c_is_the_whole_context_shared_by_the_slots(caplog) -> None:
    """-c 512 -np 2: each slot holds 256 tokens, as llama-server's n_ctx_seq; -np 1 keeps -c."""
    a = parse("-c", "512", "-np", "2")
    serve.per_slot_context(a)
    assert a.ctx_size == 256
    a = parse("-c", "512")
    serve.per_slot_context(a)
    assert a.ctx_size == 512
    a = parse("-c", "1000", "-np", "3")
    with caplog.at_level(logging.WARNING):
        serve.per_slot_context(a)
    assert a.ctx_size == 333 and "not a multiple" in caplog.text
    with pytest.raises(CliError, match="at least 64"):
        serve.per_slot_context(parse("-c", "32", "-np", "4"))


def test_long_flags_take_underscores_as_llama_cpp_does() -> None:
    a = parse("--ctx_size", "512", "--n_predict=7", "--no_ui", "--parallel", "2")
    assert (a.ctx_size, a.n_predict, a.webui, a.parallel) == (512, 7, False, 2)
    a = parse("--backend_sampling")     # a flag compat.py warns about, underscored
    assert a.compat_backend_sampling == [("--backend-sampling", ())]
    with pytest.raises(SystemExit):
        parse("--no_such_flag")
    # a value is never rewritten
    assert parse("--alias=--ctx_size").alias == "--ctx_size"


def test_no_ui_is_no_webui() -> None:
    assert parse("--no-ui").webui is False and parse("--ui").webui is True


def test_a_comma_list_of_hosts_is_refused_saying_why() -> None:
    with pytest.raises(CliError, match="one address only"):
        serve._check_host("127.0.0.1,::1")
    serve._check_host("0.0.0.0")


def test_the_request_n_predict_wins_over_the_server_n() -> None:
    s = ServerSettings(n_predict=8)
    assert schemas.n_predict(schemas.Fields({}), s, 512) == 8
    assert schemas.n_predict(schemas.Fields({"max_tokens": 100}), s, 512) == 100
    assert schemas.n_predict(schemas.Fields({"n_predict": -1}), s, 512) == 512


def test_toy_server_request_tokens_beyond_the_server_n(toy_app) -> None:
    with toy_app(n_predict=3) as url:
        short = httpx.post(url + "/completion", json={"prompt": "a"}, timeout=10).json()
        long = httpx.post(url + "/completion", json={"prompt": "a", "n_predict": 6},
                          timeout=10).json()
    assert short["tokens_predicted"] == 3 and long["tokens_predicted"] == 6


# ------------------------------------------------------------------------ CORS (fast)


def test_cors_preflight_needs_no_key_and_any_origin_is_answered(toy_app) -> None:
    """A browser page on another origin: its preflight (OPTIONS, no key) is allowed, and
    the request itself, with the key, carries Access-Control-Allow-Origin; without the key
    it is still a 401. A request with a foreign Host is still refused (DNS rebinding)."""
    origin = {"Origin": "http://app.example"}
    pre = {**origin, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    with toy_app(api_key="k") as url:
        r = httpx.options(url + "/v1/chat/completions", headers=pre, timeout=10)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] in ("*", "http://app.example")
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = httpx.post(url + "/completion", json={"prompt": "a", "n_predict": 2},
                       headers={**origin, "Authorization": "Bearer k"}, timeout=10)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        r = httpx.post(url + "/completion", json={"prompt": "a"}, headers=origin, timeout=10)
        assert r.status_code == 401
    with toy_app() as url:
        r = httpx.post(url + "/completion", json={"prompt": "a", "n_predict": 1},
                       headers={**origin, "Host": "evil.example"}, timeout=10)
        assert r.status_code == 403


def test_cors_origins_limits_who_may_call_and_none_turns_it_off(toy_app) -> None:
    pre = {"Access-Control-Request-Method": "POST"}
    with toy_app(cors_origins=("http://ok.example",)) as url:
        ok = httpx.options(url + "/completion", headers={**pre, "Origin": "http://ok.example"})
        bad = httpx.options(url + "/completion", headers={**pre, "Origin": "http://x.example"})
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
    with toy_app(cors_origins=()) as url:
        r = httpx.get(url + "/props", headers={"Origin": "http://x.example"}, timeout=10)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    a = parse("--cors-origins", "none", "--cors-methods", "get,post", "--cors-credentials")
    assert serve.cors_settings(a) == {"cors_origins": (), "cors_methods": ("GET", "POST"),
                                      "cors_headers": ("*",), "cors_credentials": True}


def test_admin_routes_still_take_application_json_only(toy_app) -> None:
    """A text/plain POST is a "simple request" any page may send without a preflight: the
    generation routes read it as JSON (llama-server's curl -d), the state-changing ones
    (/slots/*, /lora-adapters) refuse it."""
    with toy_app() as url:
        for path in ("/slots/0?action=save", "/lora-adapters"):
            r = httpx.post(url + path, content=b'{"filename": "x"}',
                           headers={"Content-Type": "text/plain"}, timeout=10)
            assert r.status_code == 415, (path, r.text)
        r = httpx.post(url + "/completion", content=b'{"prompt": "a", "n_predict": 1}',
                       headers={"Content-Type": "application/x-www-form-urlencoded"},
                       timeout=10)
        assert r.status_code == 200


# ------------------------------------------------------------------------ chat (fast)


def test_a_final_assistant_message_is_continued(toy_app) -> None:
    """llama-server's prefill: the last assistant message is continued, not closed and
    followed by a new turn; --no-prefill-assistant closes it."""
    body = {"messages": [{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": "Hello, I am"}]}
    with toy_app() as url:
        prompt = httpx.post(url + "/apply-template", json=body, timeout=10).json()["prompt"]
        assert prompt.endswith("<|im_start|>assistant\nHello, I am")
        two = {"messages": [*body["messages"], {"role": "assistant", "content": "x"}]}
        r = httpx.post(url + "/apply-template", json=two, timeout=10)
        assert r.status_code == 400 and "2 or more assistant" in r.text
    with toy_app(prefill_assistant=False) as url:
        prompt = httpx.post(url + "/apply-template", json=body, timeout=10).json()["prompt"]
        assert prompt.endswith("Hello, I am<|im_end|>\n<|im_start|>assistant\n")
    assert parse("--no-prefill-assistant").prefill_assistant is False


@pytest.mark.parametrize("name", ["command-r", "deepseek3", "gpt-oss", "llama2-sys",
                                  "mistral-v3-tekken"])
def test_every_llama_cpp_template_name_is_served(toy_app, name: str) -> None:
    from specwire.text import chat
    assert name in chat.builtin_names()
    serve._check_chat_and_cache_flags(parse("--chat-template", name))
    body = {"messages": [{"role": "user", "content": "Hi there"}]}
    with toy_app(chat_template=name) as url:
        r = httpx.post(url + "/apply-template", json=body, timeout=10)
        assert r.status_code == 200, r.text
        assert "Hi there" in r.json()["prompt"]
        assert httpx.get(url + "/props", timeout=10).json()["chat_template_name"] == name


def test_an_unknown_template_name_lists_llama_cpp_s() -> None:
    with pytest.raises(CliError, match="command-r"):
        serve._check_chat_and_cache_flags(parse("--chat-template", "nope"))


# ------------------------------------------------------------------ requests (fast)


def test_id_slot_runs_on_that_slot_and_out_of_range_is_400(toy_app) -> None:
    with toy_app(n_seq=3) as url:
        for k in (2, 0, 1, 2):
            r = httpx.post(url + "/completion", json={"prompt": "a", "n_predict": 2,
                                                      "id_slot": k}, timeout=10)
            assert r.status_code == 200 and r.json()["id_slot"] == k
        r = httpx.post(url + "/completion", json={"prompt": "a", "id_slot": 3}, timeout=10)
        assert r.status_code == 400 and "id_slot" in r.text
        r = httpx.post(url + "/completion", json={"prompt": "a", "n_predict": 1,
                                                  "id_slot": -1}, timeout=10)
        assert r.status_code == 200


def test_a_list_of_prompts_gets_a_list_of_results(toy_app) -> None:
    """Each prompt answered as it would be alone, in order, with its index."""
    with toy_app(n_seq=2) as url:
        alone = [httpx.post(url + "/completion", json={"prompt": p, "n_predict": 3},
                            timeout=10).json()["content"] for p in ("a", "k", "q")]
        r = httpx.post(url + "/completion", json={"prompt": ["a", "k", [ord("q")]],
                                                  "n_predict": 3}, timeout=10)
        assert r.status_code == 200, r.text
        out = r.json()
        assert [x["index"] for x in out] == [0, 1, 2]
        assert [x["content"] for x in out] == alone == ["bcd", "lmn", "rst"]
        r = httpx.post(url + "/completion", json={"prompt": ["a", "b"], "stream": True},
                       timeout=10)
        assert r.status_code == 400 and "stream" in r.text
        r = httpx.post(url + "/v1/completions", json={"prompt": ["a", "b"]}, timeout=10)
        assert r.status_code == 400 and "/completion only" in r.text


def test_metrics_carry_llama_server_names_fingerprint_and_aliases(toy_app) -> None:
    with toy_app(n_seq=2, alias="one,two") as url:
        c = httpx.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "a"}], "max_tokens": 2}, timeout=10)
        assert c.json()["system_fingerprint"].startswith("specwire-")
        t = httpx.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 2},
                       timeout=10)
        assert t.json()["system_fingerprint"].startswith("specwire-")
        text = httpx.get(url + "/metrics", timeout=10).text
        models = httpx.get(url + "/v1/models", timeout=10).json()
    figures = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("llamacpp:")}
    for name in ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "n_decode_total", "n_busy_slots_per_decode",
                 "prompt_tokens_seconds", "predicted_tokens_seconds", "requests_processing",
                 "requests_deferred", "n_tokens_max"):
        assert "llamacpp:" + name in figures, name
    assert figures["llamacpp:tokens_predicted_total"] == 4
    assert figures["llamacpp:n_decode_total"] >= 2
    assert figures["llamacpp:n_busy_slots_per_decode"] >= 1
    assert "specwire:tokens_predicted_total" in text           # both names kept
    assert models["data"][0]["id"] == "one" and models["data"][0]["aliases"] == ["one", "two"]
    assert models["models"][0]["name"] == "one"


def test_return_progress_streams_prompt_progress_before_the_text(toy_app) -> None:
    from toy_server import _sse
    with toy_app() as url:
        with httpx.stream("POST", url + "/completion", json={
                "prompt": "abc", "n_predict": 3, "stream": True, "return_progress": True},
                timeout=10) as r:
            events = list(_sse(r.iter_lines()))
        with httpx.stream("POST", url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
                "stream": True, "return_progress": True}, timeout=10) as r:
            chat_events = [e for e in _sse(r.iter_lines()) if isinstance(e, dict)]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert progress and progress[-1]["processed"] == progress[-1]["total"] == 3
    first_text = next(i for i, e in enumerate(events) if e.get("content"))
    assert all("prompt_progress" in e for e in events[:first_text] if e.get("content") == "")
    assert "".join(e["content"] for e in events) == "def"
    assert any("prompt_progress" in e for e in chat_events)


# ------------------------------------------------------------------ one real serve (slow)


@pytest.fixture(scope="module")
def real_serve():
    from serve_process import run_serve
    with run_serve("-t", "1", "-td", "1", "--temp", "0", "-c", "512", "-np", "2", "-n", "4",
                   "--no-warmup") as (url, _log):
        yield url


@pytest.mark.slow
def test_real_serve_splits_c_and_lets_the_request_n_predict_win(real_serve) -> None:
    props = httpx.get(real_serve + "/props", timeout=30).json()
    assert props["default_generation_settings"]["n_ctx"] == 256 and props["total_slots"] == 2
    r = httpx.post(real_serve + "/completion", json={"prompt": "def add(a, b):",
                                                     "n_predict": 8, "ignore_eos": True},
                   timeout=120).json()
    assert r["tokens_predicted"] == 8          # beyond the server's -n 4


@pytest.mark.slow
def test_real_serve_is_lossless_for_prefill_lists_and_slots(real_serve) -> None:
    """Greedy output with the draft equals plain decoding (speculative: false) for a
    continued assistant message, a list of prompts and a request pinned to slot 1."""
    chat = {"messages": [{"role": "user", "content": "Count to five."},
                         {"role": "assistant", "content": "One, two,"}], "max_tokens": 6}
    many = {"prompt": ["def add(a, b):", "The capital of France is"], "n_predict": 6}
    pinned = {"prompt": "for i in range(", "n_predict": 6, "id_slot": 1}

    def both(path: str, body: dict) -> tuple:
        drafted = httpx.post(real_serve + path, json=body, timeout=120)
        plain = httpx.post(real_serve + path, json={**body, "speculative": False},
                           timeout=120)
        assert drafted.status_code == plain.status_code == 200, (drafted.text, plain.text)
        return drafted.json(), plain.json()

    d, p = both("/v1/chat/completions", chat)
    assert d["choices"][0]["message"]["content"] == p["choices"][0]["message"]["content"]
    d, p = both("/completion", many)
    assert [x["content"] for x in d] == [x["content"] for x in p] and len(d) == 2
    d, p = both("/completion", pinned)
    assert d["content"] == p["content"] and d["id_slot"] == p["id_slot"] == 1
