"""llama.cpp's process-wide state, with one owner: backend init, --numa, the log.

llama.cpp has one log callback and one backend initialisation per process, and --numa can
be set only once, so everything in specwire that touches them (model loading, device
listing, grammars, the quantizer) goes through here. `init_backend(numa)` installs the log
callback and initialises the backends once, refusing a second, different --numa. The
callback forwards warnings and errors to `logging` and hands every line to the taps open at
the time: `llama_log()` collects lines while a block runs, `log_tap(on_line, quiet=True)`
streams them to a function and keeps them out of `logging` (the quantizer's progress).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import llama_cpp as C

from specwire.backend.base import BackendError
from specwire.config import NUMA_STRATEGIES

log = logging.getLogger("specwire.backend.llama")

#: ggml log levels.
WARN, ERROR, CONT = 3, 4, 5


@dataclass(slots=True)
class _Tap:
    on_line: Callable[[int, str], None]
    quiet: bool


_lock = threading.Lock()
_initialised = False
_numa: str | None = None
_taps: list[_Tap] = []


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _log_callback(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation. llama.cpp is chatty;
    # keep problems, and hand every line to the taps open now.
    if not text:
        return
    line = text.decode(errors="replace")
    taps = list(_taps)
    for tap in taps:
        with contextlib.suppress(Exception):
            tap.on_line(level, line)
    if level in (WARN, ERROR) and not any(t.quiet for t in taps):
        log.log(logging.ERROR if level >= ERROR else logging.DEBUG, line.rstrip())


def _install() -> None:
    C.llama_log_set(_log_callback, ctypes.c_void_p())


def init_backend(numa: str = "disabled") -> None:
    """llama.cpp's process-wide setup, once: log callback, backends, --numa strategy."""
    global _initialised, _numa
    with _lock:
        if not _initialised:
            _install()
            C.llama_backend_init()
            _initialised = True
        if numa != "disabled" and numa != _numa:
            if _numa is not None:
                raise BackendError(f"--numa {numa}: this process already runs --numa {_numa}")
            C.llama_numa_init(NUMA_STRATEGIES[numa])
            _numa = numa


@contextlib.contextmanager
def log_tap(on_line: Callable[[int, str], None], quiet: bool = False) -> Iterator[None]:
    """Hand every llama.cpp log line (level, text) to on_line while the block runs; quiet
    keeps them out of `logging` meanwhile. The callback is installed again on entry, in
    case a library (llama-cpp-python's own Llama) set its own since."""
    init_backend()
    tap = _Tap(on_line, quiet)
    with _lock:
        _install()
        _taps.append(tap)
    try:
        yield
    finally:
        with _lock:
            _taps.remove(tap)


@contextlib.contextmanager
def llama_log() -> Iterator[list[str]]:
    """Collect llama.cpp's log lines (every level) while the block runs."""
    lines: list[str] = []
    with log_tap(lambda _level, text: lines.append(text)):
        yield lines
