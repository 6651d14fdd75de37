"""A scripted draft node for tests/link/test_hostile_peers.py: a real socket speaking HTTP/2
through h2 (not specwire's own link/transport/h2/connection.py, so the two are checked
against each other), with hooks where a script misbehaves.

`hostile_node(target, script)` starts a FakeNode (wire_helpers) for Hello, advertising a
synchronous port served here; every Session on it plays `script`:

* Script.settings: SETTINGS values the node sends raw after its own (its h2 does not apply
  them, so it never enforces what it announces);
* Script.credit: whether it credits back what it receives (False: never a WINDOW_UPDATE);
* Script.on_open / on_verdict: what to send; the default answers each message with one
  token at the position the target expects, on a fresh branch (a usable draft);
* Script.background(peer): runs on its own thread once the session opened, for floods.

Peer, what a script drives: `answer(...)`, `chunk(...)`, `raw(bytes)`, `end(trailers)`,
`reset()`, and `position`, the history length after the last verdict.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import hpack
from wire_helpers import FakeNode

from specwire.link.transport import specwire_pb2 as pb

FILLER = 0  # the token a scripted answer proposes (verified like any other)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") \
        + payload


def block(headers: list[tuple[str, str]]) -> bytes:
    """A header block that leaves HPACK's dynamic table alone (never-indexed literals)."""
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])


def message(payload: bytes) -> bytes:
    return b"\0" + len(payload).to_bytes(4, "big") + payload


class Peer:
    """One Session on the scripted port."""

    def __init__(self, sock: socket.socket, conn: h2.connection.H2Connection, sid: int,
                 lock: threading.RLock) -> None:
        self.sock, self.conn, self.sid = sock, conn, sid
        self.position = 0  # the target's history length after the last verdict
        self.gen = 0
        self.received = 0  # flow-controlled bytes the target sent on this stream
        self.lock = lock  # the connection's writes: the reader and background threads
        self.stopped = threading.Event()
        self.verdicts = 0

    def chunk(self, gen: int, start: int, tokens: list[int], **q) -> None:
        msg = pb.DraftMessage(chunk=pb.DraftChunk(gen=gen, start=start, tokens=tokens, **q))
        self.raw(frame(0, 0, self.sid, message(msg.SerializeToString())))

    def answer(self, tokens: list[int] | None = None, **q) -> None:
        """A usable answer: tokens (one FILLER by default) at the position the target
        expects, on a fresh branch."""
        self.gen += 1
        self.chunk(self.gen, self.position, tokens or [FILLER], **q)

    def raw(self, data: bytes) -> None:
        with self.lock:
            self._flush()
            self.sock.sendall(data)

    def end(self, trailers: list[tuple[str, str]]) -> None:
        self.raw(frame(1, 5, self.sid, block(trailers)))  # HEADERS, END_STREAM|END_HEADERS

    def reset(self, code: int = 8) -> None:
        self.raw(frame(3, 0, self.sid, code.to_bytes(4, "big")))

    def _flush(self) -> None:
        out = self.conn.data_to_send()
        if out:
            self.sock.sendall(out)


class Script:
    """An honest-looking node by default: one usable token per message."""

    settings: dict[int, int] = {}
    credit = True

    def on_open(self, peer: Peer, o: pb.Open) -> None:
        peer.answer()

    def on_verdict(self, peer: Peer, v: pb.Verdict) -> None:
        peer.answer()

    def background(self, peer: Peer) -> None:
        """Runs on its own thread from the Open until the session ends."""


class ScriptedPort:
    """Accepts connections and plays the script on each (a thread per connection)."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sessions = 0
        self.errors: list[str] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = h2.connection.H2Connection(h2.config.H2Configuration(
            client_side=False, header_encoding="utf-8"))
        conn.initiate_connection()
        sock.sendall(conn.data_to_send())
        if self.script.settings:
            body = b"".join(k.to_bytes(2, "big") + v.to_bytes(4, "big")
                            for k, v in self.script.settings.items())
            sock.sendall(frame(4, 0, 0, body))
        peers: dict[int, Peer] = {}
        buffers: dict[int, bytearray] = {}
        lock = threading.RLock()  # h2 and the socket: the reader and background threads
        try:
            while data := sock.recv(65536):
                with lock:
                    for event in conn.receive_data(data):
                        self._on_event(sock, conn, event, peers, buffers, lock)
                    out = conn.data_to_send()
                    if out:
                        sock.sendall(out)
        except (OSError, h2.exceptions.H2Error) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
        finally:
            for peer in peers.values():
                peer.stopped.set()
            sock.close()

    def _on_event(self, sock, conn, event, peers, buffers, lock) -> None:
        if isinstance(event, h2.events.RequestReceived):
            conn.send_headers(event.stream_id, [(":status", "200"),
                                                ("content-type", "application/grpc")])
            peers[event.stream_id] = Peer(sock, conn, event.stream_id, lock)
            buffers[event.stream_id] = bytearray()
            self.sessions += 1
        elif isinstance(event, h2.events.DataReceived) and event.stream_id in peers:
            peers[event.stream_id].received += event.flow_controlled_length
            if self.script.credit:
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            buf = buffers[event.stream_id]
            buf += event.data
            for msg in _messages(buf):
                self._on_message(peers[event.stream_id], msg)
        elif isinstance(event, h2.events.StreamReset | h2.events.StreamEnded):
            peer = peers.pop(event.stream_id, None)
            if peer is not None:
                peer.stopped.set()

    def _on_message(self, peer: Peer, data: bytes) -> None:
        m = pb.TargetMessage.FromString(data)
        kind = m.WhichOneof("kind")
        if kind == "open":
            peer.position = len(m.open.history)
            self.script.on_open(peer, m.open)
            threading.Thread(target=self.script.background, args=(peer,), daemon=True).start()
        elif kind == "verdict":
            v = m.verdict
            peer.position = v.position + v.accepted + len(v.tokens)
            peer.verdicts += 1
            self.script.on_verdict(peer, v)


def _messages(buf: bytearray) -> Iterator[bytes]:
    while len(buf) >= 5 and len(buf) >= 5 + int.from_bytes(buf[1:5], "big"):
        n = int.from_bytes(buf[1:5], "big")
        yield bytes(buf[5 : 5 + n])
        del buf[: 5 + n]


@contextlib.contextmanager
def hostile_node(target, script: Script) -> Iterator[tuple[FakeNode, ScriptedPort]]:
    """A FakeNode for Hello whose synchronous port plays `script`; its main port's
    Sessions end at once (so a target never drafts there)."""
    port = ScriptedPort(script)
    try:
        with FakeNode(target.fingerprint, target.n_vocab, scripts=[lambda o, v, s: None],
                      sync_port=port.port) as fake:
            yield fake, port
    finally:
        port.close()
