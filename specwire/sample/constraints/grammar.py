"""llama.cpp's own grammar engine (GBNF), driven through llama-cpp-python's C API.

llama.cpp keeps a grammar's parse state in a sampler: applying it sets the logit of every
token the grammar cannot take next to -inf, and accepting a token advances it. Its cost
grows with the candidates (a whole 262k vocabulary is costly), so callers ask about the
few best tokens first (`allowed` takes any id array) and fall back to the whole vocabulary
only when none fits. The state advances only along committed tokens, so the target needs
no rollback; a drafter that follows the grammar speculatively works on a `clone()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from specwire.config import ConfigError
from specwire.sample.constraints.bounds import check_gbnf

_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
_compile_lock = threading.Lock()


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """A GBNF grammar to compile for a request: its text, start rule and where it came from.

    origin names the request field it came from ("grammar", "json_schema",
    "response_format", "tool_choice"...), so that a compile error names it too.
    """

    text: str
    root: str = "root"
    origin: str = "grammar"


@contextlib.contextmanager
def _stderr_captured() -> Iterator[list[str]]:
    """Capture file descriptor 2: llama.cpp's grammar parser prints its errors there.

    The capture is brief (one parse) and whatever was written is handed back to
    the real stderr afterwards, so nothing another thread printed meanwhile is lost.
    """
    out: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            out.append(text)
            if text and "error parsing grammar" not in text:
                sys.stderr.write(text)


class Grammar:
    """One compiled grammar and its parse state, for one sequence."""

    __slots__ = ("_smpl", "_C", "spec")

    def __init__(self, smpl: ctypes.c_void_p, spec: GrammarSpec) -> None:
        import llama_cpp as C

        self._C, self._smpl, self.spec = C, smpl, spec

    @classmethod
    def compile(cls, spec: GrammarSpec, vocab: ctypes.c_void_p) -> Grammar:
        """Parse spec against a model's vocabulary; ConfigError naming the problem if invalid."""
        import llama_cpp as C

        if not spec.text.strip():
            raise ConfigError(f"{spec.origin}: the grammar is empty")
        check_gbnf(spec.text, spec.origin)   # llama.cpp's parser has no bound of its own
        from specwire.backend.llama_process import ERROR, WARN, log_tap

        problems: list[str] = []

        def keep(level: int, text: str) -> None:
            if level in (WARN, ERROR):
                problems.append(text.strip())

        with _compile_lock, _stderr_captured() as printed, log_tap(keep):
            smpl = C.llama_sampler_init_grammar(vocab, spec.text.encode(), spec.root.encode())
        if not smpl:
            why = _parse_error("".join(printed)) or "; ".join(
                ln for ln in problems if "failed to parse" not in ln)
            raise ConfigError(f"{spec.origin}: invalid grammar: {why or 'llama.cpp rejected it'}")
        return cls(smpl, spec)

    @classmethod
    def for_backend(cls, spec: GrammarSpec, backend: object) -> Grammar:
        """Compile against a llama.cpp backend's vocabulary (others cannot take grammars)."""
        vocab = getattr(getattr(backend, "model", None), "vocab", None)
        if vocab is None:
            raise ConfigError(f"{spec.origin}: this model backend cannot apply grammars")
        return cls.compile(spec, vocab)

    def allowed(self, ids: np.ndarray) -> np.ndarray:
        """(n,) bool: which of these token ids the grammar accepts next. ids: (n,) ints."""
        n = int(ids.shape[0])
        if n == 0:
            return np.zeros(0, dtype=bool)
        data = np.zeros(n, dtype=_TOKEN_DATA)
        data["id"] = ids
        arr = self._C.llama_token_data_array(
            data=data.ctypes.data_as(ctypes.POINTER(self._C.llama_token_data)),
            size=n, selected=-1, sorted=False)
        self._C.llama_sampler_apply(self._smpl, ctypes.byref(arr))
        return np.isfinite(data["logit"])

    def accept(self, token: int) -> None:
        """Advance the parse state by one token.

        llama.cpp aborts the process on a token its grammar cannot take, so that is
        checked first (one candidate: cheap) and refused with an exception.
        """
        if not self.allowed(np.array([token]))[0]:
            raise ConfigError(f"{self.spec.origin}: token {token} does not fit the grammar here")
        self._C.llama_sampler_accept(self._smpl, int(token))

    def clone(self) -> Grammar:
        """An independent copy of the grammar and its current state."""
        return Grammar(self._C.llama_sampler_clone(self._smpl), self.spec)

    def close(self) -> None:
        if self._smpl:
            self._C.llama_sampler_free(self._smpl)
            self._smpl = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


def _parse_error(printed: str) -> str:
    """llama.cpp's message, e.g. "Undefined rule identifier 'foo'", without the echoed grammar."""
    for line in printed.splitlines():
        if "error parsing grammar:" in line:
            return line.split("error parsing grammar:", 1)[1].strip()
    lines = [ln.strip() for ln in printed.splitlines() if ln.strip()]
    return lines[0] if lines else ""
