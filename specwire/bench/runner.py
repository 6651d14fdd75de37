"""Run one benchmark configuration over the prompts, from a clean slate each time.

Two things would flatter speculation and are ruled out: state carried between prompts
(the target's and the local draft model's KV caches are truncated to zero before every
prompt; n-gram and remote drafters start a fresh sequence per request) and cold start (one
short warm-up generation per configuration is run and thrown away). What carries over is
the adaptive policy's estimates (PolicyMemory), as in a server: they change which draft
length is asked for, never which tokens come out or what an evaluation costs.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from specwire.bench.netemu import LinkEmulator
from specwire.bench.prompts import Prompt
from specwire.config import DraftParams, SamplingParams
from specwire.emulate.hold import HoldCounters
from specwire.engine.engine import Engine, Request

#: Budget when neither -n nor the prompt's max_tokens says.
DEFAULT_MAX_TOKENS = 128
WARMUP_TOKENS = 8


@dataclass(frozen=True, slots=True)
class RunParams:
    """One point of the sweep. rtt/bandwidth only matter for remote modes."""

    mode: str
    draft_max: int = 0
    policy: str = "fixed"
    rtt_s: float | None = None
    bandwidth_bps: float | None = None     # None: unlimited

    @property
    def drafting(self) -> bool:
        return self.mode != "plain"

    def label(self) -> str:
        """Short, unique text for tables and plot legends."""
        parts = [self.mode]
        if self.drafting:
            parts.append(f"k={self.draft_max}" if self.policy == "fixed" else
                         f"adaptive<={self.draft_max}")
        if self.rtt_s is not None:
            parts.append(f"rtt={format_ms(self.rtt_s)}")
        if self.bandwidth_bps is not None:
            parts.append(f"bw={format_bps(self.bandwidth_bps)}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "draft_max": self.draft_max, "policy": self.policy,
                "rtt_ms": None if self.rtt_s is None else 1000 * self.rtt_s,
                "bandwidth_bps": self.bandwidth_bps, "label": self.label()}

    @classmethod
    def from_dict(cls, d: dict) -> RunParams:
        """The point a results.json record was run at (to_dict's fields, which it holds)."""
        rtt_ms = d.get("rtt_ms")
        return cls(d["mode"], d["draft_max"], d["policy"],
                   None if rtt_ms is None else rtt_ms / 1000.0, d.get("bandwidth_bps"))


@dataclass(slots=True)
class Workload:
    """What every configuration runs: the same prompts, budgets and sampling."""

    prompts: list[Prompt]
    tokens: list[list[int]]
    sampling: SamplingParams
    draft: DraftParams                   # n_max and policy are replaced per configuration
    n_predict: int | None = None         # overrides each prompt's max_tokens
    ignore_eos: bool = False
    #: --emulate: the holds' counters by model ("target", "draft"); each prompt's run
    #: records what they counted during it
    holds: dict = field(default_factory=dict)

    def budget(self, i: int) -> int:
        if self.n_predict is not None:
            return self.n_predict
        return self.prompts[i].max_tokens or DEFAULT_MAX_TOKENS


@dataclass(slots=True)
class PromptRun:
    """One prompt under one configuration: what the report aggregates."""

    id: str
    category: str
    prompt_tokens: int
    generated: int
    tokens_per_s: float
    prompt_ms: float
    predicted_ms: float
    stop_type: str
    tokens_sha: str                      # of the generated ids: equal across modes at temp 0
    stats: dict                          # Stats.to_dict(), drafter counters for this prompt only
    link_bytes_up: int = 0
    link_bytes_down: int = 0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def tokens_digest(tokens: Sequence[int]) -> str:
    """A short digest of token ids: enough to tell two outputs apart, small in JSON."""
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def reset_state(engine: Engine) -> None:
    """Empty the target's and the local draft model's KV caches (no prefix reuse)."""
    engine.target.truncate(0)
    backend = engine.drafter.backend
    if backend is not None:
        backend.truncate(0)


def draft_params(work: Workload, cfg: RunParams) -> DraftParams:
    if not cfg.drafting:
        return work.draft.with_(enabled=False)
    return work.draft.with_(n_max=cfg.draft_max, policy=cfg.policy, enabled=True,
                            n_min=min(work.draft.n_min, cfg.draft_max))


def warm_up(engine: Engine, work: Workload, cfg: RunParams) -> None:
    """A short generation on the first prompt, discarded."""
    reset_state(engine)
    n = min(WARMUP_TOKENS, work.budget(0))
    engine.generate(Request(work.tokens[0], n, work.sampling, draft_params(work, cfg),
                            work.ignore_eos)).run()


def run_config(engine: Engine, work: Workload, cfg: RunParams, link: LinkEmulator | None = None,
               on_prompt: Callable[[PromptRun], None] | None = None) -> list[PromptRun]:
    """Warm up, then every prompt from empty caches; one PromptRun per prompt."""
    warm_up(engine, work, cfg)
    runs = []
    for i in range(len(work.prompts)):
        run = run_prompt(engine, work, cfg, i, link)
        runs.append(run)
        if on_prompt is not None:
            on_prompt(run)
    reset_state(engine)
    return runs


def run_prompt(engine: Engine, work: Workload, cfg: RunParams, i: int,
               link: LinkEmulator | None) -> PromptRun:
    reset_state(engine)
    if link is not None:
        link.reset_counters()
    before = {k: c.snapshot() for k, c in work.holds.items()}
    gen = engine.generate(Request(work.tokens[i], work.budget(i), work.sampling,
                                  draft_params(work, cfg), work.ignore_eos))
    tokens = gen.run()
    extra = ({"emulation": {k: HoldCounters.since(before[k], c.snapshot())
                            for k, c in work.holds.items()}} if work.holds else {})
    st = gen.stats.to_dict()
    st["drafter"] = dict(gen.stats.drafter) if cfg.drafting else {}
    p = work.prompts[i]
    return PromptRun(
        id=p.id, category=p.category, prompt_tokens=len(work.tokens[i]), generated=len(tokens),
        tokens_per_s=gen.stats.predicted_per_second, prompt_ms=gen.stats.prompt_ms,
        predicted_ms=gen.stats.predicted_ms, stop_type=gen.stop_type,
        tokens_sha=tokens_digest(tokens), stats=st,
        link_bytes_up=link.bytes_up if link else 0, link_bytes_down=link.bytes_down if link else 0,
        extra=extra)


def format_ms(seconds: float) -> str:
    ms = 1000 * seconds
    return f"{ms:g}ms"


def format_bps(bps: float | None) -> str:
    if bps is None or math.isinf(bps):
        return "inf"
    for scale, unit in ((1e9, "gbit"), (1e6, "mbit"), (1e3, "kbit")):
        if bps >= scale:
            return f"{bps / scale:g}{unit}"
    return f"{bps:g}bit"
