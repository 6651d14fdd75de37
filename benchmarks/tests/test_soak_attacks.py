"""benchmarks/soak_attacks.py's and soak.py's pure helpers for issue 40's attackers: how
a LoRA attacker's answer is counted, how a slot file is spoiled, which counts are faults,
the LoRA adapter written for a model's attention and the self-signed certificate."""

from __future__ import annotations

import contextlib
import ssl

import numpy as np
import pytest

from benchmarks import soak_attacks as attacks
from benchmarks.soak import attacker_faults


@pytest.mark.parametrize(("case", "status", "scale_max", "kind"), [
    ("scale_1e5", 400, 4.0, "refused"),
    ("nan", 415, 4.0, "refused"),
    ("scale_1e5", 200, 4.0, "unexpected"),     # past the bound and served: the bound failed
    ("scale_1e5", 500, 4.0, "unexpected"),
    ("scale_1e5", 200, 1e6, "served_own"),     # a wide bound lets it through
    ("scale_-1e5", 500, 1e6, "failed_own"),    # its NaN fails it alone
    ("scale_nan", 500, 1e6, "unexpected"),     # NaN is never in bound
    ("scale_1e300", 200, 1e6, "unexpected"),
])
def test_a_lora_attackers_answer_is_counted(case, status, scale_max, kind) -> None:
    assert attacks.expected_lora(case, status, scale_max) == kind


def test_the_bodies_are_hostile_and_the_posts_keep_one_plain_text() -> None:
    assert b"NaN" in attacks.LORA_REQUESTS["scale_nan"]
    assert set(attacks.LORA_POSTS) >= {"nan", "inf", "1e400", "text_plain"}


@pytest.mark.parametrize("how", attacks.CORRUPTIONS)
def test_each_corruption_changes_the_file(tmp_path, how) -> None:
    path = tmp_path / "slot.bin"
    original = bytes(range(256)) * 4
    path.write_bytes(original)
    attacks.corrupt(path, how)
    data = path.read_bytes()
    assert data != original and len(data) <= len(original)
    if how == "flip_middle":
        assert len(data) == len(original) and sum(a != b for a, b in zip(data, original,
                                                                          strict=True)) == 1


def test_faults_name_the_attacker_and_what_it_saw() -> None:
    reports = {
        "soak-attack-idle-keep-alive": {"opened": 9, "closed_by_server": 9,
                                        "close_s": {"p50": 5.0}},
        "soak-attack-tls-stall": {"opened_silent": 3, "held_past_deadline": 2},
        "soak-attack-slot-files": {"restore:400": 4, "restore_not_400": 1},
        "soak-attack-lora-scales": {"refused": 10, "first_unexpected": []},
        "soak-attack-slowloris": {"opened": 6},
    }
    assert attacker_faults(reports) == {
        "soak-attack-tls-stall:held_past_deadline": 2,
        "soak-attack-tls-stall:never_closed_by_server": 1,
        "soak-attack-slot-files:restore_not_400": 1}


def test_a_client_hello_is_one_tls_handshake_record() -> None:
    hello = attacks.client_hello()
    assert hello[0] == 0x16 and hello[5] == 0x01     # handshake record, ClientHello
    assert int.from_bytes(hello[3:5], "big") == len(hello) - 5


def test_the_lora_adapter_follows_the_models_attention_shapes(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    model = tmp_path / "model.gguf"
    w = gguf.GGUFWriter(str(model), arch="gemma3")
    for i in range(2):
        w.add_tensor(f"blk.{i}.attn_q.weight", np.zeros((24, 16), dtype=np.float32))
        w.add_tensor(f"blk.{i}.attn_v.weight", np.zeros((8, 16), dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_up.weight", np.zeros((32, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert attacks.lora_shapes(model) == ("gemma3", [
        ("blk.0.attn_q.weight", 16, 24), ("blk.0.attn_v.weight", 16, 8),
        ("blk.1.attn_q.weight", 16, 24), ("blk.1.attn_v.weight", 16, 8)])
    out = attacks.write_lora(model, tmp_path / "lora.gguf", rank=2)
    r = gguf.GGUFReader(str(out))
    assert bytes(r.fields["general.architecture"].parts[-1]).decode() == "gemma3"
    assert bytes(r.fields["adapter.type"].parts[-1]).decode() == "lora"
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert shapes["blk.0.attn_q.weight.lora_a"] == (16, 2)    # ggml's ne: [n_in, rank]
    assert shapes["blk.0.attn_q.weight.lora_b"] == (2, 24)    # [rank, n_out]
    assert shapes["blk.1.attn_v.weight.lora_b"] == (2, 8)
    assert len(shapes) == 8


def test_the_self_signed_certificate_verifies_for_its_address(tmp_path) -> None:
    key, cert = attacks.self_signed(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = attacks.tls_client(cert)
    c_in, c_out, s_in, s_out = (ssl.MemoryBIO() for _ in range(4))
    c = client.wrap_bio(c_in, c_out, server_hostname="127.0.0.1")
    s = server.wrap_bio(s_in, s_out, server_side=True)
    for _ in range(6):
        for obj in (c, s):
            with contextlib.suppress(ssl.SSLWantReadError):
                obj.do_handshake()
        s_in.write(c_out.read())
        c_in.write(s_out.read())
    c.do_handshake()
    assert c.getpeercert()["subjectAltName"] == (("DNS", "localhost"),
                                                   ("IP Address", "127.0.0.1"))
