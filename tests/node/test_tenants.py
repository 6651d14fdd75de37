"""Tenants on the draft node, without a model: the memory's scoping, expiry and purge
(node/kv_cache.py on fake contexts), the identities and quotas (node/tenants.py), the
Open's new fields on the wire, a request's cache_salt and cache_prompt as the target
turns them into a scope. The probe against a real node is tests/node/test_tenants_probe.py.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest

from specwire.backend.base import reusable_prefix
from specwire.config import SamplingParams, VerifyMode
from specwire.link.messages import Open
from specwire.link.transport import protocol
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.protocol import ProtocolError
from specwire.node import kv_cache
from specwire.node.calibrations import target_key
from specwire.node.kv_cache import KvCache
from specwire.node.tenants import (
    Quotas,
    TokenFileError,
    certificate_subject,
    identity,
    load_token_file,
    token_name,
)
from specwire.server.errors import ApiError
from specwire.server.schemas import Fields, cache_scope

A, B = ("token:alice", ""), ("token:bob", "")
SECRET = list(range(100, 140))


@dataclass
class FakeContext:
    """What KvCache asks of a llama.cpp context: its tokens, truncation, closing."""

    tokens: list[int] = field(default_factory=list)
    ctx: object = True
    closed: bool = False

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def truncate(self, n: int) -> None:
        del self.tokens[n:]

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class CountingCondition:
    """The memory's lock, counting its waits; a wait moves the fake clock past it."""

    def __init__(self, clock: Clock) -> None:
        self._cv, self.clock, self.waits = threading.Condition(), clock, 0

    def __enter__(self):
        return self._cv.__enter__()

    def __exit__(self, *exc):
        return self._cv.__exit__(*exc)

    def wait(self, timeout: float) -> None:
        self.waits += 1
        self.clock.now += timeout

    def notify_all(self) -> None:
        self._cv.notify_all()


def _saved(tokens: list[int]) -> SimpleNamespace:
    t = np.asarray(tokens, dtype=np.int32)
    return SimpleNamespace(tokens=t, size=1000 + t.nbytes)


@pytest.fixture
def memory(monkeypatch):
    """memory(**kw) -> a KvCache over FakeContexts, saved states copied as token lists."""
    fake_state = SimpleNamespace(
        state_size=lambda b: 1000,
        save=lambda b: _saved(b.tokens),
        restore=lambda b, s: (b.tokens.__setitem__(slice(None), list(s.tokens)), True)[1],
    )
    monkeypatch.setattr(kv_cache, "llama", fake_state)

    def make(**kw) -> KvCache:
        clock = Clock()
        mem = KvCache(None, None, ram_mib=64, sessions=8, max_contexts=kw.pop("contexts", 2),
                      new_backend=FakeContext, clock=clock, **kw)
        mem.clock = clock
        mem._lock = CountingCondition(clock)
        made.append(mem)
        return mem

    made: list[KvCache] = []
    yield make
    for mem in made:
        mem.close()


def _session(mem: KvCache, history: list[int], scope, store: bool = True) -> int:
    """One session: its context from the memory, the history filled in, released; how
    many history tokens it found cached (the session's cache_n)."""
    ctx = mem.acquire(history, scope, store=store)
    cached = reusable_prefix(ctx.tokens, history)
    ctx.truncate(cached)
    ctx.tokens.extend(history[cached:])
    mem.release(ctx, history)
    return cached


def test_a_scope_reuses_its_own_history_and_nothing_of_another(memory) -> None:
    mem = memory()
    assert _session(mem, SECRET, A) == 0
    assert _session(mem, SECRET + [7, 8], A) == len(SECRET)     # its own next turn
    assert _session(mem, SECRET + [9], B) == 0                  # the same tokens elsewhere
    assert _session(mem, SECRET + [9], ("token:alice", "salt-2")) == 0  # same peer, other salt


def test_the_probe_learns_nothing_across_scopes(memory) -> None:
    """[known prefix, guess, filler] from another scope: cache_n is 0 whether the guess is
    right or wrong, and the memory does the same work (no waits) for both."""
    mem = memory(contexts=4)
    known, secret_next = SECRET[:20], SECRET[20]
    _session(mem, SECRET, A)
    seen = {}
    for guess in (secret_next, 5, 6):
        seen[guess] = _session(mem, known + [guess] + [1, 2, 3], ("token:mallory", ""))
    # Mallory's own previous probe is in her scope: every guess finds the same prefix.
    assert seen[secret_next] == 0 and seen[5] == len(known) and seen[6] == len(known)
    assert mem._lock.waits == 0
    # In one scope the same probe tells (the oracle the scopes close).
    assert _session(mem, known + [secret_next, 1], A) > len(known)


def test_saved_states_stay_in_their_scope(memory) -> None:
    """A's sequence, pushed out of its context into a saved state by B's sessions, is
    restored for A and for nobody else; B's taking A's context first empties it."""
    mem = memory(contexts=1)
    _session(mem, SECRET, A)
    assert _session(mem, [1, 2, 3, 4], B) == 0   # A's context, emptied for B, A's cells saved
    assert mem.counters.saves == 1
    assert _session(mem, SECRET[:30] + [5], B) == 0
    assert _session(mem, SECRET[:30] + [5], A) == 30
    assert mem.counters.restores == 1


def test_an_open_session_is_waited_for_only_by_its_own_scope(memory) -> None:
    mem = memory()
    long = list(range(100, 101 + 2 * kv_cache.WORTH_WAITING))
    held = mem.acquire(long, A)   # open: its history is long, nothing cached yet
    foreign = mem.acquire(long + [1], B)
    assert mem._lock.waits == 0 and reusable_prefix(foreign.tokens, long) == 0
    mem.acquire(long + [1], A)
    assert mem._lock.waits == 1     # its own scope's open session is worth waiting for
    mem.release(held, long)


def test_no_store_reuses_nothing_and_leaves_nothing(memory) -> None:
    mem = memory()
    _session(mem, SECRET, A)
    pooled = mem.pooled()
    ctx = mem.acquire(SECRET + [1], A, store=False)
    assert reusable_prefix(ctx.tokens, SECRET) == 0
    ctx.tokens.extend(SECRET + [1])
    mem.release(ctx, SECRET + [1])
    assert ctx.closed and mem.pooled() == pooled
    assert _session(mem, SECRET + [1, 2], A) == len(SECRET)   # what was there, not more


def test_entries_expire_after_the_ttl_and_a_purge_drops_them(memory) -> None:
    mem = memory(ttl_s=60.0, contexts=1)
    _session(mem, SECRET, A)
    _session(mem, [1, 2, 3], B)          # A's sequence saved, B's context pooled
    assert mem.pooled() == 1 and mem.saved_bytes > 0
    mem.clock.now += 59.0
    assert mem.expire() == 0
    assert mem.expire(mem.clock.now + 2.0) == 2 and mem.pooled() == 0 and mem.saved_bytes == 0
    mem.clock.now += 2.0
    _session(mem, SECRET, A)
    _session(mem, [1, 2, 3], B)
    assert mem.purge("token:bob") == 1 and mem.pooled() == 0
    assert _session(mem, SECRET + [1], A) == len(SECRET)   # A's saved state is still there
    assert mem.purge() >= 1 and _session(mem, SECRET + [1], A) == 0


def _flood(mem: KvCache) -> tuple[int, int]:
    """Alice keeps two conversations; bob then has twelve of his own (each session saves
    the one before it: one pooled context). What alice's next turns of both find cached."""
    alice = [SECRET, [200 + i for i in range(30)]]
    for h in alice:
        _session(mem, h, A)
    for i in range(12):
        _session(mem, [1000 + 50 * i + j for j in range(20)], B)
    return _session(mem, alice[0] + [1], A), _session(mem, alice[1] + [1], A)


def test_one_identity_cannot_evict_every_other_identitys_conversations(memory) -> None:
    """With a share per identity (--cache-sessions-per-identity 3 of 8), bob's flood evicts
    his own states only and alice's both survive; without one (the control), bob's flood
    evicts both of alice's."""
    assert _flood(memory(contexts=1)) == (0, 0)
    shared = memory(contexts=1, identity_sessions=3)
    assert _flood(shared) == (len(SECRET), 30)
    bobs = [e for e in shared._saved.values() if e.scope == B]
    assert len(bobs) <= 3


def test_an_identitys_share_of_bytes_is_its_own(memory, monkeypatch) -> None:
    """By bytes (--cache-ram-per-identity): with a "MiB" of 2500 bytes here, a share of one
    holds two of these ~1.1 kB states, and bob's flood stays within it."""
    monkeypatch.setattr(kv_cache, "MIB", 2500)
    mem = memory(contexts=1, identity_mib=1)
    assert _flood(mem) == (len(SECRET), 30)
    assert sum(e.size for e in mem._saved.values() if e.scope == B) <= 2500
    assert memory(contexts=1).identity_budget == mem.budget     # 0: the whole


def test_a_token_file_names_each_target(tmp_path) -> None:
    f = tmp_path / "tokens"
    f.write_text("# targets\nalpha  aaaaaaaaaaaaaaaaaaaa\n\nbeta bbbbbbbbbbbbbbbbbbbb\n")
    tokens = load_token_file(f)
    assert token_name(tokens, "Bearer bbbbbbbbbbbbbbbbbbbb") == "beta"
    assert token_name(tokens, "Bearer cccccccccccccccccccc") is None
    assert token_name(tokens, "bbbbbbbbbbbbbbbbbbbb") is None
    for text, why in [("alpha", "want `NAME TOKEN`"), ("alpha short", "shorter than 16"),
                      ("a " + "x" * 20 + "\na " + "y" * 20, "twice"), ("# none\n", "no `NAME")]:
        f.write_text(text)
        with pytest.raises(TokenFileError, match=why):
            load_token_file(f)


def test_identity_is_the_token_name_and_the_certificate_subject() -> None:
    ctx = SimpleNamespace(auth_context=lambda: {"x509_subject": [b"CN=target-a"]})
    assert certificate_subject(ctx) == "CN=target-a"
    assert certificate_subject(SimpleNamespace()) == ""
    assert identity("alpha", "CN=target-a") == "token:alpha cert:CN=target-a"
    assert identity(None, "") == ""
    header_ctx = SimpleNamespace(peer=lambda: "ipv4:10.0.0.5:1234",
                                 invocation_metadata=lambda: ((protocol.TARGET_HEADER, "x"),))
    assert target_key(header_ctx, "token:alpha") == ("identity", "token:alpha", "")
    assert target_key(header_ctx) == ("10.0.0.5", "x", "")   # no identity: as before


def test_each_scope_of_a_target_has_its_own_calibration() -> None:
    """One tenant's verdicts must not move another's stops: the request's cache scope is
    part of the calibration's key, beside the target's identity."""
    from specwire.node.calibrations import Calibrations
    ctx = SimpleNamespace(peer=lambda: "ipv4:10.0.0.5:1234",
                          invocation_metadata=lambda: ((protocol.TARGET_HEADER, "x"),))
    cals = Calibrations(8)
    a = cals.get(target_key(ctx, "token:alpha", "tenant-a"))
    assert cals.get(target_key(ctx, "token:alpha", "tenant-a")) is a
    assert cals.get(target_key(ctx, "token:alpha", "tenant-b")) is not a
    assert cals.get(target_key(ctx, "token:beta", "tenant-a")) is not a
    assert cals.get(target_key(ctx, "", "tenant-a")) is not a


def test_quotas_count_sessions_per_identity() -> None:
    q = Quotas(2)
    assert q.enter("a") and q.enter("a") and not q.enter("a") and q.enter("b")
    q.leave("a")
    assert q.enter("a") and q.held("a") == 2
    assert all(Quotas(0).enter("a") for _ in range(100))


def test_the_open_carries_its_scope_and_old_peers_read_the_default() -> None:
    o = Open([1, 2], SamplingParams(), VerifyMode.GREEDY, cache_scope="abc", no_store=True)
    back = protocol.open_from_pb(pb.Open.FromString(protocol.open_to_pb(o).SerializeToString()))
    assert back.cache_scope == "abc" and back.no_store
    old = protocol.open_to_pb(o)   # what a target that predates the fields sends
    old.ClearField("cache_scope")
    old.ClearField("no_store")
    assert protocol.open_from_pb(old).cache_scope == "" and not protocol.open_from_pb(old).no_store
    with pytest.raises(ProtocolError, match="cache_scope"):
        Open([1], SamplingParams(), VerifyMode.GREEDY, cache_scope="x" * 129)


def test_cache_salt_becomes_a_digest_scope() -> None:
    one, two = cache_scope(Fields({"cache_salt": "u1"})), cache_scope(Fields({"cache_salt": "u2"}))
    assert one != two and len(one) == 32 and "u1" not in one
    assert cache_scope(Fields({"cache_salt": "u1"})) == one and cache_scope(Fields({})) == ""
    assert len(cache_scope(Fields({"cache_salt": "\ud800"}))) == 32   # a lone surrogate
    for bad in ("", "x" * 2000, 5):
        with pytest.raises(ApiError, match="cache_salt"):
            cache_scope(Fields({"cache_salt": bad}))


class Refused(Exception):
    pass


class FakeCall:
    """A gRPC servicer context: metadata, a peer, abort raising."""

    def __init__(self, token: str) -> None:
        self._meta = ((protocol.AUTH_HEADER, f"Bearer {token}"),)

    def invocation_metadata(self):
        return self._meta

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def abort(self, code, details: str):
        raise Refused(code, details)


def test_admission_knows_each_token_and_holds_each_to_its_quota() -> None:
    from specwire.config import ModelParams
    from specwire.emulate.hold import HoldCounters
    from specwire.link.transport.h2.grpcframe import Status
    from specwire.node.server import DraftNodeService, NodeSettings
    from specwire.node.steps import StepLoop

    alice, bob, shared = "a" * 20, "b" * 20, "s" * 20
    settings = NodeSettings(model=ModelParams("unused.gguf"), token=shared, max_sessions=4,
                            tokens={alice: "alice", bob: "bob"}, sessions_per_identity=1)
    service = DraftNodeService(settings, None, StepLoop(SimpleNamespace(n_seq=1, n_batch=1)),
                               HoldCounters())
    assert service._admit(FakeCall(alice), "Session") == "token:alice"
    with pytest.raises(Refused) as e:
        service._admit(FakeCall(alice), "Session")
    assert e.value.args[0] == Status.RESOURCE_EXHAUSTED
    assert "--sessions-per-identity" in e.value.args[1]
    assert service._admit(FakeCall(bob), "Session") == "token:bob"
    assert service._admit(FakeCall(shared), "Session") == ""   # the single --token
    service._release()
    service.quotas.leave("token:alice")
    assert service._admit(FakeCall(alice), "Session") == "token:alice"
    with pytest.raises(Refused) as e:
        service._admit(FakeCall("c" * 20), "Session")
    assert e.value.args[0] == Status.UNAUTHENTICATED
    assert service.metrics.refused == {"quota": 1, "token": 1}


def test_a_completion_body_carries_its_salt_and_cache_prompt_to_the_drafter() -> None:
    from specwire.server import schemas
    from specwire.server.settings import ServerSettings

    class Toy:
        name, n_vocab, n_ctx = "toy.gguf", 128, 64

        def tokenize(self, text, add_special=True, parse_special=True):
            return [1] + [min(ord(c), 127) for c in text]

    def draft(**body):
        return schemas.completion({"prompt": "hi", **body}, Toy(), ServerSettings(),
                                  ["toy"]).request.draft

    assert draft().cache_scope == "" and draft().cache_store
    assert draft(cache_salt="u1").cache_scope == cache_scope(Fields({"cache_salt": "u1"}))
    assert not draft(cache_prompt=False).cache_store
    with pytest.raises(ApiError, match="cache_salt"):
        draft(cache_salt=["x"])


def test_tenant_flags_are_refused_with_one_clear_line(specwire_cli, tmp_path) -> None:
    bad = tmp_path / "tokens"
    bad.write_text("alpha short\n")
    for args, needle in ((["--sessions-per-identity", "-1"], "--sessions-per-identity"),
                         (["--cache-ttl", "-5"], "--cache-ttl"),
                         (["--cache-ram-per-identity", "-1"], "--cache-ram-per-identity"),
                         (["--cache-sessions-per-identity", "-2"],
                          "--cache-sessions-per-identity"),
                         (["--sync-conn-per-address", "-1"], "--sync-conn-per-address"),
                         (["--token-file", str(tmp_path / "none")], "--token-file"),
                         (["--token-file", str(bad)], "shorter than 16")):
        r = specwire_cli("draft", *args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr


def test_each_api_key_is_a_scope_of_its_own_and_a_salt_narrows_it() -> None:
    """serve with several API keys: requests of one key share a scope, requests of another
    key (or with a salt) get another; without keys the salt alone decides."""
    import httpx
    from toy_server import ToyBackend, serve_app

    from specwire.drafters.base import NoDrafter
    from specwire.engine.engine import Engine
    from specwire.server import ServerSettings, create_app

    class Scopes(NoDrafter):
        name = "scopes"

        def __init__(self) -> None:
            self.seen: list[str] = []

        def begin(self, prompt, sampling, params, **guide) -> None:
            self.seen.append(params.cache_scope)

    def scopes(api_key: str | None, calls: list[tuple[str | None, dict]]) -> list[str]:
        drafter = Scopes()
        settings = ServerSettings(sampling=SamplingParams(temperature=0.0), api_key=api_key)
        with serve_app(create_app(Engine(ToyBackend(), drafter), settings)) as url:
            for key, extra in calls:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                r = httpx.post(url + "/completion", json={"prompt": "z", "n_predict": 2, **extra},
                               headers=headers, timeout=10)
                assert r.status_code == 200, r.text
        return drafter.seen

    a1, a2, b, a_salted, b_salted = scopes("key-a,key-b", [
        ("key-a", {}), ("key-a", {}), ("key-b", {}), ("key-a", {"cache_salt": "s"}),
        ("key-b", {"cache_salt": "s"})])
    assert a1 == a2 and a1 != b and len({a1, b, a_salted, b_salted}) == 4
    assert "" not in {a1, b}
    plain, salted = scopes(None, [(None, {}), (None, {"cache_salt": "s"})])
    assert plain == "" and salted == cache_scope(Fields({"cache_salt": "s"}))
