"""gRPC over HTTP/2: length-prefixed messages in DATA, a status in the trailers.

What h2 does not know about gRPC, with the limits a peer cannot push past:
a message longer than the agreed maximum, a compressed one (no encoding is
ever agreed), more unread messages than a stream may hold, and a status
trailer that is not a clean decimal code all end in H2Error or GrpcStatus
naming the problem, never in an exception of another kind.
"""

from __future__ import annotations

import enum
import re
from collections import deque
from dataclasses import dataclass, field
from urllib.parse import unquote

from specwire.link.transport.peertext import peer_text

#: Unread messages a stream may hold. A synchronous round is one message each way, so an
#: honest peer never comes near it; a peer sending messages nobody asked for stops here.
MAX_QUEUED = 256
#: gRPC's status codes are 0..16; anything else in a trailer is malformed.
MAX_STATUS_CODE = 16
_STATUS = re.compile(r"[0-9]{1,2}")  # ASCII digits only: "²".isdigit() is True


class Status(enum.IntEnum):
    """gRPC's status codes (the ones this link uses), as they travel in grpc-status."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    FAILED_PRECONDITION = 9
    RESOURCE_EXHAUSTED = 8
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


class H2Error(Exception):
    """The peer broke HTTP/2 or gRPC framing, or the connection ended; the message says how."""


class GrpcStatus(Exception):
    """A stream ended with a gRPC status other than OK."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"gRPC status {code}: {message}")
        self.code, self.message = code, message


@dataclass(slots=True)
class Stream:
    """One gRPC call: its headers, the messages received and not yet read, how it ended."""

    sid: int
    headers: list[tuple[str, str]] = field(default_factory=list)
    trailers: list[tuple[str, str]] = field(default_factory=list)
    messages: deque[bytes] = field(default_factory=deque)
    partial: bytearray = field(default_factory=bytearray)  # an incomplete message
    ended: bool = False  # the peer sent END_STREAM (or reset the stream)
    reset: int | None = None  # the peer's RST_STREAM error code

    def take(self, data: bytes, max_message: int) -> None:
        """Split DATA into messages (a 1-byte flag and a 4-byte length before each)."""
        part = self.partial
        if not part and len(data) >= 5 and data[0] == 0 and \
                int.from_bytes(data[1:5], "big") == len(data) - 5 <= max_message and \
                len(self.messages) < MAX_QUEUED:
            self.messages.append(data[5:])  # one whole message, the common case
            return
        part += data
        while len(part) >= 5:
            if part[0] != 0:
                raise H2Error("compressed gRPC message (no encoding was agreed)")
            size = int.from_bytes(part[1:5], "big")
            if size > max_message:
                raise H2Error(f"gRPC message of {size} bytes, above the limit of {max_message}")
            if len(part) < 5 + size:
                return
            if len(self.messages) >= MAX_QUEUED:
                raise H2Error(f"stream {self.sid}: more than {MAX_QUEUED} unread messages")
            self.messages.append(bytes(part[5 : 5 + size]))
            del part[: 5 + size]


def frame_message(payload: bytes) -> bytes:
    """The bytes of one uncompressed gRPC message."""
    return b"\0" + len(payload).to_bytes(4, "big") + payload


def check_status(headers: list[tuple[str, str]]) -> None:
    """Raise GrpcStatus unless the trailers (or a trailers-only response) say OK."""
    h = dict(headers)
    status = h.get(":status", "200")
    if status != "200":
        raise GrpcStatus(14, f"HTTP status {status[:16]!r}")
    code = h.get("grpc-status")
    if code is None:
        raise GrpcStatus(13, "the call ended without a gRPC status")
    if code == "0":
        return
    if not _STATUS.fullmatch(code) or int(code) > MAX_STATUS_CODE:
        raise GrpcStatus(13, f"malformed grpc-status {code[:16]!r}")
    raise GrpcStatus(int(code), peer_text(unquote(h.get("grpc-message", ""))))


def percent_encode(text: str) -> str:
    """grpc-message's encoding: printable ASCII as is, everything else %XX of its UTF-8."""
    return "".join(c if " " <= c <= "~" and c != "%" else "".join(
        f"%{b:02X}" for b in c.encode(errors="replace")) for c in text)
