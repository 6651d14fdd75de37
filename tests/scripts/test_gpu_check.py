"""scripts/gpu_check.py: the pack's trimming (fast) and the whole run's CPU dry run (slow),
so that the script a lent GPU machine runs once has already run end to end here."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

TOP = "llama_cpp_python-0.3.36"


@pytest.mark.parametrize(("name", "left_out"), [
    (f"{TOP}", False),
    (f"{TOP}/pyproject.toml", False),
    (f"{TOP}/llama_cpp/llama.py", False),
    (f"{TOP}/docs/index.md", True),
    (f"{TOP}/tests/test_llama.py", True),
    (f"{TOP}/vendor/llama.cpp/src/llama.cpp", False),
    (f"{TOP}/vendor/llama.cpp/ggml/src/ggml.c", False),
    (f"{TOP}/vendor/llama.cpp/ggml/src/ggml-cuda/fattn.cu", False),
    (f"{TOP}/vendor/llama.cpp/ggml/src/ggml-cpu/ggml-cpu.c", False),
    (f"{TOP}/vendor/llama.cpp/ggml/src/ggml-backend.cpp", False),
    (f"{TOP}/vendor/llama.cpp/ggml/src/ggml-vulkan/ggml-vulkan.cpp", True),
    (f"{TOP}/vendor/llama.cpp/ggml/src/ggml-metal", True),
    (f"{TOP}/vendor/llama.cpp/models/ggml-vocab-llama.gguf", True),
    (f"{TOP}/vendor/llama.cpp/tools/server/server.cpp", True),
    (f"{TOP}/vendor/llama.cpp/CMakeLists.txt", False),
    (f"{TOP}/vendor/other/x.c", True),
])
def test_the_pack_keeps_what_a_cuda_build_reads(name: str, left_out: bool) -> None:
    assert gpu_check.trimmed(name) is left_out


def test_the_pack_writes_the_kept_members_alone(tmp_path: Path) -> None:
    sdist = tmp_path / "sdist.tar.gz"
    names = [f"{TOP}/pyproject.toml", f"{TOP}/vendor/llama.cpp/src/llama.cpp",
             f"{TOP}/vendor/llama.cpp/docs/build.md",
             f"{TOP}/vendor/llama.cpp/ggml/src/ggml-sycl/x.cpp"]
    with tarfile.open(sdist, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(name)
            info.size = len(name)
            tar.addfile(info, io.BytesIO(name.encode()))
    out = gpu_check.pack_sources(sdist, tmp_path)
    with tarfile.open(out) as tar:
        kept = {m.name: tar.extractfile(m).read().decode() for m in tar}
    assert kept == {n: n for n in names[:2]}


@pytest.mark.slow
def test_the_dry_run_measures_every_placement_and_finds_the_tokens_unchanged(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] is True
    rows = report["rows"]
    assert {r["placement"] for r in rows} == {p.name for p in gpu_check.PLACEMENTS}
    assert {r["mode"].split()[0] for r in rows} == set(gpu_check.MODES.split(","))
    assert all(r["same"] for r in rows)
    for r in rows:
        sizes = [n for n, _ in r["verify_cost"]]
        assert sizes[0] == 1 and len(sizes) >= 3
        assert r["draft_tps"] > 0 and r["tok_s"] > 0
    # the experts-in-the-CPU run asked for the override it is named for
    cmds = {r["gpu_check"]["placement"]: r["gpu_check"]["command"] for r in report["results"]}
    assert "-ot exps=CPU" in cmds["MoE, experts in the CPU"]
    assert "--temp 0.8" in cmds["dense, all on the GPU, seeded sampling"]
    assert "| MoE, experts in the CPU | plain |" in (out / "gpu-check.md").read_text()
    assert not (out / "models").exists()  # the dry run's models are deleted after it
