"""Deadlines for peers that go silent, on one thread for the whole node.

grpcio's request iterator blocks until the peer sends or the call ends: a
Session that never sends its Open, or a Ping stream that stops pinging, would
hold its admission slot for ever. A Lease is a deadline that the call moves
forward each time the peer is heard from (`feed`, one float written, so the
round's critical path pays nothing measurable); the watchdog thread checks
the leases a few times a second and ends the calls whose deadline passed
(`on_expiry`, which for grpcio is the context's cancel: the blocked iterator
then raises grpc.RpcError in the call's own thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Lease:
    """One call's deadline; `feed` moves it timeout_s past now, `release` drops it."""

    __slots__ = ("deadline", "timeout_s", "on_expiry", "expired", "_owner")

    def __init__(self, owner: Watchdog, timeout_s: float, on_expiry: Callable[[], None]) -> None:
        self._owner, self.timeout_s, self.on_expiry = owner, timeout_s, on_expiry
        self.deadline = time.monotonic() + timeout_s
        self.expired = False

    def feed(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s

    def release(self) -> None:
        self._owner._drop(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class Watchdog:
    """Checks every lease each `period_s` and expires the late ones (daemon thread)."""

    def __init__(self, period_s: float = 0.25) -> None:
        self.period_s = period_s
        self._leases: set[Lease] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, timeout_s: float, on_expiry: Callable[[], None]) -> Lease:
        lease = Lease(self, timeout_s, on_expiry)
        with self._lock:
            self._leases.add(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="node-watchdog",
                                                daemon=True)
                self._thread.start()
        return lease

    def _drop(self, lease: Lease) -> None:
        with self._lock:
            self._leases.discard(lease)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            now = time.monotonic()
            with self._lock:
                late = [lease for lease in self._leases if lease.deadline < now]
                self._leases.difference_update(late)
            for lease in late:
                lease.expired = True
                try:
                    lease.on_expiry()
                except Exception:  # noqa: BLE001 - one call's cleanup must not stop the others
                    log.exception("ending a silent call failed")
