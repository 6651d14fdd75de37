"""`specwire serve`: an HTTP server with llama-server's and OpenAI's APIs.

The engine flags are `generate`'s (llama.cpp's names): with no model flags the
bundled pair is served, the target verifying what the bundled draft proposes.
See specwire/server/app.py for the endpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket

from specwire.cli.args import (
    CliError,
    add_emulation_args,
    add_model_args,
    add_sampling_args,
    draft_params,
    sampling_params,
)
from specwire.text import reasoning

log = logging.getLogger("specwire.serve")

#: limits.MAX_BODY_BYTES, repeated so that `--help` needs no FastAPI import.
MAX_BODY_BYTES = 8 << 20


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI and llama-server HTTP APIs",
        description="Serve POST /completion, /v1/completions, /v1/chat/completions, "
        "/tokenize, /detokenize and GET /health, /v1/models, /props, /metrics with "
        "speculative decoding (bundled pair by default), and a live page at GET /.")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on")
    g.add_argument("--port", type=int, default=8080, help="port to listen on (0: any free port)")
    g.add_argument("--api-key", default=os.environ.get("SPECWIRE_API_KEY"),
                   help="require `Authorization: Bearer KEY` on every endpoint but /health "
                   "and the web UI's page, which asks for the key (env SPECWIRE_API_KEY)")
    g.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True,
                   help="the live page at GET / (--no-webui: off, / and /stats.json are 404)")
    g.add_argument("-a", "--alias", help="model name for /v1/models (default: the file name)")
    g.add_argument("--chat-template", default=None, metavar="NAME",
                   help="chat template by llama.cpp name (chatml, gemma, llama3, llama2, "
                   "mistral-v7, phi3, zephyr, vicuna) or Jinja source; overrides the GGUF's. "
                   "Default: the GGUF's own, else gemma for Gemma models, else chatml")
    g.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="read the Jinja chat template from FILE (overrides --chat-template)")
    g.add_argument("--jinja", action="store_true",
                   help="accepted for llama-server compatibility: templates are always Jinja "
                   "here (tools, tool_choice and chat_template_kwargs need no flag)")
    g.add_argument("--reasoning-format", default="auto", choices=reasoning.FORMATS,
                   help="none: keep <think> blocks in the content; deepseek/auto: return "
                   "them as reasoning_content (default auto)")
    g.add_argument("--reasoning-budget", type=int, default=-1,
                   help="-1: unlimited thinking; 0: thinking off (enable_thinking false)")
    g.add_argument("-np", "--parallel", type=int, default=1,
                   help="slots: requests generating at once, batched into one decode per step "
                   "(each has its own sequence of the KV cache, of -c tokens, and its own "
                   "drafter)")
    g.add_argument("--queue-size", type=int, default=16,
                   help="requests that may wait for a slot; more are refused with 429")
    g.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="most tokens per request (-1: up to the context size)")
    g.add_argument("--max-body", type=int, default=MAX_BODY_BYTES, metavar="BYTES",
                   help="largest request body; more is refused with 413 (default 8 MiB: a "
                   "full 1M-token context as token ids)")
    g.add_argument("-sps", "--slot-prompt-similarity", type=float, default=0.1,
                   help="a request goes to the idle slot whose cached prompt shares most "
                   "with it, if more than this share of its prompt (0: least recently used "
                   "slot)")
    g.add_argument("--cache-reuse", type=int, default=0, metavar="N",
                   help="reuse cached chunks of at least N tokens after the common prefix "
                   "by shifting them in the KV cache (0: off; see docs/memory.md)")
    add_model_args(p)
    add_sampling_args(p)
    add_emulation_args(p)
    p.set_defaults(func=run)


def run(a: argparse.Namespace) -> int:
    import uvicorn

    from specwire.build import build_engine
    from specwire.cli.settings import engine_settings
    from specwire.drafters.base import declared
    from specwire.server import ServerSettings, create_app
    from specwire.text import chat

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
    if a.chat_template_file:
        try:
            with open(a.chat_template_file, encoding="utf-8") as f:
                a.chat_template = f.read()
        except OSError as e:
            raise CliError(f"--chat-template-file: cannot read {a.chat_template_file}: "
                           f"{e.strerror or e}") from None
        if not ("{{" in a.chat_template or "{%" in a.chat_template):
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
    if a.chat_template and a.chat_template not in chat.TEMPLATES and not (
            "{{" in a.chat_template or "{%" in a.chat_template):
        raise CliError(f"--chat-template: unknown name {a.chat_template!r}; known: "
                       f"{', '.join(sorted(chat.TEMPLATES))} (or a Jinja template)")
    settings = ServerSettings(sampling=sampling_params(a), draft=draft_params(a), alias=a.alias,
                              chat_template=a.chat_template, api_key=a.api_key or None,
                              queue_size=a.queue_size, n_predict=a.n_predict, webui=a.webui,
                              max_body=a.max_body, reasoning_format=a.reasoning_format,
                              reasoning_budget=a.reasoning_budget,
                              slot_prompt_similarity=a.slot_prompt_similarity)
    engine_s = engine_settings(a)
    engines = [build_engine(engine_s, n_seq=a.parallel)]
    for e in engines:
        e.cache_reuse = a.cache_reuse
    sock = _listen(a.host, a.port)
    app = create_app(engines, settings)
    _log_emulation_at_shutdown(app, engines[0].target)
    verbose = getattr(a, "verbose", False)
    config = uvicorn.Config(app, log_level="info" if verbose else "warning",
                            access_log=verbose, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    port = sock.getsockname()[1]
    host = f"[{a.host}]" if ":" in a.host else a.host
    target, drafter = engines[0].target, engines[0].drafter
    log.info("listening on http://%s:%d (target %s, drafter %s, %d slot%s, context %d)",
             host, port, target.name, drafter.name, a.parallel, "s" * (a.parallel > 1),
             target.n_ctx)
    if a.webui:
        log.info("live page: http://%s:%d/", host, port)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for e in engines:
            for d in e.drafters:
                declared(d).close()
    return 0


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


def _listen(host: str, port: int) -> socket.socket:
    """Bind before serving, so that the logged URL has the real port (--port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise CliError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
