"""benchmarks/stacks.py: the hand encoding against protobuf, in microbenchmarks and in
synchronous rounds."""

from __future__ import annotations

import os

import pytest

from benchmarks.stacks import codec, codec_ops, main, protobuf_only
from specwire.link.messages import Verdict
from specwire.link.transport import roundcodec


def test_both_ways_of_each_operation_give_the_same_result() -> None:
    for name, (hand, proto) in codec_ops(4).items():
        assert hand() == proto(), name


def test_codec_times_every_operation_both_ways() -> None:
    r = codec(2, warm_calls=10, cold_calls=3, evict_mb=1)
    assert set(r) == {"verdict encode", "verdict decode", "chunk encode", "chunk decode"}
    for figures in r.values():
        assert set(figures) == {"hand_warm", "pb_warm", "hand_cold", "pb_cold"}
        assert all(v > 0 for v in figures.values())


def test_protobuf_only_turns_the_hand_encoding_off_and_back_on() -> None:
    v = Verdict(3, 1, [5])
    with protobuf_only():
        assert roundcodec.verdict_bytes(v) is None
        assert "specwire-stacks-" in os.environ["PYTHONPATH"]
    assert roundcodec.verdict_bytes(v) is not None
    assert "specwire-stacks-" not in os.environ.get("PYTHONPATH", "")


def test_bad_arguments_are_refused(capsys) -> None:
    assert main(["--rounds", "0"]) == 2
    assert "stacks: " in capsys.readouterr().err


@pytest.mark.slow
def test_sync_rounds_with_and_without_the_hand_encoding(capsys) -> None:
    assert main(["-k", "2", "--rounds", "3", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.splitlines()[-2:]] == ["h2", "h2-pb"]
