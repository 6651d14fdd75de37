"""The target's transport of the draft link: gRPC streams over one HTTP/2 connection per node.

It only moves messages: RemoteDrafter (link/remote.py) is a BranchDrafter (link/branch.py)
carried by it, and one target's drafters share its connections (channels.py). The engine
thread writes a synchronous verdict and reads the chunk itself; a pipelined session's
chunks are read into the branch's buffer by the connection's reader thread, and
`propose` never waits for them. So a dead, slow or hostile node costs the target at most
a lock and a list slice per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from specwire.link.messages import Chunk, Close, Failure, TargetMessage, Verdict
from specwire.link.transport import protocol, roundcodec
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.base import Branch, Transport
from specwire.link.transport.channel import Link, LinkError
from specwire.link.transport.channels import Delivery, Line, LinkSet
from specwire.link.transport.h2.connection import CreditTimeout, GrpcStatus, H2Error
from specwire.link.transport.h2.grpcframe import Status
from specwire.link.transport.peertext import peer_text
from specwire.link.transport.protocol import ProtocolError

log = logging.getLogger("specwire.remote")


class NodeFailure(ProtocolError):
    """The node ended one session with its error (a Failure message): that session is
    dropped, and the link backs off as for a broken peer, but the connection and the
    other sessions on it stay."""


#: Messages one round takes in without waiting (a late node's answers catch up in a few).
MAX_POLLED = 16


@dataclass(slots=True)
class _Call:
    """A Session stream on a node's connection. A synchronous one only the engine thread
    touches; a pipelined one's messages come from the line's reader thread."""

    line: Line
    link: Link
    epoch: int  # the link's epoch when it opened (Link.failed)
    session: int  # the branch's session number it carries
    pipelined: bool
    sid: int = 0
    closed: bool = False  # the Close went out with END_STREAM
    answered: bool = False  # a message of the node's came on it
    reopened: bool = False  # it opened again after its first Open crossed an idle close
    counted: bool = False  # it holds one of the link's streams (Link.take_stream)
    over: bool = False  # it failed: what its stream still delivers is ignored
    sent_at: float = 0.0  # time.monotonic() when the last verdict went out
    asked: int = 0  # tokens it asked for; 0 once its answer came
    # (time.monotonic(), tokens asked, forecast window) of the last answer, until the forecast
    # learns from it after the next send
    arrived: tuple[float, int, tuple[float, float] | None] | None = None


@dataclass(slots=True)
class ArrivalForecast:
    """When a synchronous answer should arrive, learned as TCP learns its round trip (a
    moving mean and mean deviation, here per requested token), so that the engine thread
    can sleep until just before it and busy-poll across it (http2.Connection._fill).

    The window is kept narrow: its width is the CPU it costs, and an answer outside it
    costs only the ordinary wake-up.
    """

    per_token_s: float = 0.0
    dev_s: float = 0.0
    margin_s: float = 0.0005

    def window(self, sent_at: float, tokens: int) -> tuple[float, float] | None:
        if not self.per_token_s or not tokens:
            return None
        mid = sent_at + self.per_token_s * tokens
        spread = self.dev_s * tokens + self.margin_s
        return mid - spread, mid + 3 * spread

    def learn(self, waited_s: float, tokens: int) -> None:
        sample = waited_s / tokens
        if not self.per_token_s:
            self.per_token_s, self.dev_s = sample, sample / 4
            return
        self.dev_s += 0.25 * (abs(sample - self.per_token_s) - self.dev_s)
        self.per_token_s += 0.125 * (sample - self.per_token_s)


class GrpcTransport(Transport):
    """The gRPC transport of a BranchDrafter (link/branch.py's Transport): the links to
    the draft nodes, the live Session stream, and the arrival forecast; the branch's
    state it reads through the branch alone."""

    def __init__(self, links: list[Link] | LinkSet, poll: bool = True) -> None:
        """links: this drafter's own, or a LinkSet shared with the target's other drafters;
        poll: busy-poll a synchronous answer around its forecast arrival."""
        if not links:
            raise ValueError("RemoteDrafter needs at least one link")
        self.shared = links if isinstance(links, LinkSet) else LinkSet(links)
        self.shared.attach()
        self.links = self.shared.links
        self._loop = self.shared.loop
        self._call: _Call | None = None  # the live Session stream
        self._closed = False
        self.forecast: ArrivalForecast | None = (  # None: never busy-poll
            ArrivalForecast() if poll else None)
        self._opening = False
        self._reopened = -1  # the session that replaces a call the node refused (_reopen)

    def bind(self, branch: Branch) -> None:
        super().bind(branch)
        c = branch.counters  # the counters of this transport's own (LinkCounters)
        c.sync_port_sessions, c.polled_answers, c.poll_ms, c.stream_cap = 0, 0, 0.0, 0

    def handshake(self, timeout_s: float = 30.0) -> list[str | None]:
        """Connect every link now (its connection and Hello), so that the first request
        already drafts.

        Returns, per link, None or why it could not connect; a failed link is retried
        with backoff once generation starts, as after any failure.
        """
        return self.shared.handshake(not self.branch.pipelined, timeout_s)

    def close(self) -> None:
        """The drafter is done: the last one of the LinkSet closes the connections."""
        if not self._closed:
            self._closed = True
            self.shared.close()

    # -- transport ------------------------------------------------------------------

    def live(self) -> bool:
        return self._call is not None

    def post(self, message: TargetMessage) -> None:
        call = self._call
        if call is None:
            return
        # A verdict's bytes written directly (roundcodec.py): no protobuf object on the
        # way from the round's end to the socket.
        data = roundcodec.verdict_bytes(message) if isinstance(message, Verdict) else None
        if data is None:
            data = protocol.target_to_pb(message).SerializeToString()
        close = isinstance(message, Close)
        try:
            # A verdict is a few bytes: a node granting too little credit for it within
            # the round's deadline is broken (or hostile), and the round decodes plainly.
            call.line.send(call.sid, data, close, 0.0 if close else self.branch.sync_timeout_s)
        except (H2Error, TimeoutError, OSError) as e:
            self._failed(call, str(e), dropped=isinstance(e, CreditTimeout))
            return
        if not call.pipelined:
            if call.arrived is not None:
                self._learn_arrival(call)
            call.sent_at, call.asked = time.monotonic(), self.branch.k
        call.closed = close
        self.branch.counters.bytes_up += len(data) + 5

    def open(self, session: int, history: list[int]) -> None:
        self._opening = True
        threading.Thread(target=self._run_session, args=(session, history),
                         name="draft-session", daemon=True).start()

    def trees(self) -> bool:
        """The live stream's node said "tree" in its Hello (pipelined sessions only: a
        synchronous one carries no alternates)."""
        call = self._call
        hello = call.link.hello if call is not None and call.pipelined else None
        return hello is not None and "tree" in hello.modes

    def revive(self) -> None:
        """No session is live: start one if a link's backoff has passed."""
        if not self.branch.active or self._opening:
            return
        if any(link.ready_to_try() for link in self.links):
            self.branch.counters.reconnects += 1
            self.branch.restart()

    def useful(self) -> None:
        """The current session drafted: its link's next failure starts a fresh backoff."""
        call = self._call
        if call is not None:
            call.link.worked()

    def useless(self, reason: str) -> None:
        """A node answering verdicts with chunks that extend nothing: drop it."""
        call = self._call
        if call is not None:
            self.branch.invalidate()  # what its stream still delivers is ignored
            self._failed(call, reason, dropped=True)

    def detach(self) -> None:
        """Forget the current stream: stop listening to it if our Close ended it, else
        cancel it (a node that never answers would hold its stream for ever)."""
        with self.branch.lock:
            call, self._call = self._call, None
        if call is not None:
            try:
                self._release(call, call.closed)
            except H2Error as e:
                self._failed(call, str(e), reopen=False)

    # -- opening a session (its own thread) ------------------------------------------

    def _run_session(self, session: int, history: list[int]) -> None:
        """Pick a link (its Hello if needed), then open the session's stream on it."""
        link = None
        try:
            picking = asyncio.run_coroutine_threadsafe(self._pick_link(), self._loop)
            # Every link's handshake has its own timeout; this one only guards against a
            # loop already stopped by close().
            link = picking.result(timeout=5 + sum(x.settings.connect_timeout_s
                                                  for x in self.links))
            if link is None or session != self.branch.session:
                return
            self._open_call(link, session, history)
        except (LinkError, OSError, TimeoutError, ValueError, RuntimeError) as e:
            if link is not None and session == self.branch.session:
                link.failed(str(e))
        finally:
            with self.branch.lock:
                if session == self.branch.session:
                    self._opening = False
            self.branch.wake()

    def _open_call(self, link: Link, session: int, history: list[int]) -> None:
        """Open the session as a stream on the link's connection, which the target's
        drafters share. The node closes a connection idle for --idle-timeout, and its
        close may cross our Open after the line looked alive (the Open then fails on a
        broken line): the Open goes once more, on a new connection, and only a second
        failure counts."""
        pipelined = self.branch.pipelined
        for attempt in (1, 2):
            try:
                line = self._line(link, pipelined)
            except LinkError as e:
                link.failed(str(e))
                return
            call = _Call(line, link, link.epoch, session, pipelined)
            if not link.take_stream():
                self.branch.counters.stream_cap += 1
                return
            call.counted = True
            deliver = None
            if pipelined:
                def deliver(sid: int, item: Delivery, call: _Call = call) -> None:
                    self._delivered(call, sid, item)
            try:
                sid = line.open(lambda: self._first_message(history).SerializeToString(),
                                link.settings.connect_timeout_s, deliver)
                break
            except (H2Error, TimeoutError, OSError) as e:
                self._give(call)
                if isinstance(e, CreditTimeout):  # no credit even for the Open: broken
                    link.drop_line(line)
                    self._drop(link, str(e))
                elif line.broken():
                    link.drop_line(line)
                    if attempt == 1:
                        continue  # it crossed the node's idle close: open on a new one
                    link.failed(str(e), epoch=call.epoch)
                else:
                    link.failed(str(e), epoch=call.epoch, reconnect=False)
                return
        if sid is None:
            self._give(call)
            self.branch.counters.stream_cap += 1
            return
        call.sid = sid
        with self.branch.lock:  # a newer session may have started meanwhile: it owns the link
            if session == self.branch.session:
                self._call, self._opening = call, False
                # a reopened call goes on with the session its first Open began
                call.reopened = session == self._reopened
                self.branch.counters.sync_port_sessions += \
                    line.port == link.sync_port() and not call.reopened
                return
        with contextlib.suppress(H2Error):
            self._release(call, closed=False)

    @staticmethod
    def _line(link: Link, pipelined: bool) -> Line:
        """The connection a session uses: a synchronous one the port the node advertised for
        them, if it has one and it can be reached (`specwire draft --sync-port`); else,
        and for the rest, the main one."""
        port = 0 if pipelined else link.sync_port()
        if port:
            try:
                return link.line(port)
            except LinkError as e:
                log.warning("draft node %s: %s; synchronous sessions use its main port",
                            link.url, e)
        return link.line()

    def _first_message(self, history: list[int]) -> pb.TargetMessage:
        """The session's Open, counted as bytes sent."""
        first = protocol.target_to_pb(self.branch.open_message(history))
        n = protocol.message_bytes(first)
        self.branch.counters.bytes_up += n
        self.branch.counters.bytes_open += n
        return first

    async def _pick_link(self) -> Link | None:
        """The fastest healthy link, connecting (Hello) where needed."""
        for link in sorted(self.links, key=lambda x: x.sort_key()):
            if link.up or link.ready_to_try():
                try:
                    await link.connect()
                    return link
                except LinkError as e:
                    log.warning("draft node %s unavailable: %s", link.url, e)
        return None

    # -- a pipelined stream's messages (the line's reader thread) ----------------------

    def _delivered(self, call: _Call, sid: int, item: Delivery) -> None:
        """What the node sent on a pipelined stream: a message, its end, or why it ended."""
        call.sid = call.sid or sid
        if call.over or call.session != self.branch.session:
            return   # a failed or older session's: its stream is being released
        if isinstance(item, bytes):
            call.answered = True
            self._message(call, item)
        elif item is None:
            self._failed(call, "the draft node ended the session", reopen=False)
        elif isinstance(item, GrpcStatus):
            self._failed(call, f"{_status_name(item.code)}: {peer_text(item.message)}",
                         reopen=False)
        else:
            self._failed(call, str(item), reopen=False)

    # -- a synchronous stream: the engine thread reads and writes ----------------------

    def poll(self) -> None:
        """Take in what has arrived, without waiting: at most MAX_POLLED messages. A node
        answers each verdict once, so more waiting than that is a flood: it is dropped."""
        for _ in range(MAX_POLLED):
            call = self._call
            if call is None or call.pipelined or not self._read_sync(call, 0.0, spin=False):
                return
        self.useless(f"{MAX_POLLED} or more messages waiting in one round")

    def wait(self, left_s: float) -> None:
        call = self._call
        if call is None or call.pipelined:
            super().wait(left_s)
        else:
            self._read_sync(call, left_s)

    def _read_sync(self, call: _Call, timeout_s: float, spin: bool = True) -> bool:
        """One message of the call, waiting up to timeout_s (busy-polling across the
        answer's forecast arrival); False if none came."""
        forecast = self.forecast if spin and call.asked else None
        window = forecast.window(call.sent_at, call.asked) if forecast else None
        try:
            data = call.line.recv(call.sid, timeout_s, window)
        except TimeoutError:
            return False
        except (H2Error, GrpcStatus) as e:
            self._failed(call, str(e))
            return False
        if data is None:
            self._failed(call, "the draft node ended the session")
            return False
        now = time.monotonic()
        call.answered = True
        # The forecast learns after the next verdict is sent (post): off the critical path.
        if forecast is not None:
            call.arrived = (now, call.asked, window)
        call.asked = 0
        return self._message(call, data)

    def _message(self, call: _Call, data: bytes) -> bool:
        """A message from the node, either kind of session; False if it ended the call."""
        self.branch.counters.bytes_down += len(data) + 5
        try:
            # The common chunk decoded directly (roundcodec.py); anything else by protobuf.
            chunk = roundcodec.chunk_from_bytes(data)
            if chunk is None:
                chunk = _chunk(pb.DraftMessage.FromString(data))
            if chunk.step is not None:
                call.link.node_step = chunk.step
            self.branch.on_chunk(call.session, chunk)
        except DecodeError:
            self._failed(call, "undecodable frame: not a DraftMessage", dropped=True)
            return False
        except ProtocolError as e:
            self._failed(call, str(e), dropped=True, alone=isinstance(e, NodeFailure))
            return False
        return True

    def _learn_arrival(self, call: _Call) -> None:
        """When the last answer came: the forecast learns, the polling is counted."""
        now, asked, window = call.arrived
        call.arrived = None
        if self.forecast is not None:
            self.forecast.learn(now - call.sent_at, asked)
        if window is not None and now > window[0]:
            self.branch.counters.polled_answers += now <= window[1]
            self.branch.counters.poll_ms += 1000 * (min(now, window[1]) - window[0])

    # -- endings ---------------------------------------------------------------------

    def _failed(self, call: _Call, reason: str, dropped: bool = False,
                alone: bool = False, reopen: bool = True) -> None:
        """The call is over. A node that broke the protocol is dropped: its connection is
        closed, ending every session on it. Otherwise only a broken connection is closed
        (the next session reconnects); a call that failed alone (the node ended or
        cancelled it) is cancelled, and the sessions beside it go on. Either way the
        link backs off, once per failure however many sessions saw it. alone: the node
        failed this session alone (NodeFailure), which drops it without its connection.
        reopen: a synchronous call the node refused may open again (_reopen); not while
        detaching, nor from the reader thread."""
        with self.branch.lock:
            if call.over:
                return   # counted once, however many of its messages said so
            call.over = True
            if self._call is call:
                self._call = None
            self.branch.lock.notify_all()
        if reopen and not dropped and not call.pipelined and self._reopen(call):
            return
        alone = (alone or not dropped) and not call.line.broken()
        if alone:
            with contextlib.suppress(H2Error):
                self._release(call, closed=False)
        else:
            self._give(call)
            call.link.drop_line(call.line)
        if dropped:
            self._drop(call.link, reason, alone=alone)
        else:
            call.link.failed(reason, epoch=call.epoch, reconnect=not alone)

    def _reopen(self, call: _Call) -> bool:
        """The node's idle close crossed the call's Open after both left (the node then
        refuses the stream with its GOAWAY, or resets the connection), as _open_call's
        retry does when the Open itself fails: a call that the node never answered, on a
        connection now gone, opens again on a new one, without a failure counted. Once: a
        reopened call that fails so counts."""
        if call.answered or call.reopened or not call.line.broken() or not self.branch.active:
            return False
        self._give(call)
        call.link.drop_line(call.line)
        with self.branch.lock:
            self._reopened = self.branch.session + 1  # the one restart opens
        self.branch.restart()
        return True

    def _release(self, call: _Call, closed: bool) -> None:
        """Done with the call's stream (Line.release), and with its share of the link."""
        self._give(call)
        call.line.release(call.sid, closed)

    def _give(self, call: _Call) -> None:
        if call.counted:
            call.counted = False
            call.link.give_stream()

    def _drop(self, link: Link | None, reason: str, alone: bool = False) -> None:
        """A node that broke the protocol: disconnect it (alone: only this session) and
        back off."""
        self.branch.counters.dropped_peers += 1
        log.warning("dropping draft node %s: %s", link.url if link else "?", reason)
        if link is not None:
            link.failed(reason, hostile=True, reconnect=not alone)


def _status_name(code: int) -> str:
    try:
        return Status(code).name
    except ValueError:
        return f"status {code}"


def _chunk(msg: pb.DraftMessage) -> Chunk:
    """The chunk a message from the node holds; NodeFailure for its DraftError,
    ProtocolError for a broken peer."""
    got = protocol.draft_from_pb(msg)
    if isinstance(got, Failure):
        raise NodeFailure(f"draft node reported: {peer_text(got.message)}")
    return got
