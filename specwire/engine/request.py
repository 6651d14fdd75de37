"""A request to the engine: the prompt, how much to generate, and how."""

from __future__ import annotations

import math
from dataclasses import dataclass

from specwire.config import ConfigError, DraftParams, SamplingParams
from specwire.sample.constraints.grammar import GrammarSpec
from specwire.sample.logprobs import LogprobsSpec


@dataclass(slots=True)
class Request:
    prompt: list[int]
    n_predict: int = 128
    sampling: SamplingParams = SamplingParams()
    draft: DraftParams = DraftParams()
    ignore_eos: bool = False
    grammar: GrammarSpec | None = None     # constrains the target's sampling (lossless)
    logprobs: LogprobsSpec | None = None   # record the target's probabilities per token
    #: llama-server's cache_prompt: start from what the target's cache holds of the prompt.
    #: False evaluates the whole prompt again.
    cache_prompt: bool = True
    #: llama-server's n_keep (--keep): the prompt tokens a context shift keeps (-1: all);
    #: it only matters where the engine shifts the context (Engine.context_shift).
    n_keep: int = 0
    #: llama-server's n_discard: the tokens a shift drops (0: half of those after n_keep).
    n_discard: int = 0
    #: llama-server's per-request `lora`: every loaded adapter's scale for this request
    #: (None: the target's own, as --lora and POST /lora-adapters set them).
    lora: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt: is empty (no tokens)")
        if self.n_predict < 0:
            raise ConfigError(f"n_predict: must be >= 0, got {self.n_predict}")
        if self.n_keep < -1:
            raise ConfigError(f"n_keep: must be >= -1 (-1: the whole prompt), got {self.n_keep}")
        if self.n_discard < 0:
            raise ConfigError(f"n_discard: must be >= 0, got {self.n_discard}")
        if self.lora is not None and not all(math.isfinite(x) for x in self.lora):
            raise ConfigError(f"lora: scales must be finite numbers, got {list(self.lora)}")
