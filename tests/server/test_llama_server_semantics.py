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
        s = ServerSettings(sampling=SamplingParams(temperature=0.0), chat_template="chatml",
                           **settings)
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
