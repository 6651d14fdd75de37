"""The draft link's authentication: token, TLS and mutual TLS, on both ports."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import specwire_pb2_grpc as pbg
from wire_helpers import (
    CODE,
    GREEDY,
    RawSession,
    _sync_open,
    make_certs,
    node_process,
    ref,
    request,
    run_to_end,
    wait_for,
)

from specwire.engine.engine import Engine
from specwire.link.transport import specwire_pb2 as pb
from specwire.link.transport.channel import LinkError, LinkSettings

# ============================================================================ authentication
# First among the tests that load models: the shared node is not started yet, so these
# nodes never run beside it.


@pytest.mark.slow
def test_token_authentication(target, tmp_path) -> None:
    """A node started with --token: a target with the wrong token or none is refused at the
    handshake (UNAUTHENTICATED, and the node logs 'refused connection'), a Session without
    the token is refused too, and the right token drafts normally."""
    with node_process(tmp_path, ["--token", "secret"], name="token") as n:
        for token in ("wrong", None):
            link = target.link(n.url, LinkSettings(token=token))
            with pytest.raises(LinkError, match="UNAUTHENTICATED"):
                asyncio.run(link.connect())
            assert not link.up
        wait_for(lambda: n.log().count("refused connection") >= 2, 10, "the node's log lines")
        assert "wrong token" in n.log() and "missing token" in n.log()
        for url in (n.url, f"127.0.0.1:{n.sync_port}"):     # the main port and the sync port
            _session_refused(target, url, grpc.StatusCode.UNAUTHENTICATED)
        with grpc.insecure_channel(n.url) as channel:
            with pytest.raises(grpc.RpcError) as e:
                list(pbg.DraftNodeStub(channel).Ping(iter([pb.PingMessage(seq=1)])))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        _drafts_like_plain(target, n.url, pipelined=False, settings=LinkSettings(token="secret"))


@pytest.mark.slow
def test_tls_and_mutual_tls(target, tmp_path) -> None:
    """A TLS node refuses a plain-text target and serves one that trusts its CA; with
    --tls-client-ca it also refuses targets without a client certificate or with one from
    another CA, and drafts for one whose certificate its CA signed."""
    c = make_certs(tmp_path)
    tls = ["--tls-cert", c["server_cert"], "--tls-key", c["server_key"]]
    with node_process(tmp_path, tls, name="tls") as n:
        with pytest.raises(LinkError):
            asyncio.run(target.link(n.url, LinkSettings(connect_timeout_s=2)).connect())
        link = target.link(n.url, LinkSettings(tls_ca=c["ca"]))
        asyncio.run(link.connect())
        assert link.up and link.hello.vocab_fingerprint == target.fingerprint
    with node_process(tmp_path, [*tls, "--tls-client-ca", c["ca"]], name="mtls") as n:
        for settings in (LinkSettings(connect_timeout_s=2),
                         LinkSettings(tls_ca=c["ca"], connect_timeout_s=2),
                         LinkSettings(tls_ca=c["ca"], tls_cert=c["rogue_client_cert"],
                                      tls_key=c["rogue_client_key"], connect_timeout_s=2)):
            with pytest.raises(LinkError):
                asyncio.run(target.link(n.url, settings).connect())
        good = LinkSettings(tls_ca=c["ca"], tls_cert=c["client_cert"], tls_key=c["client_key"])
        _drafts_like_plain(target, n.url, pipelined=True, settings=good)
        _drafts_like_plain(target, n.url, pipelined=False, settings=good)  # the sync port
        # Plain text against the TLS sync port.
        _session_refused(target, f"127.0.0.1:{n.sync_port}", grpc.StatusCode.UNAVAILABLE)


def _session_refused(target, url: str, code: grpc.StatusCode) -> None:
    """A synchronous Session opened at url with a plain-text channel fails with code."""
    with grpc.insecure_channel(url) as channel:
        s = RawSession(pbg.DraftNodeStub(channel))
        s.send(open=_sync_open(target.tokens(CODE)))
        with pytest.raises(grpc.RpcError) as e:
            list(s.call)
        assert e.value.code() == code
        s.close()


def _drafts_like_plain(target, url: str, pipelined: bool, settings: LinkSettings) -> None:
    """A target connected with these settings gets accepted drafts and plain's tokens.

    40 tokens: a pipelined target never waits for the node, so a short generation on a
    loaded machine could end before the node's first draft arrived."""
    rd = target.drafter(url, pipelined=pipelined, settings=settings)
    try:
        assert rd.links[0].up, "the handshake failed"
        g = Engine(target.backend, rd).generate(request(target.tokens(CODE), 40, GREEDY, 4))
        assert run_to_end(g) == ref(target, GREEDY, 40)
        assert g.stats.draft_n_accepted > 0 and rd.links[0].up
        assert rd.counters.sync_port_sessions == (0 if pipelined else 1)
    finally:
        rd.close()
