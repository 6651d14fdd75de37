"""Build an Engine from typed settings: target, drafter, compatibility checks.

Shared by generate, serve and bench so that every command resolves the bundled
defaults, refuses incompatible pairs and picks the drafter the same way. The
commands build the settings from their flags (specwire/cli/settings.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from specwire.backend.base import Backend, BackendError
from specwire.config import ConfigError
from specwire.drafters.base import Drafter, NoDrafter
from specwire.engine.engine import Engine
from specwire.settings import DraftSettings, EngineSettings

if TYPE_CHECKING:
    from specwire.drafters.ngram.cache import LookupCache
    from specwire.drafters.ngram.persist import CacheFile

log = logging.getLogger(__name__)


def resolve_target(path: str | None) -> str:
    """-m, else $LLAMA_ARG_MODEL (llama.cpp's environment spelling), else the bundled target."""
    if path or (path := os.environ.get("LLAMA_ARG_MODEL")):
        return path
    from specwire.assets import models
    return str(models.default_target())


def resolve_draft(path: str | None) -> str:
    """-md (the node's -m), else $LLAMA_ARG_MODEL_DRAFT, else the bundled draft."""
    if path or (path := os.environ.get("LLAMA_ARG_MODEL_DRAFT")):
        return path
    from specwire.assets import models
    return str(models.default_draft())


def build_engine(s: EngineSettings, n_seq: int = 1) -> Engine:
    """The target backend plus the drafter the settings ask for.

    n_seq: sequences the target holds in one context (serve -np), each with a drafter of
    its own (a local draft model: one draft context of n_seq sequences, drafting in
    lockstep; with --draft-mode pipelined or --draft-hybrid a context per sequence;
    draft nodes: one connection per node and port, a stream per sequence).
    Both models' placements are checked (buffer types, devices) before either loads,
    so a bad -otd does not wait for a big target to load first.
    """
    from specwire.backend.llama import LlamaBackend
    from specwire.backend.placement import check
    try:
        check(s.target.placement)
        if s.draft.model is not None:
            check(s.draft.model.placement, dict(s.draft.flags))
        trees = tree_branches(s, n_seq)
        target = LlamaBackend(s.target, n_seq=n_seq, tree_branches=trees)
        lookup = lookup_file(s.draft, target)
        wrap, draft = _identity, s.draft
        if s.emulation is not None:
            target, wrap = emulated(s, target)
            draft = replace(draft, remote=draft.remote.emulated(target.emulation.scale))
        if draft.lockstep and n_seq > 1:
            drafters = lockstep_drafters(draft, target, n_seq, wrap)
        elif draft.kind == "remote" and not draft.hybrid:
            from specwire.link.remote import make_remote_drafters
            drafters = make_remote_drafters(list(draft.urls), draft.remote, target, n_seq)
        else:
            cache = lookup.cache if lookup is not None else None
            drafters = [build_drafter(draft, target, wrap, cache) for _ in range(n_seq)]
        for d in drafters:   # a drafter is told the target verifies trees only where it does
            for part in (d, getattr(d, "model", None)):   # a hybrid's model drafter too
                if hasattr(part, "tree"):
                    part.tree = min(part.tree, trees)
    except BackendError as e:
        raise ConfigError(str(e)) from None
    try:
        engine = Engine(target, drafters, verify=s.verify)
        engine.lookup_file = lookup
        return engine
    except ConfigError:
        for drafter in drafters:
            drafter.close()
        raise


def _identity(backend: Any) -> Any:
    return backend


def emulated(s: EngineSettings, target: Any) -> tuple[Any, Callable[[Any], Any]]:
    """--emulate: the target held to the emulated one's times, and how to hold a local
    draft model's backend; the scale is fitted to the real pair first unless given."""
    from specwire.backend.llama import LlamaBackend, load_model
    from specwire.emulate.hold import HoldCounters, emulate
    from specwire.emulate.regimes import scaled
    assert s.emulation is not None
    probe = None
    if s.fit_scale and s.draft.model is not None and s.emulation.draft_tps is not None:
        probe = LlamaBackend(s.draft.model, load_model(s.draft.model, dict(s.draft.flags)))
    try:
        emu, _measured = scaled(s.emulation, s.fit_scale, target, probe)
    finally:
        if probe is not None:
            probe.close()
    log.info("%s", emu.describe())
    if s.draft.kind == "remote" and emu.draft_tps is not None:
        log.info("emulation: start the draft node with --emulate-scale %.4g --draft-tps %g "
                 "--verify-cost %s to hold its drafts alike", emu.scale, emu.draft_tps,
                 ",".join(f"{n}:{c:g}" for n, c in emu.verify.points))
    regime = emu.draft_regime()
    draft_counters = HoldCounters()

    def wrap(backend: Any) -> Any:
        return backend if regime is None else emulate(backend, regime, draft_counters)

    held = emulate(target, emu.target_regime())
    held.emulation, held.draft_counters = emu, draft_counters   # for the commands' reports
    return held, wrap


def lookup_file(s: DraftSettings, target: Backend) -> CacheFile | None:
    """--lookup-cache-dynamic: the n-gram drafters' shared cache, loaded from its file
    for the target's vocabulary (its fingerprint is the one the link's handshake
    compares); None without the flag."""
    if s.lookup_cache is None:
        return None
    from specwire.drafters.ngram.persist import CacheFile
    return CacheFile(s.lookup_cache, target.n_vocab, target.vocab_fingerprint(),
                     scope_share=s.lookup_share)


def tree_branches(s: EngineSettings, n_seq: int) -> int:
    """--draft-tree for the target: side branches come from a pipelined drafter (a draft
    node or a draft model on its own thread) or the hybrid (its second candidate), to
    one sequence alone in its decode."""
    d = s.draft
    if n_seq != 1:
        return 0
    if d.hybrid:
        return d.remote.tree if d.kind == "remote" else d.tree
    if d.kind == "remote" and d.remote.pipelined and not d.hybrid:
        return d.remote.tree
    return d.tree if d.threaded else 0


def build_drafter(s: DraftSettings, target: Backend,
                  wrap: Callable[[Any], Any] = _identity,
                  cache: LookupCache | None = None) -> Drafter:
    """cache: the n-gram lookup's cache of earlier requests, shared by the drafters that
    are given it (None: one of its own, in memory)."""
    if s.ngram and cache is None:
        from specwire.drafters.ngram.cache import LookupCache
        cache = LookupCache(scope_share=s.lookup_share)
    if s.hybrid:
        from specwire.drafters.hybrid import HybridDrafter
        from specwire.drafters.ngram.drafter import NgramDrafter
        return HybridDrafter(NgramDrafter(cache=cache), build_model_drafter(s, target, wrap))
    if s.kind == "none":
        return NoDrafter()
    if s.kind == "ngram":
        from specwire.drafters.ngram.drafter import NgramDrafter
        return NgramDrafter(cache=cache)
    return build_model_drafter(s, target, wrap)


def build_model_drafter(s: DraftSettings, target: Backend,
                        wrap: Callable[[Any], Any] = _identity) -> Drafter:
    """A draft model: remote (--draft-url) or in this process (-md or the bundled one)."""
    if s.kind == "remote":
        from specwire.link.remote import make_remote_drafter
        return make_remote_drafter(list(s.urls), s.remote, target)
    from specwire.backend.llama import LlamaBackend, check_pair, load_model
    assert s.model is not None  # DraftSettings refuses kind model without one
    dmodel = load_model(s.model, dict(s.flags))
    check_pair(target.model, dmodel)
    backend = wrap(LlamaBackend(s.model, dmodel))
    if s.threaded:
        from specwire.link.alternates import alternate_params
        from specwire.link.threaded import ThreadedDrafter
        return ThreadedDrafter(backend, alternates=alternate_params(s.branches), tree=s.tree)
    from specwire.drafters.model import ModelDrafter
    return ModelDrafter(backend)


def lockstep_drafters(s: DraftSettings, target: Backend, n_seq: int,
                      wrap: Callable[[Any], Any] = _identity) -> list[Drafter]:
    """One draft context of n_seq sequences on the draft's weights, a drafter for each."""
    from specwire.backend.llama import LlamaBackend, check_pair, load_model
    from specwire.drafters.model import ModelDrafter
    assert s.model is not None  # DraftSettings refuses kind model without one
    dmodel = load_model(s.model, dict(s.flags))
    check_pair(target.model, dmodel)
    return ModelDrafter.per_sequence(wrap(LlamaBackend(s.model, dmodel, n_seq=n_seq)))
