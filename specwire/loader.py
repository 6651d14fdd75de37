"""Build an Engine from command-line settings: target, drafter, compatibility checks.

Shared by generate, serve and bench so that every command resolves the bundled
defaults, refuses incompatible pairs and picks the drafter the same way.
"""

from __future__ import annotations

import argparse
import logging
import os

from specwire.backend.base import BackendError
from specwire.cliargs import CliError, draft_model_params, spec_type, target_params
from specwire.cliplacement import draft_flag_names
from specwire.config import ConfigError, VerifyMode
from specwire.drafters.base import Drafter, NoDrafter
from specwire.engine import Engine

log = logging.getLogger(__name__)


def resolve_target(path: str | None) -> str:
    if path:
        return path
    from specwire import models
    return str(models.default_target())


def resolve_draft(path: str | None) -> str:
    if path:
        return path
    from specwire import models
    return str(models.default_draft())


def build_engine(a: argparse.Namespace, n_seq: int = 1) -> Engine:
    """The target backend plus the drafter the flags ask for (bundled pair by default).

    n_seq: sequences the target holds in one context (serve -np), each with a drafter of
    its own (a local draft model: one draft context of n_seq sequences, drafting in
    lockstep; with --draft-mode pipelined or --draft-hybrid a context per sequence).
    Both models' placements are checked (buffer types, devices) before either loads,
    so a bad -otd does not wait for a big target to load first.
    """
    from specwire.backend.llama import LlamaBackend
    from specwire.backend.placement import check
    try:
        tparams = target_params(a, resolve_target(a.model))
        kind = drafter_kind(a)
        dparams = (draft_model_params(a, resolve_draft(a.model_draft)) if kind == "model"
                   else None)
        check(tparams.placement)
        if dparams is not None:
            check(dparams.placement, draft_flag_names())
        target = LlamaBackend(tparams, n_seq=n_seq)
        drafters = (lockstep_drafters(a, target, dparams, n_seq) if lockstep(a, kind, n_seq)
                    else [build_drafter(a, kind, target, dparams) for _ in range(n_seq)])
    except BackendError as e:
        raise CliError(str(e)) from None
    sampled = getattr(a, "temp", 0.0) > 0
    verify = VerifyMode(a.verify) if sampled and getattr(a, "verify", None) else None
    try:
        return Engine(target, drafters, verify=verify)
    except ConfigError as e:
        for drafter in drafters:
            close = getattr(drafter, "close", None)
            if close is not None:
                close()
        raise CliError(str(e)) from None


def drafter_kind(a: argparse.Namespace) -> str:
    """none, ngram, remote or model (a draft model in this process)."""
    kind = spec_type(a)
    if getattr(a, "no_draft", False) or kind == "none":
        kind = "none"
    elif getattr(a, "draft_ngram", False) or kind == "ngram":
        kind = "ngram"
    else:
        kind = "remote" if getattr(a, "draft_url", None) else "model"
    if getattr(a, "draft_hybrid", False) and kind not in ("remote", "model"):
        raise CliError("--draft-hybrid: needs a draft model (-md or --draft-url), not "
                       "--no-draft or --draft-ngram")
    return kind


def build_drafter(a: argparse.Namespace, kind: str, target, dparams) -> Drafter:
    if getattr(a, "draft_hybrid", False):
        from specwire.drafters.hybrid import HybridDrafter
        from specwire.drafters.ngram import NgramDrafter
        return HybridDrafter(NgramDrafter(), build_model_drafter(a, kind, target, dparams))
    if kind == "none":
        return NoDrafter()
    if kind == "ngram":
        from specwire.drafters.ngram import NgramDrafter
        return NgramDrafter()
    return build_model_drafter(a, kind, target, dparams)


def build_model_drafter(a: argparse.Namespace, kind: str, target, dparams) -> Drafter:
    """A draft model: remote (--draft-url) or in this process (-md or the bundled one)."""
    if kind == "remote":
        from specwire.wire.client import make_remote_drafter
        return make_remote_drafter(a.draft_url, a, target)
    from specwire.backend.llama import LlamaBackend, check_pair, load_model
    dmodel = load_model(dparams, draft_flag_names())
    check_pair(target.model, dmodel)
    backend = LlamaBackend(dparams, dmodel)
    if local_mode(a) == "pipelined":
        from specwire.drafters.threaded import ThreadedDrafter
        return ThreadedDrafter(backend)
    from specwire.drafters.model import ModelDrafter
    return ModelDrafter(backend)


def lockstep(a: argparse.Namespace, kind: str, n_seq: int) -> bool:
    """Several sequences of a local draft model share one draft context and draft in
    lockstep (unless --draft-mode pipelined or --draft-hybrid asks otherwise)."""
    return (kind == "model" and n_seq > 1 and not getattr(a, "draft_hybrid", False)
            and getattr(a, "draft_mode", "auto") != "pipelined")


def lockstep_drafters(a: argparse.Namespace, target, dparams, n_seq: int) -> list[Drafter]:
    """One draft context of n_seq sequences on the draft's weights, a drafter for each."""
    from specwire.backend.llama import LlamaBackend, check_pair, load_model
    from specwire.drafters.model import ModelDrafter
    dmodel = load_model(dparams, draft_flag_names())
    check_pair(target.model, dmodel)
    return ModelDrafter.per_sequence(LlamaBackend(dparams, dmodel, n_seq=n_seq))


def local_mode(a: argparse.Namespace) -> str:
    """A local draft works ahead on its own thread only when a core is free for it."""
    mode = getattr(a, "draft_mode", "auto")
    if mode != "auto":
        return mode
    cores = os.cpu_count() or 1
    return "pipelined" if a.threads + a.threads_draft <= cores else "sync"
