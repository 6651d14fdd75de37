"""The order `specwire` loads its native libraries in: llama.cpp's before numpy's.

With numpy imported first, a CUDA build of llama.cpp crashed loading an F16 model fully on
the GPU, and loaded it in the other order (issue 36). No GPU here: what can be checked is
the order itself, in a fresh interpreter, through Python's audit events (an import, a
ctypes.dlopen), for the entry point every command goes through."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
seen = []
def hook(event, args):
    if event == "import" and args[0] == "numpy":
        seen.append("numpy")
    elif event == "ctypes.dlopen" and "libllama" in str(args[0]):
        seen.append("libllama")
sys.addaudithook(hook)
import {module}
print(" ".join(dict.fromkeys(seen)))
"""


def first_loaded(module: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.split()


def test_the_command_line_loads_llama_cpp_before_numpy() -> None:
    assert first_loaded("specwire.cli.main") == ["libllama", "numpy"]


def test_the_probe_sees_the_wrong_order_too() -> None:
    """The check can fail: a module that imports numpy first is seen doing so."""
    assert first_loaded("numpy, llama_cpp") == ["numpy", "libllama"]
