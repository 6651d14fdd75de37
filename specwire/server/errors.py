"""Errors as llama-server and OpenAI clients expect them: {"error": {message, type, code}};
on Anthropic's routes (/v1/messages...) as Anthropic's: {"type": "error", "error": {type, message}}.

Every failure a client can cause is an ApiError raised where it is detected
(parsing, queueing, authentication); the handlers installed here turn it, and
FastAPI's own validation and routing errors, into that body. A bad request is
never answered with a 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

#: HTTP status -> OpenAI error type.
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    403: "permission_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "unavailable_error",
}

#: HTTP status -> Anthropic's error type (any other 4xx: invalid_request_error, 5xx: api_error).
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_path(path: str) -> bool:
    """Whether a request's path is one of Anthropic's routes, answered in its error shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class ApiError(Exception):
    """A request that cannot be served, with the status and body to answer it with."""

    def __init__(self, status: int, message: str, type_: str | None = None,
                 retry_after: int | None = None, **extra: object) -> None:
        # A message may quote the request; what cannot be written as UTF-8 (a lone
        # surrogate) is escaped, or answering the error would itself fail.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type_ or TYPES.get(status, "invalid_request_error")
        self.extra = extra
        self.retry_after = retry_after      # seconds, sent as the Retry-After header

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.type,
                          **self.extra}}

    def anthropic_body(self) -> dict:
        """The body in Anthropic's shape: its clients read error.type and error.message."""
        kind = ANTHROPIC_TYPES.get(self.status,
                                   "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, anthropic: bool = False) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(self.retry_after)
        body = self.anthropic_body() if anthropic else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers or None)


def bad_request(message: str, **extra: object) -> ApiError:
    return ApiError(400, message, **extra)


def install_handlers(app: FastAPI) -> None:
    """Route every exception to an OpenAI-style error body (Anthropic's on its routes)."""

    def shaped(request: Request, e: ApiError) -> JSONResponse:
        return e.response(anthropic_path(request.url.path))

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return shaped(request, e)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        parts = []
        for err in e.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        return shaped(request, ApiError(400, "; ".join(parts) or "invalid request"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else "request failed"
        return shaped(request, ApiError(e.status_code, message))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return shaped(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
