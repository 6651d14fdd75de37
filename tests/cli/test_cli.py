"""`specwire generate` end to end (slow), and its answers to bad input: one line, exit 2, no
traceback (in this process, and as a real process in the full suite)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import bundled
import pytest

from specwire.assets import models
from specwire.backend.base import BackendError
from specwire.backend.llama import check_pair, load_model
from specwire.config import ModelParams


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specwire", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory) -> Path:
    """The bundled draft with one token's text changed: same size, another tokenizer."""
    src = models.default_draft()
    data = bytearray(src.read_bytes())
    at = data.find(b"<unused5>")
    assert at > 0 and data.count(b"<unused5>") == 1
    data[at:at + 9] = b"<unusedX>"
    out = tmp_path_factory.mktemp("vocab") / "other-vocab.gguf"
    out.write_bytes(bytes(data))
    return out


@pytest.mark.slow
def test_generate_json_reports_llama_server_timings() -> None:
    r = run("generate", "def add(a, b):", "-n", "12", "--temp", "0", "--json", "-c", "256")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["tokens"]) == 12 and isinstance(out["text"], str) and out["text"]
    t = out["timings"]
    for key in ("prompt_n", "prompt_ms", "predicted_n", "predicted_ms", "predicted_per_second",
                "draft_n", "draft_n_accepted"):
        assert key in t, key
    assert t["predicted_n"] == 12 and t["draft_n"] >= t["draft_n_accepted"] >= 0


@pytest.mark.slow
def test_generate_streams_text_then_stats() -> None:
    r = run("generate", "def add(a, b):", "-n", "8", "--temp", "0", "--draft-ngram", "-c", "256")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    for label in ("draft_n", "draft_n_accepted", "tokens/s", "histogram"):
        assert label in r.stderr


@pytest.mark.slow
def test_incompatible_pair_is_refused_naming_both_files(other_vocab: Path) -> None:
    target = load_model(ModelParams(str(bundled.target())))
    with pytest.raises(BackendError) as e:
        check_pair(target, load_model(ModelParams(str(other_vocab))))
    assert str(bundled.target()) in str(e.value) and str(other_vocab) in str(e.value)
    r = run("generate", "x", "-n", "4", "-md", str(other_vocab), "-c", "256")
    assert r.returncode == 2
    assert "incompatible models" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["x", "-m", "/no/such/model.gguf"], "model file not found"),
    (["x", "-m", "pyproject.toml"], "not a GGUF"),
    (["x", "--temp", "-1"], "--temp"),
    (["x", "--top-p", "1.5"], "--top-p"),
    (["x", "--draft-max", "1000"], "--draft-max"),
    (["x", "-n", "-3"], "-n"),
    (["x", "--keep", "-2"], "--keep: must be >= -1"),
    pytest.param(["x", "-c", "256", "-n", "1000"], "exceeds the context",
                 marks=pytest.mark.slow),      # checked with the target loaded
    (["x", "--verify", "sideways"], "--verify"),
    (["--messages", "not json"], "--messages"),
    (["x", "--file", "/no/such/prompt.txt"], "--file"),
    ([], "give exactly one"),
])
def test_bad_input_is_one_clear_line(specwire_cli, args: list[str], needle: str) -> None:
    r = specwire_cli("generate", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--port", "70000"], "--port"),
    (["--sync-port", "70000"], "--sync-port"),
    (["--port", "7070", "--sync-port", "7070"], "is --port already"),
    (["--max-sessions", "0"], "--max-sessions"),
])
def test_draft_node_bad_flags_are_one_clear_line(specwire_cli, args: list[str], needle: str
                                                 ) -> None:
    r = specwire_cli("draft", *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr
    assert "Traceback" not in r.stderr


def test_draft_policy_defaults_to_adaptive() -> None:
    """generate (and serve) pick each round's draft length unless told `fixed`."""
    from specwire.cli.args import draft_params
    from specwire.cli.main import build_parser
    p = build_parser()
    assert draft_params(p.parse_args(["generate", "x"])).policy == "adaptive"
    fixed = p.parse_args(["generate", "x", "--draft-policy", "fixed"])
    assert draft_params(fixed).policy == "fixed"
    assert draft_params(p.parse_args(["serve"])).policy == "adaptive"
