"""The GPU check: what the emulation presets stand for (specwire/emulate/regimes.py), run for
real on a lent GPU machine, which can fetch nothing and receives at most 64 MiB of the tree.

    python scripts/gpu_check.py pack          here, online: fill .gpu/ (git ignores it)
    scripts/gpu-check                         there: build once, make the models, measure
    scripts/gpu-check --dry-run               here, on CPU: the same steps, tiny and unbuilt

`pack` trims llama-cpp-python's sdist to what a CUDA build of the library needs, downloads
the wheels that machine lacks and writes the bundled tokenizer alone (a GGUF without
tensors), so that random-weight models with the real vocabulary can be made there.

`run` makes a dense and a MoE target (F16, random but confident weights: their Q4_0 copies,
the drafts, agree with them most of the time; specwire/assets/moe.py, _confident) and
measures, each placement in a process of its own that loads its models once:

  1. raw: specwire's plain decoding against llama.cpp's own loop on the same context (one
     llama_decode of one token and an argmax per step, through llama_cpp's C API): tokens/s
     and their ratio, the Python cost per step;
  2. curve: the verification cost t_v(n) / t_v(1) for n = 1 to 32, beside the curves the
     presets gpu-dense and seed-moe claim;
  3. lossless: greedy output with a local draft and a remote node drafting ahead (the dry
     run adds a node waited for), at every draft length 1-16, against plain decoding token
     for token; a prompt
     that differs is reported with the position and the target's top two logits there,
     computed as plain decoding does (a batch of one) and as a verification does;
  4. speedup, seeded: `specwire bench`'s sweep (plain, local, remote pipelined) on the same
     loaded models, greedy and seeded, with plan's prediction of each configuration.

The placements, most valuable first: the dense target all on the GPU (1-4), the MoE with
its experts in the CPU (-ot exps=CPU: 2, 4, 1, 3), the MoE all on the GPU (2, 4); the draft
(local, and the node's) on the GPU. Between the first and the second, a probe loads the
dense target bare with numpy imported before llama_cpp and after (the order that crashed
on an H200), and takes cuda-gdb's backtrace where it crashes. The run has a deadline (the
shell script's budget, the build included): a step that would not end before it is skipped
with a line saying so, the lossless sweep stops at it (its lengths in an order that spreads
over 1-16 first), and a process still running at it is stopped. The report, OUT/gpu-check.json
and OUT/gpu-check.md, is rewritten after every step, so a run cut short returns what it
measured; it names every command that reproduces a figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# this tree's specwire, whatever is installed (the GPU machine has none)
sys.path.insert(0, str(ROOT))
PACK = ROOT / os.environ.get("GPU_CHECK_PACK", ".gpu")
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


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True, slots=True)
class Plan:
    """The models' shapes and each measurement's size: the GPU's, or the CPU dry run's."""

    dense: dict
    moe: dict
    ngl: str
    #: specwire bench flags every placement shares (threads, context, sampling extras)
    flags: tuple[str, ...]
    prompts: int           # code prompts for the speedups and the lossless sweep
    n: int                 # tokens per prompt
    raw_n: int             # tokens of the raw loop and specwire's plain decoding, per try
    raw_tries: int
    curve_sizes: tuple[int, ...]
    curve_reps: int
    lossless_lengths: tuple[int, ...]
    #: the drafters of the lossless sweep: on the GPU local and the node drafting ahead; on
    #: a CPU, whose tiny draft costs what its target does (the vocabulary's output matrix),
    #: the node drafting ahead verifies little, so the node waited for is swept too
    lossless_modes: tuple[str, ...]
    #: drafters swept after those, at every length, where the time budget leaves room
    lossless_after: tuple[str, ...] = ()
    #: the bigram margin of the confident targets (specwire/assets/moe.py, _confident):
    #: on CPU a dense 16 x 1024 target's Q4_0 copy had greedy acceptance 0.77 at 8 and
    #: 0.83 at 12 (k = 8, three code prompts, 48 tokens each)
    confidence: float = 12.0


#: every draft length 1-16, in an order that spreads over the range first, so that a sweep
#: cut short by the time budget still covers it
LENGTHS = (1, 16, 8, 4, 2, 12, 6, 3, 14, 10, 5, 7, 9, 11, 13, 15)

GPU = Plan(
    # about 3.2B parameters in F16 (6.4 GB), half of them the embeddings of Gemma's vocabulary
    dense=dict(n_layer=16, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192, n_expert=0),
    # 12 layers of 32 experts, 4 used: about 2.9B parameters (5.8 GB), 0.3B of them active
    moe=dict(n_layer=12, n_embd=2048, n_head=16, n_head_kv=4, n_ff=768, n_expert=32,
             n_expert_used=4),
    ngl="99",
    flags=("-c", "2048", "-t", "8", "-td", "2", "--shared-cpus"),
    prompts=4, n=64, raw_n=128, raw_tries=3,
    curve_sizes=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32), curve_reps=5,
    lossless_lengths=LENGTHS,
    lossless_modes=("local", "remote-pipelined"),
    lossless_after=("remote-sync",),
)
#: tiny shapes; a confidence of 5 leaves the 64-wide target's bigram about 4.3 standard
#: deviations above the rest, near the largest of the others (4.9): its Q4_0 copy is
#: accepted about 60% of the time, so that rounds are rejected too
DRY = Plan(
    dense=dict(n_layer=2, n_embd=64, n_head=4, n_head_kv=4, n_ff=128, n_expert=0),
    moe=dict(),   # the test fixture's shape
    ngl="0",
    flags=("-c", "512", "-t", "1", "-td", "1"),
    prompts=1, n=12, raw_n=16, raw_tries=2,
    curve_sizes=(1, 2, 4, 8, 16, 32), curve_reps=2,
    lossless_lengths=LENGTHS,
    lossless_modes=("local", "remote-sync", "remote-pipelined"),
    confidence=5.0,
)


@dataclass(frozen=True, slots=True)
class Placement:
    """One target placement, measured in one process (the models loaded once): its steps
    in the order they run, the most valuable first."""

    key: str
    name: str
    model: str              # "dense" or "moe"
    flags: tuple[str, ...]  # the target's placement flags
    preset: str             # the emulation preset it stands for
    steps: tuple[str, ...]
    #: seconds it takes on the GPU machine, about (the budget's guess before it runs)
    gpu_s: float
    #: seconds its lossless sweep (open-ended: it runs to the deadline) leaves for the
    #: placements after it, on the GPU
    reserve_s: float = 0.0


PLACEMENTS = (
    Placement("dense-gpu", "dense, all on the GPU", "dense", ("-ngl", "{ngl}"), "gpu-dense",
              ("raw", "curve", "lossless", "speedup", "seeded"), 120, reserve_s=60),
    Placement("moe-cpu", "MoE, experts in the CPU", "moe",
              ("-ngl", "{ngl}", "-ot", "exps=CPU"), "seed-moe",
              ("curve", "speedup", "raw", "lossless"), 120, reserve_s=30),
    Placement("moe-gpu", "MoE, all on the GPU", "moe", ("-ngl", "{ngl}"), "gpu-dense",
              ("curve", "speedup"), 45),
)
MODES = "plain,local,remote-pipelined"
#: every drafter a lossless sweep may run, in the report's order
LOSSLESS_MODES = ("local", "remote-sync", "remote-pipelined")
RTT = "1ms"
#: seconds kept back at the end for the report and the exit
MARGIN_S = 10.0


# --------------------------------------------------------------------------- models


def model_paths(plan: Plan, folder: Path) -> dict[str, tuple[Path, Path]]:
    """(target, draft) per model, named by the recipe's hash: a changed recipe is a new file."""
    out = {}
    for name, spec in model_specs(plan).items():
        out[name] = (folder / f"{name}-{spec.key()}-f16.gguf",
                     folder / f"{name}-{spec.key()}-q4_0.gguf")
    return out


def model_specs(plan: Plan) -> dict:
    from specwire.assets.moe import MoeSpec
    return {name: replace(MoeSpec(weights="f16", confidence=plan.confidence), **shape)
            for name, shape in (("dense", plan.dense), ("moe", plan.moe))}


def make_models(plan: Plan, folder: Path, tokenizer: Path, targets: bool = True,
                drafts: bool = True) -> dict:
    """Random confident F16 targets (specwire/assets/moe.py) and their Q4_0 copies as the
    drafts, each made only if missing; what each took, in seconds (0: kept)."""
    from specwire.assets.models import atomic_output, make_draft
    from specwire.assets.moe import write_moe
    folder.mkdir(parents=True, exist_ok=True)
    specs, took = model_specs(plan), {}
    for name, (target, draft) in model_paths(plan, folder).items():
        t0 = time.perf_counter()
        if targets and not target.exists():
            with atomic_output(target) as tmp:
                write_moe(tmp, specs[name], tokenizer)
            took[f"{name} target"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if drafts and not draft.exists():
            make_draft(target, draft, "Q4_0", embedding_type=None)
            took[f"{name} draft"] = time.perf_counter() - t0
    for k, v in took.items():
        print(f"gpu-check: {k} made in {v:.0f} s", flush=True)
    return took


# --------------------------------------------------------------------------- the report


class Report:
    """gpu-check.json and gpu-check.md in OUT, rewritten after every step, so that a run
    cut short still returns what it measured."""

    def __init__(self, out: Path) -> None:
        self.path = out / "gpu-check.json"

    def load(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def put(self, keys: tuple[str, ...], value: object) -> None:
        data = self.load()
        node = data
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        self.write(data)

    def step(self, name: str, status: str, seconds: float, note: str = "") -> None:
        """One line of the run's log: a step done, skipped (and why) or failed."""
        data = self.load()
        data.setdefault("steps", []).append({"step": name, "status": status,
                                             "s": round(seconds, 1), "note": note})
        self.write(data)
        print(f"gpu-check: {name}: {status} ({seconds:.0f} s){': ' + note if note else ''}",
              flush=True)

    def write(self, data: dict) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.path)
        md = self.path.with_suffix(".md")
        tmp = md.with_suffix(".tmp")
        tmp.write_text(markdown(data))
        tmp.replace(md)


def markdown(d: dict) -> str:
    """The report as docs/benchmarks.md takes it: the four measurements, then the run."""
    out = [f"# gpu-check{' (dry run, CPU)' if d.get('dry_run') else ''}", ""]
    if d.get("machine"):
        out += [f"{d['machine']}", ""]
    places = d.get("placements", {})
    out += ["## 1. specwire plain against a raw llama.cpp loop", "",
            "One llama_decode of one token and an argmax per step, through the same library, "
            "model and context; tokens/s after the first token.", "",
            "| placement | raw loop tok/s | specwire plain tok/s | ratio | per step: raw ms, "
            "specwire's extra ms | outside llama_decode: raw, specwire ms | same tokens |",
            "|---|---|---|---|---|---|---|"]
    for p in places.values():
        r = p.get("raw")
        if r:
            o = r["outside_decode_ms"]
            out.append(f"| {p['name']} | {r['raw_tps']:.1f} | {r['plain_tps']:.1f} | "
                       f"{r['ratio']:.3f} | {r['raw_ms']:.3f}, {r['extra_ms']:+.3f} | "
                       f"{o['raw']:.3f}, {o['plain']:.3f} | "
                       f"{'yes' if r['same_tokens'] else 'NO'} |")
    out += ["", "## 2. Verification cost (t_v(n) / t_v(1)) against the presets", ""]
    for p in places.values():
        c = p.get("curve")
        if not c:
            continue
        sizes = [n for n, _ in c["measured"]]
        out += [f"{p['name']} (t_v(1) = {c['ms'][0][1]:.2f} ms):", "",
                "| n | " + " | ".join(map(str, sizes)) + " |",
                "|---" * (len(sizes) + 1) + "|",
                "| measured | " + " | ".join(f"{v:.2f}" for _, v in c["measured"]) + " |"]
        for name, pts in c["presets"].items():
            out.append(f"| {name} | " + " | ".join(f"{v:.2f}" for _, v in pts) + " |")
        out.append("")
    out += ["## 3. Lossless: greedy output with a draft against plain decoding", ""]
    for p in places.values():
        ll = p.get("lossless")
        if not ll:
            continue
        out += [f"{p['name']}, {ll['prompts']} prompts x {ll['n']} tokens; prompts whose "
                "tokens equal plain decoding's, per draft length (drafted tokens accepted):",
                "",
                "| mode | " + " | ".join(f"k={k}" for k in sorted(ll["lengths"])) + " |",
                "|---" * (len(ll["lengths"]) + 1) + "|"]
        for mode in (m for m in LOSSLESS_MODES if m in ll["by_mode"]):
            cells = [ll["by_mode"][mode].get(str(k)) for k in sorted(ll["lengths"])]
            out.append(f"| {mode} | " + " | ".join(
                "-" if c is None else f"{c['same']}/{c['prompts']} ({c['accepted']}/"
                f"{c['drafted']})" for c in cells) + " |")
        for m in ll["mismatches"]:
            out.append(f"\n- {m['mode']} k={m['k']} prompt {m['prompt']}: {m['explain']}")
        if ll.get("not_run"):
            out.append(f"\nnot run (time budget): {ll['not_run']}")
        out.append("")
    out += ["## 4. Speedups over plain decoding, and plan's prediction", "",
            "| placement | sampling | mode | tok/s | speedup | accept | plan predicts | "
            "same as plain |", "|---|---|---|---|---|---|---|---|"]
    for p in places.values():
        for kind in ("speedup", "seeded"):
            sp = p.get(kind)
            for r in (sp or {}).get("rows", []):
                acc = "-" if r["acceptance"] is None else f"{100 * r['acceptance']:.0f}%"
                plan = ("-" if r["plan_tps"] is None else
                        f"{r['plan_tps']:.1f} ({r['plan_error_pct']:+.0f}%)")
                out.append(f"| {p['name']} | {sp['sampling']} | {r['mode']} | "
                           f"{r['tok_s']:.1f} | {r['speedup']:.2f}x | {acc} | {plan} | "
                           f"{'yes' if r['same'] else 'NO'} |")
    m, plan = d.get("models", {}), d.get("plan", {})
    if m:
        out += ["", "## The models", "",
                f"Random F16 targets made confident (specwire/assets/moe.py, confidence "
                f"{plan.get('confidence')}), each drafted by its Q4_0 copy: "
                + "; ".join(f"{k}: {v}" for k, v in m.get("shapes", {}).items()) + ". Made: "
                + (", ".join(f"{k} {v:.0f} s" for k, v in m.get("made_s", {}).items())
                   or "all kept") + ". The drafts' acceptance is section 4's."]
    out += ["", "## Loading, and the import-order probe", ""]
    for p in places.values():
        if p.get("load"):
            ld = p["load"]
            out.append(f"- {p['name']}: loaded in {ld['s']:.1f} s, plain step "
                       f"{ld['step_ms']:.2f} ms")
    if d.get("probe"):
        for order, r in d["probe"].items():
            out.append(f"- load with {order} first: {r['result']}")
    if d.get("backtrace"):
        out += ["", "```", d["backtrace"], "```"]
    out += ["", "## The run", "", "| step | status | s | note |", "|---|---|---|---|"]
    for st in d.get("steps", []):
        out.append(f"| {st['step']} | {st['status']} | {st['s']:.0f} | {st['note']} |")
    build = d.get("build") or {}
    if build.get("how") or d.get("total_s"):
        out += ["", f"Build: {build.get('how') or 'none (dry run)'}. "
                f"{d.get('total_s', 0):.0f} s in all, the build included."]
    out += ["", "Commands (the speedups' bench reproduces them alone):", ""]
    for p in places.values():
        if p.get("command"):
            out.append(f"- {p['name']}: `{p['command']}`")
    if d.get("command"):
        out.append(f"- the whole check: `{d['command']}`")
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- measure (a worker)


def bench_argv(plan: Plan, p: Placement, pair: tuple[Path, Path], out: Path) -> list[str]:
    """The `specwire bench` flags of the placement's speedups (and its models' loading)."""
    return ["-m", str(pair[0]), "-md", str(pair[1]),
            *(f.format(ngl=plan.ngl) for f in p.flags), "-ngld", plan.ngl, *plan.flags,
            "--modes", MODES, "--prompts", "code", "--limit", str(plan.prompts),
            "-n", str(plan.n), "--ignore-eos", "--rtt", RTT, "--draft-p-min", "0",
            "--no-plots", "--no-progress", "--out", str(out)]


class Worker:
    """One placement's measurements on its models, loaded once; each step's figures go
    into the report as it ends, and a step that would not end before the deadline is
    skipped with a line saying so."""

    def __init__(self, plan: Plan, p: Placement, pair: tuple[Path, Path], out: Path,
                 work: Path, deadline: float) -> None:
        self.plan, self.p, self.pair, self.deadline = plan, p, pair, deadline
        self.dry = plan is DRY
        self.report = Report(out)
        self.work = work / p.key
        self.argv = bench_argv(plan, p, pair, self.work / "bench")
        self.step_s = 0.0   # a plain step's seconds, measured after loading
        self.failed = False

    def left(self) -> float:
        return self.deadline - time.time() - MARGIN_S

    def put(self, key: str, value: object) -> None:
        self.report.put(("placements", self.p.key, key), value)

    def run(self) -> None:
        import contextlib

        from specwire.backend.llama import LlamaBackend
        from specwire.bench.modes import Drafters
        from specwire.bench.prompts import resolve, tokenize
        from specwire.cli.commands import bench as bench_cmd
        from specwire.cli.main import build_parser
        a = build_parser().parse_args(["bench", *self.argv])
        self.settings = bench_cmd.settings_from_args(a)
        self.bench = bench_cmd.bench_settings(a, self.settings.modes)
        self.put("name", self.p.name)
        self.put("command", "specwire bench " + " ".join(self.argv))
        t0 = time.perf_counter()
        self.target = LlamaBackend(self.bench.target, tree_branches=self.bench.remote.tree)
        self.prompts = [tokenize(q, self.target) for q in resolve("code", self.plan.prompts)]
        self.step_s = self.plain_step_s()
        self.put("load", {"s": time.perf_counter() - t0, "step_ms": 1000 * self.step_s,
                          "flags": " ".join(f.format(ngl=self.plan.ngl) for f in self.p.flags)})
        self.report.step(f"{self.p.key}: load", "done", time.perf_counter() - t0,
                         f"plain step {1000 * self.step_s:.2f} ms")
        with contextlib.ExitStack() as stack:
            self.drafters = Drafters(self.bench, self.target, self.work, stack)
            for step in self.p.steps:
                need = self.estimate(step)
                name = f"{self.p.key}: {step}"
                if need > self.left():
                    self.report.step(name, "skipped", 0.0, f"needs about {need:.0f} s, "
                                     f"{max(0.0, self.left()):.0f} s left")
                    continue
                t0 = time.perf_counter()
                try:
                    note = getattr(self, f"step_{step}")()
                except Exception as e:   # the next steps may still run: report, go on
                    import traceback
                    traceback.print_exc()
                    self.failed = True
                    self.report.step(name, "failed", time.perf_counter() - t0,
                                     f"{type(e).__name__}: {e}"[:600])
                    continue
                self.report.step(name, "done", time.perf_counter() - t0, note or "")

    def plain_step_s(self) -> float:
        import numpy as np
        t = self.target
        t.truncate(0)
        tok = int(np.argmax(t.eval(self.prompts[0], logits="last")[-1]))
        t0, n = time.perf_counter(), 8
        for _ in range(n):
            tok = int(np.argmax(t.eval([tok], logits="last")[-1]))
        t.truncate(0)
        return (time.perf_counter() - t0) / n

    def estimate(self, step: str) -> float:
        """The step's seconds, about, in plain steps measured at load (a drafted token
        costs about a step where the draft is slow: an upper bound)."""
        pl, s = self.plan, self.step_s
        tokens = pl.prompts * (pl.n + 8)
        return {
            "raw": 2 * pl.raw_tries * pl.raw_n * s,
            "curve": pl.curve_reps * sum(max(1.0, n / 8) for n in pl.curve_sizes) * s + 1,
            # one length of one mode, at least (the sweep stops at the deadline)
            "lossless": 2 * tokens * s + 5,
            "speedup": 3 * tokens * s + 40 * s + 10,
            "seeded": 3 * tokens * s + 40 * s + 5,
        }[step]

    # -- 1. the Python cost per step

    def step_raw(self) -> str:
        """The raw loop and specwire's plain decoding, taking turns; medians."""
        import statistics
        raw, plain, same = [], [], True
        raw_out, plain_out = [], []
        raw_loop(self.target, self.prompts[0], 8)   # warm both paths up
        self.plain(self.prompts[0], 8)
        for _ in range(self.plan.raw_tries):
            rt, rtoks, rout = raw_loop(self.target, self.prompts[0], self.plan.raw_n)
            pt, ptoks, pout = self.plain(self.prompts[0], self.plan.raw_n)
            raw.append(rt)
            plain.append(pt)
            raw_out.append(rout)
            plain_out.append(pout)
            same = same and rtoks == ptoks
        r, p = statistics.median(raw), statistics.median(plain)
        ro, po = statistics.median(raw_out), statistics.median(plain_out)
        self.put("raw", {"raw_tps": r, "plain_tps": p, "ratio": p / r, "raw_ms": 1000 / r,
                         "extra_ms": 1000 / p - 1000 / r, "tokens": self.plan.raw_n,
                         "outside_decode_ms": {"raw": ro, "plain": po},
                         "tries": {"raw": raw, "plain": plain}, "same_tokens": same,
                         "steps": self.plan.raw_n - 1})
        return (f"plain/raw {p / r:.3f} ({p:.1f} / {r:.1f} tokens/s); outside llama_decode "
                f"{po:.3f} / {ro:.3f} ms a step")

    def plain(self, prompt: list[int], n: int) -> tuple[float, list[int], float]:
        """specwire's plain decoding, timed as raw_loop is (from the first token on):
        tokens/s, the tokens, and the milliseconds per step spent outside llama_decode."""
        from specwire.config import DraftParams, SamplingParams
        from specwire.engine.engine import Engine, Request
        t = self.target
        t.truncate(0)
        gen = Engine(t).generate(Request(
            prompt, n, SamplingParams(temperature=0.0), DraftParams(enabled=False), True))
        next(gen)   # the prompt, and the first token
        d0, t0 = t.decode_s, time.perf_counter()
        for _ in gen:
            pass
        elapsed, decode = time.perf_counter() - t0, t.decode_s - d0
        t.truncate(0)
        steps = len(gen.tokens) - 1
        return steps / elapsed, gen.tokens, 1000 * (elapsed - decode) / steps

    # -- 2. the verification cost curve

    def step_curve(self) -> str:
        from specwire.bench.calibrate import batch_times
        from specwire.emulate.regimes import PRESETS
        from specwire.policy.throughput import VerifyCurve
        times = batch_times(self.target, self.prompts[0], self.plan.curve_sizes,
                            self.plan.curve_reps)
        base = times[1]
        measured = [[n, t / base] for n, t in sorted(times.items())]
        presets = {}
        for name in ("gpu-dense", "seed-moe"):
            curve = VerifyCurve.parse(PRESETS[name].verify_cost)
            presets[name] = [[n, curve.cost(n)] for n, _ in measured]
        self.put("curve", {"measured": measured, "ms": [[n, 1000 * t] for n, t in
                                                        sorted(times.items())],
                           "presets": presets, "preset": self.p.preset})
        return ("t_v: " + " ".join(f"{n}:{c:.2f}" for n, c in measured)
                + f" (preset {self.p.preset})")

    # -- 3. lossless on this backend

    def step_lossless(self) -> str:
        from specwire.bench.runner import RunParams, reset_state
        from specwire.config import DraftParams, SamplingParams
        from specwire.engine.engine import Engine, Request
        pl = self.plan
        greedy = SamplingParams(temperature=0.0)
        refs = [self.plain(q, pl.n)[1] for q in self.prompts]
        out = {"prompts": len(refs), "n": pl.n, "lengths": [], "by_mode": {},
               "mismatches": []}
        order = [(k, m) for modes in (pl.lossless_modes, pl.lossless_after)
                 for k in pl.lossless_lengths for m in modes]
        # what the sweep leaves for the placements after this one (the dense target's
        # speedups come after its sweep: their own estimate is kept for them too)
        reserve = 0.0 if self.dry else self.p.reserve_s + sum(
            self.estimate(s) for s in self.p.steps[self.p.steps.index("lossless") + 1:])
        per = None
        for i, (k, mode) in enumerate(order):
            if per is not None and per > self.left() - reserve:
                out["not_run"] = ", ".join(f"{m} k={kk}" for kk, m in order[i:])
                break
            t0 = time.perf_counter()
            cfg = RunParams(mode, k, rtt_s=None if mode == "local" else 0.001)
            same = drafted = accepted = 0
            with self.drafters.build(cfg) as (drafter, _emu):
                for j, (q, ref) in enumerate(zip(self.prompts, refs, strict=True)):
                    engine = Engine(self.target, drafter)
                    reset_state(engine)
                    gen = engine.generate(Request(
                        q, pl.n, greedy, DraftParams(n_max=k, n_min=1, p_min=0.0), True))
                    got = gen.run()
                    drafted += gen.stats.draft_n
                    accepted += gen.stats.draft_n_accepted
                    if got == ref:
                        same += 1
                    else:
                        out["mismatches"].append({"mode": mode, "k": k, "prompt": j,
                                                  **explain(self.target, q, ref, got, k)})
            self.target.truncate(0)
            out["by_mode"].setdefault(mode, {})[str(k)] = {
                "same": same, "prompts": len(refs), "drafted": drafted, "accepted": accepted}
            if k not in out["lengths"]:
                out["lengths"].append(k)
            self.put("lossless", out)
            per = time.perf_counter() - t0
        runs = sum(len(v) for v in out["by_mode"].values())
        return f"{runs} (mode, length) runs, {len(out['mismatches'])} prompts differed"

    # -- 4. speedups, and plan's prediction

    def step_speedup(self) -> str:
        return self.sweep("speedup", "greedy", ())

    def step_seeded(self) -> str:
        return self.sweep("seeded", "seeded (temp 0.8, seed 42)", ("--temp", "0.8", "-s", "42"))

    def sweep(self, key: str, label: str, extra: tuple[str, ...]) -> str:
        import argparse

        from specwire.bench.sweep import run_on
        from specwire.cli.args import draft_params, sampling_params
        from specwire.cli.commands import bench as bench_cmd
        from specwire.cli.main import build_parser
        argv = [*self.argv, *extra]
        argv[argv.index("--out") + 1] = str(self.work / key)
        a = build_parser().parse_args(["bench", *argv])
        s = bench_cmd.settings_from_args(a)
        one = argparse.Namespace(**{**vars(a), "draft_max": s.draft_max[0],
                                    "draft_policy": s.policies[0]})
        res = run_on(s, self.bench, sampling_params(a), draft_params(one), self.target,
                     self.drafters, self.drafters.stack)
        rows = []
        for rec in res["records"]:
            plan = rec.get("plan") or {}
            rows.append({"mode": rec["label"], "tok_s": rec["tokens_per_s"]["median"],
                         "speedup": rec["speedup"]["ratio_of_medians"],
                         "acceptance": rec.get("acceptance"), "same": rec["tokens_match_plain"],
                         "drafted": rec["draft_n"], "accepted": rec["draft_n_accepted"],
                         "plan_tps": plan.get("predicted_tps"),
                         "plan_error_pct": plan.get("error_pct")})
        cal = res["calibration"]
        self.put(key, {"sampling": label, "rows": rows, "command": "specwire bench " +
                       " ".join(argv), "draft_tps": cal["draft_tps"],
                       "verify_cost": cal["verify_cost"], "lossless_expected":
                       res["settings"]["lossless_expected"]})
        return ", ".join(f"{r['mode']} {r['speedup']:.2f}x" for r in rows[1:])


def raw_loop(target, prompt: list[int], n: int) -> tuple[float, list[int], float]:
    """llama.cpp's own loop on the target's context, through llama_cpp's C API: the prompt
    as one batch, then n - 1 steps of one llama_decode of one token and an argmax of its
    logits row. Tokens/s after the first token, the tokens, and the milliseconds per step
    spent outside llama_decode (the argmax, the loop)."""
    import llama_cpp as C
    import numpy as np
    target.truncate(0)
    ctx, n_vocab = target.ctx, target.n_vocab
    first = int(np.argmax(target.eval(prompt, logits="last")[-1]))
    batch = C.llama_batch_init(1, 0, 1)
    try:
        batch.n_tokens = 1
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = 0
        batch.logits[0] = 1
        tokens, tok, pos, decode = [first], first, len(prompt), 0.0
        t0 = time.perf_counter()
        for _ in range(n - 1):
            batch.token[0] = tok
            batch.pos[0] = pos
            d0 = time.perf_counter()
            rc = C.llama_decode(ctx, batch)
            decode += time.perf_counter() - d0
            if rc != 0:
                raise RuntimeError(f"llama_decode failed at position {pos}")
            row = np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
            tok = int(row.argmax())
            tokens.append(tok)
            pos += 1
        elapsed = time.perf_counter() - t0
    finally:
        C.llama_batch_free(batch)
        target.truncate(0)   # the cells past the prompt go with it
    return (n - 1) / elapsed, tokens, 1000 * (elapsed - decode) / (n - 1)


def explain(target, prompt: list[int], ref: list[int], got: list[int], k: int) -> dict:
    """Where a drafted output first differs from plain decoding's: the position, both
    tokens, and the target's top two logits there as plain decoding computes them (a
    batch of one token) and as a verification does (a batch of k + 1), with their gaps."""
    import numpy as np
    i = next((j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b),
             min(len(ref), len(got)))
    history = prompt + ref[:i]
    rows = {}
    for name, tail in (("plain", 1), ("batched", min(k + 1, len(history)))):
        target.truncate(0)
        if len(history) > tail:
            target.eval(history[:-tail], logits="none")
        rows[name] = target.eval(history[-tail:], logits="all")[-1].copy()
    target.truncate(0)
    out = {"position": i, "plain_token": ref[i] if i < len(ref) else None,
           "draft_token": got[i] if i < len(got) else None,
           "max_abs_diff": float(np.abs(rows["plain"] - rows["batched"]).max())}
    text = [f"first difference at token {i}: plain {out['plain_token']}, "
            f"drafted {out['draft_token']}"]
    for name, row in rows.items():
        top = np.argsort(-row)[:2]
        gap = float(row[top[0]] - row[top[1]])
        out[name] = {"top": [[int(t), float(row[t])] for t in top], "gap": gap}
        text.append(f"{name} top-2 {top[0]}:{row[top[0]]:.4f} {top[1]}:{row[top[1]]:.4f} "
                    f"gap {gap:.4f}")
    out["explain"] = "; ".join(text) + f"; max |plain - batched| {out['max_abs_diff']:.4f}"
    return out


# --------------------------------------------------------------------------- the probe


#: A bare load of the dense target at the plan's -ngl, numpy imported before llama_cpp or
#: after: with numpy first, the load crashed (SIGSEGV) on an H200 (issue 36).
PROBE = """
import sys
if sys.argv[1] == "numpy":
    import numpy
import llama_cpp as C
import numpy
C.llama_backend_init()
mp = C.llama_model_default_params()
mp.n_gpu_layers = int(sys.argv[3])
m = C.llama_model_load_from_file(sys.argv[2].encode(), mp)
print("loaded" if m else "load failed", flush=True)
sys.exit(0 if m else 3)
"""


def probe(model: Path, ngl: str, timeout: float) -> dict:
    """Each import order's bare load, in a child of its own: its outcome."""
    out = {}
    for first in ("numpy", "llama_cpp"):
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-c", PROBE, first, str(model), ngl],
                               capture_output=True, text=True, timeout=timeout)
            rc = r.returncode
            result = ("loaded" if rc == 0 else f"crashed (signal {-rc})" if rc < 0
                      else f"failed (status {rc})")
            tail = (r.stdout + r.stderr)[-800:]
        except subprocess.TimeoutExpired:
            rc, result, tail = None, f"no answer in {timeout:.0f} s", ""
        out[f"{first}"] = {"rc": rc, "result": result, "s": time.perf_counter() - t0,
                           "tail": tail}
    return out


def backtrace(model: Path, ngl: str, timeout: float) -> str:
    """cuda-gdb's native backtrace of the crashing load (numpy first)."""
    gdb = shutil.which("cuda-gdb")
    if gdb is None:
        return "cuda-gdb not found"
    cmd = [gdb, "-q", "-batch", "-ex", "set pagination off", "-ex", "run", "-ex", "bt 40",
           "-ex", "info sharedlibrary", "--args", sys.executable, "-c", PROBE, "numpy",
           str(model), ngl]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return f"cuda-gdb: no answer in {timeout:.0f} s\n{(e.stdout or '')[-3000:]}"
    lines = (r.stdout + r.stderr).splitlines()
    keep = [ln for ln in lines if ln.startswith(("#", "Thread", "Program", "0x"))
            or "signal" in ln.lower()]
    return "\n".join(keep[-120:])


# --------------------------------------------------------------------------- run (the steps)


def run(dry: bool, out: Path, deadline: float | None, build: dict,
        folder: Path | None = None, gpu: str = "") -> int:
    """Models, then each placement's worker and the probe, in the order of their value,
    each started only where the budget leaves it time; the report after every step."""
    t_start = time.time()
    plan = DRY if dry else GPU
    deadline = deadline or t_start + (3600 if dry else 570)
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    from specwire.bench.report import machine_info
    machine = machine_line(machine_info()) + (f"; GPU {gpu}" if gpu else "")
    report.write({"dry_run": dry, "build": build, "machine": machine,
                  "command": "scripts/gpu-check" + (" --dry-run" if dry else ""),
                  "plan": {"confidence": plan.confidence, "prompts": plan.prompts,
                           "n": plan.n}})
    folder = folder or models_folder(dry)
    if deadline - time.time() < MARGIN_S + 30:
        report.step("models", "skipped", 0.0, f"the deadline is {deadline - time.time():.0f} "
                    "s away: nothing measured")
        return 1
    t0 = time.perf_counter()
    try:
        took = make_models_child(dry, folder)
    except RuntimeError as e:
        report.step("models", "failed", time.perf_counter() - t0, str(e)[-1500:])
        return 1
    shapes = {name: ", ".join(f"{k} {v}" for k, v in asdict(spec).items()
                              if k.startswith("n_") and k != "n_ctx_train")
              for name, spec in model_specs(plan).items()}
    report.put(("models",), {"made_s": took, "folder": str(folder), "shapes": shapes})
    report.step("models", "done", time.perf_counter() - t0,
                ", ".join(f"{k} {v:.0f} s" for k, v in took.items()) or "kept")
    pairs = model_paths(plan, folder)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    failed = False
    try:
        for i, p in enumerate(PLACEMENTS):
            failed |= not worker(plan, p, pairs[p.model], out, work, deadline, dry)
            if i == 0:
                failed |= not probe_step(plan, pairs["dense"][0], report, deadline, dry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    data = report.load()
    data["total_s"] = time.time() - t_start + (build.get("s") or 0)
    report.write(data)
    print((out / "gpu-check.md").read_text())
    return 1 if failed or not lossless_ok(data) else 0


def machine_line(m: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in m.items() if isinstance(v, str | int | float))


def models_folder(dry: bool) -> Path:
    """The dry run's models live in specwire's cache (tiny, kept between runs, as the
    tests' MoE fixture); the GPU's under /tmp, which lasts while the machine is held."""
    if dry:
        from specwire.assets import models
        return models.home() / "gpu-check"
    return Path(tempfile.gettempdir()) / "gpu-check-models"


def make_models_child(dry: bool, folder: Path) -> dict:
    """The models, in a child process (numpy's and llama.cpp's libraries loaded in the
    order the parent does not care about); what each took."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "models", "--folder", str(folder)]
    if dry:
        cmd.append("--dry-run")
    r = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"making the models failed (status {r.returncode}): "
                           f"{r.stdout[-1000:]}{r.stderr[-2000:]}")
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    return json.loads(line[-1]) if line else {}


def worker(plan: Plan, p: Placement, pair: tuple[Path, Path], out: Path, work: Path,
           deadline: float, dry: bool) -> bool:
    """The placement's measurements in a child process, stopped at the deadline; whether
    it ended well. Its figures are in the report, however it ended."""
    report = Report(out)
    left = deadline - time.time() - MARGIN_S
    need = 20.0 if dry else min(p.gpu_s, 60.0)
    if left < need:
        report.step(f"{p.key}", "skipped", 0.0, f"needs at least {need:.0f} s, "
                    f"{max(0.0, left):.0f} s left")
        return True
    cmd = [sys.executable, str(Path(__file__).resolve()), "measure", "--placement", p.key,
           "--out", str(out), "--work", str(work), "--deadline", f"{deadline:.3f}",
           "--target", str(pair[0]), "--draft", str(pair[1])]
    if dry:
        cmd.append("--dry-run")
    t0 = time.perf_counter()
    # a session of its own: at the deadline it goes with the draft node it started
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        rc = proc.wait(timeout=left)
        ok, note = rc == 0, ("" if rc == 0 else f"exit status {rc} (a step failed)" if rc > 0
                             else f"killed by signal {-rc}")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ok, note = False, "stopped at the deadline"
    if not ok:
        report.step(f"{p.key}", "failed", time.perf_counter() - t0, note)
    return ok


def probe_step(plan: Plan, model: Path, report: Report, deadline: float, dry: bool) -> bool:
    """The import-order probe (about two loads), and cuda-gdb's backtrace of a crash."""
    left = deadline - time.time() - MARGIN_S
    need = 5.0 if dry else 30.0
    if left < need:
        report.step("probe", "skipped", 0.0, f"needs about {need:.0f} s, {left:.0f} s left")
        return True
    t0 = time.perf_counter()
    res = probe(model, plan.ngl, timeout=min(left, 120.0))
    report.put(("probe",), res)
    report.step("probe", "done", time.perf_counter() - t0,
                "; ".join(f"{k} first: {v['result']}" for k, v in res.items()))
    if res["numpy"]["rc"] is not None and res["numpy"]["rc"] < 0:
        left = deadline - time.time() - MARGIN_S
        if left < 60:
            report.step("backtrace", "skipped", 0.0, f"needs about 60 s, {left:.0f} s left")
        else:
            t0 = time.perf_counter()
            report.put(("backtrace",), backtrace(model, plan.ngl, min(left, 180.0)))
            report.step("backtrace", "done", time.perf_counter() - t0)
    return res["llama_cpp"]["rc"] == 0


def lossless_ok(d: dict) -> bool:
    """Every drafted greedy output equal to plain decoding's, in the sweep and the speedups."""
    for p in d.get("placements", {}).values():
        if p.get("lossless", {}).get("mismatches"):
            return False
        for kind in ("speedup", "seeded"):
            sp = p.get(kind)
            if sp and sp["lossless_expected"] and not all(r["same"] for r in sp["rows"]):
                return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack", help="here: fill .gpu/ with what the GPU machine needs")
    p.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (default: download it)")
    r = sub.add_parser("run", help="there: make the models and measure (after the build)")
    r.add_argument("--dry-run", action="store_true", help="on CPU, tiny models, no build")
    r.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check-out")))
    r.add_argument("--deadline", type=float, help="epoch seconds by which the report is final")
    r.add_argument("--build-s", type=float, help="the build's seconds, for the report")
    r.add_argument("--build", default="", help="how the build went, for the report")
    r.add_argument("--gpu", default="", help="the GPU as nvidia-smi names it, for the report")
    r.add_argument("--models", type=Path, help="the models' folder (default: /tmp's, or "
                   "specwire's cache for the dry run)")
    m = sub.add_parser("models", help="make the models that are missing")
    m.add_argument("--folder", type=Path, required=True)
    m.add_argument("--dry-run", action="store_true")
    m.add_argument("--targets-only", action="store_true", help="no drafts (before the build)")
    w = sub.add_parser("measure", help="one placement's measurements (run starts it)")
    w.add_argument("--placement", required=True, choices=[p.key for p in PLACEMENTS])
    w.add_argument("--out", type=Path, required=True)
    w.add_argument("--work", type=Path, required=True)
    w.add_argument("--deadline", type=float, required=True)
    w.add_argument("--target", type=Path, required=True)
    w.add_argument("--draft", type=Path, required=True)
    w.add_argument("--dry-run", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "pack":
        pack(a.sdist, PACK)
        return 0
    if a.cmd == "measure":
        # llama.cpp's libraries before numpy's (specwire/cli/main.py says why)
        import llama_cpp.llama_cpp  # noqa: F401
        p = next(p for p in PLACEMENTS if p.key == a.placement)
        w = Worker(DRY if a.dry_run else GPU, p, (a.target, a.draft), a.out, a.work,
                   a.deadline)
        w.run()
        return 1 if w.failed else 0
    if a.cmd == "models":
        tokenizer = PACK / "tokenizer.gguf"
        if a.dry_run or not tokenizer.exists():
            from specwire.assets import models
            tokenizer = models.ensure_model("base", progress=False)
        took = make_models(DRY if a.dry_run else GPU, a.folder, tokenizer,
                           drafts=not a.targets_only)
        print(json.dumps(took))
        return 0
    return run(a.dry_run, a.out, a.deadline, {"s": a.build_s, "how": a.build}, a.models,
               a.gpu)


if __name__ == "__main__":
    sys.exit(main())
