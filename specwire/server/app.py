"""The HTTP routes: llama-server's API and OpenAI's, over one queue of slots.

README.md's table lists the endpoints. A request is parsed and tokenized off the event
loop, queued as a Job and awaited: the worker thread pushes its events onto the job's
asyncio queue (`stream: true` answers with server-sent events). A client that goes away
cancels its job at once.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.middleware.cors import CORSMiddleware

from specwire.backend.base import Backend
from specwire.engine.engine import Engine
from specwire.server import anthropic, idle_threads, limits, oai_responses, schemas
from specwire.server.anthropic_output import AnthropicMessages
from specwire.server.deadlines import BodyBudget
from specwire.server.errors import ApiError, install_handlers
from specwire.server.metrics import CONTENT_TYPE, Metrics
from specwire.server.oai_responses_output import OpenAIResponses
from specwire.server.responses import Dialect, LlamaCompletion, OpenAIChat, OpenAICompletion
from specwire.server.settings import ServerSettings
from specwire.server.slots import (
    Done,
    Draining,
    Event,
    Failed,
    Job,
    Progress,
    QueueFull,
    Result,
    SlotPool,
    TextChunk,
    shutting_down,
)
from specwire.server.webui import RecentRequests
from specwire.server.webui import install as install_webui
from specwire.text import chat

log = logging.getLogger(__name__)

#: How often a waiting request checks whether its client is still there.
POLL_S = 0.25


def model_names(target: Backend, alias: str | None) -> list[str]:
    """Names a request may use for the served model: the alias first (listed by /v1/models)."""
    file_name = str(target.name)
    names = [n.strip() for n in (alias or "").split(",") if n.strip()]
    for n in (file_name, Path(file_name).stem):
        if n not in names:
            names.append(n)
    return names


def create_app(engine: Engine | Sequence[Engine],
               settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI app serving `engine` (or several engines): one slot per sequence.

    The worker threads start with the app's lifespan and stop with it, so the
    app must be run by a server that runs the lifespan (uvicorn does).
    """
    served = _served(engine, settings or ServerSettings())
    settings = served.settings
    app = FastAPI(title="specwire", description="Speculative decoding server",
                  lifespan=_lifespan(served), docs_url=None, redoc_url=None, openapi_url=None)
    app.state.scheduler, app.state.metrics, app.state.settings = \
        served.scheduler, served.metrics, settings
    install_handlers(app)
    if settings.cors_origins:      # llama-server's CORS: any origin unless --cors-origins
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                           allow_methods=list(settings.cors_methods),
                           allow_headers=list(settings.cors_headers),
                           allow_credentials=settings.cors_credentials, max_age=600)
    _health_routes(app)
    api = APIRouter(dependencies=[Depends(_auth(settings.api_key)),
                                  Depends(_host_check(settings))])
    read_json = _json_reader(served)
    _model_routes(api, served)
    _slot_routes(api, served, _json_reader(served, strict=True))
    _token_routes(api, served, read_json)
    _generation_routes(api, served, read_json)
    _agent_routes(api, served, read_json)
    if settings.webui:
        _webui_routes(app, api, served)
    app.include_router(api)
    return app


@dataclass(frozen=True, slots=True)
class _Served:
    """What the routes share: the engines behind one queue of slots, and the settings."""

    engines: list[Engine]
    settings: ServerSettings
    scheduler: SlotPool
    metrics: Metrics
    names: list[str]          # the model's names a request may use (model_names)
    started: int              # the app's creation, in Unix seconds (/v1/models' `created`)
    recent: RecentRequests    # the live page's latest requests
    budget: BodyBudget        # request bodies in reading at once (--max-reading)

    @property
    def target(self) -> Backend:
        return self.engines[0].target


def _served(engine: Engine | Sequence[Engine], settings: ServerSettings) -> _Served:
    """The slots over `engine`'s sequences and what the routes share; a bad
    --chat-template name fails here, before anything is served."""
    engines = [engine] if isinstance(engine, Engine) else list(engine)
    chat.template_for(engines[0].target, settings.chat_template)  # an unknown name fails now
    metrics = Metrics()
    scheduler = SlotPool(engines, settings.queue_size, metrics,
                          settings.slot_prompt_similarity)
    metrics.watch(scheduler.state, scheduler.link_states)
    target = engines[0].target
    names = model_names(target, settings.alias)
    started = int(time.time())
    recent = RecentRequests()
    budget = BodyBudget(settings.max_reading, settings.body_timeout_s)
    return _Served(engines, settings, scheduler, metrics, names, started, recent, budget)


def _lifespan(served: _Served) -> Callable:
    """The worker threads' life: started with the app's lifespan, stopped at its end."""
    settings, scheduler = served.settings, served.scheduler

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if settings.threads_http > 0:     # --threads-http: the pool requests are parsed on
            limiter = anyio.to_thread.current_default_thread_limiter()
            limiter.total_tokens = settings.threads_http
            log.info("HTTP request threads: %d", limiter.total_tokens)
        scheduler.start()
        retiring = asyncio.create_task(idle_threads.retire_idle_workers())
        try:
            yield
        finally:
            retiring.cancel()
            await run_in_threadpool(scheduler.stop)

    return lifespan


def _health_routes(app: FastAPI) -> None:
    """GET /health and /v1/health: on the app itself, so they never need the API key."""

    @app.get("/health")
    @app.get("/v1/health")
    async def health() -> dict:
        return {"status": "ok"}


def _model_routes(api: APIRouter, served: _Served) -> None:
    """GET /v1/models (the served model) and /props (its default settings)."""
    engines, settings, scheduler = served.engines, served.settings, served.scheduler
    target, names, started = served.target, served.names, served.started

    aliases = [n.strip() for n in (settings.alias or "").split(",") if n.strip()]

    def model_card() -> dict:
        label, _ = chat.template_for(target, settings.chat_template)
        return {"id": names[0], "aliases": aliases, "object": "model", "created": started,
                "owned_by": "specwire",
                "meta": {"file": target.name, "n_ctx": target.n_ctx, "n_vocab": target.n_vocab,
                         "drafter": engines[0].drafter.name, "chat_template": label,
                         "slots": len(scheduler.slots)}}

    @api.get("/v1/models")
    @api.get("/models")
    async def models() -> dict:
        card = model_card()      # and llama-server's Ollama-style list beside OpenAI's
        return {"models": [{"name": card["id"], "model": card["id"], "aliases": aliases,
                            "type": "model", "capabilities": ["completion"]}],
                "object": "list", "data": [card]}

    @api.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id not in names:
            raise ApiError(404, f"model {model_id!r} not found", "not_found_error")
        return model_card()

    @api.get("/props")
    async def props() -> dict:
        label, source = chat.template_for(target, settings.chat_template)
        d = settings.draft
        return {"default_generation_settings": {
                    "n_ctx": target.n_ctx, "n_predict": settings.n_predict,
                    **settings.sampling.to_dict(), "speculative": d.enabled,
                    "speculative.n_max": d.n_max, "speculative.n_min": d.n_min,
                    "speculative.p_min": d.p_min},
                "total_slots": len(scheduler.slots), "model_alias": names[0],
                "model_path": target.name,
                "drafter": engines[0].drafter.name, "chat_template_name": label,
                "chat_template": source, "queue_size": settings.queue_size}


def _slot_routes(api: APIRouter, served: _Served, read_json: Callable) -> None:
    """The slots' state and saved caches, the LoRA adapters' scales, and /metrics."""
    settings, scheduler, metrics = served.settings, served.scheduler, served.metrics
    from specwire.server.slot_files import Quota
    quota = Quota(settings.slot_save_files, settings.slot_save_bytes)

    if settings.slots:
        @api.get("/slots")
        async def slots(request: Request) -> list:
            key = getattr(request.state, "key_scope", "")    # another key's slots: no details
            return scheduler.slot_states(schemas.joined_scope(key) if key else None)

    @api.get("/lora-adapters")
    async def lora_adapters() -> list:
        return scheduler.lora_adapters()

    @api.post("/lora-adapters")
    async def set_lora_adapters(request: Request) -> list:
        body = await read_json(request, list)    # a JSON array, not an object
        return await run_in_threadpool(scheduler.set_lora_adapters, body,
                                       settings.lora_scale_max)

    @api.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, request: Request, action: str = "") -> dict:
        body = await read_json(request) if action != "erase" else {}
        scope = schemas.joined_scope(getattr(request.state, "key_scope", ""))
        return await run_in_threadpool(scheduler.slot_action, slot_id, action,
                                       settings.slot_save_path, body, scope, quota)

    if settings.metrics:
        @api.get("/metrics")
        async def metrics_text() -> Response:
            return Response(await run_in_threadpool(metrics.render), media_type=CONTENT_TYPE)


def _json_reader(served: _Served, strict: bool = False) -> Callable:
    """read_json for the routes that take a JSON body (limits.check_json_type: `strict`
    for the state-changing admin routes)."""
    settings, budget = served.settings, served.budget

    async def read_json(request: Request, kind: type = dict) -> Any:
        """The body within --max-body, --max-reading and --body-timeout, parsed off the
        event loop (a large one takes a while) as a JSON object (kind list: an array), of a
        Content-Type limits.check_json_type takes (`strict`: application/json only)."""
        limits.check_json_type(request, strict)
        raw = await limits.read_body(request, settings.max_body, budget)
        return await run_in_threadpool(schemas.parse_json, raw, kind)

    return read_json


def _token_routes(api: APIRouter, served: _Served, read_json: Callable) -> None:
    """POST /tokenize, /apply-template and /detokenize."""
    settings, target = served.settings, served.target

    @api.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await read_json(request)
        return await run_in_threadpool(schemas.tokenize, body, target)

    @api.post("/apply-template")
    async def apply_template(request: Request) -> dict:
        body = await read_json(request)
        return await run_in_threadpool(schemas.apply_template, body, target, settings)

    @api.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        body = await read_json(request)
        return await run_in_threadpool(schemas.detokenize, body, target)


def _generator(served: _Served, read_json: Callable) -> Callable:
    """generate(request, endpoint, parse, dialect): a completion route's work, the request
    queued as a Job and answered whole or as server-sent events."""
    settings, scheduler, metrics = served.settings, served.scheduler, served.metrics
    names, recent = served.names, served.recent

    async def generate(request: Request, endpoint: str,
                       parse: Callable[[dict], schemas.Completion],
                       dialect: type[Dialect]) -> Response:
        try:
            scheduler.check_room()    # before the body is read, parsed and tokenized
            body = await read_json(request)
            spec = await run_in_threadpool(parse, body)
            if isinstance(spec, list):      # several prompts (/completion): one job each
                return await many(request, endpoint, spec, dialect)
            key = getattr(request.state, "key_scope", "")
            schemas.scope_by_key(spec.request, key)
            job = Job(spec.request, spec.stops, spec.stream, special=settings.special,
                      slot=scheduler.slot_for(spec.id_slot), progress=spec.return_progress)
            scheduler.submit(job)
        except Draining:
            raise shutting_down() from None
        except QueueFull:
            raise ApiError(429, f"the server is busy: {settings.queue_size} requests are already "
                           "waiting (--queue-size); retry later", "rate_limit_error") from None
        metrics.request(endpoint)
        fmt = dialect(spec, names[0])
        if spec.stream:
            return _JobStream(_sse(job, request, fmt,
                                   lambda r: recent.record(endpoint, r, key)),
                              lambda: scheduler.cancel(job))
        try:
            result = await _result(job, request)
        finally:
            scheduler.cancel(job)
        if result is None:   # the client is gone; nobody reads this
            return Response(status_code=499)
        recent.record(endpoint, result, key)
        return JSONResponse(fmt.whole(result))

    async def many(request: Request, endpoint: str, specs: list[schemas.Completion],
                   dialect: type[Dialect]) -> Response:
        """llama-server's answer to a list of prompts: a list of results, each with its
        `index`, the prompts queued at once (they run side by side on free slots)."""
        key = getattr(request.state, "key_scope", "")
        jobs = []
        try:
            for spec in specs:
                schemas.scope_by_key(spec.request, key)
                jobs.append(Job(spec.request, spec.stops, False, special=settings.special,
                                slot=scheduler.slot_for(spec.id_slot)))
                scheduler.submit(jobs[-1])
            metrics.request(endpoint)
            results = [await _result(job, request) for job in jobs]
        finally:
            for job in jobs:
                scheduler.cancel(job)
        if any(r is None for r in results):
            return Response(status_code=499)
        out = []
        for i, (spec, result) in enumerate(zip(specs, results, strict=True)):
            recent.record(endpoint, result, key)
            out.append({**dialect(spec, names[0]).whole(result), "index": i})
        return JSONResponse(out)

    return generate


def _generation_routes(api: APIRouter, served: _Served, read_json: Callable) -> None:
    """The completion routes: llama-server's /completion and /infill, OpenAI's two."""
    settings, target, names = served.settings, served.target, served.names
    generate = _generator(served, read_json)

    @api.post("/completion")
    @api.post("/completions")
    async def completion(request: Request) -> Response:
        return await generate(request, "/completion",
                              lambda b: schemas.completion(b, target, settings, names),
                              LlamaCompletion)

    @api.post("/infill")
    async def infill(request: Request) -> Response:
        return await generate(request, "/infill",
                              lambda b: schemas.infill(b, target, settings, names),
                              LlamaCompletion)

    @api.post("/v1/completions")
    async def oai_completion(request: Request) -> Response:
        return await generate(request, "/v1/completions",
                              lambda b: schemas.completion(b, target, settings, names,
                                                           dialect="completions"),
                              OpenAICompletion)

    @api.post("/v1/chat/completions")
    @api.post("/chat/completions")
    async def oai_chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions",
                              lambda b: schemas.chat_completion(b, target, settings, names),
                              OpenAIChat)


def _agent_routes(api: APIRouter, served: _Served, read_json: Callable) -> None:
    """Anthropic's /v1/messages and OpenAI's /v1/responses: translated onto the chat route
    (anthropic.py, oai_responses.py), answered in their own shapes."""
    settings, target, names = served.settings, served.target, served.names
    generate = _generator(served, read_json)

    @api.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generate(request, "/v1/messages",
                              lambda b: anthropic.parse(b, target, settings, names),
                              AnthropicMessages)

    @api.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        body = await read_json(request)
        counted = await run_in_threadpool(anthropic.count_tokens, body, target, settings)
        served.metrics.request("/v1/messages/count_tokens")
        return counted

    @api.post("/v1/responses")
    @api.post("/responses")
    async def responses(request: Request) -> Response:
        return await generate(request, "/v1/responses",
                              lambda b: oai_responses.parse(b, target, settings, names),
                              OpenAIResponses)


def _webui_routes(app: FastAPI, api: APIRouter, served: _Served) -> None:
    """The live page at GET / and its figures at GET /stats.json (webui/)."""
    engines, scheduler, metrics = served.engines, served.scheduler, served.metrics
    target, names, started, recent = served.target, served.names, served.started, served.recent

    def exposition() -> str:
        return metrics.render().decode()

    install_webui(app, api, exposition, scheduler, recent,
                  {"model": names[0], "drafter": engines[0].drafter.name,
                   "slots": len(scheduler.slots), "n_ctx": target.n_ctx, "started": started})


# -- helpers -------------------------------------------------------------------------------------


def _auth(api_key: str | Sequence[str] | None) -> Callable:
    """llama-server's --api-key: `Authorization: Bearer KEY` (or `X-Api-Key: KEY`); a comma
    list is several keys, any of which is let in; a tuple is keys taken whole (commas
    kept: --api-key-file's lines). Each key is a tenant of the draft node's cache: the
    request's scope is derived from the key it came with (schemas.key_scope)."""
    listed = api_key.split(",") if isinstance(api_key, str) else (api_key or ())
    keys = [k.encode() for k in listed if k]

    async def check(request: Request) -> None:
        if not keys:
            return
        header = request.headers.get("authorization", "")
        given = header[7:].strip() if header[:7].lower() == "bearer " else \
            request.headers.get("x-api-key", "")
        matched = [hmac.compare_digest(given.encode(), k) for k in keys] if given else []
        if not any(matched):
            raise ApiError(401, "invalid or missing API key (Authorization: Bearer KEY, or "
                           "x-api-key: KEY)", "authentication_error")
        request.state.key_scope = schemas.key_scope(keys[matched.index(True)])

    return check


def _host_check(settings: ServerSettings) -> Callable:
    """Without an API key, the Host header must be an IP address, localhost or an allowed
    name: a web page whose own name an attacker points at this address (DNS rebinding)
    would otherwise read and drive the server from a browser."""
    allowed = frozenset(h.lower() for h in settings.allowed_hosts)

    async def check(request: Request) -> None:
        if settings.api_key:
            return
        host = request.headers.get("host")
        if host is None or host_allowed(host, allowed):
            return
        raise ApiError(403, f"Host {host[:80]!r} is not this server's: connect by IP address "
                       "or localhost, or start it with --allowed-host NAME or --api-key",
                       "permission_error")

    return check


def host_allowed(host: str, allowed: frozenset[str]) -> bool:
    """Whether a Host header (name or address, maybe with a port) is one this server takes."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:name.find("]")] if "]" in name else name[1:]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    name = name.rstrip(".")
    if name == "localhost" or name.endswith(".localhost") or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


async def _events(job: Job, request: Request) -> AsyncIterator[Event]:
    """The job's events until Done or Failed; stops early if the client disconnects."""
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                return
            continue
        yield event
        if isinstance(event, Done | Failed):
            return


async def _result(job: Job, request: Request) -> Result | None:
    async for event in _events(job, request):
        if isinstance(event, Done):
            return event.result
        if isinstance(event, Failed):
            raise event.error
    return None


async def _sse(job: Job, request: Request, fmt: Dialect,
               on_done: Callable[[Result], None]) -> AsyncIterator[str]:
    for obj in fmt.opening():
        yield fmt.sse_line(obj)
    async for event in _events(job, request):
        if isinstance(event, TextChunk):
            for obj in fmt.chunks(event):
                yield fmt.sse_line(obj)
        elif isinstance(event, Progress):
            yield fmt.sse_line(fmt.progress(event))
        elif isinstance(event, Done):
            on_done(event.result)
            for obj in fmt.closing(event.result):
                yield fmt.sse_line(obj)
        else:
            yield fmt.sse_line(fmt.error_event(event.error))
    if fmt.done_marker:
        yield fmt.sse_line("[DONE]")


class _JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends.

    Starlette stops iterating the body when the client disconnects, but the
    generator itself would only be finalised later by the garbage collector;
    the job is cancelled here instead, right away.
    """

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001 - ASGI
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
