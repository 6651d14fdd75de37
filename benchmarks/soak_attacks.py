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

and issue 40's, against a `serve --lora --slot-save-path` over TLS with API keys:

  lora scales   a request's `lora` with hostile scales (1e5, 1e300, NaN, 1e400, a string,
                no such adapter) and POST /lora-adapters with NaN, Infinity, 1e400, an
                out-of-bound scale or a text/plain body: a 4xx is expected (with a wide
                --lora-scale-max an in-bound 1e5 request may be served or fail alone:
                a 5xx of the attacker's own request is then acceptable); the adapters'
                scales must stay as they were
  idle keep-alive  TLS connections that send one GET /health and then idle: the server
                must close each within --keep-alive (counted, with how long it took)
  slot files    saves a slot under its own API key, truncates or corrupts the file in the
                slot folder (a full disk), then restores it: a 400 is expected, and serve
                stays up
  TLS stall     TCP connections that never send a ClientHello, that send half of one, or
                that stop after it: each must be closed by --header-timeout, and a TLS
                probe meanwhile must get in

Each attacker counts what it opened and what the other side closed, so the report
shows the deadlines at work (a count of closes that stays 0 is a deadline missing).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import ssl
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

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
    except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
        return False
    except OSError:
        return True
    finally:
        sock.setblocking(True)


class Slowloris(Attacker):
    """Half-sent headers and stalled bodies against serve, a byte every `drip_s`."""

    def __init__(self, host: str, port: int, n: int = 6, drip_s: float = 3.0,
                 tls: ssl.SSLContext | None = None) -> None:
        super().__init__("slowloris", n)
        self.addr, self.drip_s, self.tls = (host, port), drip_s, tls

    def _open(self, i: int) -> socket.socket | None:
        try:
            s = socket.create_connection(self.addr, timeout=5)
            if self.tls is not None:
                s = self.tls.wrap_socket(s, server_hostname=self.addr[0])
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


# ------------------------------------------------------------------ issue 40's attackers


def self_signed(folder: Path, host: str = "127.0.0.1") -> tuple[str, str]:
    """A self-signed certificate for `host` (and localhost) and its key, as PEM files in
    `folder`: (key path, certificate path); clients verify with the certificate itself."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address(host))]),
                critical=False)
            .sign(key, hashes.SHA256()))
    key_path, cert_path = folder / "soak-key.pem", folder / "soak-cert.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def tls_client(cafile: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cafile)


def lora_shapes(model: Path, names: tuple[str, ...] = ("attn_q", "attn_v")
                ) -> tuple[str, list[tuple[str, int, int]]]:
    """A GGUF model's architecture and (tensor, n_in, n_out) of every layer's `names`."""
    from gguf import GGUFReader

    r = GGUFReader(str(model))
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    out = []
    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in names and parts[3] == "weight":
            n_in, n_out = (int(x) for x in t.shape[:2])   # ggml's ne: [n_in, n_out]
            out.append((t.name, n_in, n_out))
    return arch, out


def write_lora(model: Path, out: Path, rank: int = 4, alpha: float = 4.0,
               seed: int = 40) -> Path:
    """A LoRA adapter GGUF for `model` (any architecture: the shapes are read from it) on
    every layer's attn_q and attn_v: seeded random A and B, small (an adapter at scale 1
    nudges the model; at 1e5 its activations overflow). Written once; kept."""
    import numpy as np
    from gguf import GGUFWriter

    if out.exists():
        return out
    arch, shapes = lora_shapes(model)
    if not shapes:
        raise RuntimeError(f"{model}: no attn_q/attn_v weights to adapt")
    rng = np.random.default_rng(seed)
    tmp = out.with_name(out.name + f".{os.getpid()}.tmp")
    w = GGUFWriter(str(tmp), arch=arch)
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, n_in, n_out in shapes:
        # ggml's A is [n_in, rank] and B [rank, n_out]; numpy shapes are reversed
        a = rng.standard_normal((rank, n_in), dtype=np.float32) * n_in ** -0.5
        b = rng.standard_normal((n_out, rank), dtype=np.float32) * (0.2 * rank ** -0.5)
        w.add_tensor(f"{name}.lora_a", a)
        w.add_tensor(f"{name}.lora_b", b)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return out


def _percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    xs = sorted(xs)
    return {"p50": round(xs[len(xs) // 2], 2), "max": round(xs[-1], 2), "n": len(xs)}


class _Timed(Attacker):
    """An attacker that also times how long the server took to close its connections."""

    def __init__(self, name: str, n: int) -> None:
        super().__init__(name, n)
        self.close_s: list[float] = []

    def closed_after(self, seconds: float) -> None:
        with self._lock:
            self.counts["closed_by_server"] += 1
            self.close_s.append(seconds)

    def report(self) -> dict:
        with self._lock:
            return dict(self.counts) | {"close_s": _percentiles(self.close_s)}


def _connect(addr: tuple[str, int], source: str, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection(addr, timeout=timeout, source_address=(source, 0))


def _watch_closes(attacker: _Timed, socks: dict, give_up_s: float) -> None:
    """One pass over open connections {sock: since}: those the server closed (EOF, a reset
    or a TLS alert) are counted and timed, those held past give_up_s counted and dropped."""
    if socks:
        readable, _, _ = select.select(list(socks), [], [], 0.5)
    else:
        readable = []
    now = time.monotonic()
    for s in readable:
        try:
            data = s.recv(65536)
        except (ssl.SSLWantReadError, BlockingIOError):
            continue
        except OSError:
            data = b""
        if data == b"":
            attacker.closed_after(now - socks.pop(s))
            s.close()
    for s, since in list(socks.items()):
        if now - since > give_up_s:
            attacker.count("held_past_deadline")
            socks.pop(s)
            s.close()


class IdleKeepAlive(_Timed):
    """TLS connections from `source` that send one GET /health, read its answer and then
    idle: each must be closed by the server within --keep-alive; the count of those held
    past it (plus a margin) must stay 0. Each closed one is opened again."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext, keep_alive_s: float,
                 n: int = 16, source: str = "127.0.0.3", margin_s: float = 5.0) -> None:
        super().__init__("idle-keep-alive", n)
        self.addr, self.tls, self.source = (host, port), tls, source
        self.give_up_s = keep_alive_s + margin_s

    def _open(self) -> ssl.SSLSocket | None:
        try:
            s = self.tls.wrap_socket(_connect(self.addr, self.source),
                                     server_hostname=self.addr[0])
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("closed before the answer")
                head += chunk
            head, body = head.split(b"\r\n\r\n", 1)
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:
                chunk = s.recv(65536)
                if not chunk:
                    raise ConnectionError("closed in the answer")
                body += chunk
        except (OSError, ValueError) as e:
            self.count(f"refused_{type(e).__name__}")
            return None
        self.count("opened")
        self.count(f"answered_{head.split(b' ', 2)[1].decode(errors='replace')}")
        s.settimeout(None)
        return s

    def run(self) -> None:
        socks: dict = {}
        while not self._halt.is_set():
            while len(socks) < self.n and not self._halt.is_set():
                s = self._open()
                if s is None:
                    self._halt.wait(1.0)
                    break
                socks[s] = time.monotonic()
            _watch_closes(self, socks, self.give_up_s)
        for s in socks:
            s.close()


def client_hello() -> bytes:
    """The first flight of a TLS client: a whole ClientHello's record."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    obj = ctx.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return outgoing.read()


class TlsStall(_Timed):
    """TCP connections to the TLS port from `source`: a third never send a ClientHello, a
    third send half of one, a third send it whole and then never answer the server's
    flight. Each must be closed within --header-timeout (plus a margin: held_past_deadline
    stays 0); every few seconds a TLS probe from 127.0.0.1 asks for /health meanwhile
    (probe_ok; probe_failed must stay 0). Each closed one is opened again."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext, header_timeout_s: float,
                 n: int = 12, source: str = "127.0.0.4", margin_s: float = 5.0,
                 probe_every_s: float = 5.0) -> None:
        super().__init__("tls-stall", n)
        self.addr, self.tls, self.source = (host, port), tls, source
        self.give_up_s, self.probe_every_s = header_timeout_s + margin_s, probe_every_s
        self.hello = client_hello()

    def _open(self, i: int) -> socket.socket | None:
        mode = ("silent", "half_hello", "whole_hello")[i % 3]
        try:
            s = _connect(self.addr, self.source)
            if mode == "half_hello":
                s.sendall(self.hello[:len(self.hello) // 2])
            elif mode == "whole_hello":
                s.sendall(self.hello)
        except OSError:
            self.count("refused")
            return None
        self.count(f"opened_{mode}")
        return s

    def _probe(self) -> None:
        try:
            with httpx.Client(verify=self.tls, timeout=15) as c:
                ok = c.get(f"https://{self.addr[0]}:{self.addr[1]}/health").status_code < 500
        except httpx.HTTPError:
            ok = False
        self.count("probe_ok" if ok else "probe_failed")

    def run(self) -> None:
        socks: dict = {}
        i, probe_due = 0, time.monotonic() + self.probe_every_s
        while not self._halt.is_set():
            while len(socks) < self.n:
                s = self._open(i)
                i += 1
                if s is None:
                    self._halt.wait(1.0)
                    break
                socks[s] = time.monotonic()
            # what a server's flight sends back is drained by the watch; EOF is the close
            _watch_closes(self, socks, self.give_up_s)
            if time.monotonic() >= probe_due:
                probe_due = time.monotonic() + self.probe_every_s
                self._probe()
        for s in socks:
            s.close()


#: A request's `lora` field: hostile scales (raw bodies: NaN and 1e400 are not JSON's).
LORA_REQUESTS = {
    "scale_1e5": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 0, "scale": 1e5}]}',
    "scale_-1e5": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 0, "scale": -1e5}]}',
    "scale_1e300": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 0, "scale": 1e300}]}',
    "scale_nan": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 0, "scale": NaN}]}',
    "scale_1e400": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 0, "scale": 1e400}]}',
    "scale_str": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 0, "scale": "1e5"}]}',
    "no_adapter": b'{"prompt": "Hi", "n_predict": 4, "lora": [{"id": 7, "scale": 1}]}',
}
#: POST /lora-adapters: bodies and their Content-Type.
LORA_POSTS = {
    "nan": b'[{"id": 0, "scale": NaN}]', "inf": b'[{"id": 0, "scale": Infinity}]',
    "-inf": b'[{"id": 0, "scale": -Infinity}]', "1e400": b'[{"id": 0, "scale": 1e400}]',
    "1e5": b'[{"id": 0, "scale": 1e5}]', "text_plain": b'[{"id": 0, "scale": 1e5}]',
}


def expected_lora(case: str, status: int, scale_max: float) -> str:
    """How an answer to the LoRA attacker's `case` is counted: "refused" (a 4xx, as
    expected), "served_own" or "failed_own" (a 2xx or a 5xx of a request whose scale 1e5 a
    wide --lora-scale-max lets through: its NaN fails it alone), or "unexpected"."""
    if 400 <= status < 500:
        return "refused"
    inbound = case in ("scale_1e5", "scale_-1e5") and scale_max >= 1e5
    if inbound and status < 300:
        return "served_own"
    if inbound and status >= 500:
        return "failed_own"
    return "unexpected"


class LoraScales(Attacker):
    """A client of its own API key sending LORA_REQUESTS and LORA_POSTS in turn, one every
    `every_s`; counted by expected_lora, and the adapters' scales read back after each
    POST (scale_changed must stay 0). An in-bound POST (1e5 under a wide
    --lora-scale-max) is never sent: setting the scales is the endpoint's work."""

    def __init__(self, url: str, http: dict, scale_max: float, every_s: float = 1.0) -> None:
        super().__init__("lora-scales", 0)
        self.url, self.http, self.scale_max, self.every_s = url, http, scale_max, every_s
        self.first_unexpected: list[str] = []

    def _note(self, case: str, r: httpx.Response) -> None:
        kind = expected_lora(case, r.status_code, self.scale_max)
        self.count(kind)
        self.count(f"{case}:{r.status_code}")
        if kind == "unexpected" and len(self.first_unexpected) < 5:
            self.first_unexpected.append(f"{case} {r.status_code}: {r.text[:200]}")

    def run(self) -> None:
        cases = [("req", k, v) for k, v in LORA_REQUESTS.items()] + \
                [("post", k, v) for k, v in LORA_POSTS.items()
                 if not (k in ("1e5", "text_plain") and self.scale_max >= 1e5)]
        with httpx.Client(base_url=self.url, timeout=300, **self.http) as c:
            scales = [a.get("scale") for a in c.get("/lora-adapters").json()]
            i = 0
            while not self._halt.wait(self.every_s):
                where, case, body = cases[i % len(cases)]
                i += 1
                ctype = "text/plain" if case == "text_plain" else "application/json"
                try:
                    r = c.post("/completion" if where == "req" else "/lora-adapters",
                               content=body, headers={"Content-Type": ctype})
                    self._note(case, r)
                    if where == "post":
                        now = [a.get("scale") for a in c.get("/lora-adapters").json()]
                        if now != scales:
                            self.count("scale_changed")
                except httpx.HTTPError as e:
                    self.count(f"error_{type(e).__name__}")

    def report(self) -> dict:
        return super().report() | {"first_unexpected": self.first_unexpected}


#: How the slot-file attacker spoils its file (a full disk, a crash mid-write, a bit flip).
CORRUPTIONS = ("half", "empty", "last_byte", "flip_middle", "header_only")


def corrupt(path: Path, how: str) -> None:
    """Spoil a saved slot file in place."""
    data = path.read_bytes()
    if how == "half":
        data = data[:len(data) // 2]
    elif how == "empty":
        data = b""
    elif how == "last_byte":
        data = data[:-1]
    elif how == "flip_middle":
        i = len(data) // 2
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]
    elif how == "header_only":
        data = data[:64]
    else:
        raise ValueError(how)
    path.write_bytes(data)


class SlotFiles(Attacker):
    """With its own API key: a short request on a slot, a save of that slot, the file
    spoiled on disk (CORRUPTIONS in turn), a restore (expected: 400), then /health
    (serve up). A busy slot (409) or one holding another key's cache (403) is tried again
    on the next round. restore_not_400 and health_failed must stay 0."""

    def __init__(self, url: str, http: dict, folder: Path, n_slots: int,
                 every_s: float = 4.0) -> None:
        super().__init__("slot-files", 0)
        self.url, self.http, self.folder = url, http, folder
        self.n_slots, self.every_s = n_slots, every_s
        self.first_unexpected: list[str] = []

    def _round(self, c: httpx.Client, i: int) -> None:
        slot, name, how = i % self.n_slots, f"soak-attack-{i}.bin", CORRUPTIONS[i % 5]
        for _ in range(4):   # busy slots: the honest clients may take it back at once
            c.post("/completion", json={"prompt": f"Slot file {i}: the attacker's text",
                                        "n_predict": 2, "id_slot": slot, "cache_prompt": True})
            for _ in range(20):
                r = c.post(f"/slots/{slot}", params={"action": "save"},
                           json={"filename": name})
                if r.status_code != 409:   # busy: tried again; 403: another key's cache
                    break
                time.sleep(0.1)
            self.count(f"save:{r.status_code}")
            if r.status_code == 200:
                break
        else:
            return
        files = list(self.folder.rglob(name))
        if len(files) != 1:
            self.count("saved_file_not_found")
            return
        corrupt(files[0], how)
        self.count(f"corrupted_{how}")
        for _ in range(20):   # the slot may be busy: the restore is a 409 then
            r = c.post(f"/slots/{slot}", params={"action": "restore"},
                       json={"filename": name})
            if r.status_code != 409:
                break
            time.sleep(0.25)
        self.count(f"restore:{r.status_code}")
        if r.status_code not in (400, 409):
            self.count("restore_not_400")
            if len(self.first_unexpected) < 5:
                self.first_unexpected.append(f"{how} {r.status_code}: {r.text[:200]}")
        with contextlib.suppress(OSError):
            files[0].unlink()
        ok = c.get("/health").status_code == 200
        self.count("health_ok" if ok else "health_failed")

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=300, **self.http) as c:
            i = 0
            while not self._halt.wait(self.every_s):
                try:
                    self._round(c, i)
                except httpx.HTTPError as e:
                    self.count(f"error_{type(e).__name__}")
                i += 1

    def report(self) -> dict:
        return super().report() | {"first_unexpected": self.first_unexpected}
