"""The first check of a model file, before llama.cpp sees it: llama.cpp turns a wrong
path or a file that is no GGUF into an opaque load failure, this names the file."""

from __future__ import annotations

import os
from pathlib import Path

from specwire.backend.base import BackendError


def check_gguf(path: str | os.PathLike) -> None:
    """Raise BackendError naming `path` unless it is a readable file starting with b'GGUF'.

    Catches the common mistakes (wrong path, a .safetensors or an HTML error page
    saved as .gguf) before llama.cpp turns them into an opaque load failure.
    """
    p = Path(path)
    if not p.exists():
        raise BackendError(f"{p}: model file not found")
    if not p.is_file():
        raise BackendError(f"{p}: not a file")
    try:
        with p.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise BackendError(f"{p}: cannot read: {e.strerror}") from None
    if magic != b"GGUF":
        raise BackendError(f"{p}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
