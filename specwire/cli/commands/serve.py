"""`specwire serve`: an HTTP server with llama-server's and OpenAI's APIs.

The engine flags are `generate`'s (llama.cpp's names): with no model flags the
bundled pair is served, the target verifying what the bundled draft proposes.
See specwire/server/app.py for the endpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from specwire.cli.args import (
    CliError,
    add_emulation_args,
    add_lookup_cache_arg,
    add_model_args,
    add_sampling_args,
    draft_params,
    lora_params,
    sampling_params,
)
from specwire.cli.commands import compat
from specwire.text import reasoning

if TYPE_CHECKING:
    from specwire.server import ServerSettings

log = logging.getLogger("specwire.serve")

#: limits.MAX_BODY_BYTES, repeated so that `--help` needs no FastAPI import.
MAX_BODY_BYTES = 8 << 20
#: limits.LORA_SCALE_MAX, likewise.
LORA_SCALE_MAX = 4.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI and llama-server HTTP APIs",
        description="Serve POST /completion, /v1/completions, /v1/chat/completions, "
        "/tokenize, /detokenize and GET /health, /v1/models, /props, /metrics with "
        "speculative decoding (bundled pair by default), and a live page at GET /.")
    g = p.add_argument_group("server")
    _add_listen_args(g)
    _add_cors_args(g)
    _add_endpoint_args(g)
    _add_constraint_args(g)
    _add_chat_args(g)
    _add_slot_args(g)
    _add_limit_args(g)
    _add_cache_args(g)
    add_log_args(p)
    add_model_args(p)
    add_lookup_cache_arg(p)
    add_sampling_args(p)
    add_emulation_args(p)
    compat.add_rpc_arg(p)
    compat.add_compat_args(p)
    p.set_defaults(func=run)


def _add_listen_args(g: argparse._ActionsContainer) -> None:
    """Where serve listens, who may ask (API keys, TLS), and its HTTP threads."""
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("SPECWIRE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health "
                   "and the web UI's page, which asks for the key; a comma list gives "
                   "several keys (env SPECWIRE_API_KEY)")
    g.add_argument("--api-key-file", metavar="FNAME",
                   help="API keys, one per line, each line whole (a comma is part of the "
                   "key; '#' starts a comment line)")
    g.add_argument("--ssl-key-file", metavar="FNAME", help="PEM private key: serve HTTPS")
    g.add_argument("--ssl-cert-file", metavar="FNAME", help="PEM certificate: serve HTTPS")
    g.add_argument("-to", "--timeout", type=int, default=600, metavar="N",
                   help="llama-server's read/write timeout: here it bounds --keep-alive "
                   "(default 600)")
    g.add_argument("--threads-http", type=int, default=-1, metavar="N",
                   help="threads that parse, tokenize and render requests (-1: the "
                   "default pool)")


def _add_cors_args(g: argparse._ActionsContainer) -> None:
    """CORS, as llama-server answers it: any origin by default (docs/hardening.md)."""
    g.add_argument("--cors-origins", default="*", metavar="LIST",
                   help="origins a browser page may call this server from, comma list ('*': "
                   "any, the default, as llama-server; 'none': no CORS headers). Without "
                   "--api-key any web page can then use the server: see docs/hardening.md")
    g.add_argument("--cors-methods", default="GET,POST", metavar="LIST",
                   help="methods a preflight allows (default GET,POST)")
    g.add_argument("--cors-headers", default="*", metavar="LIST",
                   help="request headers a preflight allows (default '*': any)")
    g.add_argument("--cors-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="answer Access-Control-Allow-Credentials: true (no cookies are used "
                   "here; the API key is a header)")


def cors_settings(a: argparse.Namespace) -> dict:
    """--cors-* -> ServerSettings' cors_* fields."""
    def items(text: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in text.split(",") if x.strip())

    origins = () if a.cors_origins.strip().lower() in ("", "none") else items(a.cors_origins)
    return {"cors_origins": origins,
            "cors_methods": tuple(m.upper() for m in items(a.cors_methods)),
            "cors_headers": items(a.cors_headers), "cors_credentials": a.cors_credentials}


def _add_endpoint_args(g: argparse._ActionsContainer) -> None:
    """The optional endpoints (/metrics, /slots, slot files) and what every request gets:
    infill order, the warm-up, special tokens' text, parallel tool calls."""
    g.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="GET /metrics (Prometheus): on by default here, unlike "
                   "llama-server; --no-metrics turns it off (404)")
    g.add_argument("--slot-save-path", metavar="PATH", default=None,
                   help="folder for POST /slots/{id}?action=save|restore (a slot's KV cache "
                   "as a file; with API keys each key has a subfolder of its own)")
    g.add_argument("--slot-save-files", type=int, default=16, metavar="N",
                   help="slot files each API key (or, without keys, the server) may keep in "
                   "--slot-save-path; a save past it is refused with 403 (default 16)")
    g.add_argument("--slot-save-bytes", type=int, default=8 << 30, metavar="BYTES",
                   help="bytes of slot files each API key may keep (default 8 GiB); also "
                   "the largest file restored")
    g.add_argument("--spm-infill", action="store_true",
                   help="/infill: suffix before prefix (Suffix/Prefix/Middle), as some "
                   "models prefer")
    g.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="GET /slots: each slot's state (--no-slots: 404)")
    g.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="decode one token on the target before serving, so that the first "
                   "request does not pay llama.cpp's first-use costs (the cache is emptied "
                   "after)")
    g.add_argument("-sp", "--special", action="store_true",
                   help="generated special tokens print their text")
    g.add_argument("-ptc", "--parallel-tool-calls", action="store_true",
                   help="chat requests may make several tool calls in one reply unless they "
                   "say parallel_tool_calls: false (default: off, as in llama-server)")


def _add_constraint_args(g: argparse._ActionsContainer) -> None:
    """A grammar or JSON schema for every request without a constraint of its own."""
    c = g.add_mutually_exclusive_group()
    c.add_argument("--grammar", metavar="GBNF", default=None,
                   help="constrain every request that has no constraint of its own")
    c.add_argument("--grammar-file", metavar="FNAME", default=None,
                   help="--grammar, read from FNAME")
    c.add_argument("-j", "--json-schema", metavar="SCHEMA", default=None,
                   help="a JSON schema every request without its own constraint follows")
    c.add_argument("-jf", "--json-schema-file", metavar="FILE", default=None,
                   help="--json-schema, read from FILE")


def _add_chat_args(g: argparse._ActionsContainer) -> None:
    """The chat template and its variables, reasoning, the model's name and the live page."""
    g.add_argument("--chat-template-kwargs", metavar="JSON", default=None,
                   help="a JSON object of template variables every chat request gets "
                   "(its own chat_template_kwargs win), e.g. '{\"enable_thinking\": false}'")
    g.add_argument("--webui", "--ui", action=argparse.BooleanOptionalAction, default=True,
                   help="the live page at GET / (--no-webui or --no-ui: off, / and /stats.json "
                   "are 404)")
    g.add_argument("-a", "--alias", help="model name for /v1/models (default: the file name)")
    g.add_argument("--chat-template", default=None, metavar="NAME",
                   help="chat template by any of llama.cpp's built-in names (chatml, gemma, "
                   "llama3, command-r, deepseek3, gpt-oss, ...) or Jinja source; overrides "
                   "the GGUF's. Default: the GGUF's own, else gemma for Gemma models, else "
                   "chatml")
    g.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="read the Jinja chat template from FILE (overrides --chat-template)")
    g.add_argument("--prefill-assistant", action=argparse.BooleanOptionalAction, default=True,
                   help="a chat ending in an assistant message continues that message, as "
                   "llama-server does (--no-prefill-assistant: a new turn after it)")
    g.add_argument("--jinja", action="store_true",
                   help="accepted for llama-server compatibility: templates are always Jinja "
                   "here (tools, tool_choice and chat_template_kwargs need no flag)")
    g.add_argument("--reasoning-format", default="auto", choices=reasoning.FORMATS,
                   help="none: keep <think> blocks in the content; deepseek/auto: return "
                   "them as reasoning_content (default auto)")
    g.add_argument("--reasoning-budget", type=int, default=-1,
                   help="-1: unlimited thinking; 0: thinking off (enable_thinking false)")


def _add_slot_args(g: argparse._ActionsContainer) -> None:
    """Slots, the waiting queue and the tokens a request may ask for."""
    g.add_argument("-np", "--parallel", type=int, default=1,
                   help="slots: requests generating at once, batched into one decode per step "
                   "(each has its own sequence of the KV cache, of -c/-np tokens as in "
                   "llama-server, and its own drafter)")
    g.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait for a slot; more are refused with 429")
    g.add_argument("-n", "--n-predict", "--predict", dest="n_predict", type=int, default=-1,
                   help="tokens a request gets when it does not say (n_predict, max_tokens); "
                   "a request's own value wins, as in llama-server (-1: up to the context)")


def _add_limit_args(g: argparse._ActionsContainer) -> None:
    """Bounds on what clients may send and hold: bodies, time, connections."""
    g.add_argument("--max-body", type=int, default=MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body; more is refused with 413 (default 8 MiB: a "
                   "full 1M-token context as token ids)")
    g.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="a connection must send a request's headers within S seconds "
                   "(from its accept, TLS handshake included, and from the end of each "
                   "response)")
    g.add_argument("--keep-alive", type=float, default=5.0, metavar="S",
                   help="close a kept-alive connection idle this long between requests "
                   "(default 5, as llama-server and uvicorn; at most --timeout)")
    g.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                   help="a request body must arrive within S seconds (408 past it), and a "
                   "client that reads nothing of its response (a stream) for S seconds is "
                   "cut, which ends its generation")
    g.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="open connections at most, TLS handshakes in progress included; one "
                   "more is closed at once")
    g.add_argument("--conn-per-address", type=int, default=None, metavar="N",
                   help="open connections from one client address at most, loopback "
                   "included (default: a quarter of --max-connections; behind a reverse "
                   "proxy, every client is its address: raise it to --max-connections)")
    g.add_argument("--max-reading", type=int, default=64 << 20, metavar="BYTES",
                   help="bytes of request bodies in reading at once, all requests together "
                   "(503 with Retry-After past it; default 64 MiB)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM: waiting requests get 503 with Retry-After, running "
                   "generations get S seconds to finish, then end with a 503 (a stream: "
                   "an error event)")
    g.add_argument("--logit-bias-max", type=int, default=300, metavar="N",
                   help="most logit_bias entries per request (default 300, as OpenAI); each "
                   "costs every sampled token of the request")
    g.add_argument("--lora-scale-max", type=float, default=LORA_SCALE_MAX, metavar="X",
                   help="largest |scale| of a LoRA adapter a request's `lora` or POST "
                   f"/lora-adapters may set (default {LORA_SCALE_MAX:g}; far beyond 1, "
                   "activations overflow and answers turn to NaN)")
    g.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without --api-key, requests must name an IP address or localhost "
                   "in Host (DNS rebinding); this allows one more name (repeatable)")


def _add_cache_args(g: argparse._ActionsContainer) -> None:
    """Which slot's cache a request reuses, context shift, and the prompt cache file."""
    g.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.1,
                   help="a request goes to the idle slot whose cached prompt shares most "
                   "with it, if more than this share of its prompt (0: least recently used "
                   "slot)")
    g.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="reuse cached chunks of at least N tokens after the common prefix "
                   "by shifting them in the KV cache (0: off; see docs/memory.md)")
    g.add_argument("--context-shift", dest="context_shift", action="store_true",
                   default=False,
                   help="when a request fills its context, keep the first --keep prompt "
                   "tokens, drop half of the rest and go on (llama-server's; lossless under "
                   "speculation)")
    g.add_argument("--no-context-shift", dest="context_shift", action="store_false",
                   help="stop a request at its context's end (the default, as llama-server's)")
    g.add_argument("--prompt-cache", metavar="FILE", default=None,
                   help="keep the last served prompt's KV cache in FILE across restarts: "
                   "restored into slot 0 at start, written at stop (see docs/memory.md)")
    g.add_argument("--prompt-cache-all", action="store_true",
                   help="with --prompt-cache: the generated tokens too, not the prompt only")
    g.add_argument("--prompt-cache-ro", action="store_true",
                   help="with --prompt-cache: restore FILE, never write it")
    g.add_argument("--keep", type=int, default=0, metavar="N",
                   help="prompt tokens a context shift keeps (default 0, -1: all); a "
                   "request's n_keep overrides it")


def add_log_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging (llama.cpp's flags)")
    g.add_argument("-v", "--verbose", "--log-verbose", action="store_true",
                   default=argparse.SUPPRESS,
                   help="log everything: debug lines and each HTTP request")
    g.add_argument("-lv", "--verbosity", "--log-verbosity", type=int, default=None,
                   metavar="N", help="log threshold as llama.cpp's: 1 errors, 2 warnings, "
                   "3 info (default), 4-5 debug; 0 nothing but errors that stop serve")
    g.add_argument("--log-file", metavar="FNAME", help="also write the log to FNAME")
    g.add_argument("--log-disable", action="store_true", help="no log lines")
    g.add_argument("--verbose-prompt", action="store_true",
                   help="log each request's prompt tokens and their text")


def log_level(a: argparse.Namespace) -> int:
    """-v, --verbosity and --log-disable -> a logging level (llama.cpp's thresholds)."""
    if getattr(a, "log_disable", False):
        return logging.CRITICAL + 1
    if getattr(a, "verbose", False):
        return logging.DEBUG
    v = getattr(a, "verbosity", None)
    if v is None:
        return logging.INFO
    if v < 0:
        raise CliError(f"--verbosity: must be >= 0, got {v}")
    return {0: logging.CRITICAL, 1: logging.ERROR, 2: logging.WARNING,
            3: logging.INFO}.get(v, logging.DEBUG)


def setup_logging(a: argparse.Namespace) -> None:
    root = logging.getLogger()
    root.setLevel(log_level(a))
    if getattr(a, "log_file", None):
        try:
            handler = logging.FileHandler(a.log_file, encoding="utf-8")
        except OSError as e:
            raise CliError(f"--log-file: cannot write {a.log_file}: {e.strerror or e}") from None
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


def api_keys(a: argparse.Namespace) -> tuple[str, ...]:
    """--api-key (a comma list) and --api-key-file's lines, each a key whole (commas kept:
    a line is never split into two keys)."""
    keys = [k.strip() for k in (a.api_key or "").split(",") if k.strip()]
    if a.api_key_file:
        try:
            with open(a.api_key_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as e:
            raise CliError(f"--api-key-file: cannot read {a.api_key_file}: "
                           f"{e.strerror or e}") from None
        keys += [k.strip() for k in lines if k.strip() and not k.lstrip().startswith("#")]
        if not keys:
            raise CliError(f"--api-key-file: {a.api_key_file} holds no key")
    return tuple(dict.fromkeys(keys))


def template_kwargs(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        kw = json.loads(text)
    except ValueError as e:
        raise CliError(f"--chat-template-kwargs: not JSON: {e}") from None
    if not isinstance(kw, dict):
        raise CliError("--chat-template-kwargs: must be a JSON object")
    from specwire.server.schemas import RESERVED_KWARGS
    clash = RESERVED_KWARGS & set(kw)
    if clash:
        raise CliError(f"--chat-template-kwargs: {sorted(clash)[0]!r} cannot be set here")
    return kw


def server_grammar(a: argparse.Namespace):  # noqa: ANN201 - GrammarSpec, imported late
    """--grammar, --grammar-file, --json-schema or --json-schema-file -> a GrammarSpec."""
    from specwire.config import ConfigError
    from specwire.sample.constraints import GrammarSpec, schema_grammar

    for flag, dest, is_file, kind in (("--grammar", "grammar", False, "gbnf"),
                                      ("--grammar-file", "grammar_file", True, "gbnf"),
                                      ("--json-schema", "json_schema", False, "schema"),
                                      ("--json-schema-file", "json_schema_file", True, "schema")):
        text = getattr(a, dest, None)
        if text is None:
            continue
        if is_file:
            try:
                with open(text, encoding="utf-8") as f:
                    text = f.read()
            except OSError as e:
                raise CliError(f"{flag}: cannot read {getattr(a, dest)}: {e.strerror or e}"
                               ) from None
        if kind == "gbnf":
            return GrammarSpec(text, "root", flag)
        try:
            return schema_grammar(json.loads(text), flag)
        except ValueError as e:
            raise CliError(f"{flag}: not JSON: {e}") from None
        except ConfigError as e:
            raise CliError(str(e)) from None
    return None


def warm_up(target) -> None:  # noqa: ANN001 - a Backend
    """llama-server's warm-up: one decode (BOS) on the target, then the cache emptied, so
    nothing of it is left for requests to match."""
    t0 = time.perf_counter()
    target.eval(target.tokenize("", add_special=True) or [0])
    target.truncate(0)
    log.info("warm-up: one target decode in %.0f ms (--no-warmup skips it)",
             (time.perf_counter() - t0) * 1000)


def check_grammar(spec, target) -> None:  # noqa: ANN001 - GrammarSpec, Backend
    """Compile the server-wide grammar once for the target: a bad one stops serve here."""
    if spec is None:
        return
    from specwire.config import ConfigError
    from specwire.sample.constraints import Grammar
    try:
        Grammar.for_backend(spec, target).close()
    except ConfigError as e:
        raise CliError(str(e)) from None


def shift_contexts(engine) -> None:  # noqa: ANN001 - Engine
    """--context-shift on an engine: a target whose cache cannot shift stops serve here."""
    from specwire.config import ConfigError
    try:
        engine.enable_context_shift()
    except ConfigError as e:
        raise CliError(str(e)) from None


def slot_folder(path: str | None) -> str | None:
    """--slot-save-path: a folder, made if missing (llama-server's reading of it)."""
    if path is None:
        return None
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CliError(f"--slot-save-path: cannot use {path}: {e.strerror or e}") from None
    if not os.path.isdir(path):
        raise CliError(f"--slot-save-path: {path} is not a folder")
    return path


def ssl_files(a: argparse.Namespace) -> dict:
    """uvicorn's ssl_keyfile / ssl_certfile, both or neither, each readable."""
    key, cert = a.ssl_key_file, a.ssl_cert_file
    if bool(key) != bool(cert):
        raise CliError("--ssl-key-file and --ssl-cert-file: give both, or neither")
    for flag, path in (("--ssl-key-file", key), ("--ssl-cert-file", cert)):
        if path and not os.path.isfile(path):
            raise CliError(f"{flag}: no such file: {path}")
    return {"ssl_keyfile": key, "ssl_certfile": cert} if key else {}


def run(a: argparse.Namespace) -> int:
    """Check the flags, build the engines and the app, then serve until stopped."""
    from specwire.server import create_app

    setup_logging(a)
    compat.check_compat(a)
    compat.check_rpc(a)
    compat.warn_remote_draft_flags(a)
    keys = api_keys(a)
    kwargs = template_kwargs(a.chat_template_kwargs)
    tls = ssl_files(a)
    grammar = server_grammar(a)
    _check_limits(a)
    _check_host(a.host)
    per_slot_context(a)
    _check_chat_and_cache_flags(a)
    settings = _server_settings(a, keys, kwargs, grammar)
    engines = _build_engines(a, grammar)
    sock = _listen(a.host, a.port)
    app = create_app(engines, settings)
    _log_emulation_at_shutdown(app, engines[0].target)
    _save_lookup_cache_at_shutdown(app, engines)
    _keep_prompt_cache(app, a)
    server = _http_server(app, a, tls)
    _log_listening(a, sock, engines, tls)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        _close(engines)
    return 0


def _check_limits(a: argparse.Namespace) -> None:
    """The numeric server flags, each in its range (CliError naming the flag)."""
    if a.timeout < 1:
        raise CliError(f"--timeout: must be >= 1, got {a.timeout}")
    if a.threads_http == 0 or a.threads_http < -1:
        raise CliError(f"--threads-http: must be >= 1 or -1, got {a.threads_http}")
    if not 0 <= a.port <= 65535:
        raise CliError(f"--port: must be in [0, 65535], got {a.port}")
    if not 1 <= a.parallel <= 64:
        raise CliError(f"-np: must be in [1, 64], got {a.parallel}")
    if a.queue_size < 0:
        raise CliError(f"--queue-size: must be >= 0, got {a.queue_size}")
    if a.n_predict < -1:
        raise CliError(f"-n: must be >= -1, got {a.n_predict}")
    if a.max_body < 1:
        raise CliError(f"--max-body: must be >= 1, got {a.max_body}")
    if a.slot_save_files < 0 or a.slot_save_bytes < 0:
        raise CliError("--slot-save-files / --slot-save-bytes: must be >= 0, got "
                       f"{a.slot_save_files} / {a.slot_save_bytes}")
    for flag in ("header_timeout", "body_timeout"):
        if not 0 < getattr(a, flag) <= 86400:
            raise CliError(f"--{flag.replace('_', '-')}: must be in (0, 86400] seconds, got "
                           f"{getattr(a, flag):g}")
    if not 0 <= a.shutdown_timeout <= 86400:
        raise CliError(f"--shutdown-timeout: must be in [0, 86400] seconds, got "
                       f"{a.shutdown_timeout:g}")
    if a.max_connections < 1:
        raise CliError(f"--max-connections: must be >= 1, got {a.max_connections}")
    if a.conn_per_address is not None and not 1 <= a.conn_per_address <= a.max_connections:
        raise CliError(f"--conn-per-address: must be in [1, --max-connections "
                       f"({a.max_connections})], got {a.conn_per_address}")
    if not 0 < a.keep_alive <= 86400:
        raise CliError(f"--keep-alive: must be in (0, 86400] seconds, got {a.keep_alive:g}")
    if a.max_reading < a.max_body:
        raise CliError(f"--max-reading: must be at least --max-body ({a.max_body}), got "
                       f"{a.max_reading}")
    if a.logit_bias_max < 0:
        raise CliError(f"--logit-bias-max: must be >= 0, got {a.logit_bias_max}")
    if not 0 <= a.lora_scale_max < float("inf"):
        raise CliError(f"--lora-scale-max: must be a finite number >= 0, got "
                       f"{a.lora_scale_max:g}")
    for path, scale in lora_params(a):
        if abs(scale) > a.lora_scale_max:
            raise CliError(f"--lora-scaled: {path}'s scale {scale:g} is beyond "
                           f"--lora-scale-max {a.lora_scale_max:g}; raise that to use it")


def per_slot_context(a: argparse.Namespace) -> None:
    """-c is the whole context, shared by the -np slots, as in llama-server (llama.cpp's
    n_ctx_seq = n_ctx / n_parallel): each slot gets -c/-np tokens (a.ctx_size becomes
    that), so a pasted command line allocates the KV cache its author planned."""
    if a.parallel <= 1:
        return
    per_slot = a.ctx_size // a.parallel
    if per_slot < 16:
        raise CliError(f"-c {a.ctx_size} -np {a.parallel}: each slot would get {per_slot} "
                       "tokens (-c is shared by the -np slots, as in llama-server); give "
                       f"-c at least {16 * a.parallel}")
    if a.ctx_size % a.parallel:
        log.warning("-c %d is not a multiple of -np %d: each slot gets %d tokens",
                    a.ctx_size, a.parallel, per_slot)
    a.ctx_size = per_slot


def _check_host(host: str) -> None:
    """One address, as llama-server binds one: a comma list is refused by name."""
    if "," in host:
        raise CliError(f"--host {host}: one address only (llama-server binds one too); "
                       "use 0.0.0.0 or :: for every interface, or run one server per address")


def _check_chat_and_cache_flags(a: argparse.Namespace) -> None:
    """The chat template (--chat-template-file read into a.chat_template), reasoning and
    cache flags."""
    from specwire.text import chat

    if a.chat_template_file:
        try:
            with open(a.chat_template_file, encoding="utf-8") as f:
                a.chat_template = f.read()
        except OSError as e:
            raise CliError(f"--chat-template-file: cannot read {a.chat_template_file}: "
                           f"{e.strerror or e}") from None
        if not chat.is_jinja(a.chat_template):
            raise CliError(f"--chat-template-file: {a.chat_template_file} is not a Jinja "
                           "template")
    if a.reasoning_budget not in (-1, 0):
        raise CliError(f"--reasoning-budget: only -1 (unlimited) and 0 (off) are supported, "
                       f"got {a.reasoning_budget}")
    if not 0.0 <= a.slot_prompt_similarity <= 1.0:
        raise CliError(f"--slot-prompt-similarity: must be in [0, 1], got "
                       f"{a.slot_prompt_similarity}")
    if a.cache_reuse < 0:
        raise CliError(f"--cache-reuse: must be >= 0, got {a.cache_reuse}")
    if a.keep < -1:
        raise CliError(f"--keep: must be >= -1 (-1: the whole prompt), got {a.keep}")
    if a.keep and not a.context_shift:
        logging.getLogger("specwire.flags").warning(
            "--keep: ignored: it is what a context shift keeps, and --context-shift is off "
            "(llama-server's default): generation stops at the context's end")
    if (a.chat_template and not chat.is_known(a.chat_template)
            and not chat.is_jinja(a.chat_template)):
        raise CliError(f"--chat-template: unknown name {a.chat_template!r}; known: "
                       f"{', '.join(chat.builtin_names())} (or a Jinja template)")


def _server_settings(a: argparse.Namespace, keys: tuple[str, ...], kwargs: dict,
                     grammar) -> ServerSettings:  # noqa: ANN001 - GrammarSpec, imported late
    """The flags checked -> the app's ServerSettings."""
    from specwire.server import ServerSettings

    return ServerSettings(sampling=sampling_params(a), draft=draft_params(a), alias=a.alias,
                          chat_template=a.chat_template,
                          api_key=keys or None,
                          queue_size=a.queue_size, n_predict=a.n_predict, webui=a.webui,
                          max_body=a.max_body, reasoning_format=a.reasoning_format,
                          reasoning_budget=a.reasoning_budget,
                          slot_prompt_similarity=a.slot_prompt_similarity,
                          logit_bias_max=a.logit_bias_max, body_timeout_s=a.body_timeout,
                          lora_scale_max=a.lora_scale_max,
                          max_reading=a.max_reading,
                          allowed_hosts=(*a.allowed_host, *_named(a.host)),
                          metrics=a.metrics, special=a.special,
                          threads_http=a.threads_http, template_kwargs=kwargs,
                          verbose_prompt=a.verbose_prompt, grammar=grammar,
                          parallel_tool_calls=a.parallel_tool_calls, slots=a.slots,
                          spm_infill=a.spm_infill,
                          slot_save_path=slot_folder(a.slot_save_path),
                          slot_save_files=a.slot_save_files,
                          slot_save_bytes=a.slot_save_bytes,
                          n_keep=a.keep, context_shift=a.context_shift,
                          prefill_assistant=a.prefill_assistant, **cors_settings(a))


def _build_engines(a: argparse.Namespace, grammar) -> list:  # noqa: ANN001 - GrammarSpec
    """The engine (its -np sequences) from the model flags, checked against the server-wide
    grammar, warmed up, with --cache-reuse and --context-shift set."""
    from specwire.build import build_engine
    from specwire.cli.settings import engine_settings

    engine_s = engine_settings(a)
    engines = [build_engine(engine_s, n_seq=a.parallel)]
    check_grammar(grammar, engines[0].target)
    if a.warmup:
        warm_up(engines[0].target)
    for e in engines:
        e.cache_reuse = a.cache_reuse
        if a.context_shift:
            shift_contexts(e)
    return engines


def _http_server(app, a: argparse.Namespace, tls: dict):  # noqa: ANN001, ANN201 - FastAPI, uvicorn
    """uvicorn for the app, with the connection bounds and the draining shutdown."""
    import uvicorn

    from specwire.server import deadlines
    from specwire.server.drain import DrainingServer

    verbose = getattr(a, "verbose", False)
    per_address = a.conn_per_address or deadlines.per_address_default(a.max_connections)
    # TLS is the protocol's (deadlines.py: handshakes counted and timed), not uvicorn's.
    config = uvicorn.Config(app, log_level="info" if verbose else "warning",
                            access_log=verbose, timeout_keep_alive=min(a.keep_alive, a.timeout),
                            http=deadlines.protocol(a.header_timeout, a.max_connections,
                                                    per_address, _tls_context(tls),
                                                    a.body_timeout),
                            limit_concurrency=a.max_connections + 1)
    return DrainingServer(config, app.state.scheduler, a.shutdown_timeout)


def _tls_context(tls: dict):  # noqa: ANN202 - ssl.SSLContext | None
    """ssl_files' pair -> the server's TLS context (None: plain HTTP)."""
    if not tls:
        return None
    import ssl
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(tls["ssl_certfile"], tls["ssl_keyfile"])
    except (OSError, ssl.SSLError) as e:
        raise CliError(f"--ssl-cert-file/--ssl-key-file: cannot load them: {e}") from None
    return ctx


def _log_listening(a: argparse.Namespace, sock: socket.socket, engines: list, tls: dict) -> None:
    """The line a user looks for: the URL (with the real port), the pair and the slots."""
    port = sock.getsockname()[1]
    host = f"[{a.host}]" if ":" in a.host else a.host
    target, drafter = engines[0].target, engines[0].drafter
    scheme = "https" if tls else "http"
    log.info("listening on %s://%s:%d (target %s, drafter %s, %d slot%s, context %d%s)",
             scheme, host, port, target.name, drafter.name, a.parallel, "s" * (a.parallel > 1),
             target.n_ctx, " per slot" if a.parallel > 1 else "")
    if a.webui:
        log.info("live page: %s://%s:%d/", scheme, host, port)
    if not a.api_key and not a.api_key_file and _everywhere(a.host):
        log.warning("listening on %s without --api-key: anyone who can reach this address "
                    "may use every endpoint (--api-key KEY, or --host 127.0.0.1)", a.host)


def _everywhere(host: str) -> bool:
    """Whether --host binds every address or a non-loopback one (0.0.0.0, ::, a LAN IP)."""
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host.lower() not in ("localhost",)


def _close(engines: list) -> None:
    """After serving: the lookup caches' files and every drafter closed."""
    for e in engines:
        if e.lookup_file is not None:    # saved as the lifespan ended, unless it never ran
            e.lookup_file.close()
    for e in engines:
        for d in e.drafters:
            d.close()


def _named(host: str) -> tuple[str, ...]:
    """--host when it is a name (not an address): requests may use it in Host."""
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return (host,)
    return ()


def _log_emulation_at_shutdown(app, target) -> None:
    """--emulate: log how many decodes overran their emulated time when the app's lifespan
    ends (uvicorn re-raises SIGTERM after it, so code after server.run may never run)."""
    from specwire.cli.commands.generate import emulation_lines
    if getattr(target, "emulation", None) is None:
        return
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        for line in emulation_lines(target):
            log.info("%s", line)

    app.router.lifespan_context = lifespan


def _save_lookup_cache_at_shutdown(app, engines) -> None:
    """--lookup-cache-dynamic: save the n-gram drafters' cache when the app's lifespan ends
    (uvicorn re-raises SIGTERM after it, so code after server.run may never run)."""
    files = [e.lookup_file for e in engines if e.lookup_file is not None]
    if not files:
        return
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a):
        async with inner(a) as state:
            yield state
        for f in files:
            f.close()

    app.router.lifespan_context = lifespan


def _keep_prompt_cache(app, a: argparse.Namespace) -> None:
    """--prompt-cache FILE: restore it into slot 0 now, write it when the lifespan ends
    (server/prompt_cache.py)."""
    if a.prompt_cache is None:
        if a.prompt_cache_all or a.prompt_cache_ro:
            logging.getLogger("specwire.flags").warning(
                "--prompt-cache-all / --prompt-cache-ro: ignored without --prompt-cache FILE")
        return
    from specwire.server import prompt_cache
    cache = prompt_cache.PromptCache(a.prompt_cache, a.prompt_cache_all, a.prompt_cache_ro)
    scheduler = app.state.scheduler
    prompt_cache.restore(cache, scheduler.slots)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_):
        async with inner(app_) as state:
            yield state
        with scheduler.lock:
            prompt_cache.save(cache, scheduler.slots)

    app.router.lifespan_context = lifespan


def _listen(host: str, port: int) -> socket.socket:
    """Bind before serving, so that the logged URL has the real port (--port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
