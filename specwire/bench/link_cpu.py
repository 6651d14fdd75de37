"""The CPU that the synchronous link's HTTP/2 layer spends per round, on each end.

bench/link_overhead measures the link in wall time, which only a quiet machine
can: on a loaded one the scheduler's delays dwarf the link's own costs. This
counts CPU time instead (time.thread_time of the one thread on each end that
reads and writes), which other processes' load hardly changes: a client and a
server (wire/http2.Connection, in two processes) exchange a verdict-sized and
a chunk-sized gRPC message per round over loopback, and each end reports its
CPU per round. --tree runs the same exchange with the wire/http2.py of another
checkout of specwire too (an older one, say), alternating, so that both are
measured under the same load.

    python -m specwire.bench.link_cpu [--rounds 3000] [--repeat 3] [--tree PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

UP, DOWN = b"v" * 16, b"d" * 40  # a verdict and a two-token chunk, about


def _serve() -> None:
    """The server end: answer each message with DOWN, then report CPU per round."""
    from specwire.wire.http2 import Connection

    with socket.create_server(("127.0.0.1", 0)) as listener:
        print(listener.getsockname()[1], flush=True)
        sock, _ = listener.accept()
    conn = Connection(sock, client=False, max_message=1 << 20, max_streams=1)
    conn.handshake(10)
    stream = conn.next_request(10)
    conn.respond(stream.sid)
    n, started = 0, None
    while conn.recv_message(stream.sid, 30) is not None:
        if started is None:  # the first round is warm-up
            started = time.thread_time()
        else:
            n += 1
        conn.send_message(stream.sid, DOWN)
    cpu = time.thread_time() - (started or 0.0)
    conn.finish(stream.sid)
    conn.close()
    print(f"{1e6 * cpu / max(n, 1):.2f}", flush=True)


def _client(rounds: int) -> None:
    """The client end, against a server it starts: prints client and server CPU per round
    (microseconds) and the median round's wall time."""
    from specwire.wire.http2 import Connection

    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE,
                              text=True)
    port = int(server.stdout.readline())
    conn = Connection(socket.create_connection(("127.0.0.1", port)), client=True,
                      max_message=1 << 20)
    conn.handshake(10)
    sid = conn.request("/bench.Link/Round", f"127.0.0.1:{port}", (), "http")
    conn.send_message(sid, UP)
    conn.recv_message(sid, 10)
    walls = []
    cpu = time.thread_time()
    for _ in range(rounds):
        t0 = time.perf_counter()
        conn.send_message(sid, UP, timeout_s=5.0)
        if conn.recv_message(sid, 5.0) != DOWN:
            raise RuntimeError("the server answered something else")
        walls.append(time.perf_counter() - t0)
    cpu = time.thread_time() - cpu
    conn.end_stream(sid)
    conn.recv_message(sid, 10)
    conn.close()
    server_cpu = float(server.stdout.readline())
    server.wait(10)
    print(f"{1e6 * cpu / rounds:.2f} {server_cpu} {1e6 * statistics.median(walls):.1f}")


def _run(tree: Path, rounds: int) -> tuple[float, float, float]:
    """One exchange with tree's specwire (this file runs as a script: an older tree need
    not have it)."""
    out = subprocess.run([sys.executable, __file__, "--client", "--rounds", str(rounds)],
                         env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
                         text=True, check=True)
    client, server, wall = map(float, out.stdout.split())
    return client, server, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3000)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tree", type=Path, help="another specwire checkout to compare with")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.serve:
        return _serve()
    if a.client:
        return _client(a.rounds)
    here = Path(__file__).resolve().parents[2]
    trees = [here] + ([a.tree.resolve()] if a.tree else [])
    results: dict[Path, list[tuple[float, float, float]]] = {t: [] for t in trees}
    for _ in range(a.repeat):
        for tree in trees:
            results[tree].append(_run(tree, a.rounds))
    print(f"{a.rounds} rounds x {a.repeat}, medians; CPU per round in us (thread time), "
          "wall per round in us (loopback)")
    for tree, rs in results.items():
        client, server, wall = (statistics.median(x) for x in zip(*rs, strict=True))
        print(f"  {tree}: client {client:.1f}, server {server:.1f}, both {client + server:.1f};"
              f" wall {wall:.0f}")


if __name__ == "__main__":
    main()
