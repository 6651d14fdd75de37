"""The DATA frames of an open gRPC stream, framed and parsed beside h2 rather than by it.

h2's per-frame objects and state-machine steps are most of what a synchronous round
costs in Python beyond the round trip. So a plain DATA frame (no flags, an OPEN stream,
within the frame size and both windows), which moves neither state machine, takes a
short path that keeps h2's flow-control accounting exactly; any other frame goes to h2.
It touches h2 attributes outside its public API (_NEEDS): if a release renames them the
short path turns itself off, with one log line: slower, never wrong.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import h2.connection
import h2.stream

log = logging.getLogger("specwire.wire")

_OPEN = h2.stream.StreamState.OPEN
_CLOSED = h2.connection.ConnectionState.CLOSED
#: What the short path reads or charges beyond h2's public API.
_NEEDS = ("_inbound_flow_control_window_manager", "state_machine", "streams",
          "outbound_flow_control_window", "max_outbound_frame_size", "max_inbound_frame_size")
_STREAM_NEEDS = ("_inbound_window_manager", "_expected_content_length", "state_machine",
                 "outbound_flow_control_window")
_warned = False


class DataPath:
    """Frames and parses plain DATA frames for one h2 connection (see the module doc)."""

    __slots__ = ("_h2", "enabled", "_streams_checked", "sent", "received")

    def __init__(self, conn: h2.connection.H2Connection) -> None:
        self._h2 = conn
        self.enabled = all(hasattr(conn, a) for a in _NEEDS)
        self._streams_checked = False  # h2's streams have what the short path needs
        self.sent = self.received = 0  # frames that took the short path
        if not self.enabled:
            _disable("h2.H2Connection")

    def _open_stream(self, sid: int) -> h2.stream.H2Stream | None:
        """h2's stream sid if a plain DATA frame on it changes no state, else None."""
        h = self._h2
        stream = h.streams.get(sid)
        if stream is None or h.state_machine.state is _CLOSED:
            return None
        if not self._streams_checked:
            if not all(hasattr(stream, a) for a in _STREAM_NEEDS):
                _disable("h2.H2Stream")
                self.enabled = False
                return None
            self._streams_checked = True
        machine = stream.state_machine
        if machine.state is not _OPEN or not machine.headers_received or \
                stream._expected_content_length is not None:
            return None
        return stream

    def frame(self, sid: int, data: bytes) -> bytes | None:
        """The DATA frame that carries data on stream sid, its bytes charged to h2's
        outbound windows; None if h2 must send it (then nothing was charged)."""
        n = len(data)
        if not self.enabled or not 0 < n <= self._h2.max_outbound_frame_size:
            return None
        stream = self._open_stream(sid)
        h = self._h2
        if stream is None or n > h.outbound_flow_control_window or \
                n > stream.outbound_flow_control_window:
            return None
        h.outbound_flow_control_window -= n
        stream.outbound_flow_control_window -= n
        self.sent += 1
        return n.to_bytes(3, "big") + b"\0\0" + sid.to_bytes(4, "big") + data

    def parse(self, data: bytes, deliver: Callable[[int, bytes], None]) -> int:
        """Take the plain DATA frames at the start of data, which must begin on a frame
        boundary, charging h2's inbound windows and passing each payload to
        deliver(sid, payload). Returns how many bytes it took; h2 gets the rest."""
        if not self.enabled:
            return 0
        h, i, end = self._h2, 0, len(data)
        conn_window = h._inbound_flow_control_window_manager
        max_frame = h.max_inbound_frame_size
        while end - i >= 9:
            n = int.from_bytes(data[i : i + 3], "big")
            if data[i + 3] != 0 or data[i + 4] != 0 or not 0 < n <= max_frame or \
                    end - i - 9 < n:
                break
            sid = int.from_bytes(data[i + 5 : i + 9], "big")
            stream = self._open_stream(sid)  # a reserved bit set finds no stream: h2's case
            if stream is None:
                break
            window = stream._inbound_window_manager
            if n > conn_window.current_window_size or n > window.current_window_size:
                break  # a flow-control violation: h2 ends the connection for it
            # What WindowManager.window_consumed does, less the check just made above.
            conn_window.current_window_size -= n
            window.current_window_size -= n
            self.received += 1
            i += 9
            deliver(sid, data[i : i + n])
            i += n
        return i


def _disable(what: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        log.warning("this h2 release changed %s's internals: the DATA short path is off "
                    "(correct, slower links)", what)
