"""The node's metrics port behind its tokens and under its TLS (issue 40, finding 8), without
a model: the exporter (node/exporter.py) as node/server.py's start() configures it.

Before: a node with only --token-file served /metrics to anyone ("token off" in its log),
and under --tls-cert the port stayed plain HTTP, so POST /purge carried the master token in
clear. Now /metrics wants the --token or any --token-file token, and a node with a
certificate serves the port over TLS (its client CA too); a handshake that never finishes
is cut at the connection's deadline.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from types import SimpleNamespace

import httpx
import pytest
from wire_helpers import make_certs

from specwire.config import ModelParams
from specwire.node import exporter
from specwire.node import server as node_server
from specwire.node.metrics import NodeMetrics
from specwire.node.server import NodeSettings

ALICE = "alice-token-0123456789"
ADMIN = "admin-token-0123456789"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, str]:
    return make_certs(tmp_path_factory.mktemp("metrics-certs"))


def _serve(settings: NodeSettings) -> tuple[NodeMetrics, int]:
    """The metrics port as start() serves it for these settings (purge by token)."""
    m = NodeMetrics(lambda: 0, lambda: 0, lambda: 0)
    purged: list[str | None] = []
    service = SimpleNamespace(settings=settings, memory=SimpleNamespace(
        purge=lambda scope=None: purged.append(scope) or 1))
    purge = lambda header: node_server.DraftNodeService.purge_for(service, header)  # noqa: E731
    port = m.serve(settings.host, 0, settings.token, purge=purge,
                   **node_server.metrics_options(settings))
    return m, port


def _settings(**kw) -> NodeSettings:
    return NodeSettings(model=ModelParams(path="none.gguf"), host="127.0.0.1", **kw)


def test_a_token_file_alone_puts_the_metrics_port_behind_its_tokens() -> None:
    m, port = _serve(_settings(tokens={ALICE: "alice"}))
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers={"Authorization": "Bearer wrong-token-0123456789"}
                         ).status_code == 401
        r = httpx.get(url, headers={"Authorization": f"Bearer {ALICE}"})
        assert r.status_code == 200 and "specwire:node_slots_in_use" in r.text
    finally:
        m.close()
    m, port = _serve(_settings(token=ADMIN, tokens={ALICE: "alice"}))
    try:                    # with both, either kind of token reads the figures
        url = f"http://127.0.0.1:{port}/metrics"
        assert httpx.get(url).status_code == 401
        for tok in (ALICE, ADMIN):
            assert httpx.get(url, headers={"Authorization": f"Bearer {tok}"}
                             ).status_code == 200
    finally:
        m.close()


def test_a_node_with_a_certificate_serves_metrics_and_purge_over_tls(certs) -> None:
    m, port = _serve(_settings(token=ADMIN, tls_cert=certs["server_cert"],
                               tls_key=certs["server_key"]))
    try:
        with pytest.raises(httpx.HTTPError):      # plain HTTP: no answer
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=3)
        url = f"https://127.0.0.1:{port}"
        with httpx.Client(verify=ssl.create_default_context(cafile=certs["ca"])) as c:
            assert c.get(url + "/metrics").status_code == 401
            r = c.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200 and "specwire:node_slots_in_use" in r.text
            r = c.post(url + "/purge", headers={"Authorization": f"Bearer {ADMIN}"})
            assert r.status_code == 200 and r.json()["identity"] == "all"
    finally:
        m.close()


def test_the_metrics_port_wants_a_client_certificate_under_mtls(certs) -> None:
    m, port = _serve(_settings(token=ADMIN, tls_cert=certs["server_cert"],
                               tls_key=certs["server_key"], tls_client_ca=certs["ca"]))
    try:
        url, auth = f"https://127.0.0.1:{port}/metrics", {"Authorization": f"Bearer {ADMIN}"}
        bare = ssl.create_default_context(cafile=certs["ca"])
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=bare) as c:
            c.get(url, headers=auth, timeout=3)
        mine = ssl.create_default_context(cafile=certs["ca"])
        mine.load_cert_chain(certs["client_cert"], certs["client_key"])
        with httpx.Client(verify=mine) as c:
            assert c.get(url, headers=auth).status_code == 200
    finally:
        m.close()


def test_a_handshake_that_never_finishes_is_cut_at_the_deadline(certs, monkeypatch) -> None:
    """Connections that say nothing to a TLS port are closed at DEADLINE_S, and the port
    answers meanwhile once a slot frees (the accept loop does no handshake)."""
    monkeypatch.setattr(exporter, "DEADLINE_S", 1.0)
    monkeypatch.setattr(exporter._Handler, "timeout", 0.5)
    m, port = _serve(_settings(tls_cert=certs["server_cert"], tls_key=certs["server_key"]))
    try:
        mute = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        with httpx.Client(verify=ssl.create_default_context(cafile=certs["ca"])) as c:
            assert c.get(f"https://127.0.0.1:{port}/metrics").status_code == 200
        start = time.monotonic()
        for s in mute:
            s.settimeout(10)
            with contextlib.suppress(ConnectionResetError):
                assert s.recv(1) == b""
            s.close()
        assert time.monotonic() - start < 9
    finally:
        m.close()


@pytest.mark.slow
def test_a_started_node_puts_its_metrics_port_behind_its_token_file_and_tls(certs,
                                                                             caplog) -> None:
    """start() itself (the bundled draft): --token-file alone and --tls-cert; the log
    says the token is required."""
    import logging

    from wire_helpers import draft_model_path
    caplog.set_level(logging.INFO, "specwire.node")
    settings = NodeSettings(model=ModelParams(draft_model_path(), n_ctx=256), port=0,
                            metrics_port=0, tokens={ALICE: "alice"},
                            tls_cert=certs["server_cert"], tls_key=certs["server_key"])
    node = node_server.start(settings)
    try:
        url = f"https://127.0.0.1:{node.metrics_port}/metrics"
        with httpx.Client(verify=ssl.create_default_context(cafile=certs["ca"])) as c:
            assert c.get(url).status_code == 401
            assert c.get(url, headers={"Authorization": f"Bearer {ALICE}"}).status_code == 200
        assert "token required" in caplog.text and "token off" not in caplog.text
    finally:
        node.stop()
