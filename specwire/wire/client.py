"""The remote drafter: the target's side of the draft link.

It implements the engine's Drafter protocol, so the engine loop does not know
the drafter is on another machine. A background asyncio thread owns the gRPC
channel; the engine thread only reads a buffer of received draft tokens under
a lock and queues verdicts. In pipelined mode `propose` never waits: it takes
whatever checked tokens extend the committed history, possibly none, and the
engine then runs a plain decoding step. A dead, slow or hostile node therefore
costs the target at most a lock and a list slice per round.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Sequence

import grpc

from specwire.config import DraftParams, SamplingParams, VerifyMode
from specwire.drafters.base import Draft
from specwire.wire import protocol
from specwire.wire import specwire_pb2 as pb
from specwire.wire.link import Link, LinkError, LinkSettings
from specwire.wire.protocol import ProtocolError

log = logging.getLogger("specwire.remote")


class RemoteDrafter:
    """Drafts from a draft node over gRPC; pipelined or synchronous."""

    def __init__(self, links: list[Link], n_vocab: int, pipelined: bool = True,
                 lookahead: int = 0, sync_timeout_s: float = 1.0) -> None:
        if not links:
            raise ValueError("RemoteDrafter needs at least one link")
        self.links, self.n_vocab = links, n_vocab
        self.pipelined, self.lookahead = pipelined, lookahead
        self.sync_timeout_s = sync_timeout_s
        self.name = ("remote-pipelined:" if pipelined else "remote-sync:") + links[0].url
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="draft-link", daemon=True)
        self._thread.start()
        self._cv = threading.Condition()
        self._session = 0            # bumps at every open: older chunks are ignored
        self._call = None            # the live Session stream, owned by the loop
        self._out: asyncio.Queue | None = None
        self._reset_buffer()
        self._history: list[int] = []
        self._told = 0               # committed tokens the node knows
        self._sampling = SamplingParams()
        self._params = DraftParams()
        self._active = False
        self._opening = False
        self._last_open_try = 0.0
        self._late = False           # sync mode: the node missed a deadline; stop waiting
        self._want = 0
        self.counters = {"bytes_up": 0, "bytes_down": 0, "chunks": 0, "stale_chunks": 0,
                         "dropped_peers": 0, "reconnects": 0, "wait_ms": 0.0, "sync_timeouts": 0}

    # -- Drafter protocol (engine thread) -----------------------------------------

    def begin(self, prompt: Sequence[int], sampling: SamplingParams, params: DraftParams) -> None:
        self._sampling, self._params = protocol.wire_sampling(sampling), params
        self._history = list(prompt)
        self._active = True
        self._want = params.n_max
        self._late = False
        self._open_async(list(prompt))

    def propose(self, history: Sequence[int], max_n: int) -> Draft:
        self._history = history if isinstance(history, list) else list(history)
        if self._call is None:
            self._maybe_reopen()
            return Draft()
        self._tell(history, 0)          # tokens the node has not heard of (the first one)
        deadline = None if self.pipelined or self._late else time.monotonic() + self.sync_timeout_s
        t0 = time.perf_counter()
        with self._cv:
            while True:
                draft, complete = self._usable(history, max_n)
                if complete or deadline is None or self._call is None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    self.counters["sync_timeouts"] += 1
                    self._late = True
                    log.warning("draft node %s missed the %.0f ms deadline; not waiting for it "
                                "until it catches up", self.links[0].url, 1000 * self.sync_timeout_s)
                    break
                self._cv.wait(left)
        self.counters["wait_ms"] += 1000 * (time.perf_counter() - t0)
        return draft

    def learn(self, history: Sequence[int], accepted: int, appended: int) -> None:
        self._tell(history, accepted)

    def _tell(self, history: Sequence[int], accepted: int) -> None:
        """Send the verdict for history[told:]: `accepted` branch tokens, then the target's own.

        The node mirrors the branch rule itself; here nothing needs mirroring because
        `_usable` checks every buffered token against the history by content.
        """
        if self._call is None or len(history) <= self._told:
            return
        position, self._told = self._told, len(history)
        own = list(history[position + accepted:])
        with self._cv:
            self._done = False       # the node drafts again after a verdict
        v = pb.Verdict(position=position, accepted=accepted, tokens=own, gen=max(self._gen, 0),
                       want=self._want)
        self._send(pb.TargetMessage(verdict=v))

    def end(self) -> None:
        self._active = False
        self._close_async()

    def stats(self) -> dict[str, float]:
        return {k: float(v) for k, v in self.counters.items()}

    def link_state(self) -> dict[str, float]:
        """For /metrics: 1 if a link is up, per URL."""
        return {link.url: float(link.up) for link in self.links}

    def close(self) -> None:
        self._close_async()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)

    # -- the buffer of received draft tokens (under self._cv) ---------------------

    def _reset_buffer(self) -> None:
        self._gen = -1               # gen of the buffered branch
        self._dead_gen = -1          # gens up to this one disagree with the history
        self._buf_start = 0          # absolute position of _buf[0]
        self._buf: list[int] = []
        self._sparse: list | None = None
        self._done = False           # the node stopped after _buf (p_min or budget)

    def _usable(self, history: Sequence[int], max_n: int) -> tuple[Draft, bool]:
        """Tokens of the current branch that extend history; and whether to stop waiting."""
        n = len(history)
        if self._gen < 0 or self._gen <= self._dead_gen:
            return Draft(), False
        off = n - self._buf_start
        if off < 0:
            return Draft(), False
        if off > len(self._buf):      # the node is behind the history: wait for its next gen
            return Draft(), self._done
        if self._buf[:off] != list(history[self._buf_start:n]):
            self._dead_gen = self._gen
            return Draft(), False
        # Trim what the history has confirmed: the check is O(new tokens) per round.
        del self._buf[:off]
        if self._sparse is not None:
            del self._sparse[:off]
        self._buf_start = n
        tokens = self._buf[:max_n]
        sparse = None if self._sparse is None else self._sparse[:max_n]
        complete = len(tokens) >= min(max_n, self._want) or self._done
        return Draft(tokens, sparse), complete

    def _on_chunk(self, session: int, m: pb.DraftChunk) -> None:
        c = protocol.check_chunk(m, self.n_vocab, len(self._history) + 4 * protocol.MAX_CHUNK_TOKENS)
        with self._cv:
            if session != self._session:
                self.counters["stale_chunks"] += 1
                return
            self.counters["chunks"] += 1
            if c.gen < self._gen or c.gen <= self._dead_gen:
                self.counters["stale_chunks"] += 1
                return
            if c.gen > self._gen:
                self._gen, self._buf_start, self._buf = c.gen, c.start, []
                self._sparse = [] if c.sparse is not None else None
            elif c.start != self._buf_start + len(self._buf):
                raise ProtocolError(f"chunk of gen {c.gen} at {c.start}, expected "
                                    f"{self._buf_start + len(self._buf)}")
            self._buf.extend(c.tokens)
            if c.sparse is not None and self._sparse is not None:
                self._sparse.extend(c.sparse)
            self._done = c.done
            self._late = False
            self._cv.notify_all()

    # -- the link (event-loop thread) ---------------------------------------------

    def _open_async(self, history: list[int]) -> None:
        self._last_open_try = time.monotonic()
        self._opening = True
        self._told = len(history)
        with self._cv:
            self._session += 1
            self._reset_buffer()
            session = self._session
        self._detach()
        asyncio.run_coroutine_threadsafe(self._run_session(session, history), self._loop)

    def _maybe_reopen(self) -> None:
        """After a failure, reopen on the first link whose backoff has passed."""
        if not self._active or self._opening:
            return
        if any(link.ready_to_try() for link in self.links):
            self.counters["reconnects"] += 1
            self._open_async(list(self._history))

    def _close_async(self) -> None:
        with self._cv:
            self._session += 1
        self._send(pb.TargetMessage(close=pb.Close()))
        self._detach()

    def _detach(self) -> None:
        """Forget the current stream; ending its request iterator lets it finish."""
        out, self._out, self._call = self._out, None, None
        if out is not None:
            self._loop.call_soon_threadsafe(out.put_nowait, None)

    def _send(self, msg: pb.TargetMessage | None) -> None:
        out = self._out
        if out is not None:
            if msg is not None:
                self.counters["bytes_up"] += protocol.message_bytes(msg)
            self._loop.call_soon_threadsafe(out.put_nowait, msg)

    def _open_msg(self, history: list[int]) -> pb.Open:
        p, mode = self._params, self._params.mode
        if self._sampling.greedy:
            mode = VerifyMode.GREEDY
        return pb.Open(history=history, sampling=protocol.sampling_to_pb(self._sampling),
                       mode=protocol.mode_to_pb(mode), pipelined=self.pipelined,
                       lookahead=self.lookahead or 2 * max(1, p.n_max), want=self._want,
                       p_min=p.p_min, top_k_q=p.top_k_q)

    async def _run_session(self, session: int, history: list[int]) -> None:
        link, call, writer = None, None, None
        try:
            link = await self._pick_link()
            if link is None or session != self._session:
                return
            out: asyncio.Queue = asyncio.Queue()
            first = pb.TargetMessage(open=self._open_msg(history))
            self.counters["bytes_up"] += protocol.message_bytes(first)
            out.put_nowait(first)
            call = link.stub.Session(metadata=link.metadata())
            writer = asyncio.create_task(_write_all(call, out))
            self._out, self._call = out, call
            self._opening = False
            while session == self._session:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    break
                if msg is None:      # grpc could not parse the frame (and logged why)
                    raise ProtocolError("undecodable frame: not a DraftMessage")
                self.counters["bytes_down"] += protocol.message_bytes(msg)
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    self._on_chunk(session, msg.chunk)
                elif kind == "error":
                    raise ProtocolError(f"draft node reported: {msg.error.message}")
                else:
                    raise ProtocolError("draft message with neither a chunk nor an error")
        except ProtocolError as e:
            self.counters["dropped_peers"] += 1
            log.warning("dropping draft node %s: %s", link.url if link else "?", e)
            if link is not None:
                link.failed(str(e))
        except (grpc.aio.AioRpcError, LinkError, OSError) as e:
            if link is not None and session == self._session:
                link.failed(_rpc_reason(e))
        except asyncio.CancelledError:
            pass
        finally:
            if writer is not None:
                writer.cancel()
            if call is not None:
                call.cancel()
            if session == self._session:
                self._out, self._call = None, None
                self._opening = False
            with self._cv:
                self._cv.notify_all()

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
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)


def make_remote_drafter(urls: list[str], a, target) -> object:
    """Build the drafter for --draft-url flags: gRPC nodes, or a llama-server over HTTP."""
    from specwire.cliargs import CliError
    if any(u.startswith(("http://", "https://")) for u in urls):
        if len(urls) != 1:
            raise CliError("--draft-url: a llama-server URL cannot be mixed with others")
        from specwire.wire.llama_server import LlamaServerDrafter
        return LlamaServerDrafter(urls[0])
    settings = LinkSettings(token=a.draft_token, tls_ca=a.draft_tls_ca, tls_cert=a.draft_tls_cert,
                            tls_key=a.draft_tls_key)
    links = [Link(u, settings, target.vocab_fingerprint(), target.n_vocab, target.name)
             for u in urls]
    drafter = RemoteDrafter(links, target.n_vocab, pipelined=a.draft_mode == "pipelined")
    fut = asyncio.run_coroutine_threadsafe(_handshake_all(links), drafter._loop)
    errors = fut.result(timeout=30)
    fatal = [e for e in errors if e and e.startswith("incompatible")]
    if fatal:
        drafter.close()
        raise CliError(fatal[0])
    for u, e in zip(urls, errors, strict=True):
        if e:
            log.warning("draft node %s not reachable yet (%s); decoding plainly until it is", u, e)
    return drafter


async def _write_all(call, out: asyncio.Queue) -> None:
    """Forward queued messages to the stream; None half-closes it."""
    try:
        while (m := await out.get()) is not None:
            await call.write(m)
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass


async def _handshake_all(links: list[Link]) -> list[str | None]:
    out = []
    for link in links:
        try:
            await link.connect()
            out.append(None)
        except LinkError as e:
            out.append(str(e))
    return out
