"""Where a model's weights go: ggml's device registry, -ot buffer types, -dev devices.

llama-cpp-python binds llama.h but not ggml-backend.h, whose device registry
llama.cpp's own flags resolve names through (common/arg.cpp). Its functions are
called here from the ggml libraries that libllama already loaded, so the names
a user types (`CPU`, `CUDA0`, `CUDA_Host`, `Vulkan0`, `Metal`) mean what they
mean to llama-server.

The llama_model_params struct differs between llama-cpp-python releases; a
ctypes struct silently accepts an attribute it does not have, so every field
set here goes through `set_field`, which refuses a missing one by its flag.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from specwire.backend.base import BackendError
from specwire.config import SPLIT_MODES, Placement, TensorOverride

log = logging.getLogger("specwire.backend")

#: ggml_backend_dev_type: CPU is 0 in every release (GPU, IGPU, ACCEL follow).
DEVICE_CPU = 0
#: llama.cpp's pattern for the routed experts' weights (common/common.h LLM_FFN_EXPS_REGEX).
FFN_EXPS_REGEX = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"


def cpu_moe_override() -> TensorOverride:
    """--cpu-moe: every layer's expert weights in the CPU's memory."""
    return TensorOverride(FFN_EXPS_REGEX, "CPU")


def n_cpu_moe_overrides(n: int) -> tuple[TensorOverride, ...]:
    """--n-cpu-moe N: the expert weights of layers 0..N-1 in the CPU's memory."""
    return tuple(TensorOverride(rf"blk\.{i}{FFN_EXPS_REGEX}", "CPU") for i in range(n))


def set_field(struct: ctypes.Structure, name: str, value: Any, flag: str) -> None:
    """struct.name = value, refusing a field this llama-cpp-python build does not have."""
    if name not in {f[0] for f in type(struct)._fields_}:
        raise BackendError(f"{flag} is not supported by this llama-cpp-python build "
                           f"({type(struct).__name__} has no field {name!r})")
    setattr(struct, name, value)


def has_field(struct: ctypes.Structure, name: str) -> bool:
    return name in {f[0] for f in type(struct)._fields_}


# --------------------------------------------------------------------------- ggml registry


class _Ggml:
    """The registry functions, bound once from the ggml libraries next to libllama."""

    def __init__(self) -> None:
        import llama_cpp
        libdir = os.environ.get("LLAMA_CPP_LIB_PATH") or os.path.join(
            os.path.dirname(llama_cpp.__file__), "lib")
        libs = [ctypes.CDLL(p) for p in _loaded_ggml(libdir)]
        if not libs:
            raise BackendError(f"no ggml library found in {libdir}")
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        self.dev_count = self._bind(libs, "ggml_backend_dev_count", sz, [])
        self.dev_get = self._bind(libs, "ggml_backend_dev_get", vp, [sz])
        self.dev_by_name = self._bind(libs, "ggml_backend_dev_by_name", vp, [ctypes.c_char_p])
        self.dev_name = self._bind(libs, "ggml_backend_dev_name", ctypes.c_char_p, [vp])
        self.dev_description = self._bind(libs, "ggml_backend_dev_description",
                                          ctypes.c_char_p, [vp])
        self.dev_type = self._bind(libs, "ggml_backend_dev_type", ctypes.c_int, [vp])
        self.dev_memory = self._bind(libs, "ggml_backend_dev_memory", None,
                                     [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)])
        self.dev_buffer_type = self._bind(libs, "ggml_backend_dev_buffer_type", vp, [vp])
        self.dev_host_buffer_type = self._bind(libs, "ggml_backend_dev_host_buffer_type",
                                               vp, [vp])
        self.dev_backend_reg = self._bind(libs, "ggml_backend_dev_backend_reg", vp, [vp])
        self.reg_proc_address = self._bind(libs, "ggml_backend_reg_get_proc_address", vp,
                                           [vp, ctypes.c_char_p])
        self.buft_name = self._bind(libs, "ggml_backend_buft_name", ctypes.c_char_p, [vp])
        self.reg_by_name = self._bind(libs, "ggml_backend_reg_by_name", vp, [ctypes.c_char_p])
        self.register = self._bind(libs, "ggml_backend_register", None, [vp])

    @staticmethod
    def _bind(libs: list[ctypes.CDLL], name: str, restype: Any, argtypes: list) -> Any:
        for lib in libs:
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
                return fn
        raise BackendError(f"this llama-cpp-python build's ggml lacks {name}")


def _loaded_ggml(libdir: str) -> list[str]:
    """The ggml libraries libllama loaded, by the paths it loaded them from. A wheel holds
    each one as several copies (libggml.so, .so.0, .so.0.25.3: files, not links), and
    opening another copy than libllama's would bind a second registry of its own, which
    llama.cpp never sees (an --rpc device added there, a -dev pointer from there)."""
    found: list[str] = []
    real = os.path.realpath(libdir)
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = os.path.realpath(line.rstrip("\n").split(" ", 5)[-1].strip() or ".")
                name = os.path.basename(path)
                if (name.startswith("libggml") and os.path.dirname(path) == real
                        and path not in found):
                    found.append(path)
    except OSError:
        pass
    if found:
        return found
    return [p for p in sorted(glob.glob(os.path.join(libdir, "libggml*.so*")))
            if not p.endswith(".a")]


_ggml: _Ggml | None = None


def ggml() -> _Ggml:
    """The bound registry (llama.cpp's backends registered first)."""
    global _ggml
    if _ggml is None:
        from specwire.backend.llama_process import init_backend
        init_backend()
        _ggml = _Ggml()
    return _ggml


@dataclass(slots=True, frozen=True)
class Device:
    """One ggml device: what --list-devices prints and -dev names."""

    name: str
    description: str
    is_cpu: bool
    free: int
    total: int
    ptr: int = field(repr=False, compare=False)


def devices() -> list[Device]:
    """Every device this build of llama.cpp can use, in registry order."""
    g = ggml()
    out = []
    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        g.dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(Device((g.dev_name(dev) or b"").decode(), (g.dev_description(dev) or b"")
                          .decode(errors="replace"), g.dev_type(dev) == DEVICE_CPU,
                          free.value, total.value, dev))
    return out


def describe_devices() -> str:
    """llama.cpp's --list-devices text, plus the buffer types -ot accepts."""
    lines = ["Available devices:"]
    for d in devices():
        kind = " [CPU: not for -dev]" if d.is_cpu else ""
        lines.append(f"  {d.name}: {d.description} ({d.total >> 20} MiB, "
                     f"{d.free >> 20} MiB free){kind}")
    lines.append(f"Buffer types for -ot: {', '.join(buffer_types())}")
    return "\n".join(lines)


_EXTRA_BUFTS = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)
_RPC_ADD_SERVER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)
#: endpoints already registered in this process (llama.cpp's registry keeps them)
_rpc_endpoints: list[str] = []


def add_rpc_servers(endpoints: Sequence[str], build_hint: str = "") -> list[str]:
    """--rpc HOST:PORT,...: register each llama.cpp rpc-server as a device, as llama.cpp's
    common/arg.cpp does, so that -ngl and -dev place layers on it like on a local GPU.
    Returns the names of the devices it added. A build without the RPC backend, or an
    endpoint that does not answer as an rpc-server of this llama.cpp, is refused by name:
    ggml aborts the process on a failed connection or handshake, so each endpoint is tried
    first from a child process."""
    g = ggml()
    add = _rpc_add_server(build_hint)
    before = {d.name for d in devices()}
    for endpoint in endpoints:
        if endpoint in _rpc_endpoints:
            continue
        _check_rpc_endpoint(endpoint)
        reg = add(endpoint.encode())
        if not reg:
            raise BackendError(f"--rpc {endpoint}: the rpc-server there has no device")
        g.register(reg)
        _rpc_endpoints.append(endpoint)
    return [d.name for d in devices() if d.name not in before]


def _check_rpc_endpoint(endpoint: str, timeout_s: float = 30.0) -> None:
    """The endpoint answers as an rpc-server this llama.cpp can use, tried where a failure
    cannot abort this process: a TCP connection, then a registration in a child."""
    import socket
    import subprocess
    import sys

    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise BackendError(f"--rpc {endpoint}: expected HOST:PORT")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5.0).close()
    except OSError as e:
        raise BackendError(f"--rpc {endpoint}: no rpc-server answered there ({e})") from None
    probe = ("import sys; from specwire.backend import placement as p; "
             "sys.exit(0 if p.rpc_answers(sys.argv[1]) else 3)")
    try:
        r = subprocess.run([sys.executable, "-c", probe, endpoint], capture_output=True,
                           text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise BackendError(f"--rpc {endpoint}: no answer within {timeout_s:.0f} s") from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no device"])[-1][:200]
        raise BackendError(f"--rpc {endpoint}: not an rpc-server this llama.cpp can use: {why}")


def _rpc_add_server(build_hint: str = "") -> ctypes._CFuncPtr:
    """The RPC backend's ggml_backend_rpc_add_server, refused where this build lacks it."""
    g = ggml()
    rpc = g.reg_by_name(b"RPC")
    if not rpc:
        raise BackendError("--rpc: this llama.cpp build has no RPC backend" + build_hint)
    fn = g.reg_proc_address(rpc, b"ggml_backend_rpc_add_server")
    if not fn:
        raise BackendError("--rpc: this llama.cpp's RPC backend cannot add servers")
    return _RPC_ADD_SERVER(fn)


def rpc_answers(endpoint: str) -> bool:
    """Whether the rpc-server there offers a device (the child's probe: ggml aborts the
    process on a failed connection or handshake)."""
    return bool(_rpc_add_server()(endpoint.encode()))


def buffer_types() -> dict[str, int]:
    """Buffer type name -> ggml_backend_buffer_type_t: each device's own, its host
    (pinned) type and the CPU backend's extra types (e.g. CPU_REPACK)."""
    g = ggml()
    out: dict[str, int] = {}

    def add(buft: int | None) -> None:
        if buft:
            out.setdefault(g.buft_name(buft).decode(), buft)

    for i in range(g.dev_count()):
        dev = g.dev_get(i)
        add(g.dev_buffer_type(dev))
        add(g.dev_host_buffer_type(dev))
        reg = g.dev_backend_reg(dev)
        fn = g.reg_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
        if fn:
            extra = _EXTRA_BUFTS(fn)(dev)
            j = 0
            while extra and extra[j]:
                add(extra[j])
                j += 1
    return out


# --------------------------------------------------------------------------- model params


def check(p: Placement, flags: dict[str, str] | None = None) -> None:
    """Refuse unknown buffer types and devices before any model loads (names the flag)."""
    names = {"overrides": "-ot", "devices": "-dev", **(flags or {})}
    if p.overrides:
        known = buffer_types()
        for o in p.overrides:
            _buffer_type(known, o, names["overrides"])
    if p.devices:
        _device_pointers(p.devices, names["devices"])


def _buffer_type(known: dict[str, int], o: TensorOverride, flag: str) -> int:
    buft = known.get(o.buffer_type)
    if buft is None:
        raise BackendError(f"{flag}: unknown buffer type {o.buffer_type!r} in "
                           f"{o.pattern}={o.buffer_type}; available: {', '.join(known)}")
    return buft


def _device_pointers(names: Sequence[str], flag: str) -> list[int]:
    g = ggml()
    ptrs = []
    for name in names:
        dev = g.dev_by_name(name.encode())
        if not dev or g.dev_type(dev) == DEVICE_CPU:
            usable = [d.name for d in devices() if not d.is_cpu]
            known = ", ".join(usable) or "none in this build (CPU only)"
            raise BackendError(f"{flag}: invalid device {name!r}; available: {known} "
                               "(or 'none')")
        ptrs.append(dev)
    return ptrs


class _Override(ctypes.Structure):
    """llama_model_tensor_buft_override, where llama-cpp-python does not define it."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


@dataclass(slots=True)
class Applied:
    """The C arrays handed to llama.cpp: they must live as long as the model."""

    keep: list = field(default_factory=list)


def apply(mp: ctypes.Structure, placement: Placement, n_gpu_layers: int,
          flags: dict[str, str] | None = None) -> Applied:
    """Fill llama_model_params from a Placement; `flags` names the flags for errors."""
    names = {"overrides": "-ot", "devices": "-dev", "split_mode": "-sm", "main_gpu": "-mg",
             "tensor_split": "-ts", "use_mmap": "--no-mmap", "use_mlock": "--mlock",
             "n_gpu_layers": "-ngl", **(flags or {})}
    applied = Applied()
    set_field(mp, "n_gpu_layers", n_gpu_layers, names["n_gpu_layers"])
    p, default = placement, Placement()
    if (p.use_mmap, p.use_mlock) != (default.use_mmap, default.use_mlock):
        _apply_load_mode(mp, p, names)
    if p.split_mode != default.split_mode:
        set_field(mp, "split_mode", SPLIT_MODES[p.split_mode], names["split_mode"])
    if p.main_gpu != default.main_gpu:
        set_field(mp, "main_gpu", p.main_gpu, names["main_gpu"])
    if p.tensor_split:
        _apply_tensor_split(mp, p.tensor_split, names["tensor_split"], applied)
    if p.devices is not None:
        _apply_devices(mp, p.devices, names["devices"], applied)
    if p.overrides:
        _apply_overrides(mp, p.overrides, names["overrides"], applied)
    _apply_repack(mp, p.repack)
    return applied


#: ggml's AMX buffer type: its matrix product segfaults on the first decode of a quantized
#: model on some AMX CPUs (llama.cpp #20824, open upstream; seen here on a Xeon with
#: AMX_INT8 and llama-cpp-python 0.3.36), so weights stay out of it unless --repack asks.
AMX_BUFFER = "AMX"


def _apply_repack(mp: ctypes.Structure, repack: bool | None) -> None:
    """--repack / -nr (use_extra_bufts); unset, off where the CPU backend offers AMX."""
    if repack is None:
        if not has_field(mp, "use_extra_bufts") or AMX_BUFFER not in buffer_types():
            return
        _warn_amx()
        repack = False
    set_field(mp, "use_extra_bufts", repack, "--repack" if repack else "--no-repack")


_amx_warned = False


def _warn_amx() -> None:
    global _amx_warned
    if not _amx_warned:
        _amx_warned = True
        log.warning("this CPU offers llama.cpp's AMX weight layout, whose matrix product "
                    "crashes on some machines (llama.cpp #20824): weights are not "
                    "repacked (--repack turns repacking and AMX back on)")


#: llama_load_mode for (use_mmap, use_mlock), in builds where it replaced the two booleans.
_LOAD_MODES = {(False, False): 0, (True, False): 1, (False, True): 2, (True, True): 3}


def _apply_load_mode(mp: ctypes.Structure, p: Placement, names: dict[str, str]) -> None:
    """--no-mmap/--mlock: the booleans of older builds, or the load_mode enum of newer ones."""
    if has_field(mp, "use_mmap") or not has_field(mp, "load_mode"):
        if not p.use_mmap:
            set_field(mp, "use_mmap", False, names["use_mmap"])
        if p.use_mlock:
            set_field(mp, "use_mlock", True, names["use_mlock"])
        return
    mp.load_mode = _LOAD_MODES[(p.use_mmap, p.use_mlock)]


def _apply_tensor_split(mp: ctypes.Structure, split: Sequence[float], flag: str,
                        applied: Applied) -> None:
    import llama_cpp
    most = int(llama_cpp.llama_max_devices())
    if len(split) > most:
        raise BackendError(f"{flag}: at most {most} proportions in this build, got {len(split)}")
    arr = (ctypes.c_float * most)(*split)
    applied.keep.append(arr)
    set_field(mp, "tensor_split", ctypes.cast(arr, ctypes.POINTER(ctypes.c_float)), flag)


def _apply_devices(mp: ctypes.Structure, names: Sequence[str], flag: str,
                   applied: Applied) -> None:
    ptrs = _device_pointers(names, flag)
    arr = (ctypes.c_void_p * (len(ptrs) + 1))(*ptrs, None)
    applied.keep.append(arr)
    set_field(mp, "devices", ctypes.cast(arr, ctypes.c_void_p), flag)


def _apply_overrides(mp: ctypes.Structure, overrides: Sequence[TensorOverride], flag: str,
                     applied: Applied) -> None:
    import llama_cpp
    if not has_field(mp, "tensor_buft_overrides"):
        set_field(mp, "tensor_buft_overrides", None, flag)     # raises, naming the flag
    known = buffer_types()
    struct = getattr(llama_cpp, "llama_model_tensor_buft_override", _Override)
    arr = (struct * (len(overrides) + 1))()
    for i, o in enumerate(overrides):
        buft = _buffer_type(known, o, flag)
        pattern = ctypes.create_string_buffer(o.pattern.encode())
        applied.keep.append(pattern)
        arr[i].pattern = ctypes.cast(pattern, ctypes.c_char_p)
        arr[i].buft = buft
    applied.keep.append(arr)
    ftype = dict(type(mp)._fields_)["tensor_buft_overrides"]
    set_field(mp, "tensor_buft_overrides", ctypes.cast(arr, ftype), flag)
