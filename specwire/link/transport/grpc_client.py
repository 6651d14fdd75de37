"""The target's transport of the draft link: gRPC streams and the synchronous port.

The branch bookkeeping lives in link/branch.py; RemoteDrafter (link/remote.py) is a
BranchDrafter carried by this transport, which only moves messages.
Each session has a thread of its own that reads the node's chunks from a
blocking gRPC stream into a buffer; the engine thread only reads that buffer
under a lock and queues verdicts (handshakes run on a background asyncio
thread). Synchronous sessions on a node with a synchronous port skip those
threads: the engine thread writes its verdict and reads the chunk itself over
link/transport/h2/connection.py, as a round has nothing to overlap with. The drafters of one
target (every slot of `serve -np N`) share its links and their connections
(link/transport/channels.py): each session is a stream of its own on them. In pipelined mode
`propose` never waits: it takes whatever checked tokens extend the committed
history, possibly none, and the engine then runs a plain decoding step. A dead,
slow or hostile node therefore costs the target at most a lock and a list slice
per round.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from specwire.link.messages import Close, Failure, TargetMessage, Verdict
from specwire.link.transport import protocol, roundcodec
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.base import Branch, Transport
from specwire.link.transport.channel import Link, LinkError
from specwire.link.transport.channels import LinkSet, SyncLine
from specwire.link.transport.h2.connection import CreditTimeout, GrpcStatus, H2Error
from specwire.link.transport.peertext import peer_text
from specwire.link.transport.protocol import ProtocolError

log = logging.getLogger("specwire.remote")

#: After our Close, how long the node has to end a pipelined session before it is cancelled.
CLOSE_GRACE_S = 2.0


class NodeFailure(ProtocolError):
    """The node ended one session with its error (a Failure message): that session is
    dropped, and the link backs off as for a broken peer, but the connection and the
    other sessions on it stay."""


#: Messages one round takes in without waiting (a late node's answers catch up in a few).
MAX_POLLED = 16


@dataclass(slots=True)
class _SyncCall:
    """A Session call on a node's synchronous port; only the engine thread touches it."""

    line: SyncLine
    sid: int
    link: Link
    epoch: int  # the link's epoch when it opened (Link.failed)
    closed: bool = False  # the Close went out with END_STREAM
    answered: bool = False  # a message of the node's came on it
    reopened: bool = False  # it opened again after its first Open crossed an idle close
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
    """The gRPC and synchronous-port transport of a BranchDrafter (link/branch.py's
    Transport): the links to the draft nodes, the live stream or synchronous call, and
    the arrival forecast; the branch's state it reads through the branch alone."""

    def __init__(self, links: list[Link] | LinkSet) -> None:
        """links: this drafter's own, or a LinkSet shared with the target's other drafters."""
        if not links:
            raise ValueError("RemoteDrafter needs at least one link")
        self.shared = links if isinstance(links, LinkSet) else LinkSet(links)
        self.shared.attach()
        self.links = self.shared.links
        self._loop = self.shared.loop
        self._call: grpc.Call | None = None  # the live Session stream
        self._call_link: Link | None = None  # its link
        self._call_epoch = 0  # its link's epoch when it opened
        self._out: queue.SimpleQueue | None = None  # its messages to send; None ends it
        self._sync: _SyncCall | None = None  # or the live call on a synchronous port
        self._closed = False
        self.forecast: ArrivalForecast | None = ArrivalForecast()  # None: never busy-poll
        self._opening = False
        self._reopened = -1  # the session that replaces a call the node refused (_reopen)

    def bind(self, branch: Branch) -> None:
        super().bind(branch)
        c = branch.counters  # the counters of this transport's own (LinkCounters)
        c.sync_port_sessions, c.polled_answers, c.poll_ms, c.stream_cap = 0, 0, 0.0, 0

    def handshake(self, timeout_s: float = 30.0) -> list[str | None]:
        """Connect every link now (Hello, and the connection its sessions use), so that the
        first request already drafts.

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
        return self._call is not None or self._sync is not None

    def post(self, message: TargetMessage) -> None:
        call = self._sync
        if call is not None:
            # A verdict's bytes written directly (roundcodec.py): no protobuf object on the
            # way from the round's end to the socket.
            verdict = isinstance(message, Verdict)
            data = roundcodec.verdict_bytes(message) if verdict else None
            if data is None:
                data = protocol.target_to_pb(message).SerializeToString()
            close = isinstance(message, Close)
            try:
                # A verdict is a few bytes: a node granting too little credit for it within
                # the round's deadline is broken (or hostile), and the round decodes plainly.
                call.line.send(call.sid, data, close, 0.0 if close else self.branch.sync_timeout_s)
            except (H2Error, TimeoutError, OSError) as e:
                self._sync_failed(call, str(e), dropped=isinstance(e, CreditTimeout))
                return
            if call.arrived is not None:
                self._learn_arrival(call)
            call.sent_at, call.asked = time.monotonic(), self.branch.k
            call.closed = close
            self.branch.counters.bytes_up += len(data) + 5
            return
        out = self._out
        if out is not None:
            msg = protocol.target_to_pb(message)
            self.branch.counters.bytes_up += protocol.message_bytes(msg)
            out.put(msg)

    def open(self, session: int, history: list[int]) -> None:
        self._opening = True
        threading.Thread(target=self._run_session, args=(session, history),
                         name="draft-session", daemon=True).start()

    def trees(self) -> bool:
        """The live stream's node said "tree" in its Hello (the synchronous port carries
        no alternates)."""
        link = self._call_link
        return (self._call is not None and link is not None and link.hello is not None
                and "tree" in link.hello.modes)

    def revive(self) -> None:
        """After a failure, reopen on the first link whose backoff has passed."""
        if not self.branch.active or self._opening:
            return
        if any(link.ready_to_try() for link in self.links):
            self.branch.counters.reconnects += 1
            self.branch.restart()

    def useful(self) -> None:
        """The current session drafted: its link's next failure starts a fresh backoff."""
        call = self._sync
        link = call.link if call is not None else self._call_link
        if link is not None:
            link.worked()

    def useless(self, reason: str) -> None:
        """A node answering verdicts with chunks that extend nothing: drop it."""
        call = self._sync
        if call is not None:
            self._sync_failed(call, reason, dropped=True)
            return
        link = self._call_link
        self.branch.invalidate()  # what its stream still delivers is ignored
        self.detach()
        if link is not None:
            self._drop(link, reason)

    def detach(self) -> None:
        """Forget the current stream; ending its request queue lets it finish, and if the
        node does not end it within CLOSE_GRACE_S it is cancelled (a node that never
        answers would hold its reading thread and its stream for ever)."""
        with self.branch.lock:
            out, self._out, stream = self._out, None, self._call
            self._call = None
            self._call_link = None
            call, self._sync = self._sync, None
        if out is not None:
            out.put(None)
        if stream is not None:
            with contextlib.suppress(RuntimeError):   # the loop is closed: so is the channel
                self._loop.call_soon_threadsafe(self._loop.call_later, CLOSE_GRACE_S,
                                                stream.cancel)
        if call is not None:
            try:
                call.line.release(call.sid, call.closed)
            except H2Error as e:
                self._sync_failed(call, str(e), reopen=False)

    # -- the synchronous port: the engine thread reads and writes ----------------------

    def _uses_sync_port(self, link: Link) -> bool:
        return not self.branch.pipelined and link.sync_port() != 0

    def _open_sync(self, link: Link, session: int, history: list[int]) -> bool:
        """Open the session on the link's synchronous port (session thread), a stream on
        the connection the target's drafters share; False if that port cannot be reached.
        The node closes a connection idle for --idle-timeout, and its close may cross our
        Open after the line looked alive (the Open then fails on a broken line): the Open
        goes once more, on a new connection, and only a second failure counts."""
        if session != self.branch.session:
            return True
        for attempt in (1, 2):
            line = self.shared.sync_line(link)
            if line is None:
                return False
            epoch = link.epoch
            try:
                sid = line.open(lambda: self._first_message(history).SerializeToString(),
                                link.settings.connect_timeout_s)
                break
            except (H2Error, TimeoutError, OSError) as e:
                if isinstance(e, CreditTimeout):  # no credit even for the Open: broken
                    self.shared.drop(line)
                    self._drop(link, str(e))
                elif line.broken():
                    self.shared.drop(line)
                    if attempt == 1:
                        continue  # it crossed the node's idle close: open on a new one
                    link.failed(str(e), epoch=epoch)
                else:
                    link.failed(str(e), epoch=epoch, reconnect=False)
                return True
        if sid is None:
            return False
        with self.branch.lock:  # a newer session may have started meanwhile: it owns the link
            if session == self.branch.session:
                self._sync, self._opening = _SyncCall(line, sid, link, epoch), False
                # a reopened call goes on with the session its first Open began
                self._sync.reopened = session == self._reopened
                self.branch.counters.sync_port_sessions += not self._sync.reopened
                return True
        with contextlib.suppress(H2Error):
            line.release(sid, closed=False)
        return True

    def poll(self) -> None:
        """Take in what has arrived, without waiting: at most MAX_POLLED messages. A node
        answers each verdict once, so more waiting than that is a flood: it is dropped."""
        for _ in range(MAX_POLLED):
            call = self._sync
            if call is None or not self._read_sync(call, 0.0, spin=False):
                return
        self.useless(f"{MAX_POLLED} or more messages waiting in one round")

    def wait(self, left_s: float) -> None:
        call = self._sync
        if call is None:
            super().wait(left_s)
        else:
            self._read_sync(call, left_s)

    def _read_sync(self, call: _SyncCall, timeout_s: float, spin: bool = True) -> bool:
        """One message of the call, waiting up to timeout_s (busy-polling across the
        answer's forecast arrival); False if none came."""
        forecast = self.forecast if spin and call.asked else None
        window = forecast.window(call.sent_at, call.asked) if forecast else None
        try:
            data = call.line.recv(call.sid, timeout_s, window)
        except TimeoutError:
            return False
        except (H2Error, GrpcStatus) as e:
            self._sync_failed(call, str(e))
            return False
        if data is None:
            self._sync_failed(call, "the draft node ended the session")
            return False
        now = time.monotonic()
        call.answered = True
        self.branch.counters.bytes_down += len(data) + 5
        # The forecast learns after the next verdict is sent (_post): off the critical path.
        if forecast is not None:
            call.arrived = (now, call.asked, window)
        call.asked = 0
        try:
            # The common chunk decoded directly (roundcodec.py); anything else by protobuf.
            chunk = roundcodec.chunk_from_bytes(data)
            if chunk is not None:
                self.branch.on_chunk(self.branch.session, chunk)
            else:
                self._take(self.branch.session, pb.DraftMessage.FromString(data))
        except DecodeError:
            self._sync_failed(call, "undecodable frame: not a DraftMessage", dropped=True)
            return False
        except ProtocolError as e:
            self._sync_failed(call, str(e), dropped=True, alone=isinstance(e, NodeFailure))
            return False
        return True

    def _learn_arrival(self, call: _SyncCall) -> None:
        """When the last answer came: the forecast learns, the polling is counted."""
        now, asked, window = call.arrived
        call.arrived = None
        if self.forecast is not None:
            self.forecast.learn(now - call.sent_at, asked)
        if window is not None and now > window[0]:
            self.branch.counters.polled_answers += now <= window[1]
            self.branch.counters.poll_ms += 1000 * (min(now, window[1]) - window[0])

    def _sync_failed(self, call: _SyncCall, reason: str, dropped: bool = False,
                     alone: bool = False, reopen: bool = True) -> None:
        """The call is over. A node that broke the protocol is dropped: its connection is
        closed, ending every session on it. Otherwise only a broken connection is closed
        (the next session reconnects); a call that failed alone (the node ended or
        cancelled it) is cancelled, and the sessions beside it go on. Either way the
        link backs off, once per failure however many sessions saw it. alone: the node
        failed this session alone (NodeFailure), which drops it without its connection.
        reopen: a call the node refused may open again (_reopen); not while detaching."""
        with self.branch.lock:
            if self._sync is call:
                self._sync = None
            self.branch.lock.notify_all()
        if reopen and not dropped and self._reopen(call):
            return
        alone = (alone or not dropped) and not call.line.broken()
        if alone:
            with contextlib.suppress(H2Error):
                call.line.release(call.sid, closed=False)
        else:
            self.shared.drop(call.line)
        if dropped:
            self._drop(call.link, reason, alone=alone)
        else:
            call.link.failed(reason, epoch=call.epoch, reconnect=not alone)

    def _reopen(self, call: _SyncCall) -> bool:
        """The node's idle close crossed the call's Open after both left (the node then
        refuses the stream with its GOAWAY, or resets the connection), as _open_sync's
        retry does when the Open itself fails: a call that the node never answered, on a
        connection now gone, opens again on a new one, without a failure counted. Once: a
        reopened call that fails so counts."""
        if call.answered or call.reopened or not call.line.broken() or not self.branch.active:
            return False
        self.shared.drop(call.line)
        with self.branch.lock:
            self._reopened = self.branch.session + 1  # the one restart opens
        self.branch.restart()
        return True

    def _run_session(self, session: int, history: list[int]) -> None:
        """One Session stream, on its own thread: send the Open, then read chunks."""
        link, call, out, epoch, taken = None, None, None, None, None
        try:
            picking = asyncio.run_coroutine_threadsafe(self._pick_link(), self._loop)
            # Every link's handshake has its own timeout; this one only guards against a
            # loop already stopped by close().
            link = picking.result(timeout=5 + sum(x.settings.connect_timeout_s
                                                  for x in self.links))
            if link is None or session != self.branch.session:
                return
            if self._uses_sync_port(link) and self._open_sync(link, session, history):
                return
            if not link.take_stream():
                self.branch.counters.stream_cap += 1
                link = None         # not this link's failure: nothing to count
                return
            taken = link
            out = queue.SimpleQueue()
            out.put(self._first_message(history))
            epoch = link.epoch
            call = link.session_stub().Session(iter(out.get, None), metadata=link.metadata())
            with self.branch.lock:  # a newer session may have started meanwhile: it owns _out then
                if session != self.branch.session:
                    return
                self._out, self._call, self._opening = out, call, False
                self._call_link, self._call_epoch = link, epoch
            for msg in call:
                if session != self.branch.session:
                    break
                self.branch.counters.bytes_down += protocol.message_bytes(msg)
                self._take(session, msg)
            else:
                if session == self.branch.session:  # the node ended a session we had not closed
                    link.failed("the draft node ended the session", epoch=epoch,
                                reconnect=False)
        except ProtocolError as e:
            self._drop(link, str(e), alone=isinstance(e, NodeFailure))
        except grpc.RpcError as e:
            if _undecodable(e):
                self._drop(link, "undecodable frame: not a DraftMessage")
            elif link is not None and session == self.branch.session:
                # Only a lost connection drops it (and so every session on it).
                link.failed(_rpc_reason(e), epoch=epoch, reconnect=_unavailable(e))
        except (LinkError, OSError, TimeoutError, ValueError) as e:  # ValueError: the
            if link is not None and session == self.branch.session:     # channel was closed
                link.failed(str(e), epoch=epoch)
        finally:
            if taken is not None:
                taken.give_stream()
            if call is not None:
                call.cancel()
            if out is not None:  # ends the request iterator: grpcio's thread that reads it
                out.put(None)    # would otherwise wait on it for ever, one per failed call
            with self.branch.lock:
                if session == self.branch.session:
                    self._out, self._call, self._opening = None, None, False
                    self._call_link = None
            self.branch.wake()

    def _take(self, session: int, msg: pb.DraftMessage) -> None:
        """A message from the node, either transport; ProtocolError for a broken peer."""
        got = protocol.draft_from_pb(msg)
        if isinstance(got, Failure):
            raise NodeFailure(f"draft node reported: {peer_text(got.message)}")
        self.branch.on_chunk(session, got)

    def _first_message(self, history: list[int]) -> pb.TargetMessage:
        """The session's Open, counted as bytes sent."""
        first = protocol.target_to_pb(self.branch.open_message(history))
        n = protocol.message_bytes(first)
        self.branch.counters.bytes_up += n
        self.branch.counters.bytes_open += n
        return first

    def _drop(self, link: Link | None, reason: str, alone: bool = False) -> None:
        """A node that broke the protocol: disconnect it (alone: only this session) and
        back off."""
        self.branch.counters.dropped_peers += 1
        log.warning("dropping draft node %s: %s", link.url if link else "?", reason)
        if link is not None:
            link.failed(reason, hostile=True, reconnect=not alone)

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


def _rpc_reason(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError | grpc.Call):
        return f"{e.code().name}: {peer_text(e.details())}"
    return peer_text(e)


def _unavailable(e: grpc.RpcError) -> bool:
    """The call failed with its connection (the node is gone or unreachable)."""
    return isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.UNAVAILABLE


def _undecodable(e: grpc.RpcError) -> bool:
    """grpcio ends a blocking call whose response it could not parse with INTERNAL."""
    return (isinstance(e, grpc.Call) and e.code() == grpc.StatusCode.INTERNAL
            and "deserializ" in (e.details() or "").lower())
