"""Placement and loading flags with llama.cpp's names: -ot, --cpu-moe, -dev, -fa, --numa...

The target's flags and the in-process draft's (-otd, --cpu-moe-draft, -devd,
-fad...) are added here; `specwire draft` takes the draft's under the plain
names (its own model is the draft), the draft spellings kept as aliases.
Each value is checked where it is parsed, so a bad one is one line naming the
flag; what needs the loaded ggml library (a buffer type's or a device's name)
is checked when the model loads, with the list of what this build has.
"""

from __future__ import annotations

import argparse
import re
import sys

from specwire.config import (
    NUMA_STRATEGIES,
    SPLIT_MODES,
    ConfigError,
    Placement,
    TensorOverride,
)

#: accepted -fa spellings (llama.cpp takes on/off/auto and these synonyms).
_FA_WORDS = {"on": "on", "enabled": "on", "1": "on", "true": "on",
             "off": "off", "disabled": "off", "0": "off", "false": "off",
             "auto": "auto", "-1": "auto"}


class PlacementError(ConfigError):
    """A placement flag's value is malformed; the message names the flag."""


class ListDevices(argparse.Action):
    """--list-devices: print what this build of llama.cpp can use, then exit 0."""

    def __init__(self, option_strings, dest, **kw) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from specwire.backend.placement import describe_devices
        print(describe_devices())
        sys.stdout.flush()
        parser.exit(0)


# (dest suffix, draft spellings, plain spellings, add_argument keywords): one row per flag
# both the target and a draft have. The target gets the plain spellings, dest without suffix.
_PER_MODEL: list[tuple[str, tuple[str, ...], tuple[str, ...], dict]] = [
    ("flash_attn", ("-fad", "--flash-attn-draft"), ("-fa", "--flash-attn"),
     dict(nargs="?", const="on", default="auto", metavar="on|off|auto",
          help="flash attention (default auto; a bare flag means on)")),
    ("override_tensor", ("-otd", "--override-tensor-draft", "--spec-draft-override-tensor"),
     ("-ot", "--override-tensor"),
     dict(action="append", default=[], metavar="REGEX=BUFTYPE[,...]",
          help="put tensors whose name matches REGEX in buffer type BUFTYPE (CPU, CUDA0, "
               "CUDA_Host, Vulkan0, Metal...: see --list-devices); repeatable")),
    ("cpu_moe", ("-cmoed", "--cpu-moe-draft", "--spec-draft-cpu-moe"), ("-cmoe", "--cpu-moe"),
     dict(action="store_true", help="keep every layer's MoE expert weights in the CPU")),
    ("n_cpu_moe", ("-ncmoed", "--n-cpu-moe-draft", "--spec-draft-n-cpu-moe"),
     ("-ncmoe", "--n-cpu-moe"),
     dict(type=int, default=0, metavar="N",
          help="keep the MoE expert weights of the first N layers in the CPU")),
    ("device", ("-devd", "--device-draft", "--spec-draft-device"), ("-dev", "--device"),
     dict(default=None, metavar="DEV1,DEV2|none",
          help="devices to offload to (--list-devices; none: no offload)")),
]
#: Loading flags a process (or its one model) has once: the in-process draft shares the
#: target's, `specwire draft` has its own under the same names.
_SHARED: list[tuple[str, tuple[str, ...], dict]] = [
    ("numa", ("--numa",), dict(default=None, metavar="distribute|isolate|numactl",
                               help="NUMA strategy (llama.cpp's --numa)")),
    ("no_mmap", ("--no-mmap",), dict(action="store_true",
                                     help="read the weights into memory instead of mapping")),
    ("mlock", ("--mlock",), dict(action="store_true", help="lock the weights in RAM")),
    ("repack", ("--repack",), dict(action="store_const", const=True, default=None,
                                   help="repack the weights for the CPU (llama.cpp's "
                                        "default; off by default on an AMX CPU)")),
    ("repack", ("-nr", "--no-repack"), dict(action="store_const", const=False, default=None,
                                            help="keep the weights in the file's layout")),
    ("tensor_split", ("-ts", "--tensor-split"),
     dict(default=None, metavar="N0,N1,...",
          help="proportions of the model per GPU, e.g. 3,1")),
    ("split_mode", ("-sm", "--split-mode"),
     dict(default="layer", metavar="none|layer|row", help="how to split across GPUs")),
    ("main_gpu", ("-mg", "--main-gpu"), dict(type=int, default=0, metavar="I",
                                              help="the GPU for -sm none / row's results")),
]


def add_target_placement_args(g: argparse._ActionsContainer) -> None:
    """The target's flags (plain names), the shared ones and --list-devices."""
    for suffix, _draft, plain, kw in _PER_MODEL:
        g.add_argument(*plain, dest=suffix, **kw)
    add_shared_args(g)


def add_draft_placement_args(g: argparse._ActionsContainer, plain: bool) -> None:
    """The draft's flags; `plain`: also under the plain names (`specwire draft`)."""
    for suffix, draft, plain_names, kw in _PER_MODEL:
        names = (*plain_names, *draft) if plain else draft
        g.add_argument(*names, dest=f"{suffix}_draft", **kw)
    if plain:
        add_shared_args(g)


def add_shared_args(g: argparse._ActionsContainer) -> None:
    for dest, names, kw in _SHARED:
        g.add_argument(*names, dest=dest, **kw)
    g.add_argument("--list-devices", action=ListDevices,
                   help="print the devices and buffer types this build can use, then exit")


# --------------------------------------------------------------------------- values


def flash_attn(text: str, flag: str) -> str:
    mode = _FA_WORDS.get(str(text).strip().lower())
    if mode is None:
        raise PlacementError(f"{flag}: expected on, off or auto, got {text!r}")
    return mode


def numa(text: str | None) -> str:
    if text is None:
        return "disabled"
    if text not in NUMA_STRATEGIES or text == "disabled":
        raise PlacementError(f"--numa: expected distribute, isolate or numactl, got {text!r}")
    return text


def overrides(values: list[str], flag: str) -> tuple[TensorOverride, ...]:
    """'-ot A=CPU,B=CUDA0 -ot C=CPU' -> the three overrides, each regex compiled once here."""
    out = []
    for value in values:
        for item in value.split(","):
            pattern, eq, buft = item.partition("=")
            if not eq or not pattern or not buft:
                raise PlacementError(f"{flag}: expected REGEX=BUFTYPE[,...], got {item!r}")
            try:
                re.compile(pattern)
            except re.error as e:
                raise PlacementError(f"{flag}: bad regex {pattern!r}: {e}") from None
            out.append(TensorOverride(pattern, buft))
    return tuple(out)


def moe_overrides(cpu_moe: bool, n_cpu_moe: int, flag: str) -> tuple[TensorOverride, ...]:
    from specwire.backend.placement import cpu_moe_override, n_cpu_moe_overrides
    if n_cpu_moe < 0:
        raise PlacementError(f"{flag}: must be >= 0, got {n_cpu_moe}")
    return n_cpu_moe_overrides(n_cpu_moe) + ((cpu_moe_override(),) if cpu_moe else ())


def device_list(text: str | None, flag: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(s.strip() for s in text.split(","))
    if names == ("none",):
        return ()
    if not all(names) or "none" in names:
        raise PlacementError(f"{flag}: expected a comma list of device names or 'none', "
                             f"got {text!r}")
    return names


def tensor_split(text: str | None) -> tuple[float, ...]:
    if text is None:
        return ()
    try:
        parts = tuple(float(x) for x in re.split(r"[,/]", text))
    except ValueError:
        raise PlacementError(f"-ts: expected numbers separated by ',' or '/', e.g. 3,1; "
                             f"got {text!r}") from None
    if any(x < 0 for x in parts) or not sum(parts) > 0:
        raise PlacementError(f"-ts: expected proportions >= 0, not all 0; got {text!r}")
    return parts


def split_mode(text: str) -> str:
    if text not in SPLIT_MODES:
        raise PlacementError(f"-sm: expected none, layer or row, got {text!r}")
    return text


def placement(a: argparse.Namespace, draft: bool) -> Placement:
    """The Placement the flags ask for: the target's, or the draft's (suffix _draft)."""
    sfx = "_draft" if draft else ""
    names = draft_flag_names() if draft else {}
    ot = overrides(getattr(a, f"override_tensor{sfx}", []) or [],
                   names.get("override_tensor", "-ot"))
    moe = moe_overrides(getattr(a, f"cpu_moe{sfx}", False), getattr(a, f"n_cpu_moe{sfx}", 0),
                        names.get("n_cpu_moe", "--n-cpu-moe"))
    if getattr(a, "main_gpu", 0) < 0:
        raise PlacementError(f"-mg: must be >= 0, got {a.main_gpu}")
    return Placement(
        overrides=ot + moe,
        devices=device_list(getattr(a, f"device{sfx}", None), names.get("device", "-dev")),
        split_mode=split_mode(getattr(a, "split_mode", "layer")),
        main_gpu=getattr(a, "main_gpu", 0),
        tensor_split=tensor_split(getattr(a, "tensor_split", None)),
        use_mmap=not getattr(a, "no_mmap", False),
        use_mlock=getattr(a, "mlock", False),
        repack=getattr(a, "repack", None),
    )


def draft_flag_names() -> dict[str, str]:
    """The in-process draft's spelling of each per-model flag, for its error messages."""
    return {suffix: draft[0] for suffix, draft, _plain, _kw in _PER_MODEL} | {
        "devices": "-devd", "overrides": "-otd", "n_gpu_layers": "-ngld"}


def node_flags(a: argparse.Namespace) -> list[str]:
    """The draft's placement as `specwire draft` flags (bench starts a node with them)."""
    out: list[str] = []
    for value in getattr(a, "override_tensor_draft", []) or []:
        out += ["-ot", value]
    if getattr(a, "cpu_moe_draft", False):
        out.append("--cpu-moe")
    if getattr(a, "n_cpu_moe_draft", 0):
        out += ["--n-cpu-moe", str(a.n_cpu_moe_draft)]
    if getattr(a, "device_draft", None):
        out += ["-dev", a.device_draft]
    out += ["-fa", getattr(a, "flash_attn_draft", "auto")]
    for dest, names, kw in _SHARED:
        value = getattr(a, dest, None)
        if "const" in kw:  # one of a pair of flags setting the same dest
            if value is not None and value == kw["const"]:
                out.append(names[0])
        elif value is True:
            out.append(names[0])
        elif value not in (None, False, "layer", 0):
            out += [names[0], str(value)]
    return out
