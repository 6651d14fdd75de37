"""Who a draft node's peer is, and how many sessions each peer may hold.

The node's conversation memory (node/kv_cache.py) is scoped by the peer's identity, so that
one target's clients cannot probe what another target's clients said. An identity is
authenticated, never chosen by the peer: the name of its token in a --token-file, and with
mutual TLS the subject of its client certificate; with neither, every peer is the identity
"", and the scope each target sends in its Open (cache_scope) still separates its clients.
An identity holds at most `per_identity` of the node's --max-sessions slots at once.
"""

from __future__ import annotations

import hmac
import threading
from pathlib import Path

MAX_NAME = 64


class TokenFileError(ValueError):
    """A --token-file that cannot be used (the message names the file and line)."""


def load_token_file(path: str | Path) -> dict[str, str]:
    """Token -> name, from lines `NAME TOKEN` (blank lines and `#` comments skipped).
    Names and tokens must each be unique, names at most MAX_NAME printable characters."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenFileError(f"--token-file {path}: {e}") from None
    tokens: dict[str, str] = {}
    names: set[str] = set()
    for i, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        where = f"--token-file {path} line {i}"
        if len(parts) != 2:
            raise TokenFileError(f"{where}: want `NAME TOKEN`, got {line[:40]!r}")
        name, token = parts
        if len(name) > MAX_NAME or not name.isprintable():
            raise TokenFileError(f"{where}: name must be at most {MAX_NAME} printable "
                                 "characters")
        if len(token) < 16:
            raise TokenFileError(f"{where}: token of {name!r} shorter than 16 characters")
        if name in names or token in tokens:
            raise TokenFileError(f"{where}: {name!r} or its token appears twice")
        names.add(name)
        tokens[token] = name
    if not tokens:
        raise TokenFileError(f"--token-file {path}: no `NAME TOKEN` line")
    return tokens


def token_name(tokens: dict[str, str], header: str) -> str | None:
    """The name of the token in an `authorization: Bearer TOKEN` header, or None. Every
    entry is compared in constant time, so the time taken tells nothing of which matched."""
    got = header[7:] if header.startswith("Bearer ") else ""
    found = None
    for token, name in tokens.items():
        if hmac.compare_digest(got.encode(), token.encode()):
            found = name
    return found


def certificate_subject(context) -> str:
    """The mutual-TLS client certificate's subject, or "" (no certificate, or a context
    that does not say)."""
    auth = getattr(context, "auth_context", None)
    if auth is None:
        return ""
    values = (auth() or {}).get("x509_subject") or ()
    return values[0].decode("utf-8", "replace")[:256] if values else ""


def identity(token: str | None, subject: str) -> str:
    """The identity of a peer known by its token's name and its certificate's subject."""
    parts = ([f"token:{token}"] if token else []) + ([f"cert:{subject}"] if subject else [])
    return " ".join(parts)


class Quotas:
    """Sessions held per identity, at most `per_identity` each (0: no limit)."""

    def __init__(self, per_identity: int) -> None:
        self.per_identity = per_identity
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def enter(self, who: str) -> bool:
        """One more session for `who`, if within its quota."""
        with self._lock:
            n = self._held.get(who, 0)
            if self.per_identity and n >= self.per_identity:
                return False
            self._held[who] = n + 1
            return True

    def leave(self, who: str) -> None:
        with self._lock:
            n = self._held.get(who, 0) - 1
            if n > 0:
                self._held[who] = n
            else:
                self._held.pop(who, None)

    def held(self, who: str) -> int:
        with self._lock:
            return self._held.get(who, 0)
