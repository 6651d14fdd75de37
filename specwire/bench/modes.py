"""The drafter behind each benchmark mode, and what it needs around it.

MODES names them (plain is the reference every speedup is measured against). The draft
node runs as a separate process (`python -m specwire draft`), as on another machine, so
its threads are not ours and a crash shows as a dead link. A LinkEmulator sits between
the target and it, set to RTT/2 each way per configuration, and each configuration gets
its own Link and RemoteDrafter, because a Link's channel belongs to the event loop of the
drafter that made it. Unless --shared-cpus, the node and this process keep to disjoint
halves of the CPUs, as two machines would (bench/cpus.py says why).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specwire.bench import cpus
from specwire.bench.netemu import LinkEmulator
from specwire.bench.runner import RunParams
from specwire.config import ConfigError
from specwire.settings import BenchSettings

MODES = ("plain", "local", "local-pipelined", "remote-sync", "remote-pipelined", "remote-chains",
         "ngram",
         "ngram-classic", "random", "llama-server", "hybrid", "hybrid-pipelined")
REMOTE_MODES = ("remote-sync", "remote-pipelined", "remote-chains", "llama-server",
                "hybrid-pipelined")
#: Modes that run the draft model (and so need its speed for the plan prediction).
MODEL_MODES = ("local", "local-pipelined", "remote-sync", "remote-pipelined", "remote-chains",
               "hybrid",
               "hybrid-pipelined")
NODE_START_TIMEOUT_S = 180.0
_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_SYNC_PORT = re.compile(r"synchronous sessions on \S+:(\d+)")


def parse_modes(text: str) -> list[str]:
    """'plain,local' -> ['plain', 'local'], refusing unknown names; order kept, no repeats."""
    modes: list[str] = []
    for m in (s.strip() for s in text.split(",")):
        if not m:
            continue
        if m not in MODES:
            raise ConfigError(f"--modes: unknown mode {m!r}; known: {', '.join(MODES)}")
        if m not in modes:
            modes.append(m)
    if not modes:
        raise ConfigError("--modes: no mode given")
    return modes


# --------------------------------------------------------------------------- draft node


class DraftNode:
    """`python -m specwire draft` as a child process, stopped however bench ends.

    Its output goes to a log file (not a pipe that could fill and block it);
    start() polls that file for the "listening on HOST:PORT" line.
    """

    def __init__(self, argv: list[str], log_path: Path, cpu_set: set[int] | None = None) -> None:
        self.argv, self.log_path, self.cpu_set = argv, log_path, cpu_set
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.sync_port = 0  # its synchronous port, 0 if none

    def start(self, timeout_s: float = NODE_START_TIMEOUT_S) -> str:
        """Start and wait until it listens; return HOST:PORT. ConfigError with its log if not."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        if self.cpu_set is not None:
            cpus.pin_process(self.cpu_set, self.proc.pid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self._log_text()
            m = _LISTENING.search(text)
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                sync = _SYNC_PORT.search(text)
                self.sync_port = int(sync.group(1)) if sync else 0
                return self.address
            if self.proc.poll() is not None:
                raise ConfigError(f"the draft node exited with status {self.proc.returncode} "
                               f"before listening; its log ({self.log_path}):\n{self._tail()}")
            time.sleep(0.05)
        self.stop()
        raise ConfigError(f"the draft node did not listen within {timeout_s:.0f} s; "
                       f"its log ({self.log_path}):\n{self._tail()}")

    def stop(self) -> None:
        """Terminate, then kill if it lingers. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    def __enter__(self) -> DraftNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def _tail(self, n: int = 20) -> str:
        return "\n".join(self._log_text().splitlines()[-n:]) or "(empty)"


def node_argv(flags: tuple[str, ...], draft_path: str) -> list[str]:
    """The draft node's command line: the local draft's model, threads and context (flags,
    built by the command), and no conversation memory (--cache-ram 0), so that a prompt
    run in several configurations finds an empty cache in each, as the local draft does."""
    return [sys.executable, "-m", "specwire", "draft", "-m", draft_path,
            "--host", "127.0.0.1", "--port", "0", "--max-sessions", "2", "--cache-ram", "0",
            *flags]


# --------------------------------------------------------------------------- drafters


class Drafters:
    """Builds each configuration's drafter; owns what outlives one configuration.

    The local draft model is loaded once and reused (its cache is emptied before
    every prompt by the runner); the draft node and the emulators are started
    on first use and stopped by the ExitStack the caller closes, also on Ctrl-C.
    """

    def __init__(self, bench: BenchSettings, target: Any, out_dir: Path,
                 stack: contextlib.ExitStack) -> None:
        self.bench, self.target = bench, target
        self.out_dir, self.stack = out_dir, stack
        self._draft_backend: Any = None
        self._emulators: dict[str, LinkEmulator] = {}
        # (this process's CPUs, the node's) for a node started here
        self._split = None if bench.shared_cpus else cpus.halves()
        self._own_node = False
        self._sync_port = 0  # the own node's synchronous port
        # what an n-gram drafter learned, per configuration: it outlives a request in a
        # server, as the policy's estimates do (its cache of requests does not, here)
        self._ngram_memory: dict[str, tuple[Any, Any]] = {}
        self._hybrid_memory: dict[str, Any] = {}  # the hybrid's estimates, likewise
        self._bubble_memory: dict[str, Any] = {}  # a pipelined drafter's bubble rule's
        self._draft_regime: Any = None   # --emulate: the draft's times (see hold)
        self._draft_counters: Any = None
        self._held_draft: Any = None

    def hold(self, regime: Any, counters: Any, node_flags: tuple[str, ...],
             scale: float) -> None:
        """--emulate: hold the local draft model to `regime`, start a draft node with
        `node_flags` added, which hold its drafts alike, and wait for a synchronous node
        `scale` times as long (the emulation's wall time per emulated second)."""
        self._draft_regime, self._draft_counters = regime, counters
        self.bench = dataclasses.replace(self.bench, remote=self.bench.remote.emulated(scale),
                                         node_flags=(*self.bench.node_flags, *node_flags))

    def draft_backend(self) -> Any:
        """The in-process draft model, held to the emulated draft's times under --emulate."""
        backend = self.real_draft_backend()
        if self._draft_regime is None:
            return backend
        if self._held_draft is None:
            from specwire.emulate.hold import emulate
            self._held_draft = emulate(backend, self._draft_regime, self._draft_counters)
        return self._held_draft

    def real_draft_backend(self) -> Any:
        """The in-process draft model (checked against the target's vocabulary)."""
        if self._draft_backend is None:
            from specwire.backend.base import BackendError
            from specwire.backend.llama import LlamaBackend, check_pair, load_model
            params = self.bench.draft
            if params is None:
                raise ConfigError("no draft model for a mode that runs one")
            try:
                model = load_model(params, dict(self.bench.draft_flags))
                check_pair(self.target.model, model)
                self._draft_backend = LlamaBackend(params, model)
            except BackendError as e:
                raise ConfigError(str(e)) from None
        return self._draft_backend

    @contextlib.contextmanager
    def build(self, cfg: RunParams) -> Iterator[tuple[Any, LinkEmulator | None]]:
        """(drafter, emulator or None) for one configuration; remote ones closed after."""
        if cfg.mode in ("plain", "local", "local-pipelined", "ngram", "ngram-classic", "random",
                        "hybrid"):
            drafter = self._in_process(cfg)
            try:
                yield drafter, None
            finally:
                drafter.end()
            return
        emu = self._emulator(cfg.mode)
        emu.one_way_s = (cfg.rtt_s or 0.0) / 2
        emu.bandwidth_bps = cfg.bandwidth_bps
        split_here = self._split and self._own_node and cfg.mode != "llama-server"
        ours = self._split[0] if split_here else None
        with cpus.pinned(ours):
            drafter = (self._llama_server(emu) if cfg.mode == "llama-server"
                       else self._remote(emu, cfg, pipelined=cfg.mode != "remote-sync",
                                         chains=cfg.mode == "remote-chains"))
            if cfg.mode == "hybrid-pipelined":
                drafter = self._hybrid(cfg, drafter)
            try:
                yield drafter, emu
            finally:
                drafter.close()
                emu.cut()   # the closed drafter's channel may linger; the next one starts clean

    def _in_process(self, cfg: RunParams) -> Any:
        mode = cfg.mode
        if mode == "local":
            from specwire.drafters.model import ModelDrafter
            return ModelDrafter(self.draft_backend())
        if mode == "local-pipelined":
            from specwire.link.alternates import alternate_params
            from specwire.link.threaded import ThreadedDrafter
            return ThreadedDrafter(self.draft_backend(),
                                   alternates=alternate_params(self.bench.remote.branches),
                                   tree=self.bench.remote.tree, bubbles=self._bubbles(cfg))
        if mode == "ngram":
            return self._ngram(cfg)
        if mode == "hybrid":
            from specwire.drafters.model import ModelDrafter
            return self._hybrid(cfg, ModelDrafter(self.draft_backend()))
        if mode == "ngram-classic":
            from specwire.bench.baselines import ClassicNgramDrafter
            return ClassicNgramDrafter()
        if mode == "random":
            from specwire.drafters.random import RandomDrafter
            return RandomDrafter(self.target.n_vocab)
        from specwire.drafters.base import NoDrafter
        return NoDrafter()

    def _ngram(self, cfg: RunParams) -> Any:
        from specwire.drafters.ngram.drafter import MatchCalibration, NgramDrafter, RoundCost
        calibration, cost = self._ngram_memory.setdefault(cfg.label(),
                                                          (MatchCalibration(), RoundCost()))
        return NgramDrafter(cache=None, calibration=calibration, cost=cost)

    def _hybrid(self, cfg: RunParams, model: Any) -> Any:
        from specwire.drafters.hybrid import HybridDrafter, HybridEstimates
        estimates = self._hybrid_memory.setdefault(cfg.label(), HybridEstimates())
        return HybridDrafter(self._ngram(cfg), model, estimates=estimates)

    def _bubbles(self, cfg: RunParams) -> Any:
        """The configuration's bubble estimates (drafters/bubble.py), handed from each
        prompt's drafter to the next, as the policy's estimates are (runner.py)."""
        from specwire.drafters.bubble import BubbleWait
        from specwire.policy.scoped import Scoped
        return self._bubble_memory.setdefault(cfg.label(), Scoped(BubbleWait, BubbleWait()))

    def _remote(self, emu: LinkEmulator, cfg: RunParams, pipelined: bool,
                chains: bool = False) -> Any:
        """A fresh Link + RemoteDrafter through the emulator, handshake done (chains: its
        rounds verify no alternate beside the draft), going on from the configuration's
        bubble estimates."""
        from specwire.link.remote import make_remote_drafter
        opts = dataclasses.replace(self.bench.remote, pipelined=pipelined,
                                   **({"tree": 0} if chains else {}))
        drafter = make_remote_drafter([f"{emu.listen_host}:{emu.port}"], opts, self.target,
                                      self._bubbles(cfg) if pipelined else None)
        link = drafter.status()[0]
        if not link.up:
            drafter.close()
            raise ConfigError("draft node unreachable through the link emulator: "
                              f"{link.error}")
        return drafter

    def _llama_server(self, emu: LinkEmulator) -> Any:
        from specwire.drafters.llama_server import LlamaServerDrafter
        path = urllib.parse.urlsplit(self.bench.llama_server or "").path.rstrip("/")
        return LlamaServerDrafter(f"http://127.0.0.1:{emu.port}{path}",
                                  n_vocab=self.target.n_vocab)

    def _emulator(self, mode: str) -> LinkEmulator:
        """One emulator per upstream (the draft node, or the llama-server)."""
        key = "llama-server" if mode == "llama-server" else "node"
        if key not in self._emulators:
            host, port = (self._llama_server_address() if key == "llama-server"
                          else self._node_address())
            # The own node's synchronous port goes over the same emulated link. Nodes
            # advertise it by number, so the relay listens on another loopback address,
            # where the advertised port of a --draft-url node is not reachable either.
            sync = (self._sync_port,) if key == "node" and self._sync_port else ()
            emu = LinkEmulator(host, port, listen_host="127.0.0.2" if key == "node"
                               else "127.0.0.1", extra_ports=sync)
            emu.start()
            self.stack.callback(stop_emulator, emu)
            self._emulators[key] = emu
        return self._emulators[key]

    def _node_address(self) -> tuple[str, int]:
        """--draft-url if given, else a node started here for the rest of the run."""
        url = self.bench.draft_url
        if url is None:
            draft = self.bench.draft
            if draft is None:
                raise ConfigError("no draft model for a draft node to run")
            node = self.stack.enter_context(DraftNode(
                node_argv(self.bench.node_flags, draft.path), self.out_dir / "draft-node.log",
                self._split[1] if self._split else None))
            url = node.start()
            self._own_node = True
            self._sync_port = node.sync_port
        return split_host_port(url.removeprefix("grpc://"), "--draft-url")

    def _llama_server_address(self) -> tuple[str, int]:
        u = urllib.parse.urlsplit(self.bench.llama_server or "")
        if u.scheme != "http" or not u.hostname:
            raise ConfigError("--llama-server: expected http://HOST:PORT (needed by mode "
                           "llama-server)")
        return u.hostname, u.port or 80


def stop_emulator(emu: LinkEmulator) -> None:
    """Cut the connections, let their handlers finish, then stop: stopping with live
    connections cancels their handlers mid-flight, which asyncio logs as an error."""
    emu.cut()
    time.sleep(0.05)
    emu.stop()


def split_host_port(text: str, flag: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{flag}: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)

