"""Placement and loading flags (llama.cpp's names) and the tiny MoE target.

Fast tests: every flag parses into the settings the backend applies, bad values
are one line naming the flag (exit 2), fields missing from a llama-cpp-python
build are refused. Slow tests load the tiny MoE (specwire/assets/moe.py):
llama.cpp's own log shows the overrides land on exactly the tensors named, -ub
and --no-mmap reach the structs handed to llama.cpp, and a draft never changes
the MoE's greedy or seeded output.
"""

from __future__ import annotations

import ctypes
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specwire.backend import placement
from specwire.backend.base import BackendError
from specwire.cli.args import CliError, draft_model_params, draft_params, spec_type, target_params
from specwire.cli.main import build_parser
from specwire.cli.placement import node_flags
from specwire.config import Placement, TensorOverride

EXPS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specwire", *args], capture_output=True,
                          text=True, timeout=timeout)


# --------------------------------------------------------------------------- parsing


def test_target_flags_map_into_model_params() -> None:
    a = parse("generate", "x", "-ot", r"blk\.1\.=CPU,attn_q=CPU", "-ot", "exps=CPU",
              "--n-cpu-moe", "2", "--cpu-moe", "-ub", "256", "-b", "1024", "-fa", "off",
              "--numa", "distribute", "--no-mmap", "--mlock", "-ts", "3,1", "-sm", "row",
              "-mg", "1", "-dev", "CUDA0,CUDA1")
    p = target_params(a, "m.gguf")
    assert p.placement.overrides == (
        TensorOverride(r"blk\.1\.", "CPU"), TensorOverride("attn_q", "CPU"),
        TensorOverride("exps", "CPU"),
        TensorOverride(r"blk\.0" + EXPS, "CPU"), TensorOverride(r"blk\.1" + EXPS, "CPU"),
        TensorOverride(EXPS, "CPU"))
    assert (p.n_batch, p.n_ubatch, p.flash_attn, p.numa) == (1024, 256, "off", "distribute")
    assert p.placement.devices == ("CUDA0", "CUDA1")
    assert (p.placement.use_mmap, p.placement.use_mlock) == (False, True)
    assert (p.placement.tensor_split, p.placement.split_mode, p.placement.main_gpu) == (
        (3.0, 1.0), "row", 1)


def test_defaults_are_llama_cpps() -> None:
    p = target_params(parse("generate", "x"), "m.gguf")
    assert (p.n_batch, p.n_ubatch, p.flash_attn, p.numa) == (512, 512, "auto", "disabled")
    assert p.placement == Placement()
    assert p.placement.devices is None and p.placement.use_mmap


@pytest.mark.parametrize("argv, want", [
    (["-fa"], "on"), (["-fa", "on"], "on"), (["-fa", "off"], "off"), (["-fa", "auto"], "auto"),
    (["--flash-attn", "enabled"], "on"), ([], "auto")])
def test_flash_attn_values(argv: list[str], want: str) -> None:
    assert target_params(parse("generate", *argv, "--", "x"), "m.gguf").flash_attn == want


def test_draft_flags_map_into_the_in_process_drafts_params() -> None:
    a = parse("serve", "-otd", "exps=CPU", "--cpu-moe-draft", "--n-cpu-moe-draft", "1",
              "-devd", "none", "-fad", "off", "-ngld", "99", "--no-mmap", "-sm", "none")
    d = draft_model_params(a, "d.gguf")
    assert d.placement.overrides == (TensorOverride("exps", "CPU"),
                                     TensorOverride(r"blk\.0" + EXPS, "CPU"),
                                     TensorOverride(EXPS, "CPU"))
    assert d.placement.devices == () and d.flash_attn == "off" and d.n_gpu_layers == 99
    # one process: --no-mmap and -sm are the target's and the draft's
    assert not d.placement.use_mmap and d.placement.split_mode == "none"
    t = target_params(a, "t.gguf")
    assert t.placement.overrides == () and t.placement.devices is None


@pytest.mark.parametrize("spelling", [
    ["-otd", "exps=CPU"], ["--override-tensor-draft", "exps=CPU"],
    ["--spec-draft-override-tensor", "exps=CPU"]])
def test_draft_override_spellings(spelling: list[str]) -> None:
    d = draft_model_params(parse("generate", "x", *spelling), "d.gguf")
    assert d.placement.overrides == (TensorOverride("exps", "CPU"),)


def test_draft_node_takes_the_plain_names_and_keeps_the_draft_ones() -> None:
    plain = parse("draft", "-m", "small.gguf", "-ngl", "99", "-ot", "exps=CPU", "-t", "4",
                  "-fa", "on", "-dev", "CUDA0", "--cpu-moe", "-ub", "128", "-b", "256",
                  "--no-mmap", "-ctk", "q8_0")
    p = draft_model_params(plain, "small.gguf")
    assert (p.n_gpu_layers, p.n_threads, p.flash_attn, p.n_ubatch, p.n_batch, p.type_k) == (
        99, 4, "on", 128, 256, "q8_0")
    assert p.placement.overrides == (TensorOverride("exps", "CPU"), TensorOverride(EXPS, "CPU"))
    assert p.placement.devices == ("CUDA0",) and not p.placement.use_mmap
    alias = parse("draft", "-ngld", "99", "-otd", "exps=CPU", "-td", "4", "-fad", "on",
                  "-devd", "CUDA0", "--cpu-moe-draft")
    q = draft_model_params(alias, "small.gguf")
    assert (q.n_gpu_layers, q.n_threads, q.flash_attn) == (99, 4, "on")
    assert q.placement.overrides == p.placement.overrides


def test_bench_hands_the_draft_placement_to_the_node_it_starts() -> None:
    a = parse("bench", "-otd", "exps=CPU", "--n-cpu-moe-draft", "2", "-devd", "none",
              "-fad", "off", "--no-mmap", "--mlock", "--numa", "isolate", "-ts", "3/1")
    node = parse("draft", *node_flags(a))
    local, remote = draft_model_params(a, "d.gguf"), draft_model_params(node, "d.gguf")
    assert local == remote


@pytest.mark.parametrize("argv, want", [
    ([], None), (["--repack"], True), (["-nr"], False), (["--no-repack"], False),
    (["-nr", "--repack"], True)])
def test_repack_flags_reach_both_placements_and_the_node(argv: list[str], want) -> None:
    a = parse("bench", *argv)
    assert target_params(a, "t.gguf").placement.repack is want
    assert draft_model_params(a, "d.gguf").placement.repack is want
    node = parse("draft", *node_flags(a))
    assert draft_model_params(node, "d.gguf").placement.repack is want


@pytest.mark.parametrize("argv, dest, value", [
    (["--spec-draft-n-max", "5"], "draft_max", 5),
    (["--draft-max", "5"], "draft_max", 5),
    (["--spec-draft-n-min", "2"], "draft_min", 2),
    (["--draft-min", "2"], "draft_min", 2),
    (["--spec-draft-p-min", "0.5"], "draft_p_min", 0.5),
    (["--draft-p-min", "0.5"], "draft_p_min", 0.5),
    (["--spec-draft-model", "d.gguf"], "model_draft", "d.gguf"),
    (["-md", "d.gguf"], "model_draft", "d.gguf"),
])
def test_renamed_draft_flags_are_accepted_beside_the_old(argv, dest, value) -> None:
    for cmd in (["generate", "x"], ["serve"]):
        assert getattr(parse(*cmd, *argv), dest) == value
    if dest == "draft_max":
        assert draft_params(parse("generate", "x", *argv)).n_max == value


def test_renamed_flags_in_bench_and_plan() -> None:
    assert parse("bench", "--spec-draft-n-max", "4,8").draft_max == "4,8"
    assert parse("plan", "--spec-draft-model", "d.gguf").model_draft == "d.gguf"
    assert parse("plan", "-ot", "exps=CPU").override_tensor == ["exps=CPU"]
    assert parse("plan", "--spec-draft-n-max", "6").draft_max == "6"


@pytest.mark.parametrize("value, kind", [
    ("draft-simple", "model"), ("draft", "model"), ("ngram-simple", "ngram"),
    ("ngram-mod", "ngram"), ("none", "none")])
def test_spec_type(value: str, kind: str) -> None:
    a = parse("generate", "x", "--spec-type", value)
    assert spec_type(a) == kind
    assert draft_params(a).enabled == (kind != "none")


@pytest.mark.parametrize("argv, needle", [
    (["--spec-type", "telepathy"], "not supported"),
    (["--spec-type", "ngram-simple", "-md", "d.gguf"], "contradicts -md"),
    (["--spec-type", "draft-simple", "--no-draft"], "contradicts --no-draft"),
])
def test_spec_type_conflicts(argv: list[str], needle: str) -> None:
    with pytest.raises(CliError, match=needle):
        spec_type(parse("generate", "x", *argv))


def test_spec_type_none_beside_a_draft_turns_speculation_off_and_says_so(caplog) -> None:
    with caplog.at_level("WARNING", "specwire.flags"):
        a = parse("generate", "x", "--spec-type", "none", "-md", "d.gguf")
        assert spec_type(a) == "none" and not draft_params(a).enabled
    assert "-md configured but not used: speculation is off" in caplog.text


# --------------------------------------------------------------------------- bad values


@pytest.fixture(scope="module")
def fake_gguf(tmp_path_factory) -> Path:
    """A file with GGUF's magic: enough to get past the file check to the placement."""
    p = tmp_path_factory.mktemp("fake") / "fake.gguf"
    p.write_bytes(b"GGUF" + bytes(60))
    return p


@pytest.mark.parametrize("args, needle", [
    (["-ot", "exps(=CPU"], "-ot: bad regex 'exps('"),
    (["-ot", "exps"], "-ot: expected REGEX=BUFTYPE"),
    (["-ot", "exps=GPU9"], "-ot: unknown buffer type 'GPU9' in exps=GPU9; available: CPU"),
    (["-otd", "exps=GPU9"], "-otd: unknown buffer type 'GPU9'"),
    (["--n-cpu-moe", "-1"], "--n-cpu-moe: must be >= 0"),
    (["--numa", "everywhere"], "--numa: expected distribute, isolate or numactl"),
    (["-fa", "maybe"], "-fa: expected on, off or auto, got 'maybe'"),
    (["-fad", "maybe"], "-fad: expected on, off or auto"),
    (["-ts", "3,x"], "-ts: expected numbers separated by"),
    (["-ts", "0,0"], "-ts: expected proportions"),
    (["-sm", "diagonal"], "-sm: expected none, layer or row"),
    (["-mg", "-1"], "-mg: must be >= 0"),
    (["-ub", "0"], "-ub: must be in [1, 65536]"),
    (["-dev", "CUDA7"], "-dev: invalid device 'CUDA7'; available:"),
    (["-dev", "CPU"], "-dev: invalid device 'CPU'"),
    (["-devd", "CUDA7"], "-devd: invalid device 'CUDA7'"),
    (["-dev", "CUDA0,none"], "-dev: expected a comma list of device names or 'none'"),
])
def test_bad_values_are_one_line_naming_the_flag(specwire_cli, fake_gguf: Path, args, needle
                                                ) -> None:
    r = specwire_cli("generate", "x", "-m", str(fake_gguf), "-md", str(fake_gguf), *args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert needle in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_draft_node_bad_override_is_one_line(specwire_cli, fake_gguf: Path) -> None:
    r = specwire_cli("draft", "-m", str(fake_gguf), "-ot", "exps=NOPE", "--port", "0")
    assert r.returncode == 2 and "-ot: unknown buffer type 'NOPE'" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("cmd", [["bench", "--quick", "--no-progress"], ["plan", "--measure"]])
def test_bench_and_plan_check_both_placements_before_loading(specwire_cli, fake_gguf: Path, cmd,
                                                            tmp_path):
    r = specwire_cli(*cmd, "-m", str(fake_gguf), "-md", str(fake_gguf), "-otd", "x=NOPE",
            *(["--out", str(tmp_path)] if cmd[0] == "bench" else []))
    assert r.returncode == 2, r.stderr
    assert "-otd: unknown buffer type 'NOPE' in x=NOPE; available: CPU" in r.stderr
    assert "Traceback" not in r.stderr


def test_bench_refuses_spec_type(specwire_cli) -> None:
    r = specwire_cli("bench", "--spec-type", "ngram-simple")
    assert r.returncode == 2 and "--spec-type: not a bench flag" in r.stderr, r.stderr


@pytest.mark.parametrize("cmd", [["generate"], ["serve"], ["draft"], ["bench"]])
def test_list_devices_prints_this_builds_devices(specwire_cli, cmd: list[str]) -> None:
    r = specwire_cli(*cmd, "--list-devices")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Available devices:\n")
    assert re.search(r"^  CPU: .* \(\d+ MiB, \d+ MiB free\)", r.stdout, re.M), r.stdout
    assert "Buffer types for -ot: CPU" in r.stdout


# --------------------------------------------------------------------------- structs


class _OldModelParams(ctypes.Structure):
    """The layout of llama-cpp-python releases that had the mmap/mlock booleans."""

    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_mmap", ctypes.c_bool),
                ("use_mlock", ctypes.c_bool)]


class _BareModelParams(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32)]


def test_set_field_refuses_a_field_the_build_lacks() -> None:
    s = _BareModelParams()
    placement.set_field(s, "n_gpu_layers", 7, "-ngl")
    assert s.n_gpu_layers == 7
    with pytest.raises(BackendError, match="--no-mmap is not supported by this "
                       "llama-cpp-python build"):
        placement.set_field(s, "use_mmap", False, "--no-mmap")
    with pytest.raises(BackendError, match="--no-mmap is not supported"):
        placement.apply(s, Placement(use_mmap=False), 0)
    with pytest.raises(BackendError, match="-ot is not supported"):
        placement.apply(s, Placement(overrides=(TensorOverride("x", "CPU"),)), 0)


def test_mmap_and_mlock_on_both_struct_layouts() -> None:
    import llama_cpp as C
    old = _OldModelParams(0, True, False)
    placement.apply(old, Placement(use_mmap=False, use_mlock=True), 0)
    assert (old.use_mmap, old.use_mlock) == (False, True)
    for mmap, mlock, mode in ((False, False, "NONE"), (True, True, "MMAP_MLOCK"),
                              (False, True, "MLOCK")):
        mp = C.llama_model_default_params()
        placement.apply(mp, Placement(use_mmap=mmap, use_mlock=mlock), 0)
        if placement.has_field(mp, "load_mode"):
            assert mp.load_mode == getattr(C, f"LLAMA_LOAD_MODE_{mode}")
        else:
            assert (mp.use_mmap, mp.use_mlock) == (mmap, mlock)


class _RepackParams(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_extra_bufts", ctypes.c_bool)]


@pytest.mark.parametrize("cpu_types, repack, want", [
    (["CPU", "CPU_REPACK"], None, True),          # no AMX: llama.cpp's default stands
    (["CPU", "AMX", "CPU_REPACK"], None, False),  # AMX: off unless asked (#20824)
    (["CPU", "AMX", "CPU_REPACK"], True, True),
    (["CPU", "CPU_REPACK"], False, False)])
def test_repack_is_off_by_default_only_where_amx_is_offered(monkeypatch, caplog, cpu_types,
                                                            repack, want) -> None:
    monkeypatch.setattr(placement, "buffer_types", lambda: dict.fromkeys(cpu_types, 1))
    monkeypatch.setattr(placement, "_amx_warned", False)
    mp = _RepackParams(0, True)
    with caplog.at_level("WARNING", logger="specwire.backend"):
        placement.apply(mp, Placement(repack=repack), 0)
    assert mp.use_extra_bufts is want
    warned = [r for r in caplog.records if "#20824" in r.getMessage()]
    assert len(warned) == (repack is None and "AMX" in cpu_types)


def test_repack_on_this_build_and_refused_where_the_field_is_missing() -> None:
    import llama_cpp as C
    mp = C.llama_model_default_params()
    placement.apply(mp, Placement(), 0)
    if placement.has_field(mp, "use_extra_bufts"):
        assert mp.use_extra_bufts is ("AMX" not in placement.buffer_types())
    with pytest.raises(BackendError, match="--no-repack is not supported"):
        placement.apply(_BareModelParams(), Placement(repack=False), 0)


def test_overrides_array_is_null_terminated_and_kept() -> None:
    import llama_cpp as C
    mp = C.llama_model_default_params()
    applied = placement.apply(mp, Placement(overrides=(TensorOverride("exps", "CPU"),
                                                       TensorOverride(r"blk\.0\.", "CPU"))), 0)
    arr = ctypes.cast(mp.tensor_buft_overrides, ctypes.POINTER(placement._Override))
    assert [arr[0].pattern, arr[1].pattern, arr[2].pattern] == [b"exps", rb"blk\.0\.", None]
    assert arr[0].buft == placement.buffer_types()["CPU"] and arr[0].buft
    assert applied.keep   # the strings and the array live as long as the model


def test_devices_none_is_an_empty_null_terminated_list() -> None:
    import llama_cpp as C
    mp = C.llama_model_default_params()
    placement.apply(mp, Placement(devices=()), 0)
    assert ctypes.cast(mp.devices, ctypes.POINTER(ctypes.c_void_p))[0] is None


def test_flash_attn_on_both_struct_layouts() -> None:
    import llama_cpp as C

    from specwire.backend.llama import _set_flash_attn

    class OldContext(ctypes.Structure):
        _fields_ = [("flash_attn", ctypes.c_bool)]

    old = OldContext(False)
    _set_flash_attn(old, "on")
    assert old.flash_attn is True
    cp = C.llama_context_default_params()
    for mode, value in (("on", C.LLAMA_FLASH_ATTN_TYPE_ENABLED),
                        ("off", C.LLAMA_FLASH_ATTN_TYPE_DISABLED),
                        ("auto", C.LLAMA_FLASH_ATTN_TYPE_AUTO)):
        _set_flash_attn(cp, mode)
        assert cp.flash_attn_type == value


# --------------------------------------------------------------------------- the MoE (slow)


@pytest.fixture(scope="module")
def moe():
    from specwire.assets import moe as moe_fixture
    return moe_fixture.ensure_moe()


def overridden(lines: list[str]) -> dict[str, str]:
    """llama.cpp's 'tensor NAME (...) buffer type overridden to BUFT' lines -> {NAME: BUFT}."""
    out = {}
    for line in lines:
        m = re.match(r"tensor (\S+) \(.*\) buffer type overridden to (\S+)", line.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def load_with_log(argv: list[str], path: Path):
    from specwire.backend.llama import LlamaBackend, load_model
    from specwire.backend.llama_process import llama_log
    params = target_params(parse("generate", "x", "-m", str(path), "-c", "256", *argv),
                           str(path))
    with llama_log() as lines:
        model = load_model(params)
        backend = LlamaBackend(params, model)
    return model, backend, lines


@pytest.mark.slow
def test_moe_is_a_moe_with_the_gemma_vocabulary(moe) -> None:
    from specwire.assets import models
    from specwire.assets import moe as moe_fixture
    from specwire.backend.llama import check_pair, load_model
    from specwire.backend.llama_process import llama_log
    from specwire.config import ModelParams
    names = moe_fixture.tensor_names()
    assert sum(bool(re.search(EXPS, n)) for n in names) == 3 * moe_fixture.MoeSpec().n_layer
    with llama_log() as lines:
        # -ngl 1: a cache key no other test loads, so llama.cpp loads (and logs) it here
        target = load_model(ModelParams(str(moe.target), n_gpu_layers=1))
    # the file holds exactly the tensors tensor_names() lists (the -ot tests match against it)
    assert any(re.search(rf"\b{len(names)} tensors\b", x) for x in lines), lines[:5]
    check_pair(target, load_model(ModelParams(str(moe.draft))))
    check_pair(target, load_model(ModelParams(str(models.default_draft()))))


@pytest.mark.slow
@pytest.mark.parametrize("argv, pattern", [
    (["-ot", "exps=CPU"], "exps"),
    (["--cpu-moe"], EXPS),
    (["--n-cpu-moe", "2"], r"blk\.[01]" + EXPS),
    (["-ot", r"blk\.3\.ffn_up=CPU,attn_q=CPU"], r"blk\.3\.ffn_up|attn_q"),
    (["-ot", r"blk\.1\.=CPU", "--n-cpu-moe", "1"], r"blk\.1\.|blk\.0" + EXPS),
])
def test_overrides_land_on_exactly_the_tensors_named(moe, argv, pattern) -> None:
    from specwire.assets import moe as moe_fixture
    _model, backend, lines = load_with_log(argv, moe.target)
    want = {n for n in moe_fixture.tensor_names() if re.search(pattern, n)}
    got = overridden(lines)
    assert want and set(got) == want, sorted(set(got) ^ want)
    assert set(got.values()) <= {"CPU", "CPU_REPACK"}
    backend.close()


@pytest.mark.slow
def test_ubatch_no_mmap_and_flash_attn_reach_llama_cpp(moe) -> None:
    import llama_cpp as C
    model, backend, lines = load_with_log(["-ub", "64", "-b", "256", "--no-mmap", "-fa", "off",
                                           "-ot", "ffn_gate_inp=CPU"], moe.target)
    assert backend.context_params.n_ubatch == 64 and backend.context_params.n_batch == 256
    assert any(re.search(r"n_ubatch\s+=\s+64$", x.strip()) for x in lines), lines
    assert any(re.search(r"flash_attn\s+=\s+(disabled|0)$", x.strip()) for x in lines)
    if placement.has_field(model.load_params, "load_mode"):
        assert model.load_params.load_mode == C.LLAMA_LOAD_MODE_NONE
    else:
        assert model.load_params.use_mmap is False
    backend.close()


# --- invariance: a draft never changes the MoE's output (tests/invariance/'s contract)

PROMPTS = ("The old lighthouse keeper climbed the stairs every evening, and",
           "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n")
N_PREDICT = 32


@pytest.fixture(scope="module")
def moe_engines(moe):
    from specwire.backend.llama import LlamaBackend, load_model
    from specwire.config import ModelParams
    target = LlamaBackend(ModelParams(str(moe.target), n_ctx=512))
    dp = ModelParams(str(moe.draft), n_ctx=512)
    cpu_moe = ModelParams(str(moe.target), n_ctx=512,
                          placement=Placement(overrides=(TensorOverride("exps", "CPU"),)))
    return target, LlamaBackend(dp, load_model(dp)), LlamaBackend(cpu_moe)


def moe_generate(target, draft, prompt: str, sampling, k: int = 4):
    from specwire.config import DraftParams
    from specwire.drafters.model import ModelDrafter
    from specwire.engine.engine import Engine, Request
    dp = DraftParams(n_max=k, p_min=0.0, enabled=draft is not None)
    drafter = ModelDrafter(draft) if draft is not None else None
    gen = Engine(target, drafter).generate(Request(target.tokenize(prompt), N_PREDICT,
                                                   sampling, dp))
    gen.run()
    return gen


@pytest.mark.slow
@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["prose", "code"])
def test_moe_output_is_the_same_with_a_draft(moe_engines, prompt, seeded) -> None:
    from specwire.config import SamplingParams
    target, draft, cpu_moe_target = moe_engines
    sampling = (SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05, seed=1234)
                if seeded else SamplingParams(temperature=0.0))
    ref = moe_generate(target, None, prompt, sampling).tokens
    assert len(ref) == N_PREDICT and len(set(ref)) > N_PREDICT // 2, ref   # not degenerate
    accepted = drafted = 0
    for k in (1, 2, 4, 8):
        gen = moe_generate(target, draft, prompt, sampling, k)
        assert gen.tokens == ref, f"draft-max {k}: {gen.tokens} != {ref}"
        accepted += gen.stats.draft_n_accepted
        drafted += gen.stats.draft_n
    assert 0 < accepted < drafted, (accepted, drafted)   # some accepted, some rejected
    assert moe_generate(cpu_moe_target, draft, prompt, sampling).tokens == ref


@pytest.mark.slow
def test_models_command_builds_and_names_the_moe(moe) -> None:
    r = run("models", "--no-progress", "make-moe")
    assert r.returncode == 0 and str(moe.target) in r.stdout and str(moe.draft) in r.stdout
    for role, path in (("moe", moe.target), ("moe-draft", moe.draft)):
        r = run("models", "--no-progress", "path", role)
        assert r.returncode == 0 and r.stdout.strip() == str(path), r.stderr


@pytest.mark.slow
def test_plan_measures_the_moes_verification_curve(moe) -> None:
    r = run("plan", "--measure", "-m", str(moe.target), "-md", str(moe.draft), "-ot",
            "exps=CPU", "--measure-limit", "1", "--measure-n", "16", "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert not out["inputs"]["verify_cost_assumed"]
    assert [n for n, _ in out["inputs"]["verify_cost"]] == [1, 2, 4, 8, 16]
    assert "measured:" in r.stderr
