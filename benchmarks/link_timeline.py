"""Where a synchronous round's time goes outside the drafting: timestamps on both ends.

link_overhead gives one wall figure per round (the round minus the node's
drafting, minus a raw TCP round trip), which on a loaded machine swings by
more than the link costs. This runs link_overhead with timestamps taken on
both ends of the synchronous port, and reports per round (medians, wall and
the thread's CPU) the four stretches of Python that lie on a round's critical
path besides the drafting and the round trip:

* target send: from the engine's learn() (the round's verdict known) to the
  verdict's bytes handed to the socket;
* target receive: from the chunk's bytes read off the socket to propose()
  returning the draft;
* node receive: from the verdict's bytes read off the socket to the session's
  step() (drafting starts);
* node send: from the session's chunk flush (drafting done) to the chunk's bytes
  handed to the socket.

Each stretch runs right after a wait (the node's drafting, the target's), with
the caches the model left behind, so it costs several times what the same code
costs warm. --tree PATH measures another checkout too (an older one, say;
repeatable), each in its own processes, alternating --repeat times so that all
see the same load. The timestamps come from wrappers installed in every process (a
sitecustomize.py on PYTHONPATH), so this works on a tree that lacks this file.

    python -m benchmarks.link_timeline [-k 2] [--rounds 300] [--tree PATH] [--repeat 3]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_ENV = "SPECWIRE_TIMELINE_OUT"
_FINE = "SPECWIRE_TIMELINE_FINE"
_MARKS: list[tuple[str, int, int, int]] = []  # (tag, perf_counter_ns, thread_time_ns, thread)
STRETCHES = ("target_send", "target_recv", "node_recv", "node_send")


# -- in every process of a run: the wrappers ----------------------------------------


def install() -> None:
    """Wrap the points a round passes (this tree's names or an older tree's: before the
    move to h2, and before the redesign, a0f3af0). Which tree it is is read from its files:
    an import of a module the tree lacks could reach the installed checkout's instead."""
    import specwire

    here = Path(specwire.__file__).parent
    if (here / "link").is_dir():
        from specwire.link.transport.h2 import connection as http2
        if (here / "link" / "remote.py").exists():
            from specwire.link.remote import RemoteDrafter
        else:  # the tree before the move to h2
            from specwire.link.transport.grpc_client import RemoteDrafter
        if (here / "link" / "session.py").exists():
            from specwire.link.session import DraftSession
        else:
            from specwire.link.transport.session import DraftSession
    else:  # the tree before the redesign
        from specwire.drafters.remote import RemoteDrafter
        from specwire.drafters.session import DraftSession
        from specwire.wire import http2

    _after(http2.Connection, "_recv", "recv", lambda r: r is not None)
    _after(http2.Connection, "_write" if hasattr(http2.Connection, "_write") else "_send",
           "sent")
    _before(RemoteDrafter, "learn", "learn")
    _after(RemoteDrafter, "propose", "proposed")
    _before(DraftSession, "step", "step")
    _before(DraftSession, "_flush", "flush")
    if os.environ.get(_FINE):  # more points, for a breakdown (each wrapper costs a little)
        for cls, names in ((http2.Connection, ("send_message", "recv_message", "_feed",
                                               "_write", "_pump")),
                           (RemoteDrafter, ("_tell", "_post", "_read_sync", "_on_chunk",
                                            "_usable", "_judge_answer"))):
            for name in names:
                if hasattr(cls, name):
                    _before(cls, name, f">{name}")
                    _after(cls, name, f"<{name}")
    atexit.register(_dump)
    signal.signal(signal.SIGTERM, lambda *_: (_dump(), os._exit(0)))


def _mark(tag: str) -> None:
    _MARKS.append((tag, time.perf_counter_ns(), time.thread_time_ns(), threading.get_ident()))


def _before(cls, name: str, tag: str) -> None:
    fn = getattr(cls, name)

    def wrapped(*a, **kw):
        _mark(tag)
        return fn(*a, **kw)

    setattr(cls, name, wrapped)


def _after(cls, name: str, tag: str, when=None) -> None:
    fn = getattr(cls, name)

    def wrapped(*a, **kw):
        r = fn(*a, **kw)
        if when is None or when(r):
            _mark(tag)
        return r

    setattr(cls, name, wrapped)


def _dump() -> None:
    if _MARKS:
        path = Path(os.environ[_ENV]) / f"{os.getpid()}.json"
        path.write_text(json.dumps(_MARKS))


# -- reading the marks back ----------------------------------------------------------


def stretches(marks: list[list]) -> dict[str, list[tuple[float, float]]]:
    """Per round, (wall us, CPU us) of each stretch found in one process's marks."""
    out: dict[str, list[tuple[float, float]]] = {s: [] for s in STRETCHES}
    for tid in {m[3] for m in marks}:
        seq = [m for m in marks if m[3] == tid]
        for i, (tag, *_) in enumerate(seq):
            if tag == "learn":  # target: learn .. sent, then recv .. proposed
                sent = _next(seq, i, "sent")
                done = _next(seq, i, "proposed")
                if sent is None or done is None or sent > done:
                    continue
                recv = _last(seq, done, "recv", after=sent)
                out["target_send"].append(_span(seq[i], seq[sent]))
                if recv is not None:
                    out["target_recv"].append(_span(seq[recv], seq[done]))
            elif tag == "step":  # node: recv .. step, then flush .. sent
                recv = _last(seq, i, "recv")
                if recv is not None and (prev := _last(seq, i, "step")) is not None and \
                        recv < prev:
                    recv = None  # no read since the last step: not a verdict's arrival
                flush = _next(seq, i, "flush")
                nxt = _next(seq, i, "step")
                if recv is not None:
                    out["node_recv"].append(_span(seq[recv], seq[i]))
                if flush is not None and (nxt is None or flush < nxt):
                    sent = _next(seq, flush, "sent")
                    if sent is not None and (nxt is None or sent < nxt):
                        out["node_send"].append(_span(seq[flush], seq[sent]))
    return out


def _span(a: list, b: list) -> tuple[float, float]:
    return (b[1] - a[1]) / 1000, (b[2] - a[2]) / 1000


def _next(seq: list, i: int, tag: str) -> int | None:
    return next((j for j in range(i + 1, len(seq)) if seq[j][0] == tag), None)


def _last(seq: list, i: int, tag: str, after: int = -1) -> int | None:
    return next((j for j in range(i - 1, after, -1) if seq[j][0] == tag), None)


# -- running ---------------------------------------------------------------------------


def _run(k: int, rounds: int) -> None:
    """One link_overhead run in this process (its node a child), marks on."""
    import specwire

    if (Path(specwire.__file__).parent / "bench" / "link_overhead.py").exists():
        from specwire.bench import link_overhead  # a tree from before benchmarks/
    else:
        from benchmarks import link_overhead

    r = link_overhead.measure(k, rounds)
    print(json.dumps({"beyond_ms": r["beyond_round_trip_ms"], "link_ms": r["overhead_ms"],
                      "rtt_ms": r["round_trip_ms"], "local_ms": r["local_ms"]}))


def run_tree(tree: Path, k: int, rounds: int) -> dict:
    """link_overhead with tree's specwire and the marks; the medians of each stretch."""
    with tempfile.TemporaryDirectory(prefix="specwire-timeline-") as tmp:
        site = Path(tmp) / "site"
        site.mkdir()
        (site / "sitecustomize.py").write_text(
            "import os\n"
            f"if os.environ.get({_ENV!r}):\n"
            "    import importlib.util\n"
            f"    spec = importlib.util.spec_from_file_location('_timeline', {__file__!r})\n"
            "    mod = importlib.util.module_from_spec(spec)\n"
            "    spec.loader.exec_module(mod)\n"
            "    mod.install()\n")
        out = Path(tmp) / "marks"
        out.mkdir()
        env = {**os.environ, "PYTHONPATH": f"{site}:{tree}", _ENV: str(out)}
        proc = subprocess.run([sys.executable, __file__, "--run", "-k", str(k), "--rounds",
                               str(rounds)], env=env, capture_output=True, text=True,
                              check=False)
        if proc.returncode:
            raise RuntimeError(f"{tree}: link_overhead failed:\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        found: dict[str, list[tuple[float, float]]] = {s: [] for s in STRETCHES}
        for f in out.glob("*.json"):
            for s, v in stretches(json.loads(f.read_text())).items():
                found[s] += v
    for s, v in found.items():
        v = v[5:]  # the session's first rounds: the Open, the first draft
        result[s] = (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) \
            if v else (float("nan"), float("nan"))
    result["sum_us"] = sum(result[s][0] for s in STRETCHES)
    result["sum_cpu_us"] = sum(result[s][1] for s in STRETCHES)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-k", type=int, default=2, help="draft tokens per round")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--tree", type=Path, action="append", default=[],
                   help="another specwire checkout to compare with (repeatable)")
    p.add_argument("--repeat", type=int, default=1, help="alternations")
    p.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.run:
        _run(a.k, a.rounds)
        return
    trees = [Path(__file__).resolve().parents[1], *(t.resolve() for t in a.tree)]
    print(f"k={a.k}, {a.rounds} rounds; per round, medians, wall us (CPU us): target send, "
          "target receive, node receive, node send, their sum; link_overhead's beyond the "
          "round trip")
    for i in range(a.repeat):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            load = os.getloadavg()[0]
            r = run_tree(tree, a.k, a.rounds)
            parts = "  ".join(f"{r[s][0]:6.0f} ({r[s][1]:4.0f})" for s in STRETCHES)
            print(f"{tree}: {parts}  sum {r['sum_us']:5.0f} ({r['sum_cpu_us']:4.0f})  beyond "
                  f"{r['beyond_ms']:+.2f} ms (link {r['link_ms']:.2f}, rtt {r['rtt_ms']:.2f}, "
                  f"local draft {r['local_ms']:.1f}; load {load:.1f})", flush=True)


if __name__ == "__main__":
    main()
