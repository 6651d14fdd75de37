"""What the draft link itself costs per synchronous round, beyond the round trip.

End-to-end benchmarks on a shared 2-core machine vary by about 10% between
runs, which hides a cost of a millisecond. This measures it directly, over
loopback with no emulated delay: a RemoteDrafter in sync mode drafts k tokens
per round on a draft node that reports how long it worked on each chunk
(DraftChunk.busy_us). The target's round time minus that is the link's cost:
serialisation, checks, gRPC and every thread hand-off on both sides.

Two echoes in the same rounds, each held on the far side as long as the round's
drafting took (an idle core wakes up slower, so the hold matters), put it in
proportion:
* the round trip itself: a raw TCP ping-pong with a bare echo process, the
  least any transport pays between two processes of this machine;
* the node's gRPC Ping echo: one gRPC message exchange on the link's own
  connection (link/transport/h2/ at both ends), held as long.
The same draft model drafting in this process gives each round its hold.

As on two machines, this process and the node keep to disjoint halves of the
CPUs (bench/cpus.py); --shared-cpus measures them sharing every CPU instead.

    python -m benchmarks.link_overhead [-k 4] [--rounds 60] [--shared-cpus] [--no-poll]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specwire.assets import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.bench import cpus
from specwire.bench.modes import DraftNode
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.link.remote import RemoteDrafter
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import Link, LinkSettings

PROMPT = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"


def measure(k: int, rounds: int, port: int = 0, split: bool = True, poll: bool = True,
            node_args: tuple[str, ...] = ()) -> dict:
    """node_args: more `specwire draft` flags."""
    halves = cpus.halves() if split else None
    with cpus.pinned(halves[0] if halves else None):
        r = _measure(k, rounds, port, halves[1] if halves else None, poll, node_args)
    return {**r, "cpus": "split" if halves else "shared"}


def _measure(k: int, rounds: int, port: int, node_cpus: set[int] | None,
             poll: bool, node_args: tuple[str, ...] = ()) -> dict[str, float]:
    draft_path = str(models.default_draft())
    target = LlamaBackend(ModelParams(str(models.default_target()), n_ctx=1024))
    dparams = ModelParams(draft_path, n_ctx=1024)
    local = ModelDrafter(LlamaBackend(dparams, load_model(dparams)))
    argv = [sys.executable, "-m", "specwire", "draft", "-m", draft_path, "--port", str(port),
            "-c", "1024", "-td", "1", *node_args]
    with DraftNode(argv, _log_path(), node_cpus) as node, _TcpEcho(node_cpus) as tcp:
        url = node.start()
        link = Link(url, LinkSettings(), target.vocab_fingerprint(), target.n_vocab, target.name)
        remote = RemoteDrafter([link], target.n_vocab, pipelined=False, sync_timeout_s=5.0,
                               timing=True, poll=poll)
        try:
            remote.handshake()
            pinger = _Pinger(link)
            try:
                r = _alternate(target, local, remote, {"ping": pinger, "tcp": tcp}, k, rounds)
            finally:
                pinger.close()
            return {**r, "stack": "h2"}   # both ends: link/transport/h2/
        finally:
            remote.close()


class _TcpEcho:
    """A bare echo process (`--echo-server`) on the node's CPUs, over raw TCP."""

    def __init__(self, cpu_set: set[int] | None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.link_overhead", "--echo-server"],
            stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        if cpu_set is not None:
            cpus.pin_process(cpu_set, self._proc.pid)
        port = int(self._proc.stdout.readline())
        self._sock = socket.create_connection(("127.0.0.1", port))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __call__(self, hold_s: float) -> float:
        """Seconds from sending to the echo, minus the hold."""
        t0 = time.perf_counter()
        self._sock.sendall(int(hold_s * 1e6).to_bytes(4, "little"))
        if len(self._sock.recv(4, socket.MSG_WAITALL)) != 4:
            raise OSError("tcp echo: short reply")
        return time.perf_counter() - t0 - hold_s

    def __enter__(self) -> _TcpEcho:
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
        self._proc.wait(timeout=5)


def _echo_server() -> None:
    """Answer each 4-byte hold (microseconds) after spinning that long."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while len(msg := conn.recv(4, socket.MSG_WAITALL)) == 4:
            until = time.perf_counter() + int.from_bytes(msg, "little") / 1e6
            while time.perf_counter() < until:
                pass
            conn.sendall(msg)


class _Pinger:
    """One Ping stream on the link's connection: send a ping held hold_s on the node, wait
    for its pong."""

    def __init__(self, link: Link) -> None:
        self._line = line = link.line()
        with line.lock:
            self._sid = line.conn.request(protocol.PING_PATH, line.authority, link.metadata(),
                                          "http")
        self._seq = 0

    def __call__(self, hold_s: float) -> float:
        """Seconds from sending to the pong, minus the hold."""
        self._seq += 1
        t0 = time.perf_counter()
        ping = pb.PingMessage(seq=self._seq, hold_us=int(hold_s * 1e6))
        self._line.send(self._sid, ping.SerializeToString(), False, 10.0)
        data = self._line.recv(self._sid, 10.0)
        assert data is not None and pb.Pong.FromString(data).seq == self._seq
        return time.perf_counter() - t0 - hold_s

    def close(self) -> None:
        self._line.release(self._sid, closed=False)


def _alternate(target, local, remote, echoes, k: int, rounds: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0.0)
    dp = DraftParams(n_max=k, p_min=0.0)
    history = target.tokenize(PROMPT)
    for d in (local, remote):
        d.begin(history, sp, dp)
    times: dict[str, list[float]] = {n: [] for n in ("local", "remote", "link", "ping", "tcp")}
    filler = target.tokenize(" x", add_special=False)[0]
    drafts = {name: d.propose(history, k) for name, d in (("local", local), ("remote", remote))}
    for _ in range(rounds):
        # A target token that differs from the draft: both restart after it, same work.
        own = filler if drafts["local"].tokens[0] != filler else filler + 1
        history = [*history, own]
        busy_ms = remote.counters.node_busy_ms
        for name, d in (("local", local), ("remote", remote)):
            # One synchronous round as the engine sees it: verdict out, next draft in.
            t0 = time.perf_counter()
            d.learn(history, 0, 1)
            drafts[name] = d.propose(history, k)
            times[name].append(time.perf_counter() - t0)
            assert len(drafts[name]) == k, (name, len(drafts[name]))
        busy_s = (remote.counters.node_busy_ms - busy_ms) / 1000
        times["link"].append(times["remote"][-1] - busy_s)
        for name, echo in echoes.items():
            times[name].append(echo(times["local"][-1]))
    echoes["ping"].close()
    for d in (local, remote):
        d.end()
    med = {n: 1000 * statistics.median(v) for n, v in times.items()}
    polled = remote.counters.polled_answers / rounds
    return {"k": k, "rounds": rounds, "polled": polled,
            "poll_ms": remote.counters.poll_ms / rounds,
            "local_ms": med["local"], "remote_sync_ms": med["remote"],
            "overhead_ms": med["link"], "round_trip_ms": med["tcp"],
            "beyond_round_trip_ms": med["link"] - med["tcp"], "grpc_echo_ms": med["ping"],
            "specwire_ms": med["link"] - med["ping"]}


def _log_path() -> Path:
    return Path(tempfile.mkdtemp(prefix="specwire-link-")) / "draft-node.log"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--shared-cpus", action="store_true",
                   help="let this process and the node share every CPU")
    p.add_argument("--no-poll", action="store_true",
                   help="the target sleeps until each draft arrives (as --draft-no-poll)")
    p.add_argument("--echo-server", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.echo_server:
        _echo_server()
        return
    r = measure(a.k, a.rounds, split=not a.shared_cpus, poll=not a.no_poll)
    print(f"k={r['k']}, {r['rounds']} rounds, CPUs {r['cpus']}, medians per round: local draft "
          f"{r['local_ms']:.2f} ms, remote sync {r['remote_sync_ms']:.2f} ms (loopback)\n"
          f"  link (remote round - node's drafting) {r['overhead_ms']:.2f} ms = round trip "
          f"itself (raw TCP ping-pong) {r['round_trip_ms']:.2f} ms + beyond it "
          f"{r['beyond_round_trip_ms']:+.2f} ms\n"
          f"  gRPC echo {r['grpc_echo_ms']:.2f} ms; the link beyond it {r['specwire_ms']:+.2f} ms\n"
          f"  answers that came while the target polled: {100 * r['polled']:.0f}%, polling "
          f"{r['poll_ms']:.2f} ms a round")


if __name__ == "__main__":
    main()
