"""`specwire draft`: serve a small GGUF model as a draft node over gRPC."""

from __future__ import annotations

import argparse
import logging
import os

from specwire.cli.args import (
    CliError,
    add_draft_model_args,
    add_emulation_args,
    draft_model_params,
)
from specwire.cli.commands import compat

log = logging.getLogger("specwire.node")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("draft", help="run a draft node (serves a small model to targets)",
                       description="Serve a draft model over gRPC so that a target on another "
                       "machine can use it (specwire generate/serve --draft-url HOST:PORT).")
    p.add_argument("-m", "--model", help="draft GGUF (default: the bundled Q2_K draft)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=7070)
    p.add_argument("--sync-port", type=int, default=None,
                   help="also serve on this port (0: any free one), advertised to targets "
                   "for their synchronous sessions (default: none, --port serves every call)")
    p.add_argument("--no-sync-port", action="store_true",
                   help="no second port (the default; kept for older command lines)")
    p.add_argument("--idle-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="close a target's connection (either port) after this long without "
                   "a call; the target reconnects for its next request without noticing")
    p.add_argument("--conn-per-address", "--sync-conn-per-address", type=int, default=8,
                   metavar="N", dest="conn_per_address",
                   help="most connections to a port from one peer address at once "
                   "(default 8; 0: no cap but the total, 4 x --max-sessions + 16)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context per sequence")
    p.add_argument("-s", "--seed", type=int, default=None,
                   help="this node's sampling seed for every session (default: each target's "
                   "--seed, which couples the draft to the target)")
    p.add_argument("--max-sessions", type=int, default=8,
                   help="sequences served at once (Ping streams count too)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus figures on http://HOST:PORT/metrics: open contexts, "
                   "admitted calls, refusals, memory (0: any free port; default: off); with "
                   "--token or --token-file it wants one of their tokens, with --tls-cert "
                   "it is HTTPS")
    p.add_argument("-cram", "--cache-ram", type=int, default=8192, metavar="MiB",
                   help="RAM for the KV caches of finished sessions, reused by the next "
                   "session that shares their prefix (0: keep none; see docs/memory.md)")
    p.add_argument("--cache-sessions", type=int, default=32, metavar="N",
                   help="most finished sessions kept in --cache-ram (least recently used "
                   "out first)")
    p.add_argument("--cache-ram-per-identity", type=int, default=0, metavar="MiB",
                   help="most of --cache-ram one identity's conversations hold: an identity "
                   "over it evicts its own, never another's (default 0: all of it)")
    p.add_argument("--cache-sessions-per-identity", type=int, default=0, metavar="N",
                   help="most of --cache-sessions one identity holds (default 0: all)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="S",
                   help="on SIGTERM: refuse new sessions, give open ones S seconds, then stop")
    p.add_argument("--cache-ttl", type=float, default=900.0, metavar="SECONDS",
                   help="drop a finished conversation's cached entries after this long "
                   "unused (0: keep them until evicted); SIGHUP drops them all")
    p.add_argument("--token", default=os.environ.get("SPECWIRE_TOKEN"),
                   help="shared secret required from targets (env SPECWIRE_TOKEN)")
    p.add_argument("--token-file", metavar="FILE",
                   help="one token per target, lines `NAME TOKEN`: each target's cached "
                   "conversations are its own (with --token too, holders of that one share "
                   "one identity; see docs/memory.md)")
    p.add_argument("--sessions-per-identity", type=int, default=0, metavar="N",
                   help="most sessions one identity (a --token-file name, a client "
                   "certificate) holds at once (default 0: up to --max-sessions)")
    p.add_argument("--tls-cert", help="server certificate (PEM): serve TLS")
    p.add_argument("--tls-key", help="server private key (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (mTLS)")
    add_draft_model_args(p, plain=True)
    compat.add_rpc_arg(p)
    add_emulation_args(p, node=True)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    from specwire.backend.base import BackendError
    from specwire.build import resolve_draft
    from specwire.link.transport.channel import loopback
    from specwire.node.server import NodeSettings, serve

    compat.check_rpc(a)
    if not 0 <= a.port <= 65535:
        raise CliError(f"--port: must be in 0..65535, got {a.port}")
    sync_port = None if a.no_sync_port else a.sync_port
    if sync_port is not None and not 0 <= sync_port <= 65535:
        raise CliError(f"--sync-port: must be in 0..65535, got {sync_port}")
    if sync_port and sync_port == a.port:
        raise CliError(f"--sync-port: {sync_port} is --port already")
    if a.metrics_port is not None and not 0 <= a.metrics_port <= 65535:
        raise CliError(f"--metrics-port: must be in 0..65535, got {a.metrics_port}")
    if a.max_sessions < 1:
        raise CliError(f"--max-sessions: must be >= 1, got {a.max_sessions}")
    if not 1 <= a.idle_timeout <= 86400:
        raise CliError(f"--idle-timeout: must be in 1..86400 seconds, got {a.idle_timeout:g}")
    if not 0 <= a.shutdown_timeout <= 3600:
        raise CliError(f"--shutdown-timeout: must be in [0, 3600] seconds, got "
                       f"{a.shutdown_timeout:g}")
    if not 0 <= a.cache_ttl <= 10**7:
        raise CliError(f"--cache-ttl: must be in 0..10000000 seconds, got {a.cache_ttl:g}")
    if a.cache_ram < 0:
        raise CliError(f"--cache-ram: must be >= 0 MiB, got {a.cache_ram}")
    if a.cache_sessions < 0:
        raise CliError(f"--cache-sessions: must be >= 0, got {a.cache_sessions}")
    for flag in ("cache_ram_per_identity", "cache_sessions_per_identity"):
        if getattr(a, flag) < 0:
            raise CliError(f"--{flag.replace('_', '-')}: must be >= 0, got {getattr(a, flag)}")
    if a.conn_per_address < 0:
        raise CliError(f"--conn-per-address (--sync-conn-per-address): must be >= 0, got "
                       f"{a.conn_per_address}")
    if a.sessions_per_identity < 0:
        raise CliError(f"--sessions-per-identity: must be >= 0, got {a.sessions_per_identity}")
    tokens = None
    if a.token_file:
        from specwire.node.tenants import TokenFileError, load_token_file
        try:
            tokens = load_token_file(a.token_file)
        except TokenFileError as e:
            raise CliError(str(e)) from None
    if bool(a.tls_key) and not a.tls_cert:
        raise CliError("--tls-key needs --tls-cert")
    for flag in ("tls_cert", "tls_key", "tls_client_ca"):
        path = getattr(a, flag)
        if path and not os.path.isfile(path):
            raise CliError(f"--{flag.replace('_', '-')}: file not found: {path}")
    if (a.token or tokens) and not a.tls_cert and not loopback(f"{a.host}:{a.port}"):
        log.warning("--token/--token-file without --tls-cert: targets (and scrapers of "
                    "--metrics-port) send the token in clear text over the network to %s",
                    a.host)
    a.ctx_size_draft = a.ctx_size_draft or a.ctx_size
    params = draft_model_params(a, resolve_draft(a.model))
    settings = NodeSettings(model=params, host=a.host, port=a.port, token=a.token,
                            tls_cert=a.tls_cert, tls_key=a.tls_key, tls_client_ca=a.tls_client_ca,
                            tokens=tokens, sessions_per_identity=a.sessions_per_identity,
                            max_sessions=a.max_sessions, seed=a.seed, sync_port=sync_port,
                            metrics_port=a.metrics_port, cache_ram_mib=a.cache_ram,
                            cache_sessions=a.cache_sessions, idle_s=a.idle_timeout,
                            per_address=a.conn_per_address,
                            cache_ram_per_identity_mib=a.cache_ram_per_identity,
                            cache_sessions_per_identity=a.cache_sessions_per_identity,
                            shutdown_s=a.shutdown_timeout, cache_ttl_s=a.cache_ttl,
                            emulation=node_emulation(a))
    if settings.emulation is not None:
        print(f"emulation: each draft token held to {1000 * settings.emulation.step_s:.3g} ms "
              f"(wall), batches on {settings.emulation.curve.describe()}", flush=True)
    try:
        serve(settings)
    except BackendError as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot listen on {a.host}:{a.port}: {e}") from None
    return 0


def node_emulation(a: argparse.Namespace):
    """--emulate / --draft-tps with the target's --emulate-scale -> the drafts' Regime, or
    None. The scale is the target's (it fits both models): the node cannot guess it."""
    from specwire.emulate.hold import Regime
    from specwire.emulate.regimes import PRESETS
    from specwire.policy.throughput import VerifyCurve

    if a.emulate is None and a.draft_tps is None:
        if a.verify_cost is not None or a.emulate_scale is not None:
            raise CliError("--verify-cost/--emulate-scale: give --emulate PRESET or --draft-tps")
        return None
    if a.emulate_scale is None:
        raise CliError("--emulate-scale: required on a draft node (the scale the target "
                       "printed, or bench's; wall time = emulated time x it)")
    try:
        scale = float(a.emulate_scale)
    except ValueError:
        raise CliError(f"--emulate-scale: not a number: {a.emulate_scale!r}") from None
    if not 0 < scale < 1e4:
        raise CliError(f"--emulate-scale: must be > 0, got {a.emulate_scale}")
    preset = PRESETS.get(a.emulate) if a.emulate else None
    tps = a.draft_tps or (preset.draft_tps if preset else None)
    if tps is None or not tps > 0:
        raise CliError(f"--draft-tps: must be > 0, got {tps}")
    text = a.verify_cost or (preset.verify_cost if preset else None)
    try:
        curve = VerifyCurve.parse(text) if text else VerifyCurve()
    except ValueError as e:
        raise CliError(f"--verify-cost: {e}") from None
    return Regime(scale / tps, curve)
