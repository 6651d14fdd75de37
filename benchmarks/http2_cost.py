"""CPU that link/transport/h2/connection.py spends per synchronous round, both ends in this process.

link_overhead measures a whole round against a real node, in wall time, which on
a shared machine swings by more than the HTTP/2 layer costs. This isolates that
layer: a client Connection and a server Connection on the two ends of a local
socket pair, each on its own thread, exchange `rounds` message pairs the size of
a verdict (20 bytes) and of a chunk of k=4 tokens (40 bytes). It reports the
CPU time of the process per round (both ends: framing, HPACK-free DATA, flow
control, the checks), which load on the other CPUs hardly changes, and the
median wall time of a round for reference.

--tree PATH measures another checkout's link/transport/h2/connection.py too (an older one, say),
each in its own process, alternating --repeat times, so that both see the same
load; this file runs as a script there, so that tree need not have it.

    python -m benchmarks.http2_cost [--rounds 5000] [--tree PATH [--repeat 3]]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from specwire.link.transport.h2.connection import Connection

VERDICT, CHUNK = b"v" * 20, b"c" * 40
PATH = "/specwire.v1.DraftNode/Session"


def measure(rounds: int) -> dict[str, float]:
    a, b = socket.socketpair()
    client = Connection(a, client=True, max_message=1 << 20)
    server = Connection(b, client=False, max_message=1 << 20, max_streams=1)
    served = threading.Thread(target=_echo, args=(server,), daemon=True)
    served.start()
    client.handshake(5)
    sid = client.request(PATH, "localhost", (), "http")
    walls = []
    cpu0 = time.process_time()
    for _ in range(rounds):
        t0 = time.perf_counter()
        client.send_message(sid, VERDICT)
        if client.recv_message(sid, 5) != CHUNK:
            raise RuntimeError("echo: wrong answer")
        walls.append(time.perf_counter() - t0)
    cpu = time.process_time() - cpu0
    client.end_stream(sid)
    client.recv_message(sid, 5)
    client.close()
    served.join(5)
    return {"rounds": rounds, "cpu_us_per_round": 1e6 * cpu / rounds,
            "wall_us_median": 1e6 * statistics.median(walls)}


def _echo(conn: Connection) -> None:
    conn.handshake(5)
    stream = conn.next_request(5)
    if stream is None:
        return
    conn.respond(stream.sid)
    while conn.recv_message(stream.sid, 5) is not None:
        conn.send_message(stream.sid, CHUNK)
    conn.finish(stream.sid)
    conn.close()


def _in(tree: Path, rounds: int) -> tuple[float, float]:
    """CPU and wall per round with tree's specwire, in a process of its own."""
    out = subprocess.run([sys.executable, __file__, "--rounds", str(rounds)], check=True,
                         env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                         text=True).stdout.split()
    return float(out[out.index("CPU") + 1]), float(out[out.index("median") + 1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5000)
    p.add_argument("--tree", type=Path, help="another specwire checkout to compare with")
    p.add_argument("--repeat", type=int, default=3, help="alternations with --tree")
    a = p.parse_args()
    if a.tree is None:
        r = measure(a.rounds)
        print(f"{r['rounds']} rounds: CPU {r['cpu_us_per_round']:.1f} us per round (both "
              f"ends), wall median {r['wall_us_median']:.1f} us")
        return
    trees = [Path(__file__).resolve().parents[1], a.tree.resolve()]
    runs: dict[Path, list[tuple[float, float]]] = {t: [] for t in trees}
    for _ in range(a.repeat):
        for tree in trees:
            runs[tree].append(_in(tree, a.rounds))
    for tree, rs in runs.items():
        cpu = ", ".join(f"{c:.1f}" for c, _ in rs)
        print(f"{tree}: CPU per round (both ends) {cpu} us; wall median "
              f"{statistics.median(w for _, w in rs):.1f} us")


if __name__ == "__main__":
    main()
