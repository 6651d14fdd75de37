"""The live page at GET /: its figures agree with /metrics, it obeys --api-key and --no-webui.

Fast tests run the app over support/toy_server.py's toy engine with the real n-gram
drafter (the toy writes the alphabet, so prompt lookup drafts and is kept).
The browser test (tests/server/test_webui_browser.py) loads the page in Chromium
against `specwire serve` on the bundled models.
"""

from __future__ import annotations

import time

import httpx
import pytest
from toy_server import ToyBackend, serve_app

from specwire.cli.main import build_parser
from specwire.config import DraftParams, SamplingParams
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.engine.engine import Engine
from specwire.engine.stats import Stats
from specwire.server import ServerSettings, create_app
from specwire.server.metrics import Metrics
from specwire.server.webui.exposition import Exposition

KEY = "page-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ALPHABET = "abcdefghijklmnopqrstuvwxyz"


def _app(**settings):
    s = ServerSettings(sampling=SamplingParams(temperature=0.0),
                       draft=DraftParams(policy="adaptive"), **settings)   # serve's default
    return create_app(Engine(ToyBackend(delay=0.001), NgramDrafter()), s)


def test_exposition_reads_back_what_metrics_writes() -> None:
    m = Metrics()
    m.watch(lambda: {"processing": 1, "deferred": 2, "capacity": 8, "slots": 1},
            lambda: [(0, {'node "a"\\b': 1.0})])
    st = Stats(prompt_n=5, prompt_ms=10.0, predicted_n=9, predicted_ms=300.0, draft_ms=40.0,
               verify_ms=200.0, drafter={"wait_ms": 25.0})
    st.record_round(4, 3, 4)
    st.record_round(2, 0, 4)
    m.record(0, st, 9)
    m.request("/completion")
    text = m.render().decode()
    e = Exposition.parse(text)
    assert e.total("tokens_predicted_total") == 9
    assert e.total("tokens_predicted_seconds_total") == pytest.approx(0.3)
    assert (e.total("draft_tokens_total"), e.total("draft_tokens_accepted_total")) == (6, 3)
    assert e.by("draft_accepted_length_total", "accepted") == {"0": 1, "3": 1}
    assert e.by("round_seconds_total", "phase") == pytest.approx(
        {"draft": 0.015, "network": 0.025, "verify": 0.2})
    assert e.by("requests_total", "endpoint") == {"/completion": 1}
    assert e.rows("draft_link_up") == [({"slot": "0", "link": 'node "a"\\b'}, 1.0)]
    assert e.total("requests_deferred") == 2 and e.total("no_such_metric") == 0


def test_every_metric_says_what_it_measures_in_one_batch() -> None:
    """Help texts speak of the one target batch: -np is its sequences, not engines, and
    the per-request sums say they are sums (concurrent requests share a step)."""
    m = Metrics()
    helps = {f.name.removeprefix("specwire:"): f.documentation for f in m.registry.collect()}
    assert all(helps.values()) and not any("ngine" in h for h in helps.values())
    assert helps["slots_total"].startswith("Sequences the target batch holds")
    for name in ("draft_rounds", "round_seconds", "prompt_seconds", "tokens_predicted_seconds"):
        assert "summed over requests" in helps[name], name


def test_stats_json_agrees_with_metrics_and_lists_requests() -> None:
    with serve_app(_app()) as url:
        empty = httpx.get(url + "/stats.json").json()
        assert empty["speed"]["tokens_per_s"] is None and empty["recent"] == []
        prompt = ALPHABET * 2
        body = {"prompt": prompt, "n_predict": 20, "speculative.n_max": 4}
        r = httpx.post(url + "/completion", json=body, timeout=30).json()
        stream = httpx.post(url + "/v1/completions", timeout=30,
                            json={**body, "stream": True, "prompt": ALPHABET * 3}).text
        assert "[DONE]" in stream
        plain = httpx.post(url + "/completion", timeout=30,
                           json={"prompt": "q", "n_predict": 10, "speculative": False}).json()
        assert plain["timings"]["draft_n"] == 0
        # a slot records a generation's figures just after its reply goes out
        deadline = time.monotonic() + 5
        while (s := httpx.get(url + "/stats.json").json())["speed"]["tokens_predicted"] < 50 \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        e = Exposition.parse(httpx.get(url + "/metrics").text)
    assert s["speed"]["tokens_predicted"] == e.total("tokens_predicted_total") == 50
    assert s["drafts"]["drafted"] == e.total("draft_tokens_total") > 0
    assert s["drafts"]["accepted"] == e.total("draft_tokens_accepted_total") > 0
    assert s["speed"]["tokens_per_s"] == pytest.approx(
        50 / e.total("tokens_predicted_seconds_total"), rel=1e-3)
    # per position: position 1 is drafted in every drafting round, later ones at most as often
    drafted = [n for n, _ in s["drafts"]["by_position"]]
    assert sum(drafted) == s["drafts"]["drafted"] and drafted == sorted(drafted, reverse=True)
    assert sum(k for _, k in s["drafts"]["by_position"]) == s["drafts"]["accepted"]
    hist = s["drafts"]["accepted_hist"]
    assert sum(n * c for n, c in enumerate(hist)) == s["drafts"]["accepted"]
    assert s["drafts"]["mean_accepted"] == pytest.approx(s["drafts"]["accepted"] / sum(hist),
                                                         abs=1e-3)
    assert [q["endpoint"] for q in s["recent"]] == ["/completion", "/v1/completions",
                                                    "/completion"]
    last = s["recent"][2]
    assert (last["predicted_n"], last["draft_n"]) == (20, r["timings"]["draft_n"])
    assert last["draft_n_accepted"] == r["timings"]["draft_n_accepted"]
    assert s["queue"]["requests"] == {"/completion": 2, "/v1/completions": 1}
    assert s["slots"] == [{"id": 0, "busy": False, "drafter": "ngram"}]
    # the plain request's 9 rounds after its first token, at least, timed the toy's step
    assert s["speed"]["plain_steps"] >= 9
    assert 0.001 <= 1 / s["speed"]["plain_tokens_per_s"] < 0.05      # its delay is 1 ms
    assert s["speed"]["speedup"] == pytest.approx(
        s["speed"]["tokens_per_s"] / s["speed"]["plain_tokens_per_s"], rel=1e-2)
    split = s["time_split"]
    assert split["verify"]["seconds"] == pytest.approx(
        e.by("round_seconds_total", "phase")["verify"], abs=1e-3)
    assert s["nodes"] == []


def test_page_is_public_and_holds_no_figure_but_its_data_needs_the_key() -> None:
    with serve_app(_app(api_key=KEY)) as url:
        page = httpx.get(url + "/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "toy.gguf" not in page.text and "stats.json" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")
        denied = httpx.get(url + "/stats.json")
        assert denied.status_code == 401
        assert denied.json()["error"]["type"] == "authentication_error"
        assert httpx.get(url + "/stats.json", headers=AUTH).json()["about"]["model"] == "toy.gguf"


def test_no_webui_means_404() -> None:
    with serve_app(_app(webui=False)) as url:
        assert httpx.get(url + "/").status_code == 404
        assert httpx.get(url + "/stats.json").status_code == 404
        assert httpx.get(url + "/health").status_code == 200
    assert build_parser().parse_args(["serve", "--no-webui"]).webui is False
    assert build_parser().parse_args(["serve"]).webui is True


def test_an_unreachable_draft_node_shows_down_with_its_error() -> None:
    from serve_process import _free_port

    from specwire.link.remote import RemoteDrafter
    from specwire.link.transport.channel import Link, LinkSettings

    url = f"127.0.0.1:{_free_port()}"           # nothing listens there
    link = Link(url, LinkSettings(connect_timeout_s=0.5), "toy", 128, "toy.gguf")
    drafter = RemoteDrafter([link], 128, pipelined=False)
    assert drafter.handshake() != [None]
    s = ServerSettings(sampling=SamplingParams(temperature=0.0))
    try:
        with serve_app(create_app(Engine(ToyBackend(delay=0.001), drafter), s)) as base:
            r = httpx.post(base + "/completion", json={"prompt": "abc", "n_predict": 5},
                           timeout=30)
            assert r.status_code == 200 and r.json()["timings"]["draft_n"] == 0
            nodes = httpx.get(base + "/stats.json").json()["nodes"]
    finally:
        drafter.close()
    assert len(nodes) == 1
    node = nodes[0]
    assert (node["slot"], node["url"], node["up"], node["rtt_ms"]) == (0, url, False, None)
    assert node["failures"] >= 1 and node["error"]
