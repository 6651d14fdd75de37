"""Settings shared by every layer: sampling, drafting and model loading.

Each is a small slotted dataclass that checks itself on construction, so a bad
value is refused where it enters (CLI flag, HTTP body, wire message) with a
message naming the field, never deep inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from enum import StrEnum


class ConfigError(ValueError):
    """A setting is out of range or of the wrong kind; the message names it."""


class VerifyMode(StrEnum):
    """How the target decides which draft tokens to keep.

    greedy:    argmax on both sides (used whenever temperature <= 0).
    coupled:   both sides sample by Gumbel-max with shared keyed noise; output is the
               target's own sample, identical with or without a draft.
    rejection: speculative sampling (min(1, p/q)) with sparse top-K draft probabilities.
    """

    GREEDY = "greedy"
    COUPLED = "coupled"
    REJECTION = "rejection"


#: llama.cpp keeps top_k and repeat_last_n in int32, and the draft link as (u)int32.
INT32_MAX = 2**31 - 1


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """llama.cpp's sampling knobs, same names and meanings.

    Filters run in llama.cpp's order: logit bias, penalties (repeat, frequency,
    presence, over the last repeat_last_n tokens), top-k, top-p, min-p, then
    temperature on the survivors. top_k <= 0, top_p >= 1 and min_p <= 0 disable
    their filter; repeat_penalty == 1 and zero frequency/presence penalties
    disable the penalties. logit_bias: (token id, bias) pairs added to the
    logits (-inf bans a token).
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be in [0, 100], got {self.temperature}",
        )
        _check(0 <= self.top_k <= INT32_MAX, "top_k",
               f"must be in [0, {INT32_MAX}], got {self.top_k}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(
            0.0 < self.repeat_penalty <= 10.0,
            "repeat_penalty",
            f"must be in (0, 10], got {self.repeat_penalty}",
        )
        _check(
            -1 <= self.repeat_last_n <= INT32_MAX,
            "repeat_last_n",
            f"must be in [-1, {INT32_MAX}], got {self.repeat_last_n}",
        )
        _check(0 <= self.seed < 2**64, "seed", f"must be in [0, 2^64), got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")

    @property
    def penalised(self) -> bool:
        """Whether any history-dependent penalty is on."""
        return (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0) and self.repeat_last_n != 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict:
        """JSON-ready (a ban, bias -inf, shows as false, as llama-server writes it)."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["logit_bias"] = [[t, b if b > float("-inf") else False] for t, b in self.logit_bias]
        return d


@dataclass(slots=True, frozen=True)
class DraftParams:
    """llama.cpp's speculative knobs: --draft-max, --draft-min, --draft-p-min.

    n_max:  most draft tokens verified in one round.
    n_min:  a draft shorter than this is not worth a batched verification; run a
            plain step instead (0 = always verify what there is).
    p_min:  the drafter stops a draft when its top probability falls below this.
    top_k_q: size of the sparse draft distribution sent in rejection mode (TK-SLT).
    seed:   the draft's own sampling seed. By default the draft samples with the
            request's seed, which couples it to the target (highest acceptance);
            another seed still gives the target's exact output, with fewer accepts.
    policy: "fixed" (always n_max) or "adaptive" (expected tokens/s, see policy.py).
    cache_scope: which cached text this request may reuse: the target's KV cache of its
            slot, the n-gram lookup cache, and the draft node's cached conversations
            (node/kv_cache.py) hold text per scope; derived from its API key and
            cache_salt ("" without either: one scope for the whole server).
    cache_store: False keeps the request out of the n-gram lookup cache and the draft
            node's cache (cache_prompt false).
    """

    n_max: int = 8
    n_min: int = 0
    p_min: float = 0.75
    mode: VerifyMode = VerifyMode.COUPLED
    top_k_q: int = 8
    policy: str = "fixed"
    enabled: bool = True
    seed: int | None = None  # the draft's own sampling seed; None: the request's (coupled)
    cache_scope: str = ""
    cache_store: bool = True

    def __post_init__(self) -> None:
        _check(0 <= self.n_max <= 64, "draft_max", f"must be in [0, 64], got {self.n_max}")
        _check(
            0 <= self.n_min <= self.n_max or self.n_max == 0,
            "draft_min",
            f"must be in [0, draft_max={self.n_max}], got {self.n_min}",
        )
        _check(0.0 <= self.p_min <= 1.0, "draft_p_min", f"must be in [0, 1], got {self.p_min}")
        _check(1 <= self.top_k_q <= 256, "draft_top_k", f"must be in [1, 256], got {self.top_k_q}")
        _check(
            self.policy in ("fixed", "adaptive"),
            "draft_policy",
            f"must be 'fixed' or 'adaptive', got {self.policy!r}",
        )
        if self.seed is not None:
            _check(0 <= self.seed < 2**64, "seed_draft", f"must be in [0, 2^64), got {self.seed}")
        if not isinstance(self.mode, VerifyMode):
            try:
                object.__setattr__(self, "mode", VerifyMode(self.mode))
            except ValueError:
                raise ConfigError(
                    f"verify: must be greedy, coupled or rejection, got {self.mode!r}"
                ) from None

    def with_(self, **changes) -> DraftParams:
        return replace(self, **changes)


#: llama.cpp's --numa strategies (ggml_numa_strategy values), "disabled" when not given.
NUMA_STRATEGIES = {"disabled": 0, "distribute": 1, "isolate": 2, "numactl": 3}
#: llama.cpp's --split-mode values (llama_split_mode).
SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}
#: llama.cpp's -fa values (llama_flash_attn_type).
FLASH_ATTN = ("auto", "on", "off")


@dataclass(slots=True, frozen=True)
class TensorOverride:
    """One -ot entry: tensors whose name matches `pattern` (regex search) go to `buffer_type`."""

    pattern: str
    buffer_type: str


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a model's weights live and how they are read (llama.cpp's loading flags).

    overrides:    -ot/--cpu-moe/--n-cpu-moe, in the order given (llama.cpp takes the
                  first pattern that matches a tensor).
    devices:      -dev names; None = llama.cpp's default (every GPU), () = none (-dev none).
    tensor_split: -ts proportions per device; () = llama.cpp's default split.
    repack:       --repack / -nr: the CPU's extra weight layouts (CPU_REPACK, AMX); None =
                  llama.cpp's default, but off where the CPU backend offers AMX
                  (backend/placement.py says why).
    """

    overrides: tuple[TensorOverride, ...] = ()
    devices: tuple[str, ...] | None = None
    split_mode: str = "layer"
    main_gpu: int = 0
    tensor_split: tuple[float, ...] = ()
    use_mmap: bool = True
    use_mlock: bool = False
    repack: bool | None = None

    def __post_init__(self) -> None:
        _check(self.split_mode in SPLIT_MODES, "split_mode",
               f"must be one of {', '.join(SPLIT_MODES)}, got {self.split_mode!r}")
        _check(self.main_gpu >= 0, "main_gpu", f"must be >= 0, got {self.main_gpu}")
        _check(all(x >= 0 for x in self.tensor_split) and (
            not self.tensor_split or sum(self.tensor_split) > 0), "tensor_split",
            f"must be proportions >= 0, not all 0, got {list(self.tensor_split)}")


#: llama.cpp's --rope-scaling values (llama_rope_scaling_type).
ROPE_SCALINGS = {"none": 0, "linear": 1, "yarn": 2}


@dataclass(slots=True, frozen=True)
class Rope:
    """RoPE and YaRN overrides (llama.cpp's --rope-* and --yarn-* flags); each None or 0
    keeps the GGUF's own value, as llama.cpp's defaults do."""

    scaling: str | None = None        # --rope-scaling none|linear|yarn
    freq_base: float = 0.0            # --rope-freq-base
    freq_scale: float = 0.0           # --rope-freq-scale (--rope-scale N: 1/N)
    yarn_orig_ctx: int = 0
    yarn_ext_factor: float = -1.0
    yarn_attn_factor: float = -1.0
    yarn_beta_slow: float = -1.0
    yarn_beta_fast: float = -1.0

    def __post_init__(self) -> None:
        _check(self.scaling is None or self.scaling in ROPE_SCALINGS, "rope_scaling",
               f"must be none, linear or yarn, got {self.scaling!r}")
        _check(self.freq_base >= 0, "rope_freq_base", f"must be >= 0, got {self.freq_base}")
        _check(self.freq_scale >= 0, "rope_freq_scale", f"must be > 0, got {self.freq_scale}")
        _check(self.yarn_orig_ctx >= 0, "yarn_orig_ctx", f"must be >= 0, got {self.yarn_orig_ctx}")

    def context_fields(self) -> dict[str, float | int]:
        """The llama_context_params fields to set (those the user gave)."""
        out: dict[str, float | int] = {}
        if self.scaling is not None:
            out["rope_scaling_type"] = ROPE_SCALINGS[self.scaling]
        defaults = Rope()
        for name, field_ in (("freq_base", "rope_freq_base"), ("freq_scale", "rope_freq_scale"),
                             ("yarn_orig_ctx", "yarn_orig_ctx"),
                             ("yarn_ext_factor", "yarn_ext_factor"),
                             ("yarn_attn_factor", "yarn_attn_factor"),
                             ("yarn_beta_slow", "yarn_beta_slow"),
                             ("yarn_beta_fast", "yarn_beta_fast")):
            if getattr(self, name) != getattr(defaults, name):
                out[field_] = getattr(self, name)
        return out


@dataclass(slots=True, frozen=True)
class ModelParams:
    """How one GGUF is loaded; the target and the draft each get their own."""

    path: str
    n_ctx: int = 4096
    n_threads: int = 1
    n_threads_batch: int = 0  # 0 = same as n_threads
    n_gpu_layers: int = 0
    n_batch: int = 512
    n_ubatch: int = 512       # llama.cpp's -ub: the physical batch, at most n_batch
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: str = "auto"  # -fa on|off|auto
    placement: Placement = Placement()
    numa: str = "disabled"    # --numa: process-wide, applied before the first model loads
    rope: Rope = Rope()       # --rope-* / --yarn-*: the context's RoPE overrides
    #: --lora / --lora-scaled: (adapter GGUF, scale) applied to this model's context
    loras: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.flash_attn, bool):  # the older boolean spelling
            object.__setattr__(self, "flash_attn", "on" if self.flash_attn else "off")
        _check(bool(self.path), "model", "a path is required")
        _check(
            16 <= self.n_ctx <= 1 << 20, "ctx_size", f"must be in [16, 1048576], got {self.n_ctx}"
        )
        _check(1 <= self.n_threads <= 512, "threads", f"must be in [1, 512], got {self.n_threads}")
        _check(
            0 <= self.n_threads_batch <= 512,
            "threads_batch",
            f"must be in [0, 512], got {self.n_threads_batch}",
        )
        _check(
            -1 <= self.n_gpu_layers <= 100000,
            "n_gpu_layers",
            f"must be >= -1, got {self.n_gpu_layers}",
        )
        _check(
            1 <= self.n_batch <= 1 << 16, "batch_size", f"must be in [1, 65536], got {self.n_batch}"
        )
        _check(
            1 <= self.n_ubatch <= 1 << 16,
            "ubatch_size",
            f"must be in [1, 65536], got {self.n_ubatch}",
        )
        _check(self.flash_attn in FLASH_ATTN, "flash_attn",
               f"must be on, off or auto, got {self.flash_attn!r}")
        _check(self.numa in NUMA_STRATEGIES, "numa",
               f"must be distribute, isolate or numactl, got {self.numa!r}")
        for name in ("type_k", "type_v"):
            value = getattr(self, name)
            _check(
                value in KV_TYPES,
                f"cache_{name}",
                f"must be one of {sorted(KV_TYPES)}, got {value!r}",
            )


#: KV cache element types accepted by --cache-type-k/-v, as llama.cpp names them.
KV_TYPES = frozenset({"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})
