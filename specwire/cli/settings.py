"""Command line -> typed settings (specwire.settings), so that no argparse namespace
travels below specwire/cli/commands/. Every flag keeps its name and meaning; a bad one is
a CliError naming it."""

from __future__ import annotations

import argparse
import logging
import os

from specwire.backend.base import BackendError
from specwire.cli.args import CliError, draft_model_params, emulation_args, spec_type, target_params
from specwire.cli.placement import draft_flag_names
from specwire.config import VerifyMode
from specwire.settings import DraftSettings, EngineSettings, MeasureSettings, RemoteSettings

flags_log = logging.getLogger("specwire.flags")


def engine_settings(a: argparse.Namespace) -> EngineSettings:
    """generate's and serve's flags -> the target, the drafter and the verification mode
    (bundled pair by default)."""
    from specwire.build import resolve_draft, resolve_target

    kind = drafter_kind(a)
    lookup = lookup_cache(a, kind)
    try:
        target = target_params(a, resolve_target(a.model))
        model = draft_model_params(a, resolve_draft(a.model_draft)) if kind == "model" else None
    except BackendError as e:
        raise CliError(str(e)) from None
    sampled = getattr(a, "temp", 0.0) > 0
    verify = VerifyMode(a.verify) if sampled and getattr(a, "verify", None) else None
    draft = DraftSettings(kind=kind, hybrid=bool(getattr(a, "draft_hybrid", False)),
                          urls=tuple(getattr(a, "draft_url", None) or ()),
                          remote=remote_settings(a), model=model,
                          threaded=kind == "model" and local_mode(a) == "pipelined",
                          branches=getattr(a, "draft_branches", None),
                          tree=getattr(a, "draft_tree", 0),
                          lockstep=(kind == "model" and not getattr(a, "draft_hybrid", False)
                                    and getattr(a, "draft_mode", "auto") != "pipelined"),
                          flags=draft_flag_names(), lookup_cache=lookup,
                          lookup_share=lookup_share(a))
    emu, scale = emulation_args(a)
    return EngineSettings(target, draft, verify, emu, scale is None)


def lookup_cache(a: argparse.Namespace, kind: str) -> str | None:
    """--lookup-cache-dynamic FILE where an n-gram lookup drafts, checked before any model
    loads (a whole cache file, or none yet in a directory that exists); elsewhere it
    warns that it does nothing, and why."""
    path = getattr(a, "lookup_cache_dynamic", None)
    if path is None:
        return None
    if kind == "ngram" or getattr(a, "draft_hybrid", False):
        from specwire.drafters.ngram.persist import check_file
        check_file(path)
        return path
    why = ("there is no drafter (--no-draft)" if kind == "none" else
           "the draft model drafts alone, without an n-gram lookup (add --draft-hybrid "
           "to put one beside it, or use --draft-ngram)")
    flags_log.warning("--lookup-cache-dynamic: ignored: it is the n-gram drafter's cache of "
                      "earlier requests, and %s", why)
    return None


def lookup_share(a: argparse.Namespace) -> int | None:
    """--lookup-cache-per-identity TOKENS (None without the flag: the cache's default)."""
    share = getattr(a, "lookup_cache_per_identity", None)
    if share is not None and share < 0:
        raise CliError(f"--lookup-cache-per-identity: must be >= 0 tokens, got {share}")
    return share


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


def remote_settings(a: argparse.Namespace, draft_mode: str | None = None) -> RemoteSettings:
    """--draft-token, --draft-tls-*, --draft-mode (or draft_mode) and --draft-no-poll."""
    mode = draft_mode or getattr(a, "draft_mode", "auto")
    return RemoteSettings(token=getattr(a, "draft_token", None),
                          tls_ca=getattr(a, "draft_tls_ca", None),
                          tls_cert=getattr(a, "draft_tls_cert", None),
                          tls_key=getattr(a, "draft_tls_key", None),
                          pipelined=mode != "sync",
                          poll=not getattr(a, "draft_no_poll", False),
                          branches=getattr(a, "draft_branches", None),
                          tree=getattr(a, "draft_tree", 0))


def local_mode(a: argparse.Namespace) -> str:
    """A local draft works ahead on its own thread only when a core is free for it."""
    mode = getattr(a, "draft_mode", "auto")
    if mode != "auto":
        return mode
    cores = os.cpu_count() or 1
    return "pipelined" if a.threads + a.threads_draft <= cores else "sync"


def measure_settings(a: argparse.Namespace) -> MeasureSettings:
    """`plan --measure`'s flags -> the pair to load and the prompts to run."""
    from specwire.build import resolve_draft, resolve_target

    if a.measure_limit < 1 or a.measure_n < 1:
        raise CliError("--measure-limit and --measure-n must be >= 1")
    try:
        target = target_params(a, resolve_target(a.model))
        draft = draft_model_params(a, resolve_draft(a.model_draft))
    except BackendError as e:
        raise CliError(str(e)) from None
    return MeasureSettings(target, draft, a.measure_prompts, a.measure_limit, a.measure_n,
                           draft_flag_names())
