"""llama.cpp's process-wide state has one owner: one check_gguf, one log callback whose
taps every user (loading, grammars, the quantizer) shares."""

from __future__ import annotations

import logging

import pytest

from specwire.assets import models
from specwire.backend import gguf, llama, llama_process
from specwire.backend.base import BackendError


def test_one_check_gguf(tmp_path) -> None:
    assert models.check_gguf is gguf.check_gguf
    assert llama.check_gguf is gguf.check_gguf
    (tmp_path / "a.gguf").write_bytes(b"GGUF" + bytes(12))
    gguf.check_gguf(tmp_path / "a.gguf")
    with pytest.raises(BackendError, match=r"b\.gguf: model file not found"):
        gguf.check_gguf(tmp_path / "b.gguf")


def test_one_init_backend() -> None:
    assert llama.init_backend is llama_process.init_backend
    llama_process.init_backend()
    llama_process.init_backend()          # once: a second call changes nothing
    assert llama_process._initialised


def test_taps_see_every_line_and_logging_only_problems(caplog) -> None:
    say = llama_process._log_callback
    caplog.set_level(logging.DEBUG, logger="specwire.backend.llama")
    with llama_process.llama_log() as lines:
        seen: list[tuple[int, str]] = []
        with llama_process.log_tap(lambda level, text: seen.append((level, text))):
            say(2, b"loading\n", None)
            say(4, b"broken tensor\n", None)
        say(3, b"after\n", None)
    say(4, b"nobody listens\n", None)
    assert lines == ["loading\n", "broken tensor\n", "after\n"]
    assert seen == [(2, "loading\n"), (4, "broken tensor\n")]
    logged = [r.getMessage() for r in caplog.records]
    assert logged == ["broken tensor", "after", "nobody listens"]


def test_a_quiet_tap_keeps_lines_out_of_logging(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="specwire.backend.llama")
    seen: list[str] = []
    with llama_process.log_tap(lambda level, text: seen.append(text), quiet=True):
        llama_process._log_callback(4, b"quantizer error\n", None)
    assert seen == ["quantizer error\n"]
    assert not caplog.records
