"""Peer text made safe to log (link/transport/peertext.py) and the clear-text token warning."""

from __future__ import annotations

import logging

from specwire.link.transport.channel import Link, LinkSettings, loopback
from specwire.link.transport.peertext import PEER_TEXT_MAX, peer_text


def test_peer_text_is_one_bounded_printable_line() -> None:
    assert peer_text("model-Q4 ok") == "model-Q4 ok"
    forged = "bad\n2026-01-01 INFO all good\x1b[31m\u202e\r\x00"
    safe = peer_text(forged)
    assert "\n" not in safe and "\x1b" not in safe and "\u202e" not in safe and "\x00" not in safe
    assert safe.startswith("bad?2026-01-01 INFO all good?[31m")
    long = peer_text("x" * 10**6)
    assert long == "x" * PEER_TEXT_MAX + "..."
    assert peer_text("é ü 中文") == "é ü 中文"
    assert peer_text(ValueError("boom")) == "boom"


def test_grpc_status_message_from_a_peer_is_bounded() -> None:
    import pytest

    from specwire.link.transport.h2.grpcframe import GrpcStatus, check_status

    with pytest.raises(GrpcStatus) as e:
        check_status([(":status", "200"), ("grpc-status", "13"),
                      ("grpc-message", "%0A" * 5000 + "x")])
    assert "\n" not in str(e.value) and len(str(e.value)) < PEER_TEXT_MAX + 20


def test_a_token_in_clear_text_off_this_machine_is_warned_about(caplog) -> None:
    assert loopback("127.0.0.1:7070") and loopback("localhost:1") and loopback("[::1]:7070")
    assert not loopback("10.0.0.2:7070") and not loopback("node.lan:7070")
    args = ("fp", 100, "target")
    with caplog.at_level(logging.WARNING, logger="specwire.remote"):
        Link("127.0.0.1:7070", LinkSettings(token="t"), *args)
        Link("10.0.0.2:7070", LinkSettings(), *args)
        Link("10.0.0.2:7070", LinkSettings(token="t", tls_ca="/ca.pem"), *args)
        assert not caplog.records
        Link("10.0.0.2:7070", LinkSettings(token="t"), *args)
    assert len(caplog.records) == 1 and "clear text" in caplog.records[0].getMessage()
