"""The side-by-side script's parsing of llama-speculative-simple and its bad-input errors.

The binary is stood in for by a script that prints what llama-speculative-simple
prints at its end; the real comparison (slow, needs the built binary) is the
command in docs/drafting.md and benchmarks/NOTES.md.
"""

from __future__ import annotations

import argparse
import stat
from pathlib import Path

import pytest

from benchmarks.versus_llama import main, run_llama

TAIL = """decoded  177 tokens in   15.060 seconds, speed:   11.753 t/s
n_draft   = 16
n_predict = 177
n_drafted = 66
n_accept  = 64
accept    = 96.970%
"""


def _binary(tmp_path: Path, text: str, status: int = 0) -> Path:
    path = tmp_path / "llama-speculative-simple"
    path.write_text(f"#!/bin/sh\ncat >&2 <<'END'\n{text}END\nexit {status}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _args(**kw) -> argparse.Namespace:
    base = dict(n_predict=128, threads=1, ctx_size=1024, draft_max=16, llama_args="",
                timeout_s=30.0)
    return argparse.Namespace(**{**base, **kw})


def test_reads_decoded_tokens_time_and_acceptance(tmp_path: Path) -> None:
    run = run_llama(_binary(tmp_path, TAIL), "m.gguf", "p.txt", "ngram-mod", _args())
    assert (run.tokens, run.seconds, run.drafted, run.accepted) == (177, 15.06, 66, 64)
    assert run.rate == pytest.approx(177 / 15.06)


def test_a_failed_run_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="ngram-mod: llama-speculative-simple failed"):
        run_llama(_binary(tmp_path, "error: unknown spec type\n", 1), "m.gguf", "p.txt",
                  "ngram-mod", _args())


def test_a_folder_without_the_binary_exits_2(tmp_path: Path, capsys) -> None:
    assert main(["--llama-bin", str(tmp_path), "-m", "m.gguf"]) == 2
    assert "no llama-speculative-simple" in capsys.readouterr().err
