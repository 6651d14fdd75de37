"""The live page's two routes: GET / (the page) and GET /stats.json (its figures).

The page itself is static and public, as llama-server's web UI is: it holds no
figure. Everything it shows comes from /stats.json, which sits behind
--api-key like the API; the page asks for the key when the server wants one
and keeps it in the browser's localStorage. --no-webui leaves both routes out.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import resources

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse

from specwire.server.slots import SlotPool
from specwire.server.webui.figures import snapshot
from specwire.server.webui.recent import RecentRequests

#: The page runs only its own inline script and talks only to this server.
HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


def page() -> str:
    return resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")


def install(app: FastAPI, api: APIRouter, exposition: Callable[[], str], scheduler: SlotPool,
            recent: RecentRequests, about: dict) -> None:
    """Add GET / to the app (public) and GET /stats.json to the API router (keyed)."""
    html = page()

    @app.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(html, headers=HEADERS)

    @api.get("/stats.json")
    async def stats(request: Request) -> dict:
        key = getattr(request.state, "key_scope", "")   # another key's requests: not listed
        return snapshot(exposition(), scheduler, recent, about, key or None)
