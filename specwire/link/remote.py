"""The remote drafter: the target's side of the draft link, drafting on a draft node.

BranchDrafter (link/branch.py) keeps the branch and checks every token
against the history; link/transport/grpc_client.py's GrpcTransport moves the messages. This
module joins the two and builds the drafter the --draft-url flags name.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from specwire.drafters.base import Capabilities, LinkStatus
from specwire.drafters.bubble import BubbleWait
from specwire.link.alternates import AlternateParams, alternate_params
from specwire.link.branch import DEFAULT_ALTERNATES, BranchDrafter
from specwire.link.messages import MAX_ALTERNATES
from specwire.link.transport.channel import Link, LinkSettings
from specwire.link.transport.channels import LinkSet
from specwire.link.transport.grpc_client import GrpcTransport
from specwire.policy.scoped import Scoped
from specwire.settings import RemoteSettings

log = logging.getLogger("specwire.remote")


class RemoteDrafter(BranchDrafter):
    """Drafts from a draft node over gRPC; pipelined or synchronous. Its transport also
    connects the links ahead of the first request (handshake); status reports them."""

    remote = True
    transport: GrpcTransport

    def __init__(self, links: list[Link] | LinkSet, n_vocab: int, pipelined: bool = True,
                 lookahead: int = 0, sync_timeout_s: float = 1.0, *,
                 alternates: AlternateParams | None = DEFAULT_ALTERNATES,
                 tree: int = MAX_ALTERNATES,
                 timing: bool = False, poll: bool = True,
                 bubbles: Scoped[BubbleWait] | None = None) -> None:
        """links: this drafter's own, or a LinkSet shared with the target's other drafters;
        alternates, tree, timing, bubbles: as BranchDrafter's; poll: as GrpcTransport's."""
        super().__init__(GrpcTransport(links, poll), n_vocab, pipelined, lookahead,
                         sync_timeout_s, alternates=alternates, tree=tree, timing=timing,
                         bubbles=bubbles)
        t = self.transport
        self.shared, self.links = t.shared, t.links
        self.handshake = t.handshake
        self.name = ("remote-pipelined:" if pipelined else "remote-sync:") + self.links[0].url

    @property
    def capabilities(self) -> Capabilities:
        return replace(super().capabilities, links=True)

    def status(self) -> tuple[LinkStatus, ...]:
        """Each link: up or not, the model its node announced, the handshake's round trip,
        failures in a row, the last error and when it is tried again, and the node's batch
        (what its last decode for this target held)."""
        now = time.monotonic()
        return tuple(LinkStatus(
            url=str(link.url), up=bool(link.up),
            model=link.hello.draft_model if link.hello is not None else "",
            rtt_s=link.rtt_s, failures=int(link.failures), error=str(link.last_error),
            retry_in_s=max(0.0, link.retry_at - now), step=link.node_step)
            for link in self.links)

    def close(self) -> None:
        """End the session; the last drafter of the LinkSet closes the connections."""
        self.end()
        self.transport.close()


#: The most threads the handshakes' pool holds (each slot's drafter may greet each node).
MAX_HELLO_THREADS = 8


def hello_pool(n: int) -> ThreadPoolExecutor:
    """The pool the links' blocking Hello calls run on (their loop's default executor),
    its min(n, MAX_HELLO_THREADS) threads all started now. asyncio's own default pool
    starts a thread whenever a call finds none idle and keeps it for good: the slots'
    drafters greeting a restarted node at once each left one more. Started whole at
    start-up, the pool is the same size at the end as at the start; more calls at once
    wait for a thread."""
    size = max(1, min(n, MAX_HELLO_THREADS))
    pool = ThreadPoolExecutor(size, thread_name_prefix="draft-hello")
    gate = threading.Barrier(size + 1)
    for _ in range(size):        # each waits for the others: one thread apiece
        pool.submit(gate.wait)
    gate.wait()
    return pool


def make_remote_drafter(urls: list[str], remote: RemoteSettings, target,
                        bubbles: Scoped[BubbleWait] | None = None) -> object:
    """Build the drafter for --draft-url flags: gRPC nodes, or a llama-server over HTTP.
    bubbles: an earlier drafter's bubble estimates, to go on from (BranchDrafter)."""
    return make_remote_drafters(urls, remote, target, 1, bubbles)[0]


def make_remote_drafters(urls: list[str], remote: RemoteSettings, target, n: int,
                         bubbles: Scoped[BubbleWait] | None = None) -> list:
    """n drafters (one per slot of `serve -np n`) for --draft-url flags. gRPC nodes: the
    drafters share one LinkSet, so each node sees one connection per port from this
    target, a stream per session (link/transport/channels.py), and one handshake. bubbles
    (n = 1 only): as make_remote_drafter's."""
    from specwire.config import ConfigError

    if any(u.startswith(("http://", "https://")) for u in urls):
        if len(urls) != 1:
            raise ConfigError("--draft-url: a llama-server URL cannot be mixed with others")
        from specwire.drafters.llama_server import LlamaServerDrafter

        return [LlamaServerDrafter(urls[0]) for _ in range(n)]
    settings = LinkSettings(
        token=remote.token,
        tls_ca=remote.tls_ca,
        tls_cert=remote.tls_cert,
        tls_key=remote.tls_key,
    )
    shared = LinkSet([
        Link(u, settings, target.vocab_fingerprint(), target.n_vocab, target.name) for u in urls
    ])
    shared.loop.set_default_executor(hello_pool(len(urls) * n))
    drafters = [RemoteDrafter(shared, target.n_vocab, pipelined=remote.pipelined,
                              sync_timeout_s=remote.sync_timeout_s,
                              alternates=alternate_params(remote.branches),
                              tree=remote.tree if n == 1 and remote.pipelined else 0,
                              poll=remote.poll, bubbles=bubbles if n == 1 else None)
                for _ in range(n)]
    errors = drafters[0].handshake()
    fatal = [e for e in errors if e and e.startswith("incompatible")]
    if fatal:
        for drafter in drafters:
            drafter.close()
        raise ConfigError(fatal[0])
    for u, e in zip(urls, errors, strict=True):
        if e:
            log.warning("draft node %s not reachable yet (%s); decoding plainly until it is", u, e)
    return drafters
