"""Fixtures and helpers for the draft link end to end: tests/link/test_wire_*.py,
tests/invariance/test_wire_invariance.py and the tests that start a real node.

Its fixtures (`*_fixture`, registered under the names in quotes for every test by
conftest.py's pytest_plugins):

* "target": the bundled F32 target (-c 1024, one thread), one per test module,
  with `plain(...)`, a cache of plain decoding references on it;
* "node": `python -m specwire draft` on the bundled Q2_K draft (-td 1) as a
  subprocess on a free port; tests may SIGKILL and restart it on the same
  port, and every use re-checks that it is up;
* `NodeProcess` for nodes with their own flags (token, TLS), always stopped;
* `FakeNode`: an in-process grpc.aio DraftNode whose Session plays a script,
  for feeding the target frames no real node would send;
* small drivers: a RemoteDrafter on a URL, a generation run to the end under a
  deadline, polling.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import bundled
import grpc
import numpy as np
import pytest
import specwire_pb2_grpc as pbg

from specwire.backend.llama import LlamaBackend
from specwire.bench.netemu import LinkEmulator
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.engine.engine import Engine, Generation, Request
from specwire.link.remote import RemoteDrafter
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import Link, LinkSettings

ROOT = Path(__file__).resolve().parents[2]
N_CTX = 1024
GREEDY = SamplingParams(temperature=0.0)
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1234)
CODE = ("def total(xs):\n    s = 0\n    for x in xs:\n        s += x\n    return s\n\n"
        "# The same function with type hints:\ndef")
PROSE = "The three primary colours of light are"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(cond: Callable[[], bool], timeout: float, what: str, step: float = 0.01) -> None:
    """Poll cond until true; fail the test naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(step)


# ------------------------------------------------------------------------------ the target


class Target:
    """The target backend plus cached plain-decoding references."""

    def __init__(self) -> None:
        self.path = str(bundled.target())
        self.backend = LlamaBackend(ModelParams(self.path, n_ctx=N_CTX, n_threads=1))
        self.n_vocab = self.backend.n_vocab
        self.fingerprint = self.backend.vocab_fingerprint()
        self._plain: dict[tuple, list[int]] = {}

    def tokens(self, text: str) -> list[int]:
        return self.backend.tokenize(text)

    def twin(self) -> LlamaBackend:
        """A second context (its own KV cache) over the same weights."""
        return LlamaBackend(ModelParams(self.path, n_ctx=N_CTX, n_threads=1), self.backend.model)

    def plain(self, prompt: Sequence[int], sampling: SamplingParams, n: int) -> list[int]:
        """Plain target decoding (no drafter): the reference every drafted run must equal."""
        key = (tuple(prompt), sampling, n)
        if key not in self._plain:
            longer = [v for k, v in self._plain.items() if k[:2] == key[:2] and k[2] >= n]
            if longer:   # plain decoding of n tokens is a prefix of a longer one
                self._plain[key] = longer[0][:n]
            else:
                req = Request(list(prompt), n, sampling, DraftParams(enabled=False))
                self._plain[key] = Engine(self.backend).generate(req).run()
        return self._plain[key]

    def link(self, url: str, settings: LinkSettings | None = None) -> Link:
        return Link(url, settings or LinkSettings(), self.fingerprint, self.n_vocab,
                    self.backend.name)

    def drafter(self, url: str, pipelined: bool = True, settings: LinkSettings | None = None,
                **kw) -> RemoteDrafter:
        """A drafter whose link already said Hello, as `specwire serve` builds it: a test
        that asserts drafts were accepted must not race the handshake (TLS on a slow
        machine can outlast a short generation)."""
        rd = RemoteDrafter([self.link(url, settings)], self.n_vocab, pipelined=pipelined, **kw)
        rd.handshake()
        return rd


@pytest.fixture(scope="module", name="target")
def target_fixture() -> Target:
    return Target()


def request(prompt: Sequence[int], n: int, sampling: SamplingParams, n_max: int = 8,
            **draft) -> Request:
    return Request(list(prompt), n, sampling, DraftParams(n_max=n_max, **draft))


def settled(remote, wait_s: float = 2.0) -> Callable[[Generation], None]:
    """An on_step for run_to_end that lets each round wait (wait_s at most) for a pipelined
    drafter's lookahead to come in: on a loaded machine (CI's two workers) the target
    would otherwise verify every round before the node's draft arrives, and a test about
    verified drafts would see none. Tokens do not depend on it: only what is verified."""
    def settle(_: Generation) -> None:
        deadline = time.monotonic() + wait_s
        while not remote.received.done and time.monotonic() < deadline:
            time.sleep(0.002)
    return settle


def run_to_end(gen: Generation, timeout: float = 120.0,
               on_step: Callable[[Generation], None] | None = None) -> list[int]:
    """Drive a generation on this thread; fail if it takes longer than timeout seconds.

    The engine loop is synchronous, so a hang inside it cannot be interrupted:
    the deadline is checked between rounds, and a round stuck on the drafter
    is exactly what the link's design forbids (tests then hang visibly).
    """
    deadline = time.monotonic() + timeout
    for _ in gen:
        if on_step is not None:
            on_step(gen)
        if time.monotonic() > deadline:
            gen.close()
            pytest.fail(f"generation still running after {timeout:.0f} s")
    return gen.tokens


# ------------------------------------------------------------------------------ draft nodes


def draft_model_path() -> str:
    from specwire.assets import models
    return str(models.default_draft(progress=False))


class NodeProcess:
    """`python -m specwire draft` on one port; start() again after kill() reuses it."""

    def __init__(self, log_dir: Path, args: Sequence[str] = (), port: int | None = None,
                 name: str = "node") -> None:
        self.port = port or free_port()
        # The synchronous port stays the same across restarts, like --port.
        self.sync_port = 0 if "--no-sync-port" in args else free_port()
        self.args = list(args)
        self.log_path = Path(log_dir) / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 120.0) -> NodeProcess:
        cmd = [sys.executable, "-m", "specwire", "draft", "-m", draft_model_path(),
               "--host", "127.0.0.1", "--port", str(self.port), "-td", "1", "-c", str(N_CTX),
               *(["--sync-port", str(self.sync_port)] if self.sync_port else []), *self.args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("SPECWIRE_TOKEN", None)
        seen = len(self.log())   # the log is appended to across restarts: this start's part
        log = open(self.log_path, "a")  # noqa: SIM115 - the child owns it
        with log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        banner = f"listening on 127.0.0.1:{self.port}"
        while banner not in self.log()[seen:]:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"draft node did not start ({cmd}):\n{self.log()[-3000:]}")
            time.sleep(0.05)
        return self

    def emulator(self) -> LinkEmulator:
        """A link emulator in front of both its ports; the target dials 127.0.0.2:emu.port."""
        return LinkEmulator("127.0.0.1", self.port, listen_host="127.0.0.2",
                            extra_ports=(self.sync_port,) if self.sync_port else ())

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL: no goodbye, sockets reset by the kernel."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


@contextlib.contextmanager
def node_process(log_dir: Path, args: Sequence[str] = (), name: str = "node"
                 ) -> Iterator[NodeProcess]:
    node = NodeProcess(log_dir, args, name=name)
    try:
        yield node.start()
    finally:
        node.stop()


@pytest.fixture(scope="module", name="node_proc")
def node_proc_fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    node = NodeProcess(tmp_path_factory.mktemp("draft-node"))
    try:
        yield node.start()
    finally:
        node.stop()


@pytest.fixture(name="node")
def node_fixture(node_proc: NodeProcess) -> NodeProcess:
    """The shared draft node, restarted if an earlier test left it dead."""
    if not node_proc.alive:
        node_proc.start()
    return node_proc


# ------------------------------------------------------------------------------ fake node


Frame = pb.DraftMessage | bytes
#: script(open_msg, verdict_or_None, state) -> frames to send now; state is a dict per session.
Script = Callable[[pb.Open, pb.Verdict | None, dict], list[Frame]]


class FakeNode(pbg.DraftNodeServicer):
    """An in-process DraftNode (grpc.aio, own thread) whose sessions play scripts.

    Hello answers with the given fingerprint (the target's, unless a test wants
    an incompatible node) and advertises sync_port. Session k plays scripts[k]
    (the last one repeats): its frames after the Open and after every verdict, or
    None to end the session there. A frame given as bytes goes on the wire as it is, unparsed.
    """

    def __init__(self, fingerprint: str, n_vocab: int, model: str = "fake-draft.gguf",
                 scripts: Sequence[Script] = (),
                 protocol_version: int = protocol.PROTOCOL_VERSION, sync_port: int = 0) -> None:
        self.fingerprint, self.n_vocab, self.model = fingerprint, n_vocab, model
        self.sync_port = sync_port  # advertised in Hello
        self.protocol_version = protocol_version
        self.scripts = list(scripts)
        self.sessions: list[dict] = []     # per session: script index, frames sent, ended
        self.hellos = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fake-node",
                                        daemon=True)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> FakeNode:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(0), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        handlers = {
            "Hello": grpc.unary_unary_rpc_method_handler(
                self.Hello, request_deserializer=pb.HelloRequest.FromString,
                response_serializer=pb.HelloReply.SerializeToString),
            "Session": grpc.stream_stream_rpc_method_handler(
                self.Session, request_deserializer=pb.TargetMessage.FromString,
                response_serializer=_raw_or_serialized),
        }
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("specwire.v1.DraftNode", handlers),))
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def Hello(self, request: pb.HelloRequest, context) -> pb.HelloReply:  # noqa: N802
        self.hellos += 1
        return pb.HelloReply(protocol_version=self.protocol_version,
                             vocab_fingerprint=self.fingerprint, n_vocab=self.n_vocab,
                             draft_model=self.model, modes=["greedy", "coupled", "rejection"],
                             n_ctx=N_CTX, max_sessions=8, sync_port=self.sync_port)

    async def Session(self, request_iterator, context):  # noqa: N802
        index = min(len(self.sessions), len(self.scripts) - 1)
        record = {"script": index, "sent": 0, "ended": False, "verdicts": 0}
        self.sessions.append(record)
        script, state, open_msg = self.scripts[index], {}, None
        try:
            async for m in request_iterator:
                kind = m.WhichOneof("kind")
                if kind == "open":
                    open_msg = m.open
                    frames = script(open_msg, None, state)
                elif kind == "verdict" and open_msg is not None:
                    record["verdicts"] += 1
                    frames = script(open_msg, m.verdict, state)
                else:
                    break
                if frames is None:         # the script ends the session
                    break
                for f in frames:
                    yield f
                    record["sent"] += 1
        finally:
            record["ended"] = True


def _raw_or_serialized(frame: Frame) -> bytes:
    return frame if isinstance(frame, bytes) else frame.SerializeToString()


def chunk(gen: int = 0, start: int = 0, tokens: Sequence[int] = (), done: bool = False,
          **q) -> pb.DraftMessage:
    return pb.DraftMessage(chunk=pb.DraftChunk(gen=gen, start=start, tokens=list(tokens),
                                               done=done, **q))


def error(message: str) -> pb.DraftMessage:
    return pb.DraftMessage(error=pb.DraftError(message=message))


# ------------------------------------------------------------------------------ certificates


def make_certs(folder: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1/localhost, a client certificate from the
    CA and a rogue client certificate from another CA; PEM files, paths by name."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    paths: dict[str, str] = {}

    def save(name: str, data: bytes) -> None:
        path = folder / f"{name}.pem"
        path.write_bytes(data)
        paths[name] = str(path)

    def save_key(name: str, key) -> None:
        save(name, key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()))

    def issue(cn: str, key, issuer: x509.Name, issuer_key, ca: bool = False,
              server: bool = False) -> x509.Certificate:
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        b = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            b = b.add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        elif server:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
                                critical=False)
        else:
            b = b.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]),
                                critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def pem(c: x509.Certificate) -> bytes:
        return c.public_bytes(serialization.Encoding.PEM)

    for ca_name, prefix in (("specwire test CA", ""), ("rogue CA", "rogue_")):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name)])
        ca_cert = issue(ca_name, ca_key, ca_subject, ca_key, ca=True)
        save(f"{prefix}ca", pem(ca_cert))
        if not prefix:
            server_key = ec.generate_private_key(ec.SECP256R1())
            save("server_cert", pem(issue("localhost", server_key, ca_subject, ca_key,
                                          server=True)))
            save_key("server_key", server_key)
        client_key = ec.generate_private_key(ec.SECP256R1())
        save(f"{prefix}client_cert", pem(issue(f"{prefix}target", client_key, ca_subject,
                                               ca_key)))
        save_key(f"{prefix}client_key", client_key)
    return paths


def ref(target, sampling, n: int, prompt: str = CODE) -> list[int]:
    """Plain decoding of the first n tokens (computed once for 32, or n if more, and cut)."""
    return target.plain(target.tokens(prompt), sampling, max(32, n))[:n]


class RawSession:
    """A Session stream driven by hand with the synchronous grpc client."""

    def __init__(self, stub: pbg.DraftNodeStub, metadata=()) -> None:
        self._q: queue.Queue = queue.Queue()
        self.call = stub.Session(iter(self._q.get, None), metadata=metadata, timeout=60)

    def send(self, **kind) -> None:
        self._q.put(pb.TargetMessage(**kind))

    def until_error(self) -> tuple[list[pb.DraftChunk], str]:
        """Chunks received, then the DraftError's message; the stream must then end."""
        chunks = []
        for msg in self.call:
            if msg.WhichOneof("kind") == "error":
                rest = list(self.call)        # ends (status OK) instead of going on
                assert rest == [] and self.call.code() == grpc.StatusCode.OK
                return chunks, msg.error.message
            chunks.append(msg.chunk)
        pytest.fail(f"stream ended without a DraftError after {len(chunks)} chunks")

    def answer(self) -> list[pb.DraftChunk]:
        """The chunk answering the Open or a verdict: a synchronous session sends one."""
        for msg in self.call:
            assert msg.WhichOneof("kind") == "chunk", msg
            return [msg.chunk]
        pytest.fail("stream ended before an answer")

    def close(self) -> None:
        self._q.put(None)
        self.call.cancel()


def _sync_open(history: list[int], want: int = 2, **kw) -> pb.Open:
    kw = {"mode": pb.VERIFY_GREEDY, "lookahead": 8, **kw}
    return pb.Open(history=history, sampling=protocol.sampling_to_pb(GREEDY), pipelined=False,
                   want=want, **kw)


def _random_chunk(rng: random.Random, n_vocab: int) -> pb.DraftChunk:
    """Mostly plausible, often subtly broken: each field drawn from good and bad values."""
    n = rng.choice([0, 1, 2, 5, 40, 300])
    def tok() -> int:
        return rng.choice([rng.randrange(n_vocab), -rng.randrange(1, 2**31),
                           rng.randrange(n_vocab, 2**31), 0, n_vocab - 1])
    tokens = [rng.randrange(n_vocab) for _ in range(n)]
    if rng.random() < 0.3 and tokens:
        tokens[rng.randrange(n)] = tok()
    m = pb.DraftChunk(gen=rng.randrange(2**32), start=rng.choice(
        [0, 100, 990, 2**31, 2**32 - 1, rng.randrange(1000)]), tokens=tokens,
        done=rng.random() < 0.5)
    if rng.random() < 0.5 and n <= 5:
        k = rng.choice([0, 1, 2, 3, 300])
        for t in tokens:
            ids = [t] + [rng.randrange(n_vocab) for _ in range(max(0, k - 1))]
            p = np.random.default_rng(rng.randrange(2**32)).dirichlet(np.ones(max(1, k)))
            probs = p.tolist()[:len(ids)]
            if rng.random() < 0.2:
                ids[rng.randrange(len(ids))] = tok()
            if rng.random() < 0.2:
                probs[rng.randrange(len(probs))] = rng.choice([math.nan, -0.1, 2.0, math.inf])
            if rng.random() < 0.1:
                ids = ids[:-1]
            m.q_ids.extend(ids)
            m.q_probs.extend(probs)
        m.q_k = k
    return m
