"""The interface between the target's end of a branch session and what carries its
messages: the hooks a BranchDrafter (link/branch.py) calls, what of the branch a
transport may call back, and the counters both keep."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Protocol

from specwire.link.messages import Chunk, Open, TargetMessage

log = logging.getLogger("specwire.branch")


@dataclass(slots=True)
class LinkCounters:
    """A BranchDrafter's counters, cumulative over its life; Drafter.stats reports them by
    name (engine/stats.py's counter_delta takes one request's share)."""

    bytes_up: float = 0
    bytes_down: float = 0
    bytes_open: float = 0  # the part of bytes_up spent on Opens (the prompt's tokens)
    chunks: float = 0
    tokens_received: float = 0
    stale_chunks: float = 0
    dropped_peers: float = 0
    reconnects: float = 0
    wait_ms: float = 0.0
    node_busy_ms: float = 0.0
    sync_timeouts: float = 0
    useless_answers: float = 0  # synchronous answers that extended nothing
    draft_cache_n: float = 0  # history tokens the drafter found cached, all requests
    draft_prompt_n: float = 0  # history tokens it evaluated to catch up, all requests
    # Pipelined: rounds after a rejection that found nothing to verify (the engine
    # decodes plainly meanwhile: the bubble a free drafter would not leave), and the
    # time those rounds took, propose to verdict.
    rejections: float = 0
    starved_rounds: float = 0
    starved_ms: float = 0.0
    alternates_received: float = 0
    alternate_rounds: float = 0  # rounds after a rejection that verify an alternate
    alternate_misses: float = 0  # rejections at an alternate the target did not pick
    alternate_trees: float = 0  # rounds that kept tokens of an alternate verified in a tree
    second_choices: float = 0  # ...of them one-token alternates (Open.second_choices)
    second_choices_taken: float = 0  # tree rounds that kept one
    # Pipelined: rounds with no draft at all (after a rejection or not), and rounds
    # that waited for the drafter (bubble.py): their time, and those that waited
    # in vain (no token came by the deadline: a plain step after all).
    empty_rounds: float = 0
    waited_rounds: float = 0
    waited_ms: float = 0.0
    waited_empty: float = 0
    # Fresh branches (begun after a verdict) and the time from that verdict to
    # their first token: a round trip, the drafter applying it, a draft token.
    fresh_branches: float = 0
    fresh_first_ms: float = 0.0
    # the gRPC transport's own (None: not carried by it, and not reported)
    sync_port_sessions: float | None = None  # sessions opened on a synchronous port
    polled_answers: float | None = None  # synchronous answers that came while polling
    poll_ms: float | None = None  # time spent busy-polling for them
    stream_cap: float | None = None  # sessions not opened: the link had its most streams

    def as_dict(self) -> dict[str, float]:
        return {f.name: float(v) for f in fields(self) if (v := getattr(self, f.name)) is not None}


class Branch(Protocol):
    """The branch's transport side (BranchDrafter provides it)."""

    name: str
    pipelined: bool
    sync_timeout_s: float
    counters: LinkCounters

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
    def k(self) -> int:
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
    per way of carrying them (GrpcTransport over gRPC, grpc_client.py;
    InProcessTransport by function call, link/threaded.py).

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

    def trees(self) -> bool:
        """The drafter at the other end follows the tree rule (link/rule.py), so that the
        target may verify its alternates beside the branch in one decode."""
        return False

    def useless(self, reason: str) -> None:
        """The drafter keeps answering with nothing usable (a transport drops it)."""
        log.warning("drafter %s: %s", self.branch.name, reason)
