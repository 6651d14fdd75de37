"""llama.cpp backend through llama-cpp-python's low-level C API.

The high-level `Llama` class keeps a logits row for every evaluated position when asked
for more than the last one; with Gemma-3's 262k vocabulary a row is 1 MB, so a long context
would cost gigabytes. Here a batch marks only the positions whose logits the engine reads,
and the rows come back as a zero-copy numpy view of llama.cpp's output buffer. A model file
is loaded once per process (`load_model`) and may serve many contexts. A context's KV cache
can be copied to RAM and back (`save`, `restore`: the draft node's --cache-ram) or to a file
(llama-server's slot save), and `reuse_chunks` is llama-server's --cache-reuse.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specwire.backend import placement
from specwire.backend.base import BackendError, NonFiniteLogits
from specwire.backend.batch import Part
from specwire.backend.gguf import check_gguf
from specwire.backend.llama_process import init_backend
from specwire.config import ModelParams

try:
    import llama_cpp as C
except ImportError as e:  # pragma: no cover - the package is a hard dependency
    raise BackendError(f"llama-cpp-python is not installed: {e}") from e

log = logging.getLogger(__name__)

_GGML_TYPES = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "iq4_nl": 20,
    "bf16": 30,
}


@dataclass(slots=True)
class Model:
    """A loaded GGUF: weights and vocabulary, shared by its contexts."""

    path: str
    ptr: ctypes.c_void_p
    vocab: ctypes.c_void_p
    n_vocab: int
    _pieces: dict
    _fingerprint: str | None = None
    _identity: str | None = None
    _placed: placement.Applied | None = None   # C arrays llama.cpp reads for the model's life
    load_params: ctypes.Structure | None = None  # llama_model_params as handed to llama.cpp

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def fingerprint(self) -> str:
        """sha256 over every token's text and attributes: equal iff the tables match."""
        if self._fingerprint is None:
            h = hashlib.sha256(str(self.n_vocab).encode())
            for t in range(self.n_vocab):
                h.update(C.llama_vocab_get_text(self.vocab, t) or b"")
                h.update(b"\0%d\0" % C.llama_vocab_get_attr(self.vocab, t))
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

    def identity(self) -> str:
        """A digest of the weights as far as a KV cache depends on them, cheaply: the
        vocabulary's fingerprint, llama.cpp's description, parameter count and size, and
        the file's size and 64 KiB read at 33 places across it (a fine-tune of the same
        shapes differs there). What a slot file is checked against (state_file.py)."""
        if self._identity is None:
            h = hashlib.sha256(self.fingerprint().encode())
            desc = ctypes.create_string_buffer(256)
            C.llama_model_desc(self.ptr, desc, len(desc))
            h.update(desc.value + b"\0%d\0%d" % (C.llama_model_n_params(self.ptr),
                                                  C.llama_model_size(self.ptr)))
            with contextlib.suppress(OSError), open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(b"%d" % size)
                for i in range(33):
                    f.seek(max(0, size - 65536) * i // 32)
                    h.update(f.read(65536))
            self._identity = h.hexdigest()[:32]
        return self._identity

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes a token prints as (special tokens print nothing, unless `special`:
        llama-server's --special)."""
        key = ~token if special else token
        p = self._pieces.get(key)
        if p is None:
            buf = ctypes.create_string_buffer(256)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
            p = self._pieces[key] = buf.raw[: max(n, 0)]
        return p

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def chat_template(self) -> str | None:
        t = C.llama_model_chat_template(self.ptr, None)
        return t.decode() if t else None

    def fim_tokens(self) -> dict[str, int]:
        """The vocabulary's fill-in-the-middle tokens (pre, suf, mid, pad, rep, sep) that
        it has, by name, and "bos" when its prompts start with BOS."""
        out = {name: int(getattr(C, f"llama_vocab_fim_{name}")(self.vocab))
               for name in ("pre", "suf", "mid", "pad", "rep", "sep")}
        out = {k: v for k, v in out.items() if v >= 0}
        if C.llama_vocab_get_add_bos(self.vocab):
            out["bos"] = self.bos
        return out

    def token_text(self, token: int) -> str:
        return (C.llama_vocab_get_text(self.vocab, token) or b"").decode(errors="replace")

    @property
    def bos(self) -> int:
        return int(C.llama_vocab_bos(self.vocab))

    @property
    def eos(self) -> int:
        return int(C.llama_vocab_eos(self.vocab))


def _load_lora(model: Model, path: str):  # noqa: ANN202 - llama_adapter_lora_p
    """A LoRA adapter GGUF for this model (--lora); it lives as long as the model."""
    if not os.path.isfile(path):
        raise BackendError(f"--lora: no such file: {path}")
    adapter = C.llama_adapter_lora_init(model.ptr, path.encode())
    if not adapter:
        raise BackendError(f"--lora: llama.cpp could not load {path} as a LoRA adapter of "
                           f"{model.path} (another architecture or shapes?)")
    return adapter


_models: dict[tuple, Model] = {}
_models_lock = threading.Lock()


def max_sequences() -> int:
    """The most sequences one llama.cpp context holds (LLAMA_MAX_SEQ)."""
    fn = getattr(C, "llama_max_parallel_sequences", None)
    return int(fn()) if fn is not None else 64


def load_model(params: ModelParams, flags: dict[str, str] | None = None) -> Model:
    """Load (or reuse) the weights of a GGUF file, placed as `params.placement` says.

    `flags` renames the flags in error messages (the draft's -otd, -devd...).
    """
    check_gguf(params.path)
    init_backend(params.numa)
    key = (os.path.realpath(params.path), params.n_gpu_layers, params.placement)
    with _models_lock:
        model = _models.get(key)
        if model is None:
            mp = C.llama_model_default_params()
            placed = placement.apply(mp, params.placement, params.n_gpu_layers, flags)
            ptr = C.llama_model_load_from_file(params.path.encode(), mp)
            if not ptr:
                raise BackendError(f"llama.cpp could not load the model: {params.path}")
            vocab = C.llama_model_get_vocab(ptr)
            model = Model(params.path, ptr, vocab, int(C.llama_vocab_n_tokens(vocab)), {},
                          _placed=placed, load_params=mp)
            _models[key] = model
        return model


_FLASH_ATTN_TYPE = {"auto": -1, "off": 0, "on": 1}   # llama_flash_attn_type


def _set_flash_attn(cp: ctypes.Structure, mode: str) -> None:
    """-fa on|off|auto: the enum where the struct has it, else the older boolean."""
    if placement.has_field(cp, "flash_attn_type"):
        cp.flash_attn_type = _FLASH_ATTN_TYPE[mode]
    elif mode != "auto":
        placement.set_field(cp, "flash_attn", mode == "on", "-fa")


_contexts = 0  # llama.cpp contexts alive in this process (GET /metrics: specwire:contexts_open)
_contexts_lock = threading.Lock()


def open_contexts() -> int:
    return _contexts


def _count_context(delta: int) -> None:
    global _contexts
    with _contexts_lock:
        _contexts += delta


class LlamaBackend:
    """One llama.cpp context holding n_seq sequences' KV caches, with rows only where asked.

    The backend itself speaks the Backend protocol for sequence 0; `seq(i)` is sequence
    i's view, and `decode` appends parts of several sequences in one llama_decode, so
    that the weights are read once for all of them. -c (params.n_ctx) is each sequence's
    context, as when every slot had a context of its own: the context holds n_seq times
    that, in one unified KV cache (one stream, so a step of uneven parts is one ubatch).

    With tree_branches > 0 a part may be a tree of up to tree_branches + 1 leaves
    (Part.parents): each leaf's path is a llama.cpp sequence of its own that shares the
    prefix's cells (llama_memory_seq_cp adds a sequence id to cells, copying nothing),
    each tree token is one cell carrying the ids of the leaves below it, and keep_tree
    leaves the kept path's cells in the part's sequence and frees the others.

    With forks, each sequence i also has a fork (sequence n_seq + i, `fork_seq`): a
    sequence of its own that shares i's first cells, as a draft node's alternate is drafted
    from its branch's history in the same decodes as the branch (link/fork.py). A fork
    holds few cells of its own (_FORK_CELLS); trees and forks exclude each other.
    """

    def __init__(self, params: ModelParams, model: Model | None = None, n_seq: int = 1,
                 tree_branches: int = 0, forks: bool = False) -> None:
        if n_seq < 1:
            raise BackendError(f"n_seq: must be >= 1, got {n_seq}")
        if tree_branches < 0:
            raise BackendError(f"tree_branches: must be >= 0, got {tree_branches}")
        if forks and tree_branches:
            raise BackendError("a context holds trees or forks, not both")
        self.params = params
        self.model = model or load_model(params)
        self.name = self.model.name
        self.n_vocab = self.model.n_vocab
        self.n_seq = n_seq
        #: the sliding attention window of the model's SWA layers (0: none)
        self.n_swa = int(C.llama_model_n_swa(self.model.ptr))
        self.tree_leaves = tree_branches + 1
        self.n_forks = n_seq if forks else 0
        # The cells a tree's side branches hold until keep_tree frees them, and the forks'.
        slack = n_seq * tree_branches * _TREE_CELLS + self.n_forks * _FORK_CELLS
        cp = C.llama_context_default_params()
        cp.n_ctx = params.n_ctx * n_seq + slack
        cp.n_batch = params.n_batch
        placement.set_field(cp, "n_ubatch", min(params.n_ubatch, params.n_batch), "-ub")
        cp.n_seq_max = n_seq * self.tree_leaves + self.n_forks
        if cp.n_seq_max > max_sequences():
            raise BackendError(
                f"{n_seq} sequences{' with their forks' if forks else ''}"
                f"{' and trees' if tree_branches else ''} need {cp.n_seq_max} llama.cpp "
                f"sequence ids; one context holds at most {max_sequences()}")
        if cp.n_seq_max > 1 and placement.has_field(cp, "kv_unified"):
            cp.kv_unified = True
        elif tree_branches or forks:
            raise BackendError("trees and forks need llama.cpp's unified KV cache")
        cp.n_threads = params.n_threads
        cp.n_threads_batch = params.n_threads_batch or params.n_threads
        cp.type_k = _GGML_TYPES[params.type_k]
        cp.type_v = _GGML_TYPES[params.type_v]
        _set_flash_attn(cp, params.flash_attn)
        cp.no_perf = True
        # Rolling back a sliding-window cache is only exact when it keeps every position.
        cp.swa_full = True
        for name, value in params.rope.context_fields().items():
            setattr(cp, name, value)
        self.context_params = cp   # as handed to llama.cpp (tests read n_ubatch from it)
        self.loras = [_load_lora(self.model, path) for path, _ in params.loras]
        self.ctx = C.llama_init_from_model(self.model.ptr, cp)
        if not self.ctx:
            raise BackendError(
                f"llama.cpp could not create a context (-c {params.n_ctx} x {n_seq} "
                f"sequences) for {params.path}"
            )
        _count_context(+1)
        self.lora_scales = [s for _, s in params.loras]
        self._lora_applied: list[float] = []
        if self.loras and not self._set_loras(self.lora_scales):
            C.llama_free(self.ctx)
            self.ctx = None
            _count_context(-1)
            raise BackendError(f"llama.cpp could not apply --lora to {params.path}")
        n_cells = int(C.llama_n_ctx(self.ctx))
        if slack:   # what -c gives without the trees' cells (llama.cpp pads it to 256)
            n_cells = min(n_cells - slack, _pad(params.n_ctx * n_seq, 256))
        self.n_ctx = n_cells // n_seq   # per sequence
        self.mem = C.llama_get_memory(self.ctx)
        self.n_batch = self._cap = params.n_batch
        self._batch = C.llama_batch_init(self._cap, 0, self.tree_leaves)
        self._tok = np.ctypeslib.as_array(self._batch.token, shape=(self._cap,))
        self._pos = np.ctypeslib.as_array(self._batch.pos, shape=(self._cap,))
        self._nseq = np.ctypeslib.as_array(self._batch.n_seq_id, shape=(self._cap,))
        self._out = np.ctypeslib.as_array(self._batch.logits, shape=(self._cap,))
        self._seq_ptrs = [self._batch.seq_id[i] for i in range(self._cap)]
        for p in self._seq_ptrs:
            p[0] = 0
        self._nseq[:] = 1
        self._seq_max = int(cp.n_seq_max)
        self._finite_stride = max(1, self.n_vocab // 256)   # _check_finite's sample
        self._leaves: list[list[int]] = [[] for _ in range(n_seq)]
        n_ids = n_seq + self.n_forks   # the sequences held by index: forks after the rest
        self._seqs: list[list[int]] = [[] for _ in range(n_ids)]
        #: per sequence: its pending tree part (tokens, parents, leaf of each node), or None
        self._trees: list[_PendingTree | None] = [None] * n_ids
        self._views = [self, *(SeqView(self, i) for i in range(1, n_ids))]
        self.decode_s = 0.0          # time inside llama_decode, to measure our own overhead
        self._seq_decode_s = [0.0] * n_ids   # ... each sequence's share of it

    # -- the Backend protocol (sequence 0) -------------------------------------

    @property
    def n_past(self) -> int:
        return len(self._seqs[0])

    @property
    def tokens(self) -> Sequence[int]:
        return self._seqs[0]

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        """Append tokens; rows: "last" (1, V), "all" (n, V), "none" (0, V)."""
        return self.eval_seq(0, tokens, logits)

    def truncate(self, n: int) -> None:
        self.truncate_seq(0, n)

    # -- several sequences ---------------------------------------------------

    def seq(self, i: int) -> LlamaBackend | SeqView:
        """Sequence i as a Backend of its own (sequence 0 is this object; n_seq + j is
        sequence j's fork)."""
        if not 0 <= i < len(self._views):
            raise BackendError(f"sequence {i} outside 0..{len(self._views) - 1}")
        return self._views[i]

    def fork_seq(self, seq: int, n: int) -> int:
        """Sequence seq's fork, holding seq's first n tokens and nothing else (their cells
        shared: llama_memory_seq_cp adds the fork's id to them, copying nothing); its id."""
        if not 0 <= seq < self.n_forks:
            raise BackendError(f"sequence {seq} has no fork ({self.n_forks} forks)")
        if not 0 <= n <= len(self._seqs[seq]):
            raise BackendError(f"fork of {n} tokens outside 0..{len(self._seqs[seq])}")
        fork = self.n_seq + seq
        C.llama_memory_seq_rm(self.mem, fork, -1, -1)
        if n:
            C.llama_memory_seq_cp(self.mem, seq, fork, 0, n)
        self._seqs[fork] = self._seqs[seq][:n]
        return fork

    def eval_seq(self, seq: int, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        """One sequence's tokens alone, in chunks of -b (rows from the last chunk only)."""
        n = len(tokens)
        if logits == "all" and n > self._cap:
            raise BackendError(f"cannot return logits for {n} tokens at once (batch {self._cap})")
        if n == 0:
            raise BackendError("eval of an empty token list")
        done = 0
        rows = np.empty((0, self.n_vocab), dtype=np.float32)
        while done < n:
            m = min(self._cap, n - done)
            last = done + m == n
            (rows,) = self.decode([Part(seq, list(tokens[done:done + m]),
                                        logits if last else "none")])
            done += m
        return rows

    def decode(self, parts: Sequence[Part]) -> list[np.ndarray]:
        """Every part appended to its sequence in one llama_decode; each part's rows."""
        total = sum(len(p.tokens) for p in parts)
        if total > self._cap:
            raise BackendError(f"a step of {total} tokens exceeds the batch (-b {self._cap})")
        i = 0
        for p in parts:
            if self._trees[p.seq] is not None:
                self._drop_tree(p.seq)
            n, past = len(p.tokens), len(self._seqs[p.seq])
            if n == 0:
                raise BackendError("eval of an empty token list")
            if p.parents is None and past + n > self.n_ctx:
                raise BackendError(f"context full: {past} + {n} tokens > -c {self.n_ctx}")
            bad = [t for t in p.tokens if not 0 <= t < self.n_vocab]
            if bad:
                raise BackendError(
                    f"token id {bad[0]} outside the vocabulary (0..{self.n_vocab - 1})")
            self._tok[i:i + n] = p.tokens
            if p.parents is not None:
                self._place_tree(p, i, past)
            else:
                self._pos[i:i + n] = np.arange(past, past + n)
                self._nseq[i:i + n] = 1
                if self._seq_max > 1:
                    for j in range(i, i + n):
                        self._seq_ptrs[j][0] = p.seq
            self._out[i:i + n] = 1 if p.logits == "all" else 0
            self._out[i + n - 1] = self._rows(p) > 0
            i += n
        self._batch.n_tokens = total
        t0 = time.perf_counter()
        rc = C.llama_decode(self.ctx, self._batch)
        spent = time.perf_counter() - t0
        self.decode_s += spent
        for p in parts:
            self._seq_decode_s[p.seq] += spent * len(p.tokens) / total
        if rc != 0:
            for p in parts:   # drop whatever the failed batch left behind
                if p.parents is not None:
                    self._clear_branches(p.seq)
                self.truncate_seq(p.seq, len(self._seqs[p.seq]))
            where = ", ".join(f"sequence {p.seq} at {len(self._seqs[p.seq])}" for p in parts)
            raise BackendError(f"llama_decode failed ({rc}) on {total} tokens ({where}) "
                               f"in {self.name}")
        n_rows = sum(self._rows(p) for p in parts)
        buf = (np.ctypeslib.as_array(C.llama_get_logits(self.ctx),
                                     shape=(n_rows, self.n_vocab)) if n_rows
               else np.empty((0, self.n_vocab), dtype=np.float32))
        out, r = [], 0
        for p in parts:
            if p.parents is not None:
                self._seqs[p.seq].append(p.tokens[0])
                self._trees[p.seq] = _PendingTree(p.tokens, p.parents)
            else:
                self._seqs[p.seq].extend(p.tokens)
            out.append(buf[r:r + p.n_rows])
            r += self._rows(p)
        self._check_finite(parts, buf)
        return out

    def _rows(self, p: Part) -> int:
        """Logits rows llama.cpp computes for a part: its own, and with LoRA adapters
        loaded (what can overflow: an extreme scale) the last row of a "none" part too,
        for _check_finite. Without adapters a "none" part costs no output row (on Gemma
        the output matrix is most of the model: a draft node's catch-up stays cheap)."""
        return p.n_rows or (1 if self.loras else 0)

    def _check_finite(self, parts: Sequence[Part], buf: np.ndarray) -> None:
        """A decode whose logits hold inf or NaN (activations that overflowed: a LoRA
        scale far too large, say) wrote NaN into its tokens' KV cells too. llama.cpp
        leaves a removed sequence's cells as they are, and every later decode multiplies
        the masked cells in as well (0 x NaN is NaN): every sequence of the context would
        read only NaN from then on. So the step's sequences are dropped from the cache,
        the cache's buffers are zeroed with every other sequence kept (saved and restored
        around llama_memory_clear), and the step fails: a 500 of its own. A sample of each
        row tells: a hidden state with one inf or NaN is all NaN after the final norm
        (inf / inf), so is every logit (a dot product with it); the sample costs
        microseconds where the whole rows would take milliseconds (9 x 262144 floats)."""
        if np.isfinite(buf[:, ::self._finite_stride]).all():
            return
        seqs = sorted({p.seq for p in parts})
        self._scrub(seqs)
        raise NonFiniteLogits(
            f"the model's output turned to inf/NaN (activations overflowed; an extreme "
            f"LoRA scale?) on sequence{'s' if len(seqs) > 1 else ''} "
            f"{', '.join(map(str, seqs))} of {self.name}: its cache was dropped", seqs)

    def _scrub(self, seqs: Sequence[int]) -> None:
        """Sequences seqs dropped, and the KV buffers zeroed: the others' cells are saved,
        the memory cleared with its data, and those cells restored."""
        for seq in seqs:
            if self._trees[seq] is not None:
                self._clear_branches(seq)
                self._trees[seq] = None
            C.llama_memory_seq_rm(self.mem, seq, -1, -1)
            self._seqs[seq].clear()
        kept = {}
        for fork in range(self.n_seq, len(self._seqs)):   # scratch: dropped, not saved
            self._seqs[fork].clear()
        for seq in range(self.n_seq):
            if self._seqs[seq] and self._trees[seq] is None:
                try:
                    kept[seq] = _save_seq(self, seq)
                except BackendError:
                    log.error("sequence %d: could not save its cache; dropped", seq)
        C.llama_memory_clear(self.mem, True)
        for seq in range(self.n_seq):
            data = kept.get(seq)
            if data is None or C.llama_state_seq_set_data(self.ctx, data, len(data), seq) == 0:
                if self._seqs[seq]:
                    log.error("sequence %d: its cache was lost with the scrubbed cells", seq)
                C.llama_memory_seq_rm(self.mem, seq, -1, -1)
                self._seqs[seq].clear()
                self._trees[seq] = None

    # -- trees -------------------------------------------------------------------

    def _branch_seq(self, seq: int, leaf: int) -> int:
        """The llama.cpp sequence id of leaf `leaf` of sequence seq's tree (0: seq)."""
        return seq if leaf == 0 else self.n_seq + seq * (self.tree_leaves - 1) + leaf - 1

    def _place_tree(self, p: Part, i: int, past: int) -> None:
        """Batch rows i.. for a tree part: positions by depth, each token's sequence ids
        those of the leaves below it; the prefix's cells shared with each leaf's id."""
        n, parents = len(p.tokens), p.parents
        if len(parents) != n or parents[0] != -1 or any(
                not 0 <= q < j for j, q in enumerate(parents) if j):
            raise BackendError(f"tree part: parents {parents} are not a tree in index order")
        if p.logits != "all":
            raise BackendError("tree part: its logits are a row per token")
        has_child = set(parents[1:])
        leaves = [j for j in range(n) if j not in has_child]
        if len(leaves) > self.tree_leaves:
            raise BackendError(f"tree part of {len(leaves)} leaves (at most "
                               f"{self.tree_leaves}: tree_branches + 1)")
        below: list[list[int]] = [[] for _ in range(n)]   # (n,) leaf indices under each node
        for li, leaf in enumerate(leaves):
            j = leaf
            while j >= 0:
                below[j].append(li)
                j = parents[j]
        depth = [0] * n
        for j in range(1, n):
            depth[j] = depth[parents[j]] + 1
        if past + max(depth) + 1 > self.n_ctx:
            raise BackendError(f"context full: {past} + {max(depth) + 1} tokens > -c {self.n_ctx}")
        for li in range(1, len(leaves)):
            b = self._branch_seq(p.seq, li)
            C.llama_memory_seq_rm(self.mem, b, -1, -1)
            if past:
                C.llama_memory_seq_cp(self.mem, p.seq, b, 0, past)
        for j in range(n):
            self._pos[i + j] = past + depth[j]
            ids = sorted(below[j])   # the chain's leaf (0) first where it passes
            self._nseq[i + j] = len(ids)
            for k, li in enumerate(ids):
                self._seq_ptrs[i + j][k] = self._branch_seq(p.seq, li)
        self._leaves[p.seq] = leaves

    def keep_tree(self, seq: int, nodes: Sequence[int]) -> None:
        """Keep the tree part's first token and the path `nodes` in sequence seq."""
        tree = self._trees[seq]
        if tree is None:
            raise BackendError(f"sequence {seq} holds no tree")
        leaves = self._leaves[seq]
        base = len(self._seqs[seq])   # the first token's position + 1
        last = nodes[-1] if nodes else 0
        leaf = next(li for li, lf in enumerate(leaves) if _under(tree.parents, lf, last))
        if leaf:
            b = self._branch_seq(seq, leaf)
            C.llama_memory_seq_rm(self.mem, seq, base, -1)
            C.llama_memory_seq_cp(self.mem, b, seq, base, -1)
        self._clear_branches(seq)
        C.llama_memory_seq_rm(self.mem, seq, base + len(nodes), -1)
        self._seqs[seq].extend(tree.tokens[j] for j in nodes)
        self._trees[seq] = None

    def _drop_tree(self, seq: int) -> None:
        """A tree nobody kept a path of: only its first token stays."""
        self.keep_tree(seq, [])

    def _clear_branches(self, seq: int) -> None:
        for li in range(1, self.tree_leaves):
            C.llama_memory_seq_rm(self.mem, self._branch_seq(seq, li), -1, -1)

    def set_lora_scales(self, scales: Sequence[float]) -> None:
        """POST /lora-adapters: each loaded adapter's new scale (0: off), the scales of
        every request that names none of its own."""
        if len(scales) != len(self.loras):
            raise BackendError(f"{len(scales)} scales for {len(self.loras)} adapters")
        want = [float(s) for s in scales]
        if not self._set_loras(want):
            raise BackendError("llama.cpp could not change the LoRA scales")
        self.lora_scales = want

    def apply_lora(self, scales: Sequence[float]) -> None:
        """The adapter scales the next decode runs with (a request's own `lora`, or
        lora_scales again); a no-op when they are already applied."""
        want = [float(s) for s in scales]
        if want == self._lora_applied:
            return
        if len(want) != len(self.loras):
            raise BackendError(f"{len(want)} scales for {len(self.loras)} adapters")
        if not self._set_loras(want):
            raise BackendError("llama.cpp could not change the LoRA scales")

    def _set_loras(self, scales: Sequence[float]) -> bool:
        adapters = (C.llama_adapter_lora_p_ctypes * len(self.loras))(*self.loras)
        values = (ctypes.c_float * len(self.loras))(*scales)
        ok = C.llama_set_adapters_lora(self.ctx, adapters, len(self.loras), values) == 0
        if ok:
            self._lora_applied = list(scales)
        return ok

    def seq_decode_s(self, seq: int) -> float:
        """Sequence seq's share of the time inside llama_decode: of each decode, the
        fraction of its tokens that were seq's (decode_s is every sequence's)."""
        return self._seq_decode_s[seq]

    def truncate_seq(self, seq: int, n: int) -> None:
        """Keep sequence seq's first n tokens (llama_memory_seq_rm on its cells alone)."""
        if self._trees[seq] is not None:
            self._drop_tree(seq)
        held = self._seqs[seq]
        if n < 0 or n > len(held):
            raise BackendError(f"truncate to {n} outside 0..{len(held)}")
        if not C.llama_memory_seq_rm(self.mem, seq, n, -1):
            C.llama_memory_seq_rm(self.mem, seq, -1, -1)
            n = 0
        del held[n:]

    def holds_window_seq(self, seq: int, n: int) -> bool:
        """Whether sequence seq's cache still holds every cell that a token at position n
        attends to. The SWA layers' cache reuses cells that fell out of their own
        sequence's window and then drops all of that sequence's cells up to them
        (llama.cpp's find_slot and apply_ubatch), so after a sequence held more than
        n_swa positions, a prefix of its cells is gone from those layers: a prompt that
        keeps only the start of such a cache would attend to nothing there."""
        if self.n_swa <= 0 or n <= 0:
            return True
        return 0 <= int(C.llama_memory_seq_pos_min(self.mem, seq)) <= max(0, n - self.n_swa + 1)

    def holds_window(self, n: int) -> bool:
        return self.holds_window_seq(0, n)

    def reuse_chunks(self, prompt: Sequence[int], n_past: int, n_min: int) -> int:
        """--cache-reuse: see reuse_chunks below."""
        return reuse_chunks(self, prompt, n_past, n_min)

    def shift(self, n_keep: int, n_discard: int) -> None:
        """Context shift: see shift below."""
        shift(self, n_keep, n_discard)

    def can_shift(self) -> bool:
        """Whether this context's cache can move cells (llama_memory_can_shift)."""
        return bool(C.llama_memory_can_shift(self.mem))

    @property
    def adds_bos(self) -> bool:
        """The model's prompts begin with BOS (llama-server's --keep does not count it)."""
        return bool(C.llama_vocab_get_add_bos(self.model.vocab))

    def adopt(self, tokens: Sequence[int]) -> None:
        """The KV cache now holds `tokens` (after a state restore or a KV shift made by
        this module's functions below, which change the cache behind eval's back)."""
        self._seqs[0] = list(tokens)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return self.model.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return b"".join(self.model.piece(int(t), special) for t in tokens)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def vocab_fingerprint(self) -> str:
        return self.model.fingerprint()

    def chat_template(self) -> str | None:
        return self.model.chat_template()

    def fim_tokens(self) -> dict[str, int]:
        return self.model.fim_tokens()

    def state_identity(self) -> dict:
        return state_identity(self)

    def seq_state(self) -> tuple[list[int], ctypes.Array]:
        return seq_state(self)

    def set_seq_state(self, tokens: Sequence[int], data: bytes | memoryview) -> int:
        return set_seq_state(self, tokens, data)

    def state_size(self) -> int:
        """Bytes seq_state would take for sequence 0 now."""
        return int(C.llama_state_seq_get_size(self.ctx, 0))

    def close(self) -> None:
        if self.ctx:
            C.llama_batch_free(self._batch)
            C.llama_free(self.ctx)
            self.ctx = None
            _count_context(-1)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.close()


#: KV cells a tree's side branch may hold beyond its sequence's own context.
_TREE_CELLS = 16
#: The cells each fork may hold of its own: an alternate (link/messages.py allows 8
#: tokens) and the branch tokens it is drafted after that its sequence had not evaluated.
_FORK_CELLS = 32


def _pad(n: int, to: int) -> int:
    """n rounded up to a multiple of `to` (ggml's GGML_PAD, as llama.cpp sizes contexts)."""
    return -(-n // to) * to


@dataclass(slots=True)
class _PendingTree:
    """A decoded tree part whose path to keep is not yet known."""

    tokens: list[int]
    parents: list[int]


def _under(parents: Sequence[int], leaf: int, node: int) -> bool:
    """Whether node lies on the path from the root to leaf."""
    j = leaf
    while j >= 0:
        if j == node:
            return True
        j = parents[j]
    return False


class SeqView:
    """Sequence i (> 0) of a LlamaBackend, speaking the Backend protocol on its own."""

    def __init__(self, owner: LlamaBackend, seq: int) -> None:
        self.owner, self.seq_id = owner, seq
        self.model, self.name, self.params = owner.model, owner.name, owner.params
        self.n_vocab, self.n_ctx, self.mem = owner.n_vocab, owner.n_ctx, owner.mem

    @property
    def n_past(self) -> int:
        return len(self.owner._seqs[self.seq_id])

    @property
    def tokens(self) -> Sequence[int]:
        return self.owner._seqs[self.seq_id]

    @property
    def decode_s(self) -> float:
        """This sequence's share of the context's decode time (seq_decode_s)."""
        return self.owner.seq_decode_s(self.seq_id)

    def eval(self, tokens: Sequence[int], logits: str = "last") -> np.ndarray:
        return self.owner.eval_seq(self.seq_id, tokens, logits)

    def truncate(self, n: int) -> None:
        self.owner.truncate_seq(self.seq_id, n)

    def holds_window(self, n: int) -> bool:
        return self.owner.holds_window_seq(self.seq_id, n)

    def reuse_chunks(self, prompt: Sequence[int], n_past: int, n_min: int) -> int:
        return reuse_chunks(self, prompt, n_past, n_min, self.seq_id)

    def shift(self, n_keep: int, n_discard: int) -> None:
        shift(self.owner, n_keep, n_discard, self.seq_id)

    def can_shift(self) -> bool:
        return self.owner.can_shift()

    @property
    def lora_scales(self) -> list[float]:
        return self.owner.lora_scales

    def apply_lora(self, scales: Sequence[float]) -> None:
        self.owner.apply_lora(scales)

    @property
    def adds_bos(self) -> bool:
        return self.owner.adds_bos

    def adopt(self, tokens: Sequence[int]) -> None:
        self.owner._seqs[self.seq_id] = list(tokens)

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        return self.owner.tokenize(text, add_special, parse_special)

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return self.owner.detokenize(tokens, special)

    def is_eog(self, token: int) -> bool:
        return self.owner.is_eog(token)

    def vocab_fingerprint(self) -> str:
        return self.owner.vocab_fingerprint()

    def chat_template(self) -> str | None:
        return self.owner.chat_template()

    def fim_tokens(self) -> dict[str, int]:
        return self.owner.fim_tokens()

    def state_identity(self) -> dict:
        return state_identity(self.owner)

    def seq_state(self) -> tuple[list[int], ctypes.Array]:
        return seq_state(self)

    def set_seq_state(self, tokens: Sequence[int], data: bytes | memoryview) -> int:
        return set_seq_state(self, tokens, data)

    def state_size(self) -> int:
        """Bytes seq_state would take for this sequence now."""
        return int(C.llama_state_seq_get_size(self.owner.ctx, self.seq_id))


def check_pair(target: Model, draft: Model) -> None:
    """Refuse a target/draft pair whose token tables differ, naming both files."""
    ft, fd = target.fingerprint(), draft.fingerprint()
    if ft != fd or target.n_vocab != draft.n_vocab:
        raise BackendError(
            f"incompatible models: the target {target.path} (vocabulary {target.n_vocab} tokens, "
            f"fingerprint {ft}) and the draft {draft.path} (vocabulary {draft.n_vocab} tokens, "
            f"fingerprint {fd}) do not share a tokenizer"
        )


# The KV cache out to RAM or a file and back, or shifted in place.
@dataclass(slots=True)
class SavedState:
    """The KV cells of one sequence and the tokens they hold."""

    tokens: np.ndarray  # int32, in position order
    data: ctypes.Array  # llama_state_seq_get_data's bytes

    @property
    def size(self) -> int:
        """Bytes this entry holds in RAM."""
        return len(self.data) + self.tokens.nbytes


def _save_seq(backend: LlamaBackend, seq: int) -> ctypes.Array:
    """llama_state_seq_get_data's bytes for sequence seq."""
    n = int(C.llama_state_seq_get_size(backend.ctx, seq))
    buf = (ctypes.c_uint8 * n)()
    got = C.llama_state_seq_get_data(backend.ctx, buf, n, seq)
    if got == 0:
        raise BackendError(f"llama.cpp could not save sequence {seq} of {backend.name}")
    return buf if got == n else (ctypes.c_uint8 * got).from_buffer_copy(buf, 0)


def state_size(backend) -> int:  # noqa: ANN001 - a Backend with seq_state
    """Bytes `save` would take for what the sequence holds now."""
    return backend.state_size()


def save(backend) -> SavedState:  # noqa: ANN001 - a Backend with seq_state
    """One sequence's cells and the tokens they hold (a context's sequence 0, a sequence
    view, or a draft node's StepSequence)."""
    tokens, data = backend.seq_state()
    return SavedState(np.asarray(tokens, dtype=np.int32), data)


def restore(backend, saved: SavedState) -> bool:  # noqa: ANN001 - as save's
    """Replace the sequence with a saved one; False (and an empty sequence) if llama.cpp
    refuses it."""
    try:
        backend.set_seq_state(saved.tokens.tolist(), saved.data)
    except BackendError:
        return False
    return True


def state_identity(backend: LlamaBackend) -> dict:
    """What one sequence's state bytes are only valid for: the model (Model.identity), the
    adapters loaded (their files' names), and the cache's types (slot files:
    server/state_file.py)."""
    p = backend.params
    return {"model": backend.model.identity(), "type_k": p.type_k, "type_v": p.type_v,
            "adapters": [os.path.basename(path) for path, _ in p.loras]}


def seq_state(view) -> tuple[list[int], ctypes.Array]:  # noqa: ANN001 - LlamaBackend or SeqView
    """One sequence's cells as bytes (llama_state_seq_get_data) and the tokens they hold."""
    owner, seq = getattr(view, "owner", view), getattr(view, "seq_id", 0)
    n = int(C.llama_state_seq_get_size(owner.ctx, seq))
    buf = (ctypes.c_uint8 * max(1, n))()
    got = int(C.llama_state_seq_get_data(owner.ctx, buf, n, seq)) if n else 0
    if n and got == 0:
        raise BackendError(f"llama.cpp could not save the KV state of {owner.name}")
    if got < len(buf):
        buf = (ctypes.c_uint8 * got).from_buffer_copy(buf, 0)
    return list(view.tokens), buf


def set_seq_state(view, tokens: Sequence[int], data: bytes | memoryview) -> int:  # noqa: ANN001
    """The cells of seq_state's bytes into this sequence (what it held is dropped); the
    tokens now held. Only for bytes checked against this backend (state_file.decode):
    llama.cpp takes them on trust. BackendError, and an empty sequence, if it refuses."""
    owner, seq = getattr(view, "owner", view), getattr(view, "seq_id", 0)
    view.truncate(0)
    C.llama_memory_seq_rm(owner.mem, seq, -1, -1)
    if not tokens:
        return 0
    n = len(data)
    buf = (ctypes.c_uint8 * n).from_buffer_copy(data) if n else (ctypes.c_uint8 * 1)()
    ok = C.llama_state_seq_set_data(owner.ctx, buf, n, seq) if n else 0
    held = int(C.llama_memory_seq_pos_max(owner.mem, seq)) + 1 if ok else -1
    if not ok or held != len(tokens):
        C.llama_memory_seq_rm(owner.mem, seq, -1, -1)
        view.adopt([])
        raise BackendError("llama.cpp could not restore the state into this slot")
    view.adopt(list(tokens))
    return len(tokens)


def can_shift(backend: LlamaBackend) -> bool:
    """Whether the context's memory supports moving cells to new positions."""
    return bool(C.llama_memory_can_shift(backend.mem))


def shift(backend: LlamaBackend, n_keep: int, n_discard: int, seq: int = 0) -> None:
    """Context shift: drop cells [n_keep, n_keep + n_discard) and move the cells after
    them n_discard positions down (llama_memory_seq_rm + llama_memory_seq_add, as
    llama-server does); the sequence then holds its tokens less the dropped run."""
    view = backend.seq(seq)
    held = list(view.tokens)
    if n_keep < 0 or n_discard <= 0 or n_keep + n_discard > len(held):
        raise BackendError(f"context shift of {n_discard} tokens after {n_keep} outside the "
                           f"{len(held)} cached")
    if not can_shift(backend):
        raise BackendError(f"{backend.name}: its KV cache cannot be shifted")
    C.llama_memory_seq_rm(backend.mem, seq, n_keep, n_keep + n_discard)
    C.llama_memory_seq_add(backend.mem, seq, n_keep + n_discard, len(held), -n_discard)
    view.adopt(held[:n_keep] + held[n_keep + n_discard:])


def reuse_chunks(backend: LlamaBackend, prompt: Sequence[int], n_past: int, n_min: int,
                 seq: int = 0) -> int:
    """Move runs of >= n_min cached tokens past the first n_past (the common prefix) to
    where the prompt has them; return how many prompt tokens the cache now holds.

    The cache is left holding exactly prompt[:returned]; the prompt's last token is
    never taken from the cache, so that its logits are computed.
    """
    if n_min <= 0 or not can_shift(backend):
        return n_past
    cache = list(backend.tokens)
    limit = len(prompt) - 1
    head_c = head_p = n_past
    moved = False
    while head_c < len(cache) and head_p < limit:
        n = 0
        while (head_c + n < len(cache) and head_p + n < limit
               and cache[head_c + n] == prompt[head_p + n]):
            n += 1
        if n >= n_min:
            C.llama_memory_seq_rm(backend.mem, seq, head_p, head_c)
            C.llama_memory_seq_add(backend.mem, seq, head_c, head_c + n, head_p - head_c)
            head_p += n
            head_c += n
            n_past, moved = head_p, True
        else:
            head_c += 1
    if moved:
        C.llama_memory_seq_rm(backend.mem, seq, n_past, -1)
        backend.adopt(prompt[:n_past])
    return n_past
