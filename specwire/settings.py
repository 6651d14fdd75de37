"""What the commands hand below them: typed settings built from the command line.

argparse namespaces stay in specwire/cli/commands/ (specwire/cli/settings.py
and cli/commands/bench.py build these from them); the loader, the remote drafter's
factory, the calibration and the benchmark's sweep take these instead, so what
they depend on is spelt out and a caller without a command line (a test, the
benchmark) builds them directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from specwire.config import ModelParams, VerifyMode
from specwire.emulate.regimes import Emulation

DRAFTER_KINDS = ("none", "ngram", "remote", "model")


@dataclass(frozen=True, slots=True)
class RemoteSettings:
    """How to reach draft nodes (--draft-token, --draft-tls-*) and use them (--draft-mode,
    --draft-no-poll)."""

    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    pipelined: bool = True   # --draft-mode other than sync: the node drafts ahead
    poll: bool = True        # --draft-no-poll turns the arrival forecast off
    branches: int | None = None  # --draft-branches: alternates per chunk (None: default)
    tree: int = 0  # --draft-tree: side branches the target verifies beside a draft (0: chains)
    #: how long a synchronous round waits for its draft before decoding plainly (wall
    #: time: --emulate multiplies it by the emulation's scale, as it does round trips)
    sync_timeout_s: float = 1.0

    def emulated(self, scale: float) -> RemoteSettings:
        """Under --emulate, which runs everything `scale` times slower in wall time: the
        synchronous wait stretched alike, or a node the emulated machine would wait for
        (reading a long prompt) is dropped as late."""
        return replace(self, sync_timeout_s=self.sync_timeout_s * scale)


@dataclass(frozen=True, slots=True)
class DraftSettings:
    """Which drafter: kind is none, ngram, remote (urls) or model (a draft model in this
    process, `model`); hybrid puts an n-gram lookup in front of the remote or model one."""

    kind: str = "none"
    hybrid: bool = False
    urls: tuple[str, ...] = ()
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    model: ModelParams | None = None
    threaded: bool = False   # a local draft model drafts ahead on its own thread
    branches: int | None = None  # --draft-branches for the threaded drafter (None: default)
    #: --draft-tree: side branches the target verifies beside a pipelined draft (0: chains)
    tree: int = 0
    #: with serve -np N, the local draft model's N sequences share one draft context and
    #: draft in lockstep (not with --draft-mode pipelined or --draft-hybrid)
    lockstep: bool = False
    #: how the command line spells the draft model's flags (-otd, -devd...), for errors
    flags: Mapping[str, str] = field(default_factory=dict)
    #: --lookup-cache-dynamic: the file of the cache the n-gram drafters share, loaded at
    #: build and saved by the command (None: each drafter's cache in memory only)
    lookup_cache: str | None = None
    #: --lookup-cache-per-identity: the tokens of the n-gram lookup cache each cache scope
    #: is sure to keep (None: a quarter of the cache; drafters/ngram/cache.py)
    lookup_share: int | None = None

    @property
    def ngram(self) -> bool:
        """An n-gram lookup drafts (alone, or in the hybrid)."""
        return self.kind == "ngram" or self.hybrid

    def __post_init__(self) -> None:
        if self.kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter kind: {self.kind!r} is not one of {DRAFTER_KINDS}")
        if self.kind == "model" and self.model is None:
            raise ValueError("drafter kind model: needs the draft model's parameters")
        if self.kind == "remote" and not self.urls:
            raise ValueError("drafter kind remote: needs at least one --draft-url")
        if self.lookup_cache is not None and not self.ngram:
            raise ValueError("lookup cache: only an n-gram drafter (or the hybrid) has one")


@dataclass(frozen=True, slots=True)
class EngineSettings:
    """A target, its drafter, and the verification mode requests will use if known (a
    drafter that cannot serve it is refused when the engine is built)."""

    target: ModelParams
    draft: DraftSettings = field(default_factory=DraftSettings)
    verify: VerifyMode | None = None
    #: --emulate: hold the target's (and a local draft's) decodes to an emulated model's
    #: times; fit_scale: measure the scale at start-up (--emulate-scale auto)
    emulation: Emulation | None = None
    fit_scale: bool = True


@dataclass(frozen=True, slots=True)
class MeasureSettings:
    """`plan --measure`: the pair to load and the prompts to run."""

    target: ModelParams
    draft: ModelParams
    prompts: str = "code"
    limit: int = 4
    n_predict: int = 64
    draft_flags: Mapping[str, str] = field(default_factory=dict)  # as DraftSettings.flags


@dataclass(frozen=True, slots=True)
class BenchSettings:
    """`bench`'s models and links: the pair it loads, how a draft node it starts runs the
    draft, how it reaches nodes and a llama-server, and the flags results.json records."""

    target: ModelParams
    draft: ModelParams | None = None  # the draft model, when a mode runs it
    #: `specwire draft` flags after `-m DRAFT` for a node bench starts (context, threads,
    #: placement, seed: the local draft's own)
    node_flags: tuple[str, ...] = ()
    remote: RemoteSettings = field(default_factory=RemoteSettings)  # pipelined set per mode
    draft_url: str | None = None      # a running node instead of one started here
    llama_server: str | None = None   # http://HOST:PORT for mode llama-server
    shared_cpus: bool = False         # the node and this process share every CPU
    emulation: Emulation | None = None  # --emulate (bench fits the scale unless given)
    fit_scale: bool = True
    flags: Mapping[str, object] = field(default_factory=dict)  # secrets already masked
    draft_flags: Mapping[str, str] = field(default_factory=dict)  # as DraftSettings.flags
