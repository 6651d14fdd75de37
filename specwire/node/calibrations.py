"""A draft node's calibrations, one per target.

A synchronous session of an adaptive target stops its drafts by the draft's
confidence, calibrated on the verdicts the node receives (specwire.policy.adaptive).
Targets differ (their model, their sampling), so each keeps its own: one
target's verdicts must not move another's stops, and a hostile peer must not
be able to steer them. A target is known by its authenticated identity
(node/tenants.py: its token's name, its certificate's subject) where it has
one, which it cannot choose; otherwise by its host and the id it sends in the
call metadata (protocol.TARGET_HEADER, random per target process); and within a
target by the request's cache scope (Open.cache_scope), so that one tenant's
verdicts do not move another's stops either. The node keeps the most recently
seen ones, a bounded number.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from specwire.link.transport import protocol
from specwire.policy.adaptive import Calibration


def target_key(context, identity: str = "", scope: str = "") -> tuple[str, str, str]:
    """Whose calibration a session uses: the peer's authenticated identity when it has
    one; else the peer's address without its port, and the target's id
    (protocol.TARGET_HEADER, random per target process) when it sends one; then the
    request's cache scope within that target."""
    if identity:
        return "identity", identity, scope
    peer = context.peer()   # "1.2.3.4:5678"; grpcio's spelling: "ipv4:1.2.3.4:5678"
    if peer.startswith(("ipv4:", "ipv6:")):
        peer = peer[5:]
    host = peer.rsplit(":", 1)[0].strip("[]")
    meta = dict(context.invocation_metadata() or ())
    return host, str(meta.get(protocol.TARGET_HEADER, ""))[:64], scope


class Calibrations:
    """One Calibration per target, the least recently used forgotten past `limit`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._by_key: OrderedDict[tuple[str, str, str], Calibration] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple[str, str, str]) -> Calibration:
        with self._lock:
            c = self._by_key.pop(key, None) or Calibration()
            self._by_key[key] = c
            while len(self._by_key) > self.limit:
                self._by_key.popitem(last=False)
            return c

    def __len__(self) -> int:
        return len(self._by_key)
