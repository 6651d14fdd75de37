"""A request to the engine: the prompt, how much to generate, and how."""

from __future__ import annotations

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

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("prompt: is empty (no tokens)")
        if self.n_predict < 0:
            raise ConfigError(f"n_predict: must be >= 0, got {self.n_predict}")
