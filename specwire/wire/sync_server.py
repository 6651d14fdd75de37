"""The draft node's synchronous port: Session calls served on the connection's own thread.

A synchronous round is one verdict in and one chunk out, and its cost is the
target's wait. grpcio's server hands each message between its poller and a
handler thread; here the thread that owns a connection reads the verdict,
drafts and writes the chunk (wire/http2.py says why that matters). It speaks
the same gRPC as the main port, so any gRPC client can use it, and it serves
only synchronous Session calls (DraftNodeService.serve_sync), one at a time per
connection (it advertises MAX_CONCURRENT_STREAMS 1). Pipelined sessions, Hello
and Ping stay on the main port, where several streams share a connection.

Its deadlines are the main port's: a connection must start a call within
HANDSHAKE_TIMEOUT_S, a call must send its Open as soon, a connection with no
call for `idle_s` is closed with a GOAWAY (the main port's
grpc.max_connection_idle_ms; `specwire draft --idle-timeout`), and a session
whose target sends nothing for `session_idle_s` ends. A target that finds its
connection closed opens a new one for its next session without failing it.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
from collections.abc import Iterator

import grpc
from google.protobuf.message import DecodeError

from specwire.draftlink.messages import Chunk, DraftMessage, Verdict
from specwire.wire import protocol, roundcodec
from specwire.wire import specwire_pb2 as pb
from specwire.wire.http2 import Connection, H2Error, Stream
from specwire.wire.protocol import ProtocolError

log = logging.getLogger("specwire.node")

HANDSHAKE_TIMEOUT_S = 10.0


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _Context:
    """What DraftNodeService.Session asks of grpcio's ServicerContext."""

    def __init__(self, stream: Stream, peer: str) -> None:
        self._metadata = tuple((k, v) for k, v in stream.headers if not k.startswith(":"))
        self._peer = peer

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return self._peer

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)


class SyncServer:
    """Listens on its own port; one thread per connection, connections bounded."""

    def __init__(self, service, host: str, port: int, tls: ssl.SSLContext | None,
                 max_connections: int, idle_s: float, session_idle_s: float) -> None:
        self.service, self.tls = service, tls
        self.idle_s, self.session_idle_s = idle_s, session_idle_s
        self._sock = socket.create_server((host, port), reuse_port=False)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._thread = threading.Thread(target=self._accept, name="sync-accept", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._sock.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, addr = self._sock.accept()
            except OSError:
                return  # closed
            if not self._slots.acquire(blocking=False):
                log.warning("refused connection from %s:%d on the sync port: too many", *addr[:2])
                sock.close()
                continue
            threading.Thread(target=self._serve, args=(sock, f"{addr[0]}:{addr[1]}"),
                             name="sync-conn", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        conn, served = None, 0
        try:
            if self.tls is not None:
                sock.settimeout(HANDSHAKE_TIMEOUT_S)
                sock = self.tls.wrap_socket(sock, server_side=True)
            conn = Connection(sock, client=False, max_message=protocol.MAX_MESSAGE_BYTES,
                              max_streams=1)
            conn.handshake(HANDSHAKE_TIMEOUT_S)
            # The first call comes soon or the connection closes; one refused for its token
            # closes it: only a target that was let in may keep a connection idle.
            while (stream := conn.next_request(
                    self.idle_s if served else HANDSHAKE_TIMEOUT_S)) is not None:
                if self._call(conn, stream, peer) == grpc.StatusCode.UNAUTHENTICATED:
                    break
                served += 1
        except TimeoutError:
            if served:
                log.info("sync connection from %s closed: idle for %g s", peer, self.idle_s)
            else:
                log.warning("sync connection from %s closed: no call within %g s", peer,
                            HANDSHAKE_TIMEOUT_S)
        except (H2Error, OSError) as e:  # OSError covers TLS errors
            log.warning("sync connection from %s closed: %s", peer, e)
        finally:
            if conn is not None:
                conn.close()
            else:
                sock.close()
            self._slots.release()

    def _call(self, conn: Connection, stream: Stream, peer: str) -> grpc.StatusCode | None:
        """One Session call; H2Error out of here ends the connection. The code it was
        aborted with, if it was."""
        headers = dict(stream.headers)
        if headers.get(":path") != protocol.SESSION_PATH:
            conn.finish(stream.sid, grpc.StatusCode.UNIMPLEMENTED.value[0],
                        f"this port serves only synchronous {protocol.SESSION_PATH} calls",
                        headers_sent=False)
            return
        if not headers.get("content-type", "").startswith("application/grpc") or \
                headers.get("grpc-encoding", "identity") != "identity":
            conn.finish(stream.sid, grpc.StatusCode.UNIMPLEMENTED.value[0],
                        "expected content-type application/grpc without compression",
                        headers_sent=False)
            return
        sent = False

        def send(msg: DraftMessage) -> None:
            nonlocal sent
            if stream.reset is not None:
                return  # the target cancelled the call (its request ended): nobody listens
            if not sent:
                conn.respond(stream.sid)
                sent = True
            # A plain chunk's bytes written directly (roundcodec.py), anything else by protobuf.
            data = roundcodec.chunk_bytes(msg) if isinstance(msg, Chunk) else None
            if data is None:
                data = protocol.draft_to_pb(msg).SerializeToString()
            conn.send_message(stream.sid, data)

        try:
            self.service.serve_sync(_requests(conn, stream, self.session_idle_s), send,
                                    _Context(stream, peer))
        except _Abort as e:
            conn.finish(stream.sid, e.code.value[0], e.details, headers_sent=sent)
            return e.code
        if stream.reset is None:
            conn.finish(stream.sid, 0, headers_sent=sent)
        return None


def _requests(conn: Connection, stream: Stream,
              idle_s: float) -> Iterator[pb.TargetMessage | Verdict]:
    """The call's messages, until the target ends it (or cancels it: a RST_STREAM ends the
    session as a Close would, and the connection goes on); the first (the Open) within
    the handshake deadline, as an admitted call holds one of the node's session slots,
    each next one within idle_s. A verdict in its common encoding comes decoded
    (roundcodec.py), everything else as protobuf."""
    data = _next(conn, stream, HANDSHAKE_TIMEOUT_S, "no Open")
    while data is not None:
        msg = roundcodec.verdict_from_bytes(data)
        if msg is None:
            try:
                msg = pb.TargetMessage.FromString(data)
            except DecodeError:
                raise ProtocolError("undecodable frame: not a TargetMessage") from None
        yield msg
        data = _next(conn, stream, idle_s, "the target sent nothing")


def _next(conn: Connection, stream: Stream, timeout_s: float, silent: str) -> bytes | None:
    """The stream's next message; None once the target ended or cancelled the call."""
    try:
        return conn.recv_message(stream.sid, timeout_s)
    except TimeoutError:
        raise ProtocolError(f"{silent} for {timeout_s:g} s") from None
    except H2Error:
        if stream.reset is not None:
            return None
        raise


def tls_context(cert: str, key: str | None, client_ca: str | None) -> ssl.SSLContext:
    """TLS as the main port serves it, with HTTP/2 negotiated by ALPN as gRPC requires."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key or cert)
    ctx.set_alpn_protocols(["h2"])
    if client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(client_ca)
    return ctx
