"""The GPU check: what the emulation presets stand for (specwire/emulate/regimes.py), run for
real on a lent GPU machine, which can fetch nothing and receives at most 64 MiB of the tree.

    python scripts/gpu_check.py pack          here, online: fill .gpu/ (git ignores it)
    scripts/gpu-check                         there: build, make the models, measure
    python scripts/gpu_check.py run --dry-run here, on CPU: the same run, tiny and unbuilt

`pack` trims llama-cpp-python's sdist to what a CUDA build of the library needs, downloads
the wheels that machine lacks and writes the bundled tokenizer alone (a GGUF without
tensors), so that random-weight models with the real vocabulary can be made there. `run`
makes a dense and a MoE model (F16, random weights: what it measures is time, not text)
with a quantized copy of each as its draft, and runs `specwire bench` on each placement:
the target on the GPU, the MoE's experts in the CPU (-ot exps=CPU), the draft node on the
GPU. Each bench records the verification curve, the draft's speed, plain, local and remote
tokens/s and whether every mode's tokens equal plain decoding's (greedy and seeded). The
figures go to OUT as gpu-check.json and gpu-check.md, for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACK = ROOT / ".gpu"
#: the carried tree's limit, with room for the project itself
PACK_LIMIT = 48 * 2**20

#: llama.cpp's top-level entries a library build reads (its CMake tree, sources, licenses)
KEEP_LLAMA = {"CMakeLists.txt", "LICENSE", "cmake", "common", "ggml", "include", "licenses",
              "src", "vendor"}
#: ggml's backends the GPU machine can use (the rest are other vendors' devices)
KEEP_BACKENDS = {"ggml-cpu", "ggml-cuda", "ggml-rpc", "ggml-blas"}
#: llama-cpp-python's own entries its build reads
KEEP_BINDINGS = {"CMakeLists.txt", "pyproject.toml", "LICENSE.md", "README.md", "llama_cpp",
                 "vendor"}
#: wheels for what the GPU machine's image lacks (KINDS.md) or holds in another version
WHEELS = ("h2", "hpack", "hyperframe", "gguf", "diskcache", "protobuf", "grpcio")


# --------------------------------------------------------------------------- pack (here)


def trimmed(name: str) -> bool:
    """Whether an sdist member (a path under its top folder) is left out of the pack."""
    parts = Path(name).parts[1:]
    if not parts:
        return False
    if parts[0] not in KEEP_BINDINGS:
        return True
    if parts[0] != "vendor" or len(parts) < 3:
        return False
    if parts[1] != "llama.cpp":
        return True
    rest = parts[2:]
    if rest[0] not in KEEP_LLAMA:
        return True
    return (len(rest) >= 3 and rest[:2] == ("ggml", "src") and rest[2].startswith("ggml-")
            and "." not in rest[2] and rest[2] not in KEEP_BACKENDS)


def pack_sources(sdist: Path, dest: Path) -> Path:
    """The sdist's members a CUDA build needs, as dest/llama-cpp-python.tar.xz."""
    out = dest / "llama-cpp-python.tar.xz"
    with tarfile.open(sdist) as src, tarfile.open(out, "w:xz", preset=9) as dst:
        for member in src:
            if trimmed(member.name):
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return out


def pack_tokenizer(dest: Path) -> Path:
    """The bundled model's tokenizer keys in a GGUF of no tensors (the models' vocabulary)."""
    import gguf

    from specwire.assets import models
    reader = gguf.GGUFReader(models.ensure_model("base", progress=False))
    out = dest / "tokenizer.gguf"
    w = gguf.GGUFWriter(str(out), arch="llama")
    for name, f in reader.fields.items():
        if name.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def pack(sdist: Path | None, dest: Path) -> None:
    import importlib.metadata as md
    dest.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            version = md.version("llama-cpp-python")
            _pip("download", "--no-deps", "--no-binary", ":all:", "-d", tmp,
                 f"llama-cpp-python=={version}")
            sdist = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        pack_sources(sdist, dest)
    wheels = dest / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28, 34)]
    for name in WHEELS:
        _pip("download", "--no-deps", "--only-binary=:all:", "--python-version=3.12",
             "--implementation=cp", *platforms, "-d", str(wheels),
             f"{name}=={md.version(name)}")
    pack_tokenizer(dest)
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"{dest}: {size / 2**20:.1f} MiB (limit {PACK_LIMIT / 2**20:.0f} MiB)")
    if size > PACK_LIMIT:
        sys.exit(f"{dest} is {size / 2**20:.1f} MiB, over the {PACK_LIMIT / 2**20:.0f} MiB "
                 "that may travel with the tree")


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


# --------------------------------------------------------------------------- run (there)


@dataclass(frozen=True, slots=True)
class Placement:
    """One bench run: a model and where its weights sit."""

    name: str
    model: str              # "dense" or "moe"
    flags: tuple[str, ...]  # the target's placement flags
    sampled: bool = False   # seeded sampling instead of greedy


@dataclass(frozen=True, slots=True)
class Plan:
    """The models' shapes and the bench's size: the GPU's, or the CPU dry run's."""

    dense: dict = field(default_factory=dict)
    moe: dict = field(default_factory=dict)
    ngl: str = "99"
    bench: tuple[str, ...] = ()


GPU = Plan(
    # about 3.2B parameters in F16 (6.4 GB), half of them the embeddings of Gemma's vocabulary
    dense=dict(n_layer=16, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192, n_expert=0),
    # 12 layers of 32 experts, 4 used: about 2.9B parameters (5.8 GB), 0.3B of them active
    moe=dict(n_layer=12, n_embd=2048, n_head=16, n_head_kv=4, n_ff=768, n_expert=32,
             n_expert_used=4),
    bench=("--prompts", "code", "--limit", "4", "-n", "64", "--rtt", "1ms", "--draft-p-min", "0"),
)
DRY = Plan(
    dense=dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=4, n_ff=128, n_expert=0),
    moe=dict(),   # the test fixture's shape
    ngl="0",
    bench=("--prompts", "code", "--limit", "1", "-n", "8", "--rtt", "1ms", "--draft-p-min", "0",
           "-t", "1", "-td", "1"),
)
PLACEMENTS = (
    Placement("dense, all on the GPU", "dense", ("-ngl", "{ngl}")),
    Placement("dense, all on the GPU, seeded sampling", "dense", ("-ngl", "{ngl}"), True),
    Placement("MoE, all on the GPU", "moe", ("-ngl", "{ngl}")),
    Placement("MoE, experts in the CPU", "moe", ("-ngl", "{ngl}", "-ot", "exps=CPU")),
)
MODES = "plain,local,remote-pipelined"


def make_models(plan: Plan, folder: Path, tokenizer: Path) -> dict[str, tuple[Path, Path]]:
    """(target, draft) per model: random F16 weights, and their Q4_0 copy as the draft."""
    from specwire.assets.models import make_draft
    from specwire.assets.moe import MoeSpec, write_moe
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, shape in (("dense", plan.dense), ("moe", plan.moe)):
        spec = replace(MoeSpec(weights="f16"), **shape)
        target, draft = folder / f"{name}-f16.gguf", folder / f"{name}-q4_0.gguf"
        t0 = time.perf_counter()
        write_moe(target, spec, tokenizer)
        make_draft(target, draft, "Q4_0", embedding_type=None)
        print(f"{name}: {target.stat().st_size / 2**30:.2f} GiB target, "
              f"{draft.stat().st_size / 2**30:.2f} GiB draft in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        out[name] = (target, draft)
    return out


def bench(p: Placement, plan: Plan, pair: tuple[Path, Path], out: Path) -> dict:
    """One `specwire bench` run of the placement; its results.json, with its command."""
    flags = [f.format(ngl=plan.ngl) for f in p.flags]
    folder = out / p.name.replace(",", "").replace(" ", "-")
    cmd = [sys.executable, "-m", "specwire", "bench", "-m", str(pair[0]), "-md", str(pair[1]),
           *flags, "-ngld", plan.ngl, "--modes", MODES, *plan.bench, "--no-plots",
           "--no-progress", "--out", str(folder)]
    if p.sampled:
        cmd += ["--temp", "0.8", "-s", "42"]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    result = json.loads((folder / "results.json").read_text())
    result["gpu_check"] = {"placement": p.name, "command": " ".join(cmd)}
    return result


def summary(results: list[dict]) -> list[dict]:
    """Per placement and mode: tok/s, speedup, acceptance, and whether tokens equal plain's."""
    rows = []
    for r in results:
        cal = r["calibration"]
        for rec in r["records"]:
            rows.append({
                "placement": r["gpu_check"]["placement"], "mode": rec["label"],
                "tok_s": rec["tokens_per_s"]["median"],
                "speedup": rec["speedup"]["ratio_of_medians"],
                "acceptance": rec.get("acceptance"), "same": rec["tokens_match_plain"],
                "verify_cost": cal.get("verify_cost"), "draft_tps": cal.get("draft_tps"),
            })
    return rows


def markdown(rows: list[dict], build_s: float | None, total_s: float) -> str:
    lines = ["| placement | mode | tok/s | speedup | accept | same as plain | verify cost "
             "(n: plain steps) | draft tok/s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        cost = " ".join(f"{n}:{c:.2f}" for n, c in r["verify_cost"] or [])
        acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
        lines.append(f"| {r['placement']} | {r['mode']} | {r['tok_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {acc} | {'yes' if r['same'] else 'NO'} | "
                     f"{cost} | {r['draft_tps'] or 0:.0f} |")
    took = f"build {build_s:.0f} s, " if build_s is not None else ""
    lines.append(f"\n{took}{total_s:.0f} s in all.")
    return "\n".join(lines) + "\n"


def run(dry: bool, out: Path, build_s: float | None) -> int:
    t0 = time.perf_counter()
    plan = DRY if dry else GPU
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = PACK / "tokenizer.gguf"
    if dry or not tokenizer.exists():
        from specwire.assets import models
        tokenizer = models.ensure_model("base", progress=False)
    folder = out / "models" if dry else Path(tempfile.gettempdir()) / "gpu-check-models"
    pairs = make_models(plan, folder, tokenizer)
    results = [bench(p, plan, pairs[p.model], out) for p in PLACEMENTS]
    rows = summary(results)
    total = time.perf_counter() - t0 + (build_s or 0)
    report = {"dry_run": dry, "build_s": build_s, "total_s": total, "rows": rows,
              "results": results}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    text = markdown(rows, build_s, total)
    (out / "gpu-check.md").write_text(text)
    print(text)
    if dry:
        shutil.rmtree(folder, ignore_errors=True)
    return 0 if all(r["same"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: fill .gpu/ with what the GPU machine needs")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (default: download it)")
    r = sub.add_parser("run", help="there: make the models and measure (after the build)")
    r.add_argument("--dry-run", action="store_true", help="on CPU, tiny models, no build")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    r.add_argument("--build-s", type=float, help="the build's seconds, for the report")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        pack(a.sdist, PACK)
        return 0
    return run(a.dry_run, a.out, a.build_s)


if __name__ == "__main__":
    sys.exit(main())
