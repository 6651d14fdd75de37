"""scripts/gpu_check.py: the pack's trimming (fast) and the whole run's CPU dry run (slow),
so that the script a lent GPU machine runs once has already run end to end here."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
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


def test_a_placement_that_would_not_fit_is_skipped_with_a_line(tmp_path: Path) -> None:
    p = gpu_check.PLACEMENTS[0]
    ok = gpu_check.worker(gpu_check.DRY, p, (tmp_path / "t", tmp_path / "d"), tmp_path,
                          tmp_path, deadline=time.time() + 5, dry=True)
    assert ok
    step = json.loads((tmp_path / "gpu-check.json").read_text())["steps"][-1]
    assert step["step"] == p.key and step["status"] == "skipped"
    assert "left" in step["note"]
    assert f"| {p.key} | skipped |" in (tmp_path / "gpu-check.md").read_text()


class FakeTarget:
    """Rows that depend on the history alone; a batch's last row off by `skew`."""

    def __init__(self, skew: float) -> None:
        self.history: list[int] = []
        self.skew = skew

    def truncate(self, n: int) -> None:
        del self.history[n:]

    def eval(self, tokens: list[int], logits: str = "last") -> np.ndarray:
        self.history += tokens
        row = np.zeros(10, dtype=np.float32)
        row[len(self.history) % 10] = 2.0
        row[(len(self.history) + 1) % 10] = 1.5
        if len(tokens) > 1:
            row[(len(self.history) + 1) % 10] += self.skew
        return np.stack([row] * (len(tokens) if logits == "all" else 1))


def test_a_mismatch_is_explained_by_its_position_and_both_rows_gaps() -> None:
    got = gpu_check.explain(FakeTarget(skew=0.7), [1, 2, 3], [4, 5, 6, 7], [4, 5, 9, 7], k=4)
    assert got["position"] == 2
    assert (got["plain_token"], got["draft_token"]) == (6, 9)
    assert got["plain"]["gap"] == pytest.approx(0.5)
    assert got["batched"]["gap"] == pytest.approx(0.2)   # 2.2 over 2.0: the order flipped
    assert got["batched"]["top"][0][0] == got["plain"]["top"][1][0]
    assert got["max_abs_diff"] == pytest.approx(0.7)
    assert "first difference at token 2" in got["explain"]


@pytest.mark.slow
def test_a_second_run_keeps_the_build_and_reports_what_did_not_fit(tmp_path: Path) -> None:
    """The GPU path of scripts/gpu-check up to its measurements, on CPU: a fake nvidia-smi,
    a pack whose build is already kept under GPU_CHECK_TMP, a budget too short to make the
    GPU's models. The build is skipped with a line saying so, and the report says why
    nothing was measured."""
    pack, kept, out, bin_ = (tmp_path / n for n in ("pack", "tmp", "out", "bin"))
    (pack / "wheels").mkdir(parents=True)
    sdist = pack / "llama-cpp-python.tar.xz"
    with tarfile.open(sdist, "w:xz") as tar:
        tar.addfile(tarfile.TarInfo("llama_cpp_python-0.0/empty"), io.BytesIO())
    key = hashlib.sha256(sdist.read_bytes()).hexdigest()[:16] + "-sm90"
    (kept / "gpu-check-build" / key).mkdir(parents=True)
    (kept / "gpu-check-build" / key / ".done").touch()
    bin_.mkdir()
    smi = bin_ / "nvidia-smi"
    smi.write_text('#!/bin/sh\ncase "$*" in *compute_cap*) echo 9.0;; '
                   '*) echo "Fake GPU, 1.0, 1 MiB";; esac\n')
    smi.chmod(0o755)
    py = bin_ / "python3"   # this interpreter, as the image's python3
    py.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    py.chmod(0o755)
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT), "GPU_CHECK_PACK": str(pack),
           "GPU_CHECK_TMP": str(kept), "GPU_CHECK_BUDGET_S": "20",
           "PATH": f"{bin_}:{os.environ['PATH']}"}
    run = subprocess.run([str(ROOT / "scripts" / "gpu-check")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert f"build kept ({kept / 'gpu-check-build' / key}" in run.stdout
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["build"] == {"s": 0.0, "how": f"kept: {kept / 'gpu-check-build' / key} "
                                                "(same sdist, sm_90)"}
    assert report["machine"].endswith("GPU Fake GPU, 1.0, 1 MiB")
    assert [(s["step"], s["status"]) for s in report["steps"]] == [("models", "skipped")]
    assert not (kept / "gpu-check-models").exists()


@pytest.mark.slow
def test_the_dry_run_measures_every_section_and_finds_the_tokens_unchanged(
        tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the script runs `python3`: this interpreter's, even where its venv is not on PATH
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    env = {**os.environ, "OUT": str(out), "PYTHONPATH": str(ROOT), "PATH": path}
    run = subprocess.run([str(ROOT / "scripts" / "gpu-check"), "--dry-run"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["dry_run"] is True
    assert [s for s in report["steps"] if s["status"] != "done"] == []
    places = report["placements"]
    assert list(places) == [p.key for p in gpu_check.PLACEMENTS]
    for key, p in places.items():
        steps = next(q for q in gpu_check.PLACEMENTS if q.key == key).steps
        assert set(steps) <= set(p), key
        assert p["load"]["step_ms"] > 0
    # 1. the raw loop and specwire's plain decoding: real rates, the same tokens
    raw = places["dense-gpu"]["raw"]
    assert raw["raw_tps"] > 0 and raw["plain_tps"] > 0 and raw["same_tokens"]
    assert raw["ratio"] == pytest.approx(raw["plain_tps"] / raw["raw_tps"])
    assert 0 < raw["outside_decode_ms"]["raw"] < raw["raw_ms"]   # the argmax, the loop
    assert raw["outside_decode_ms"]["plain"] > 0
    # 2. the curve, 1 to 32, beside both presets
    for p in places.values():
        sizes = [n for n, _ in p["curve"]["measured"]]
        assert sizes == list(gpu_check.DRY.curve_sizes) and sizes[-1] == 32
        assert p["curve"]["measured"][0][1] == 1.0
        assert set(p["curve"]["presets"]) == {"gpu-dense", "seed-moe"}
    # 3. lossless: every mode at every length 1-16, each prompt equal to plain decoding's,
    # drafts verified locally and remotely, rejections among them
    for key in ("dense-gpu", "moe-cpu"):
        ll = places[key]["lossless"]
        assert sorted(ll["lengths"]) == list(range(1, 17)) and ll["mismatches"] == []
        assert "not_run" not in ll
        for mode in gpu_check.DRY.lossless_modes:
            cells = ll["by_mode"][mode]
            assert sorted(map(int, cells)) == list(range(1, 17))
            assert all(c["same"] == c["prompts"] == ll["prompts"] for c in cells.values())
        for mode in ("local", "remote-sync"):
            cells = ll["by_mode"][mode].values()
            assert sum(c["accepted"] for c in cells) > 0
    local = [c for key in ("dense-gpu", "moe-cpu")
             for c in places[key]["lossless"]["by_mode"]["local"].values()]
    assert sum(c["accepted"] for c in local) < sum(c["drafted"] for c in local)  # rejections
    # 4. speedups with plan's prediction, greedy and seeded; tokens as plain decoding's
    for key, kinds in (("dense-gpu", ("speedup", "seeded")), ("moe-cpu", ("speedup",)),
                       ("moe-gpu", ("speedup",))):
        for kind in kinds:
            rows = places[key][kind]["rows"]
            assert [r["mode"].split()[0] for r in rows] == gpu_check.MODES.split(",")
            assert all(r["same"] and r["tok_s"] > 0 for r in rows)
            assert all(r["plan_tps"] for r in rows)
            assert rows[1]["acceptance"] > 0   # a confident target: its copy agrees
    assert "--temp 0.8" in places["dense-gpu"]["seeded"]["command"]
    assert "-ot exps=CPU" in places["moe-cpu"]["command"]
    assert {v["result"] for v in report["probe"].values()} == {"loaded"}
    md = (out / "gpu-check.md").read_text()
    for title in ("## 1. specwire plain against a raw llama.cpp loop", "## 2. Verification cost",
                  "## 3. Lossless", "## 4. Speedups", "| MoE, experts in the CPU | greedy | plain"):
        assert title in md
