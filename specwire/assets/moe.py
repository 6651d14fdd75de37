"""A tiny mixture-of-experts GGUF with the bundled Gemma tokenizer, for tests and benches.

The bundled pair is dense, but the users this project serves run MoE targets, where a
verification batch routes its tokens to different experts. This builds, in a second from a
fixed seed, a model llama.cpp loads as an ordinary `llama` with experts (Mixtral's layout:
4 layers, 4 experts of which 2 are used, hidden size 64), carrying the bundled GGUF's
Gemma-3 tokenizer so the bundled draft pairs with it, and weights scaled so that greedy
output wanders over the vocabulary and a quantized copy (its draft) agrees on most tokens
but not all. With `confidence` (MoeSpec), a target of any shape whose greedy token its
quantized copy agrees with most of the time, by structure rather than scale (_confident
says why): what the GPU check's models use, so that speculation there is meaningful.
Files are written atomically under names hashing the recipe, so a changed recipe never
reads a stale file.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from specwire.assets import models
from specwire.backend.base import BackendError

#: FIM role -> token id in the Gemma vocabulary (<unused0> is 6): tokens no text uses.
FIM_TOKENS = {"pre": 6, "suf": 7, "mid": 8, "sep": 9, "rep": 10}


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The tiny model's shape and seed (part of the cached file's name)."""

    n_layer: int = 4
    n_embd: int = 64
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 256           # each expert's hidden size
    n_expert: int = 4
    n_expert_used: int = 2
    n_ctx_train: int = 8192
    logit_std: float = 4.0
    seed: int = 20251130
    draft_type: str = "Q5_0"  # the draft: this model through llama.cpp's quantizer
    #: give the vocabulary fill-in-the-middle tokens (Gemma's <unused0..4> as FIM prefix,
    #: suffix, middle, file separator and repository), for /infill's tests
    fim: bool = False
    #: the weights' type: "f32", or "f16" for a model big enough to measure a GPU with
    weights: str = "f32"
    #: > 0: a confident target (see _confident): the greedy token follows a fixed random
    #: bigram, by about this many standard deviations of the other logits, so that a
    #: quantized copy agrees with it most of the time. 0: plain random weights.
    confidence: float = 0.0

    def __post_init__(self) -> None:
        if self.weights not in ("f32", "f16"):
            raise ValueError(f"weights: f32 or f16, got {self.weights!r}")
        if self.confidence < 0:
            raise ValueError(f"confidence: >= 0, got {self.confidence}")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"n_expert_used: in [1, {self.n_expert}], got {self.n_expert_used}")

    @property
    def dense(self) -> bool:
        """n_expert 0: one FFN per layer (llama's dense layout) instead of experts."""
        return self.n_expert == 0

    def key(self) -> str:
        spec = asdict(self)
        for name, default in (("fim", False), ("weights", "f32"), ("confidence", 0.0)):
            if spec[name] == default:
                del spec[name]  # the files built before the option keep their names
        text = json.dumps({"spec": spec, "builder": 1}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


@dataclass(frozen=True, slots=True)
class MoePair:
    target: Path
    draft: Path


def ensure_moe(spec: MoeSpec = MoeSpec(), progress: bool = False) -> MoePair:
    """The MoE target (F32 weights, F16 token embedding) and its quantized draft, cached."""
    folder = models.home()
    target = folder / f"moe-tiny-{spec.key()}-{spec.weights}.gguf"
    draft = folder / f"moe-tiny-{spec.key()}-{spec.draft_type.lower()}.gguf"
    if target.exists() and draft.exists():
        return MoePair(target, draft)
    base = models.ensure_model("base", progress)   # takes the cache's lock itself
    with models.locked(folder):
        if not target.exists():
            with models.atomic_output(target) as tmp:
                write_moe(tmp, spec, base)
        if not draft.exists():
            models.make_draft(target, draft, spec.draft_type, embedding_type=None,
                              progress=progress)
    return MoePair(target, draft)


def ensure_moe_lora(spec: MoeSpec = MoeSpec(), rank: int = 4, alpha: float = 8.0) -> Path:
    """A LoRA adapter GGUF for the MoE target (on every layer's attn_q and attn_v), so that
    --lora has something real to load: seeded random A and B, large enough that the
    adapted model's greedy output differs from the base's."""
    folder = models.home()
    path = folder / f"moe-tiny-{spec.key()}-lora-r{rank}.gguf"
    if path.exists():
        return path
    with models.locked(folder):
        if not path.exists():
            with models.atomic_output(path) as tmp:
                _write_lora(tmp, spec, rank, alpha)
    return path


def _write_lora(path: Path, spec: MoeSpec, rank: int, alpha: float) -> None:
    gguf = _gguf()
    rng = np.random.default_rng(spec.seed + 1)
    kv = spec.n_embd // spec.n_head * spec.n_head_kv
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for i in range(spec.n_layer):
        for name, n_out in (("attn_q", spec.n_embd), ("attn_v", kv)):
            # ggml's A is [n_in, rank] and B [rank, n_out]; numpy shapes are reversed
            a = rng.standard_normal((rank, spec.n_embd), dtype=np.float32) * spec.n_embd ** -0.5
            b = rng.standard_normal((n_out, rank), dtype=np.float32) * rank ** -0.5
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a", a)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_moe(path: Path, spec: MoeSpec, tokenizer_from: Path) -> None:
    """Write the MoE GGUF to `path`, its tokenizer copied from the GGUF `tokenizer_from`."""
    gguf = _gguf()

    keys = _tokenizer_keys(str(tokenizer_from))
    n_vocab = next(len(v) for name, v, *_ in keys if name == "tokenizer.ggml.tokens")
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name(f"specwire tiny MoE {spec.key()}")
    w.add_context_length(spec.n_ctx_train)
    w.add_embedding_length(spec.n_embd)
    w.add_block_count(spec.n_layer)
    w.add_feed_forward_length(spec.n_ff)
    w.add_head_count(spec.n_head)
    w.add_head_count_kv(spec.n_head_kv)
    w.add_rope_dimension_count(spec.n_embd // spec.n_head)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    if not spec.dense:
        w.add_expert_count(spec.n_expert)
        w.add_expert_used_count(spec.n_expert_used)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if spec.weights == "f32"
                    else gguf.LlamaFileType.MOSTLY_F16)
    for name, value, vtype, sub in keys:
        w.add_key_value(name, value, vtype, sub)
    if spec.fim:
        for name, token in FIM_TOKENS.items():
            w.add_uint32(f"tokenizer.ggml.fim_{name}_token_id", token)
    for name, array in _weights(spec, n_vocab):
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@functools.lru_cache(maxsize=2)
def _tokenizer_keys(path: str) -> tuple[tuple, ...]:
    """Every tokenizer.* key of a GGUF as (name, value, type, array's item type): read once
    per process (gguf's reader takes seconds over 262k tokens), for each model made."""
    gguf = _gguf()
    out = []
    for name, field in gguf.GGUFReader(path).fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
            out.append((name, field.contents(), vtype, sub))
    return tuple(out)


def _layout(spec: MoeSpec, n_vocab: int) -> list[tuple[str, tuple[int, ...], float | None, type]]:
    """(name, numpy shape, std or None for ones, dtype) of each tensor, in writing order.

    llama.cpp's naming; numpy shapes are ggml's dims reversed.
    """
    d, ff, e = spec.n_embd, spec.n_ff, spec.n_expert
    kv = d // spec.n_head * spec.n_head_kv
    f32 = np.float32
    w = np.float32 if spec.weights == "f32" else np.float16  # the matrices' type
    out: list[tuple[str, tuple[int, ...], float | None, type]] = [
        ("token_embd.weight", (n_vocab, d), embd_std(spec), np.float16)]
    for i in range(spec.n_layer):
        b = f"blk.{i}"
        out += [
            (f"{b}.attn_norm.weight", (d,), None, f32),
            (f"{b}.attn_q.weight", (d, d), d ** -0.5, w),
            (f"{b}.attn_k.weight", (kv, d), d ** -0.5, w),
            (f"{b}.attn_v.weight", (kv, d), d ** -0.5, w),
            (f"{b}.attn_output.weight", (d, d), d ** -0.5, w),
            (f"{b}.ffn_norm.weight", (d,), None, f32),
        ]
        if spec.dense:
            out += [
                (f"{b}.ffn_gate.weight", (ff, d), d ** -0.5, w),
                (f"{b}.ffn_up.weight", (ff, d), d ** -0.5, w),
                (f"{b}.ffn_down.weight", (d, ff), ff ** -0.5, w),
            ]
        else:
            out += [
                (f"{b}.ffn_gate_inp.weight", (e, d), 1.0, f32),
                (f"{b}.ffn_gate_exps.weight", (e, ff, d), d ** -0.5, w),
                (f"{b}.ffn_up_exps.weight", (e, ff, d), d ** -0.5, w),
                (f"{b}.ffn_down_exps.weight", (e, d, ff), ff ** -0.5, w),
            ]
    out += [("output_norm.weight", (d,), None, f32),
            ("output.weight", (n_vocab, d), spec.logit_std * d ** -0.5, w)]
    return out


def _weights(spec: MoeSpec, n_vocab: int):
    """(name, array): normal weights from the spec's seed, norms at one. An F16 model (one
    built to time a GPU, billions of weights) takes its values from a pool of 2^24 normals
    at a random offset each: drawing every value afresh would take minutes."""
    rng = np.random.default_rng(spec.seed)
    pool = rng.standard_normal(POOL, dtype=np.float32) if spec.weights == "f16" else None
    embd = None
    for name, shape, std, dtype in _layout(spec, n_vocab):
        if std is None:
            yield name, np.ones(shape, dtype=np.float32)
            continue
        if pool is None:
            array = (rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype)
        else:
            n = int(np.prod(shape))
            start = int(rng.integers(POOL))
            values = (pool[start:start + n] if n <= POOL - start
                      else np.resize(np.roll(pool, -start), n))
            array = (values.reshape(shape) * std).astype(dtype)
        if name == "token_embd.weight":
            embd = array
        elif name == "output.weight" and spec.confidence > 0:
            array = _confident(array, embd, std, spec, rng)
        yield name, array


def embd_std(spec: MoeSpec) -> float:
    """The token embedding's scale: 1, or for a confident target 2 sqrt(n_layer), so that
    the embedding still dominates the residual stream at the last layer (each layer adds
    about one unit of variance to it, whatever the embedding's scale, its input being
    normalized): about 0.85 of the stream's norm at any depth."""
    return 2.0 * spec.n_layer ** 0.5 if spec.confidence > 0 else 1.0


def _confident(out: np.ndarray, embd: np.ndarray, std: float, spec: MoeSpec,
               rng: np.random.Generator) -> np.ndarray:
    """The output matrix of a confident target: each row mixed with the embedding of
    another token, row j = std (a R_j + b E[pi(j)]) with a^2 + b^2 = 1, for a fixed random
    permutation pi of the vocabulary (E scaled to unit variance).

    Why structure and not a larger output scale: greedy decoding reads the argmax, and
    scaling every logit by one factor changes no argmax, nor where a quantized copy's
    argmax differs (Q4_0's error scales with its block's largest weight): random weights
    at any scale leave the top token within a small fraction of a standard deviation of
    the second among 262k logits, where the copy's error decides, so its greedy draft is
    seldom accepted. Here the residual stream still carries the current token's
    embedding E[c] at the last layer (embd_std), so the row j with pi(j) = c scores
    about 0.85 b sqrt(d) standard deviations above the others, and with
    b = min(1, confidence / sqrt(d)) that is about 0.85 confidence whatever the width
    (capped at 0.85 sqrt(d): a model 64 wide reaches 6.8): a next token that follows the
    bigram c -> pi^-1(c) by a margin the copy's error rarely overturns, and that the
    layers' part (the context) overturns where the margin is small. The largest of 262k
    other logits is about 4.9 standard deviations, so a confidence of 8 makes the
    bigram's token the target's choice most of the time. Every matrix keeps its shape
    and about its scale, so the model costs what a random one does.
    """
    d = out.shape[1]
    b = min(1.0, spec.confidence / d ** 0.5)
    a = (1.0 - b * b) ** 0.5
    unit = 1.0 / embd_std(spec)
    perm = rng.permutation(out.shape[0])
    mixed = np.empty_like(out)
    step = 1 << 14
    for i in range(0, out.shape[0], step):
        rows = slice(i, i + step)
        mixed[rows] = (a * out[rows].astype(np.float32)
                       + (b * std * unit) * embd[perm[rows]].astype(np.float32)).astype(out.dtype)
    return mixed


#: values in the pool an F16 model's weights are drawn from
POOL = 1 << 24


def tensor_names(spec: MoeSpec = MoeSpec()) -> list[str]:
    """The tensor names the MoE file holds (what an -ot pattern is matched against)."""
    return [name for name, *_ in _layout(spec, 0)]


def _gguf():
    try:
        import gguf
    except ImportError:
        raise BackendError("building the MoE test model needs the gguf package "
                           "(pip install gguf, or specwire[test])") from None
    return gguf
