"""Does the link's hand encoding pay for itself?

A question of issue 24, answered on this machine (its other one, grpcio against
h2, is answered in docs/protocol.md "One stack": both ends now speak only h2):
* sync: a synchronous round's link cost (benchmarks/link_overhead.py, the same
  node and model, the bundled pair) with roundcodec on (h2) and off on both ends
  (h2-pb), alternating `--repeat` times so that both see the same load;
* codec: link/transport/roundcodec.py's hand encoding of a round's two messages
  (a Verdict out, a DraftChunk of k tokens back) against the protobuf path it
  replaces (domain message -> protobuf object -> SerializeToString, and
  FromString -> domain message), per message, warm (in a loop) and cold (a pass
  over `--evict-mb` of memory before each call, as after a round's wait).
The load average is printed with the figures.

    python -m benchmarks.stacks [-k 4] [--rounds 60] [--repeat 2] [--codec-only]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from specwire.link.messages import Chunk, Verdict
from specwire.link.transport import protocol, roundcodec
from specwire.link.transport import specwire_pb2 as pb


def _messages(k: int) -> tuple[Verdict, Chunk]:
    """A round's two messages as the link sends them: a verdict of one token, k drafted."""
    verdict = Verdict(412, 3, [1734], gen=7, k=k)
    chunk = Chunk(7, 416, [1000 + 37 * i for i in range(k)], busy_us=5210)
    return verdict, chunk


def codec_ops(k: int) -> dict[str, tuple[Callable[[], object], Callable[[], object]]]:
    """Per operation, (hand, protobuf): the two ways the link does it."""
    verdict, chunk = _messages(k)
    vbytes = protocol.target_to_pb(verdict).SerializeToString()
    cbytes = protocol.draft_to_pb(chunk).SerializeToString()
    return {
        "verdict encode": (lambda: roundcodec.verdict_bytes(verdict),
                           lambda: protocol.target_to_pb(verdict).SerializeToString()),
        "verdict decode": (lambda: roundcodec.verdict_from_bytes(vbytes),
                           lambda: protocol.verdict_from_pb(
                               pb.TargetMessage.FromString(vbytes).verdict)),
        "chunk encode": (lambda: roundcodec.chunk_bytes(chunk),
                         lambda: protocol.draft_to_pb(chunk).SerializeToString()),
        "chunk decode": (lambda: roundcodec.chunk_from_bytes(cbytes),
                         lambda: protocol.chunk_from_pb(pb.DraftMessage.FromString(cbytes).chunk)),
    }


def _per_call_us(fn: Callable[[], object], calls: int, evict: np.ndarray | None) -> float:
    """Median microseconds of one call; with `evict`, a pass over it before each call."""
    if evict is None:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
        return 1e6 * statistics.median(times)
    times = []
    for _ in range(calls):
        evict += 1  # touches every line of it, so the call after finds the caches cold
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def codec(k: int = 4, warm_calls: int = 20000, cold_calls: int = 500,
          evict_mb: int = 64) -> dict[str, dict[str, float]]:
    """Per operation: hand and protobuf microseconds per message, warm and cold."""
    evict = np.zeros(evict_mb << 17, dtype=np.float64)  # evict_mb MiB
    out = {}
    for name, (hand, proto) in codec_ops(k).items():
        out[name] = {"hand_warm": _per_call_us(hand, warm_calls, None),
                     "pb_warm": _per_call_us(proto, warm_calls, None),
                     "hand_cold": _per_call_us(hand, cold_calls, evict),
                     "pb_cold": _per_call_us(proto, cold_calls, evict)}
    return out


_CODEC = ("verdict_bytes", "chunk_bytes", "verdict_from_bytes", "chunk_from_bytes")


@contextlib.contextmanager
def protobuf_only() -> Iterator[None]:
    """roundcodec off in this process and in the processes it starts meanwhile (through a
    sitecustomize.py on their PYTHONPATH): every message goes through protobuf."""
    saved = {n: getattr(roundcodec, n) for n in _CODEC}
    env = os.environ.get("PYTHONPATH")
    with tempfile.TemporaryDirectory(prefix="specwire-stacks-") as site:
        Path(site, "sitecustomize.py").write_text(
            "from specwire.link.transport import roundcodec\n"
            f"for _n in {_CODEC!r}:\n"
            "    setattr(roundcodec, _n, lambda *a: None)\n")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, env) if p)
        for n in _CODEC:
            setattr(roundcodec, n, lambda *a: None)
        try:
            yield
        finally:
            for n, fn in saved.items():
                setattr(roundcodec, n, fn)
            if env is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = env


def sync(k: int, rounds: int, repeat: int) -> list[dict]:
    """link_overhead's figures per run, alternating: h2, and h2 with roundcodec off
    (protobuf for every message)."""
    from benchmarks import link_overhead  # loads the models: only for this part

    runs = []
    for _ in range(repeat):
        for name, codec_on in (("h2", True), ("h2-pb", False)):
            with contextlib.nullcontext() if codec_on else protobuf_only():
                r = link_overhead.measure(k, rounds)
            assert r["stack"] == name.split("-")[0], (name, r["stack"])
            runs.append({**r, "stack": name, "load": os.getloadavg()[0]})
    return runs


def _load() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", type=int, default=4, help="draft tokens per round")
    p.add_argument("--rounds", type=int, default=60, help="synchronous rounds per run")
    p.add_argument("--repeat", type=int, default=2, help="runs per stack, alternating")
    p.add_argument("--evict-mb", type=int, default=64, help="memory passed over before a cold call")
    p.add_argument("--codec-only", action="store_true", help="only the encoding microbenchmark")
    a = p.parse_args(argv)
    if min(a.k, a.rounds, a.repeat, a.evict_mb) < 1:
        print("stacks: -k, --rounds, --repeat and --evict-mb must be at least 1", file=sys.stderr)
        return 2
    print(f"codec, k={a.k}, us per message (median), {_load()}")
    for name, r in codec(a.k, evict_mb=a.evict_mb).items():
        print(f"  {name:15s} warm: hand {r['hand_warm']:6.2f}  protobuf {r['pb_warm']:6.2f}"
              f"   cold: hand {r['hand_cold']:6.2f}  protobuf {r['pb_cold']:6.2f}")
    if a.codec_only:
        return 0
    print(f"sync rounds, k={a.k}, {a.rounds} rounds a run, medians per round in ms, {_load()}")
    for r in sync(a.k, a.rounds, a.repeat):
        print(f"  {r['stack']:6s} link {r['overhead_ms']:5.2f}"
              f"  round trip {r['round_trip_ms']:5.2f}  beyond {r['beyond_round_trip_ms']:+5.2f}"
              f"  gRPC echo {r['grpc_echo_ms']:5.2f}"
              f"  local draft {r['local_ms']:6.2f}  (load average {r['load']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
