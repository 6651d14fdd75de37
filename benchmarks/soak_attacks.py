"""The soak's attackers (benchmarks/soak.py --attackers): what issue 23's review sent,
running beside the honest clients for the whole soak.

  slowloris     connections to `serve` that send half a request line and headers, one
                byte every few seconds, or a body of a promised megabyte that never
                comes; each one the server closes is opened again
  silent peers  connections to the draft node's sync port that send nothing, and
                Session calls on its main port that never send their Open; each one
                the node ends is opened again
  silent node   a second `serve` drafting through a node that greets and accepts every
                call, then never answers; a client of its own sends it greedy requests
  constraints   (a client kind in soak.py) json_schema and GBNF bodies past
                llama.cpp's limits: a 400 is expected

Each attacker counts what it opened and what the other side closed, so the report
shows the deadlines at work (a count of closes that stays 0 is a deadline missing).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections import Counter

from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.h2.connection import Connection, GrpcStatus, H2Error
from specwire.link.transport.h2.grpcframe import Status
from specwire.link.transport.h2.server import H2Server
from specwire.link.transport.protocol import ProtocolError

#: Bodies whose constraint llama.cpp could not take (the segfaults of issue 23).
CONSTRAINT_BODIES = [
    json.dumps({"prompt": "Name:", "n_predict": 8,
                "json_schema": {"type": "string", "maxLength": 30000}}).encode(),
    json.dumps({"prompt": "Name:", "n_predict": 8,
                "json_schema": {"type": "string", "maxLength": 10**7}}).encode(),
    json.dumps({"prompt": "x", "n_predict": 4,
                "json_schema": {"type": "string", "pattern": "^a{0,30000}$"}}).encode(),
    json.dumps({"prompt": "x", "n_predict": 4,
                "grammar": "root ::= " + "(" * 60000 + '"a"' + ")" * 60000}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "array", "maxItems": 100000}}}}).encode(),
]


class Attacker(threading.Thread):
    """A thread that keeps `n` hostile connections open until stopped."""

    def __init__(self, name: str, n: int) -> None:
        super().__init__(name=f"soak-attack-{name}", daemon=True)
        self.n, self.counts = n, Counter()
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def stop(self) -> None:
        self._halt.set()

    def report(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def _closed(sock: socket.socket) -> bool:
    """Without waiting: whether the peer closed (or reset) this connection."""
    sock.setblocking(False)
    try:
        return sock.recv(4096) == b""   # an answer (a 408) without EOF: not yet closed
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


class Slowloris(Attacker):
    """Half-sent headers and stalled bodies against serve, a byte every `drip_s`."""

    def __init__(self, host: str, port: int, n: int = 6, drip_s: float = 3.0) -> None:
        super().__init__("slowloris", n)
        self.addr, self.drip_s = (host, port), drip_s

    def _open(self, i: int) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=5)
        except OSError:
            self.count("refused")
            return None
        if i % 2:   # a body promised and stalled after a few bytes
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                      b"application/json\r\nContent-Length: 1000000\r\n\r\n{\"prompt\": \"")
        else:       # headers that never end
            s.sendall(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        self.count("opened")
        return s

    def run(self) -> None:
        socks = [self._open(i) for i in range(self.n)]
        while not self._halt.wait(self.drip_s):
            for i, s in enumerate(socks):
                if s is not None and _closed(s):
                    self.count("closed_by_server")
                    s.close()
                    s = None
                if s is None:
                    socks[i] = self._open(i)
                    continue
                with contextlib.suppress(OSError):
                    s.sendall(b"x" if i % 2 else b"X")
        for s in socks:
            if s is not None:
                s.close()


class SilentPeers(Attacker):
    """Idle connections to the node's sync port and Session calls without an Open on its
    main port; each that the node ends is opened again."""

    def __init__(self, host: str, main_port: int, sync_port: int, n: int = 4) -> None:
        super().__init__("silent-peers", n)
        self.host, self.main_port, self.sync_port = host, main_port, sync_port

    def _sync(self) -> socket.socket | None:
        try:
            s = socket.create_connection((self.host, self.sync_port), timeout=5)
        except OSError:
            self.count("sync_refused")   # the node is down (restarting) or full
            return None
        self.count("sync_opened")
        return s

    def _silent_call(self) -> None:
        """One Session without an Open, on its own thread until the node ends it."""
        def hold() -> None:
            try:
                sock = socket.create_connection((self.host, self.main_port), timeout=5)
                conn = Connection(sock, client=True, max_message=1 << 20)
                conn.handshake(5)
                sid = conn.request(protocol.SESSION_PATH, f"{self.host}:{self.main_port}", (),
                                   "http")
            except (OSError, H2Error, TimeoutError):
                self.count("main_refused")
                return
            self.count("main_opened")
            try:
                while conn.recv_message(sid, 120.0) is not None:
                    pass
                self.count("main_ended_by_node")
            except GrpcStatus:
                self.count("main_ended_by_node")   # DEADLINE_EXCEEDED: no Open in time
            except (H2Error, TimeoutError) as e:
                self.count(f"main_{type(e).__name__}")
            finally:
                conn.close()

        threading.Thread(target=hold, name="soak-silent-call", daemon=True).start()

    def run(self) -> None:
        socks = [self._sync() for _ in range(self.n)]
        calls_due = 0.0
        while not self._halt.wait(2.0):
            for i, s in enumerate(socks):
                if s is not None and _closed(s):
                    self.count("sync_closed_by_node")
                    s.close()
                    s = None
                if s is None:
                    socks[i] = self._sync()
            if time.monotonic() >= calls_due:   # one silent call at a time, every 15 s
                calls_due = time.monotonic() + 15.0
                self._silent_call()
        for s in socks:
            if s is not None:
                s.close()


def proc_figures(pid: int) -> dict[str, float]:
    """Threads, open descriptors and resident MB of a process, from /proc."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("Threads:"):
                out["threads"] = float(line.split()[1])
            elif line.startswith("VmRSS:"):
                out["rss_mb"] = round(float(line.split()[1]) / 1024, 1)
    with contextlib.suppress(OSError):
        out["fds"] = float(len(os.listdir(f"/proc/{pid}/fd")))
    return out


def proc_names(pid: int) -> dict[str, dict[str, int]]:
    """A process's threads by name (/proc/PID/task/*/comm) and its descriptors by kind
    (the readlink of /proc/PID/fd/*, a socket's or a pipe's inode left out), counted:
    two readings that differ name what was made and not released between them."""
    threads: Counter = Counter()
    fds: Counter = Counter()
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{tid}/comm") as f:
                threads[f.read().strip()] += 1
    sockets = _tcp_sockets(pid)
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    fds[sockets.get(link[8:-1], "socket")] += 1
                else:
                    fds[link.split(":[", 1)[0] if ":[" in link else link] += 1
    return {"threads": dict(sorted(threads.items())), "fds": dict(sorted(fds.items()))}


_TCP_STATES = {"01": "established", "06": "time-wait", "07": "close", "08": "close-wait",
               "0A": "listen"}


def _tcp_sockets(pid: int) -> dict[str, str]:
    """inode -> "tcp listen :PORT", "tcp in :PORT STATE" (accepted on a port the process
    listens on), "tcp out :PORT STATE" (connected to PORT) or "unix [PATH]", from
    /proc/PID/net/tcp, tcp6 and unix."""
    rows = []
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/net/{name}") as f:
            rows += [line.split() for line in list(f)[1:]]
    listening = {int(r[1].rsplit(":", 1)[1], 16) for r in rows if r[3] == "0A"}
    out = {}
    with contextlib.suppress(OSError), open(f"/proc/{pid}/net/unix") as f:
        for line in list(f)[1:]:
            parts = line.split()
            if len(parts) >= 7:
                out[parts[6]] = f"unix {parts[7]}" if len(parts) > 7 else "unix"
    for r in rows:
        local, remote = int(r[1].rsplit(":", 1)[1], 16), int(r[2].rsplit(":", 1)[1], 16)
        state = _TCP_STATES.get(r[3], r[3])
        if r[3] == "0A":
            out[r[9]] = f"tcp listen :{local}"
        elif local in listening:
            out[r[9]] = f"tcp in :{local} {state}"
        else:
            out[r[9]] = f"tcp out :{remote} {state}"
    return out


def names_differ(start: dict[str, dict[str, int]],
                 end: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """What end holds more or fewer of than start, per thread name and descriptor kind."""
    out: dict[str, dict[str, int]] = {}
    for part in ("threads", "fds", "python_threads"):
        a, b = Counter(start.get(part, {})), Counter(end.get(part, {}))
        diff = {k: b[k] - a[k] for k in sorted(set(a) | set(b)) if b[k] != a[k]}
        if diff:
            out[part] = diff
    return out


def node_hello(host: str, port: int) -> pb.HelloReply:
    """The real node's HelloReply, for a silent node to greet with."""
    sock = socket.create_connection((host, port), timeout=10)
    conn = Connection(sock, client=True, max_message=protocol.MAX_MESSAGE_BYTES)
    try:
        conn.handshake(10)
        sid = conn.request(protocol.HELLO_PATH, f"{host}:{port}", (), "http")
        req = pb.HelloRequest(protocol_version=protocol.PROTOCOL_VERSION)
        conn.send_message(sid, req.SerializeToString(), end_stream=True, timeout_s=10)
        data = conn.recv_message(sid, 10)
        if data is None:
            raise RuntimeError(f"{host}:{port} ended Hello without a reply")
        return pb.HelloReply.FromString(data)
    finally:
        conn.close()


class _Greet:
    """Hello: the real node's reply, its synchronous port left out (sessions go to the
    main port, where they are held)."""

    idle_s = None

    def __init__(self, reply: pb.HelloReply, send) -> None:
        self.reply, self.send, self.status = reply, send, (Status.OK, "")

    def take(self, data: bytes | ProtocolError) -> bool:
        self.send(self.reply.SerializeToString())
        return False

    def end(self) -> None:
        pass


class _Hold:
    """A Session or Ping taken and never answered, until the target ends it."""

    idle_s = None

    def __init__(self, node: SilentNode) -> None:
        self.node, self.status = node, (Status.OK, "")
        node.count("calls_opened")

    def take(self, data: bytes | ProtocolError) -> bool:
        return not isinstance(data, ProtocolError)

    def end(self) -> None:
        self.node.count("calls_ended_by_target")


class SilentNode(Attacker):
    """A draft node that greets as the real one and accepts every call, then never
    answers: a target attached to it must end each call itself (its deadlines,
    keepalive and cancel after Close) and decode plainly, holding nothing after."""

    def __init__(self, reply: pb.HelloReply) -> None:
        super().__init__("silent-node", 0)
        reply = pb.HelloReply.FromString(reply.SerializeToString())
        reply.sync_port = 0
        self.server = H2Server(self._start, "127.0.0.1", 0, None, max_connections=64,
                               idle_s=3600.0, session_idle_s=3600.0, max_streams=64,
                               name="silent-node")
        self.port, self._reply = self.server.port, reply

    def _start(self, path: str, send, context):
        if path == protocol.HELLO_PATH:
            self.count("hellos")
            return _Greet(self._reply, send)
        return _Hold(self)

    def run(self) -> None:
        self.server.start()
        self._halt.wait()
        self.server.stop()
