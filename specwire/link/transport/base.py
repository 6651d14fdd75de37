"""The interface between the target's end of a branch session and what carries its
messages: the hooks a BranchDrafter (link/branch.py) calls, and what of the branch a
transport may call back."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from specwire.link.messages import Chunk, Open, TargetMessage

log = logging.getLogger("specwire.branch")


class Branch(Protocol):
    """The branch's transport side (BranchDrafter provides it)."""

    name: str
    pipelined: bool
    sync_timeout_s: float
    counters: dict[str, float]

    @property
    def lock(self) -> threading.Condition:
        """Guards the buffer and the session number; a transport waits on it."""

    @property
    def session(self) -> int:
        """The current session's number: chunks tagged with another are stale."""

    @property
    def history(self) -> Sequence[int]: ...

    @property
    def active(self) -> bool:
        """A request is running (between begin and end)."""

    @property
    def want(self) -> int:
        """The tokens the current round asks for."""

    def invalidate(self) -> None:
        """Make the current session's chunks stale (it is being dropped)."""

    def on_chunk(self, session: int, c: Chunk) -> None:
        """A chunk arrived; ProtocolError for a broken peer."""

    def open_message(self, history: list[int]) -> Open:
        """The Open that starts a session on this history."""

    def restart(self) -> None:
        """Open a new session on the current history (a reconnect)."""

    def wake(self) -> None:
        """Wake a round waiting on the lock."""

class Transport:
    """How a BranchDrafter's messages travel to its drafter and back: one implementation
    per way of carrying them (GrpcTransport over gRPC and the synchronous port,
    grpc_client.py; InProcessTransport by function call, link/threaded.py).

    The branch calls these hooks (on the engine thread); the transport calls back only
    what Branch lists.
    """

    branch: Branch

    def bind(self, branch: Branch) -> None:
        """Called once by the branch it carries the messages of."""
        self.branch = branch

    def live(self) -> bool:
        """A session is open and can take verdicts."""
        raise NotImplementedError

    def post(self, msg: TargetMessage) -> None:
        """Deliver a verdict or close message to the drafter."""
        raise NotImplementedError

    def open(self, session: int, history: list[int]) -> None:
        """Start a session with this history; chunks come back through branch.on_chunk."""
        raise NotImplementedError

    def revive(self) -> None:
        """Called while no session is live: reconnect if it is time."""

    def wait(self, left_s: float) -> None:
        """Wait, holding branch.lock, for a chunk or the end of the session (or left_s)."""
        self.branch.lock.wait(left_s)

    def poll(self) -> None:
        """Take in what a late synchronous drafter sent, without waiting (for transports
        that read only when asked)."""

    def detach(self) -> None:
        """Forget the current session (and release what carries it)."""

    def useful(self) -> None:
        """A round got a draft from the drafter (a transport may note its link worked)."""

    def useless(self, reason: str) -> None:
        """The drafter keeps answering with nothing usable (a transport drops it)."""
        log.warning("drafter %s: %s", self.branch.name, reason)
