"""What the draft link itself costs per synchronous round, beyond the round trip.

End-to-end benchmarks on a shared 2-core machine vary by about 10% between
runs, which hides a cost of a millisecond. This measures it directly: the same
draft model drafts the same k tokens after the same history, once in this
process (ModelDrafter) and once on a draft node over loopback gRPC in sync
mode, rounds alternating so that machine noise hits both alike. The difference
of the medians is the link's overhead per round (serialisation, gRPC, thread
hand-offs); loopback adds no emulated delay.

A third measurement in the same rounds splits that overhead: the node's Ping
echo, held on the node as long as a local draft takes, is the least that one
gRPC message exchange costs after that much idle time (grpcio's own threads
waking up). What remains is specwire's: checks, buffers and its thread hand-offs.

    python -m specwire.bench.link_overhead [-k 4] [--rounds 60]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from specwire import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.bench.modes import DraftNode
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.drafters.model import ModelDrafter
from specwire.wire import specwire_pb2 as pb
from specwire.wire import specwire_pb2_grpc as pbg
from specwire.wire.client import RemoteDrafter
from specwire.wire.link import Link, LinkSettings

PROMPT = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n"


def measure(k: int, rounds: int, port: int = 0) -> dict[str, float]:
    draft_path = str(models.default_draft())
    target = LlamaBackend(ModelParams(str(models.default_target()), n_ctx=1024))
    dparams = ModelParams(draft_path, n_ctx=1024)
    local = ModelDrafter(LlamaBackend(dparams, load_model(dparams)))
    argv = [sys.executable, "-m", "specwire", "draft", "-m", draft_path, "--port", str(port),
            "-c", "1024", "-td", "1"]
    with DraftNode(argv, _log_path()) as node:
        url = node.start()
        link = Link(url, LinkSettings(), target.vocab_fingerprint(), target.n_vocab, target.name)
        remote = RemoteDrafter([link], target.n_vocab, pipelined=False, sync_timeout_s=5.0)
        try:
            with grpc.insecure_channel(url) as channel:
                return _alternate(target, local, remote, _Pinger(channel), k, rounds)
        finally:
            remote.close()


class _Pinger:
    """One Ping stream: send a ping held hold_s on the node, wait for its pong."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._sent: queue.SimpleQueue = queue.SimpleQueue()
        self._replies = pbg.DraftNodeStub(channel).Ping(iter(self._sent.get, None))
        self._seq = 0

    def __call__(self, hold_s: float) -> float:
        """Seconds from sending to the pong, minus the hold."""
        self._seq += 1
        t0 = time.perf_counter()
        self._sent.put(pb.PingMessage(seq=self._seq, hold_us=int(hold_s * 1e6)))
        pong = next(self._replies)
        assert pong.seq == self._seq
        return time.perf_counter() - t0 - hold_s

    def close(self) -> None:
        self._sent.put(None)


def _alternate(target, local, remote, ping, k: int, rounds: int) -> dict[str, float]:
    sp = SamplingParams(temperature=0.0)
    dp = DraftParams(n_max=k, p_min=0.0)
    history = target.tokenize(PROMPT)
    for d in (local, remote):
        d.begin(history, sp, dp)
    times: dict[str, list[float]] = {"local": [], "remote": [], "ping": []}
    filler = target.tokenize(" x", add_special=False)[0]
    drafts = {name: d.propose(history, k) for name, d in (("local", local), ("remote", remote))}
    for _ in range(rounds):
        # A target token that differs from the draft: both restart after it, same work.
        own = filler if drafts["local"].tokens[0] != filler else filler + 1
        history = [*history, own]
        for name, d in (("local", local), ("remote", remote)):
            # One synchronous round as the engine sees it: verdict out, next draft in.
            t0 = time.perf_counter()
            d.learn(history, 0, 1)
            drafts[name] = d.propose(history, k)
            times[name].append(time.perf_counter() - t0)
            assert len(drafts[name]) == k, (name, len(drafts[name]))
        times["ping"].append(ping(times["local"][-1]))
    ping.close()
    for d in (local, remote):
        d.end()
    med = {n: 1000 * statistics.median(v) for n, v in times.items()}
    overhead = med["remote"] - med["local"]
    return {"k": k, "rounds": rounds, "local_ms": med["local"], "remote_sync_ms": med["remote"],
            "overhead_ms": overhead, "grpc_echo_ms": med["ping"],
            "specwire_ms": overhead - med["ping"]}


def _log_path() -> Path:
    return Path(tempfile.mkdtemp(prefix="specwire-link-")) / "draft-node.log"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--rounds", type=int, default=60)
    a = p.parse_args()
    r = measure(a.k, a.rounds)
    print(f"k={r['k']}, {r['rounds']} rounds: local draft {r['local_ms']:.2f} ms, remote sync "
          f"{r['remote_sync_ms']:.2f} ms (loopback), "
          f"link overhead {r['overhead_ms']:+.2f} ms/round: gRPC echo after as long busy "
          f"{r['grpc_echo_ms']:.2f} ms, specwire's own {r['specwire_ms']:+.2f} ms")


if __name__ == "__main__":
    main()
