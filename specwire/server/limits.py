"""What a request body may hold, checked before any work is spent on it.

The body is read against a byte cap (413; refused by Content-Length before a byte is read
when the client declares it), then parsed by the standard library with the additions that
keep any body from reaching a 500 through the parser or what it produces: non-finite
numbers, integers beyond +-2^64 (nothing takes more; Python's int/str guard would raise at
4300 digits), nesting beyond MAX_DEPTH (the C parser would recurse until RecursionError)
and lone UTF-16 surrogates (which fail at the first encode to UTF-8) are refused. The walk
visits each element once; arrays of plain integers (token ids) are checked at C speed.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from specwire.config import INT32_MAX
from specwire.server.deadlines import BodyBudget
from specwire.server.errors import ApiError, bad_request

__all__ = ["INT32_MAX", "parse_json", "read_body"]

#: Default --max-body: a full 1M-token context (ModelParams' largest) written as token ids
#: ("123456," is 7 bytes) fits, so no request the server could serve is refused.
MAX_BODY_BYTES = 8 << 20
MAX_DEPTH = 32
#: OpenAI's limit on logit_bias entries (`serve --logit-bias-max` raises it).
MAX_LOGIT_BIAS = 300
MAX_INT = 2**64
#: The largest |scale| a LoRA adapter may be given by a request's `lora` or POST
#: /lora-adapters (`serve --lora-scale-max` widens it). Adapters are trained for scale 1;
#: 0..2 is the range people use, negative scales subtract one. Far beyond, activations
#: overflow into inf and NaN, and a NaN in a KV cell reaches every sequence of the cache.
LORA_SCALE_MAX = 4.0
#: Stop strings: llama-server takes any number, OpenAI at most 4. Each is searched for in
#: every generated piece, so their number and length bound per-token work.
MAX_STOPS = 16
MAX_STOP_CHARS = 512
#: A text prompt is refused as too long for the context, before it is tokenized, when even
#: tokens this many times longer than the vocabulary's longest could not make it fit.
TOKEN_BOUND_SLACK = 2


class _Refused(ValueError):
    """A number the parser was given that no field can hold."""


def too_large(cap: int) -> ApiError:
    return ApiError(413, f"request body: larger than the server's limit of {cap} bytes "
                    "(--max-body)")


async def read_body(request: Request, cap: int, budget: BodyBudget | None = None) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `cap` bytes.

    budget: the bytes all requests may have in reading at once (503 past it) and the
    time a body may take to arrive (408 past it).
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise too_large(cap)
    budget = budget or BodyBudget(1 << 62, float("inf"))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(budget.timeout_s if math.isfinite(budget.timeout_s)
                                   else None):
            async for chunk in request.stream():
                budget.take(len(chunk))
                size += len(chunk)
                if size > cap:
                    raise too_large(cap)
                chunks.append(chunk)
    except TimeoutError:
        raise budget.late() from None
    except ClientDisconnect:   # nobody reads the answer: a 400 ends it without a traceback
        raise bad_request(f"request body: the client left after {size} bytes") from None
    finally:
        budget.give(size)
    return b"".join(chunks)


#: The body types a generation route reads as JSON, as llama-server does (`curl -d` sends
#: the form type; a missing type is ""): what a web page may send without a preflight.
LENIENT_TYPES = frozenset({"application/json", "", "text/plain",
                           "application/x-www-form-urlencoded"})


def check_json_type(request: Request, strict: bool = False) -> None:
    """415 unless the body's Content-Type is one read as JSON: application/json, or (not
    `strict`) one of LENIENT_TYPES, whose body must then parse as JSON all the same.

    strict: the state-changing admin routes (/slots/*, /lora-adapters) take only
    application/json, which a web page on another origin cannot send without asking first
    (a CORS preflight; docs/hardening.md)."""
    ctype = request.headers.get("content-type", "")
    kind = ctype.split(";", 1)[0].strip().lower()
    if kind == "application/json" or (not strict and kind in LENIENT_TYPES):
        return
    raise ApiError(415, f"Content-Type: must be application/json"
                   f"{'' if strict else ' (or text/plain, form-urlencoded or none, holding JSON)'}"
                   f", got {ctype[:60]!r} (curl: -H 'Content-Type: application/json')",
                   "invalid_request_error")


def _float(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise _Refused(f"the number {text[:40]}{'...' if len(text) > 40 else ''} is out of "
                       "range")
    return x


def _constant(text: str) -> Any:
    raise _Refused(f"{text} is not a JSON value")


def parse_json(raw: bytes, kind: type = dict) -> Any:
    """The body as a JSON object (kind list: an array) within the limits above, or a 400
    that says why not."""
    what = "a JSON object" if kind is dict else "a JSON array"
    if not raw.strip():
        raise bad_request(f"request body: expected {what}, got nothing")
    try:
        body = json.loads(raw, parse_float=_float, parse_constant=_constant)
    except _Refused as e:
        raise bad_request(f"request body: {e}") from None
    except RecursionError:
        raise bad_request(f"request body: nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:   # JSONDecodeError, UnicodeDecodeError, int digits limit
        if "integer string conversion" in str(e):
            raise bad_request("request body: an integer with thousands of digits; nothing "
                              "here takes more than 20") from None
        raise bad_request(f"request body: invalid JSON: {e}") from None
    if not isinstance(body, kind):
        raise bad_request(f"request body: expected {what}, got {type(body).__name__}")
    check_value(body)
    return body


def check_value(value: Any) -> None:
    """Depth, integer range and surrogates over a parsed JSON value; a 400 names where."""
    stack: list[tuple[Any, str, int]] = [(value, "", 1)]
    while stack:
        v, where, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"request body: nested deeper than {MAX_DEPTH} levels at "
                              f"{_short(where)}")
        if isinstance(v, dict):
            for k, x in v.items():
                _check_str(k, f"{where}.<key>" if where else "a key")
                path = f"{where}.{k}" if where else k
                if isinstance(x, dict | list):
                    stack.append((x, path, depth + 1))
                else:
                    _check_scalar(x, path)
        elif _plain_ints(v):
            continue
        else:
            for i, x in enumerate(v):
                path = f"{where}[{i}]"
                if isinstance(x, dict | list):
                    stack.append((x, path, depth + 1))
                else:
                    _check_scalar(x, path)


def _short(where: str) -> str:
    return where if len(where) <= 60 else where[:57] + "..."


def _plain_ints(v: list) -> bool:
    """An array of integers in range (a prompt of token ids), checked without a Python loop."""
    if not v or set(map(type, v)) != {int}:
        return False
    return min(v) > -MAX_INT and max(v) < MAX_INT


def _check_scalar(x: Any, where: str) -> None:
    if isinstance(x, str):
        _check_str(x, where)
    elif isinstance(x, int) and not isinstance(x, bool) and not -MAX_INT < x < MAX_INT:
        raise bad_request(f"{_short(where)}: the integer is out of range (at most 2^64 in "
                          "magnitude)")


def _check_str(s: str, where: str) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad_request(f"{_short(where)}: contains a lone UTF-16 surrogate "
                          f"(\\u{ord(s[e.start]):04x} at character {e.start}); "
                          "text must be valid Unicode") from None


_longest: dict[int, int] = {}


def longest_token_bytes(backend: Any) -> int:
    """The most input bytes one token of this vocabulary stands for, computed once.

    A llama.cpp vocabulary's raw token text is never shorter than what the token
    prints: SentencePiece writes a space as the 3-byte "\u2581", byte-level BPE each
    byte as a 1-2 byte character, byte-fallback tokens as "<0x41>". Reading it
    leaves the detokenizer's cache of pieces alone; other backends are asked for
    their pieces.
    """
    n = _longest.get(id(backend))
    if n is None:
        text = getattr(getattr(backend, "model", None), "token_text", None)
        if text is not None:
            n = max(len(text(t).encode("utf-8", "replace")) for t in range(backend.n_vocab))
        else:
            n = max(len(backend.detokenize([t])) for t in range(backend.n_vocab))
        _longest[id(backend)] = n = max(n, 1)
    return n


def fewest_tokens(text: str, backend: Any) -> int:
    """A lower bound on the tokens `text` becomes, without tokenizing it (0: too short to
    bound). Only long texts pay for the vocabulary scan."""
    size = len(text.encode("utf-8"))
    if size <= backend.n_ctx:
        return 0
    return size // (TOKEN_BOUND_SLACK * longest_token_bytes(backend))
