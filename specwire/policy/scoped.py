"""What is learned from requests, kept apart per cache scope.

The estimates that set draft lengths (the adaptive policy's acceptance and calibration,
the n-gram drafter's match calibration and yield, the hybrid's, the bubble rule's and the
trees' yield) are learned from the text of the requests that fed them. Shared between
tenants, they would let one tenant's requests change another's draft lengths, and so
its timings: a side channel on what the first one wrote. So each is kept per cache
scope (DraftParams.cache_scope: the API key's and cache_salt's; "" on a single-tenant
server, where nothing changes), as the caches are. What a machine costs (VerifyCost,
DraftCost) is not text and stays shared.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

#: Scopes whose learned state is kept; beyond it, the least recently used one's goes
#: (its next request starts from the priors, as a new tenant's does).
MAX_SCOPES = 64


class Scoped(Generic[T]):
    """One T per cache scope, made by `make` on a scope's first use, at most `limit`
    scopes kept (least recently used out first). `first`, when given, is scope ""'s."""

    __slots__ = ("_by_scope", "_make", "limit")

    def __init__(self, make: Callable[[], T], first: T | None = None,
                 limit: int = MAX_SCOPES) -> None:
        if limit < 1:
            raise ValueError(f"scoped state: limit must be >= 1, got {limit}")
        self._make, self.limit = make, limit
        self._by_scope: OrderedDict[str, T] = OrderedDict()
        if first is not None:
            self._by_scope[""] = first

    def get(self, scope: str) -> T:
        """Scope's state (made now if it has none), marked most recently used."""
        got = self._by_scope.get(scope)
        if got is None:
            got = self._by_scope[scope] = self._make()
            while len(self._by_scope) > self.limit:
                self._by_scope.popitem(last=False)
        else:
            self._by_scope.move_to_end(scope)
        return got

    def peek(self, scope: str) -> T | None:
        """Scope's state if it has one, without making it or marking it used."""
        return self._by_scope.get(scope)

    def scopes(self) -> list[str]:
        """The scopes held, least recently used first."""
        return list(self._by_scope)

    def __len__(self) -> int:
        return len(self._by_scope)
