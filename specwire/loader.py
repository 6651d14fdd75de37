"""Build an Engine from command-line settings: target, drafter, compatibility checks.

Shared by generate, serve and bench so that every command resolves the bundled
defaults, refuses incompatible pairs and picks the drafter the same way.
"""

from __future__ import annotations

import argparse
import logging
import os

from specwire.backend.base import BackendError
from specwire.cliargs import CliError, draft_model_params, target_params
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


def build_engine(a: argparse.Namespace) -> Engine:
    """The target backend plus the drafter the flags ask for (bundled pair by default)."""
    from specwire.backend.llama import LlamaBackend, check_pair, load_model
    try:
        tparams = target_params(a, resolve_target(a.model))
        target = LlamaBackend(tparams)
        drafter = build_drafter(a, target, check_pair, load_model)
    except BackendError as e:
        raise CliError(str(e)) from None
    return Engine(target, drafter)


def build_drafter(a: argparse.Namespace, target, check_pair, load_model) -> Drafter:
    if getattr(a, "draft_hybrid", False):
        if getattr(a, "no_draft", False) or getattr(a, "draft_ngram", False):
            raise CliError("--draft-hybrid: needs a draft model (-md or --draft-url), not "
                           "--no-draft or --draft-ngram")
        from specwire.drafters.hybrid import HybridDrafter
        from specwire.drafters.ngram import NgramDrafter
        model = build_model_drafter(a, target, check_pair, load_model)
        return HybridDrafter(NgramDrafter(), model)
    if getattr(a, "no_draft", False):
        return NoDrafter()
    if getattr(a, "draft_ngram", False):
        from specwire.drafters.ngram import NgramDrafter
        return NgramDrafter()
    return build_model_drafter(a, target, check_pair, load_model)


def build_model_drafter(a: argparse.Namespace, target, check_pair, load_model) -> Drafter:
    """A draft model: remote (--draft-url) or in this process (-md or the bundled one)."""
    urls = getattr(a, "draft_url", None)
    if urls:
        from specwire.wire.client import make_remote_drafter
        return make_remote_drafter(urls, a, target)
    from specwire.backend.llama import LlamaBackend
    dparams = draft_model_params(a, resolve_draft(a.model_draft))
    dmodel = load_model(dparams)
    check_pair(target.model, dmodel)
    backend = LlamaBackend(dparams, dmodel)
    if local_mode(a) == "pipelined":
        from specwire.drafters.threaded import ThreadedDrafter
        return ThreadedDrafter(backend)
    from specwire.drafters.model import ModelDrafter
    return ModelDrafter(backend)


def local_mode(a: argparse.Namespace) -> str:
    """A local draft works ahead on its own thread only when a core is free for it."""
    mode = getattr(a, "draft_mode", "auto")
    if mode != "auto":
        return mode
    cores = os.cpu_count() or 1
    return "pipelined" if a.threads + a.threads_draft <= cores else "sync"
