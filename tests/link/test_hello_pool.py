"""The links' Hello calls run on a pool started whole with the drafters (link/remote.py).

asyncio's default executor starts a thread whenever a call finds none idle and keeps it
for good: the slots' drafters greeting a restarted node at once left one more thread
each time. With hello_pool the pool's threads are all there from the start, and many
greetings at once add none. On an address where nothing listens (each Hello fails at
once), no model.
"""

from __future__ import annotations

import asyncio
import socket
import threading

from specwire.link.remote import MAX_HELLO_THREADS, hello_pool, make_remote_drafters
from specwire.settings import RemoteSettings


class _Target:
    name, n_vocab = "target.gguf", 32

    @staticmethod
    def vocab_fingerprint() -> str:
        return "0" * 32


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_the_pool_is_started_whole() -> None:
    before = _threads("draft-hello")
    pool = hello_pool(3)
    try:
        assert _threads("draft-hello") == before + 3
    finally:
        pool.shutdown()
    capped = hello_pool(100)
    try:
        assert _threads("draft-hello") == before + MAX_HELLO_THREADS
    finally:
        capped.shutdown()


def _greet(shared, times: int = 3, at_once: int = 6) -> None:
    async def greet_all() -> None:
        link = shared.links[0]
        await asyncio.gather(*(link.connect() for _ in range(at_once)), return_exceptions=True)

    for _ in range(times):
        asyncio.run_coroutine_threadsafe(greet_all(), shared.loop).result(30)


def test_greetings_at_once_add_no_thread() -> None:
    """Two slots' drafters: two threads from the start; 6 greetings at once, three times,
    add none."""
    before = _threads("draft-hello")
    url = f"127.0.0.1:{_closed_port()}"
    drafters = make_remote_drafters([url], RemoteSettings(pipelined=True), _Target(), 2)
    try:
        assert _threads("draft-hello") == before + 2
        _greet(drafters[0].shared)
        assert _threads("draft-hello") == before + 2
    finally:
        for d in drafters:
            d.close()


def test_the_control_asyncios_own_pool_grows_and_stays() -> None:
    """The same greetings on the loop's default executor as asyncio makes it: a thread per
    greeting waiting at once, kept after."""
    from specwire.link.transport.channel import Link, LinkSettings
    from specwire.link.transport.channels import LinkSet

    target = _Target()
    shared = LinkSet([Link(f"127.0.0.1:{_closed_port()}", LinkSettings(),
                           target.vocab_fingerprint(), target.n_vocab, target.name)])
    shared.attach()
    try:
        _greet(shared, times=1, at_once=1)
        one = _threads("asyncio_")
        _greet(shared)
        assert _threads("asyncio_") > one
    finally:
        shared.close()
