"""The commands turn their flags into typed settings; nothing below them sees argparse."""

from __future__ import annotations

import pytest

from specwire.cli.args import CliError
from specwire.cli.main import build_parser
from specwire.cli.settings import engine_settings, measure_settings
from specwire.config import VerifyMode
from specwire.settings import DraftSettings, RemoteSettings


def settings(*argv: str):
    return engine_settings(build_parser().parse_args(["generate", "x", *argv]))


def test_remote_flags_become_remote_settings() -> None:
    s = settings("--draft-url", "h:1", "--draft-url", "h:2", "--draft-mode", "sync",
                 "--draft-no-poll", "--draft-token", "secret", "--draft-tls-ca", "ca.pem",
                 "--draft-branches", "3", "--draft-tree", "2")
    assert s.draft.kind == "remote" and s.draft.urls == ("h:1", "h:2")
    assert s.draft.remote == RemoteSettings(token="secret", tls_ca="ca.pem", pipelined=False,
                                            poll=False, branches=3, tree=2)
    assert s.draft.model is None
    auto = settings("--draft-url", "h:1", "--draft-token", "t").draft.remote
    assert auto.pipelined and auto.poll


def test_drafter_kinds_and_the_draft_model() -> None:
    assert settings("--no-draft").draft.kind == "none"
    assert settings("--draft-ngram").draft.kind == "ngram"
    assert settings("--spec-type", "ngram-simple").draft.kind == "ngram"
    local = settings("-md", "d.gguf", "-t", "1", "-td", "1", "--draft-mode", "pipelined").draft
    assert local.kind == "model" and local.model is not None and local.model.path == "d.gguf"
    assert local.threaded
    assert not settings("-md", "d.gguf", "--draft-mode", "sync").draft.threaded
    assert settings("-md", "d.gguf", "--draft-hybrid").draft.hybrid
    with pytest.raises(CliError, match="--draft-hybrid: needs a draft model"):
        settings("--draft-ngram", "--draft-hybrid")


def test_verification_mode_only_when_sampling() -> None:
    assert settings("--temp", "0", "--verify", "rejection").verify is None
    assert settings("--temp", "0.7", "--verify", "rejection").verify is VerifyMode.REJECTION


def test_draft_settings_refuse_what_cannot_be_built() -> None:
    with pytest.raises(ValueError, match="needs the draft model"):
        DraftSettings(kind="model")
    with pytest.raises(ValueError, match="--draft-url"):
        DraftSettings(kind="remote")
    with pytest.raises(ValueError, match="is not one of"):
        DraftSettings(kind="lookup")


def test_plan_measure_flags_become_measure_settings() -> None:
    a = build_parser().parse_args(["plan", "--measure", "--measure-limit", "2",
                                   "--measure-n", "8", "-md", "d.gguf"])
    m = measure_settings(a)
    assert (m.limit, m.n_predict, m.prompts, m.draft.path) == (2, 8, "code", "d.gguf")
    a.measure_n = 0
    with pytest.raises(CliError, match="--measure-n must be >= 1"):
        measure_settings(a)


def test_no_namespace_travels_to_the_loader_the_wire_or_the_calibration() -> None:
    """loader.py, the remote drafter's factory and calibrate.py take typed settings."""
    import inspect

    from specwire import build as loader
    from specwire.bench import calibrate
    from specwire.link import remote

    for module in (loader, calibrate):
        assert "argparse" not in inspect.getsource(module)
    assert "argparse" not in inspect.getsource(remote.make_remote_drafter)
    assert inspect.signature(remote.make_remote_drafter).parameters["remote"].annotation \
        == "RemoteSettings"


def test_llama_arg_model_names_the_models_when_the_flags_do_not(monkeypatch) -> None:
    """llama.cpp's environment spellings of -m and -md: the flag wins, else the variable."""
    monkeypatch.setenv("LLAMA_ARG_MODEL", "/models/big.gguf")
    monkeypatch.setenv("LLAMA_ARG_MODEL_DRAFT", "/models/small.gguf")
    s = settings()
    assert s.target.path == "/models/big.gguf" and s.draft.model.path == "/models/small.gguf"
    s = settings("-m", "t.gguf", "-md", "d.gguf")
    assert s.target.path == "t.gguf" and s.draft.model.path == "d.gguf"
