"""Issue 40: a hostile client of a shared `serve` and the slot files, --prompt-cache,
/stats.json and --api-key-file.

Fast tests: the file format on bytes (state_file.py) and the HTTP routes over a toy engine
whose backend keeps its "KV state" as bytes and records what it is handed, so that a file
failing a check is seen never to reach it. Slow tests: the same attacks on `specwire
serve` over llama.cpp, where a truncated llama.cpp state file used to abort the process.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import httpx
import pytest
from toy_server import SpyDrafter, ToyBackend, serve_app

from specwire.config import SamplingParams
from specwire.engine.engine import Engine
from specwire.server import ServerSettings, create_app, prompt_cache, schemas, slot_files
from specwire.server import state_file as sf
from specwire.server.state_file import StateFileError

IDENT = {"model": "toy-1", "type_k": "f16", "type_v": "f16", "adapters": []}


class StateToy(ToyBackend):
    """The toy model with a state to save: its tokens, as bytes llama.cpp's would be."""

    def __init__(self) -> None:
        super().__init__(delay=0.0)
        self.handed: list[tuple[list[int], bytes]] = []   # every set_seq_state call

    def state_identity(self) -> dict:
        return dict(IDENT)

    def seq_state(self) -> tuple[list[int], bytes]:
        return list(self.tokens), b"cells:" + struct.pack(f"<{self.n_past}i", *self.tokens)

    def set_seq_state(self, tokens, data) -> int:
        data = bytes(data)
        self.handed.append((list(tokens), data))
        assert data == b"cells:" + struct.pack(f"<{len(tokens)}i", *tokens)
        self.truncate(0)
        self.tokens.extend(tokens)
        return len(tokens)


def _blob(tokens=(1, 2, 3), lora=(), ident=IDENT, state=None) -> bytes:
    state = b"cells:" + struct.pack(f"<{len(tokens)}i", *tokens) if state is None else state
    return b"".join(bytes(p) for p in sf.encode(ident, lora, list(tokens), state))


# ----------------------------------------------------------------- the format, on bytes


def test_a_file_round_trips_with_its_scales() -> None:
    got = sf.decode(_blob((5, 6, 7), lora=(0.5,)), IDENT, n_ctx=16)
    assert got.tokens == [5, 6, 7] and got.lora == (0.5,)
    assert bytes(got.state) == b"cells:" + struct.pack("<3i", 5, 6, 7)


def test_every_truncation_and_every_flipped_byte_is_refused() -> None:
    """Finding 3: llama.cpp aborted on 5 truncations of 5, one byte included. Here every
    prefix of a file, and the file with any one byte changed, fails the check."""
    blob = _blob(tuple(range(40)), lora=(1.0,))
    for n in range(len(blob)):
        with pytest.raises(StateFileError):
            sf.decode(blob[:n], IDENT, n_ctx=64)
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x41
        with pytest.raises(StateFileError):
            sf.decode(bytes(bad), IDENT, n_ctx=64)
    with pytest.raises(StateFileError, match="truncated or damaged"):
        sf.decode(blob + b"\0", IDENT, n_ctx=64)


@pytest.mark.parametrize(("key", "value"), [("model", "another"), ("type_k", "q8_0"),
                                            ("adapters", ["other.gguf"])])
def test_a_file_of_another_model_adapters_or_cache_type_is_refused(key, value) -> None:
    blob = _blob(ident={**IDENT, key: value})
    with pytest.raises(StateFileError, match=f"saved under another {key}"):
        sf.decode(blob, IDENT, n_ctx=16)


def test_a_file_of_more_tokens_than_the_context_or_of_llama_cpp_is_refused() -> None:
    with pytest.raises(StateFileError, match="more than the slot's context"):
        sf.decode(_blob(tuple(range(20))), IDENT, n_ctx=16)
    llama_file = struct.pack("<III", 0x67677371, 2, 0)    # llama.cpp's own seq file head
    with pytest.raises(StateFileError, match="not a specwire slot file"):
        sf.decode(llama_file, IDENT, n_ctx=16)


def test_a_failed_write_leaves_no_file_and_the_old_one_whole(tmp_path: Path,
                                                              monkeypatch) -> None:
    """Finding 3's way in: a save that failed (a full disk) left a partial file."""
    fd = sf.open_folder(str(tmp_path))
    try:
        sf.write_atomic(fd, "a.bin", [b"old"])

        def full(_fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", full)
        for name in ("a.bin", "b.bin"):
            with pytest.raises(OSError, match="No space"):
                sf.write_atomic(fd, name, [b"new", b"er"])
    finally:
        os.close(fd)
    assert sorted(os.listdir(tmp_path)) == ["a.bin"]
    assert (tmp_path / "a.bin").read_bytes() == b"old"


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    folder = tmp_path / "slots"
    folder.mkdir()
    (folder / "evil.bin").symlink_to(outside)
    fd = sf.open_folder(str(folder))
    try:
        with pytest.raises(StateFileError, match="symlink is never followed"):
            sf.read_whole(fd, "evil.bin", 1 << 20)
        sf.write_atomic(fd, "evil.bin", [b"mine"])
    finally:
        os.close(fd)
    assert outside.read_bytes() == b"precious"
    assert not (folder / "evil.bin").is_symlink()
    assert (folder / "evil.bin").read_bytes() == b"mine"


# ----------------------------------------------------------------- the routes, toy engine

KEYS = ("alpha", "beta")
A, B = ({"Authorization": f"Bearer {k}"} for k in KEYS)


def _app(folder: Path, **settings):
    backend = StateToy()
    settings = ServerSettings(sampling=SamplingParams(temperature=0.0),
                              slot_save_path=str(folder), **settings)
    return create_app(Engine(backend, SpyDrafter()), settings), backend


def _folder_of(key: str) -> str:
    return slot_files.key_folder(schemas.joined_scope(schemas.key_scope(key.encode())))


def _ask(c: httpx.Client, headers: dict, prompt: str = "PIN 4721 abc") -> dict:
    r = c.post("/completion", headers=headers, json={"prompt": prompt, "n_predict": 4})
    assert r.status_code == 200, r.text
    return r.json()


def _act(c: httpx.Client, headers: dict, action: str, name: str = "pin.bin") -> httpx.Response:
    body = {} if action == "erase" else {"filename": name}
    return c.post(f"/slots/0?action={action}", headers=headers, json=body)


def test_slot_files_are_each_keys_own(tmp_path: Path) -> None:
    """Finding 4: key B restored key A's file and read A's prompt back through cache_n,
    overwrote A's file, and erased A's slot. Now each key has a folder of its own, and a
    slot holding A's cache is not B's to save or erase."""
    app, backend = _app(tmp_path, api_key=",".join(KEYS))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, A)
        held = backend.n_past
        assert _act(c, A, "save").status_code == 200
        erase = _act(c, B, "erase")                         # A's cache, B's request
        assert erase.status_code == 403 and "another API key" in erase.text
        assert backend.n_past == held
        assert _act(c, B, "save").status_code == 403
        assert _act(c, B, "restore").status_code == 404     # A's name means nothing to B
        assert backend.handed == []
        _ask(c, B, "B's own text")                           # B's slot now (A's emptied)
        assert _act(c, B, "save").status_code == 200        # B's file of the same name
        assert _act(c, A, "restore").json()["n_restored"] == held   # A's is intact
        probe = _ask(c, A)
        assert probe["timings"]["cache_n"] == len("PIN 4721 abc") - 1
    a_dir, b_dir = _folder_of(KEYS[0]), _folder_of(KEYS[1])
    assert sorted(os.listdir(tmp_path)) == sorted([a_dir, b_dir])
    assert os.listdir(tmp_path / a_dir) == ["pin.bin"] == os.listdir(tmp_path / b_dir)
    assert (tmp_path / a_dir / "pin.bin").read_bytes() != (tmp_path / b_dir /
                                                          "pin.bin").read_bytes()


def test_a_damaged_file_is_a_400_and_never_reaches_the_backend(tmp_path: Path) -> None:
    """Finding 3 over HTTP: truncated (one byte, half), a flipped byte, a llama.cpp file, a
    directory, a symlink: each restore a 400 naming why; the backend is handed nothing
    and the server goes on."""
    app, backend = _app(tmp_path)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, {})
        assert _act(c, {}, "save", "good.bin").status_code == 200
        good = (tmp_path / "good.bin").read_bytes()
        flipped = bytearray(good)
        flipped[-3] ^= 1
        (tmp_path / "cut1.bin").write_bytes(good[:-1])
        (tmp_path / "half.bin").write_bytes(good[:len(good) // 2])
        (tmp_path / "flip.bin").write_bytes(bytes(flipped))
        (tmp_path / "llama.bin").write_bytes(struct.pack("<III", 0x67677371, 2, 0))
        (tmp_path / "dir.bin").mkdir()
        (tmp_path / "link.bin").symlink_to(tmp_path / "good.bin")
        for name, why in (("cut1.bin", "truncated"), ("half.bin", "truncated"),
                          ("flip.bin", "checksum"), ("llama.bin", "not a specwire slot file"),
                          ("dir.bin", "directory"), ("link.bin", "symlink")):
            r = _act(c, {}, "restore", name)
            assert r.status_code == 400 and why in r.text, (name, r.text)
        assert backend.handed == []
        assert _act(c, {}, "restore", "good.bin").status_code == 200
        assert len(backend.handed) == 1
        assert _ask(c, {})["timings"]["cache_n"] > 0


def test_a_save_that_fails_leaves_no_file(tmp_path: Path, monkeypatch) -> None:
    """A full disk during a save: a 507 naming it, and no file (not even a temporary one)
    for a later restore to trip on."""
    app, _ = _app(tmp_path)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, {})

        def full(_fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(os, "fsync", full)
        r = _act(c, {}, "save", "x.bin")
        assert r.status_code == 507 and "no file was left" in r.text
    assert os.listdir(tmp_path) == []


def test_each_key_has_a_quota_of_files_and_bytes(tmp_path: Path) -> None:
    """Low finding: no quota (8 saves under one key filled a small disk)."""
    app, _ = _app(tmp_path, api_key=",".join(KEYS), slot_save_files=2)
    size = 0
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, A)
        assert _act(c, A, "save", "1.bin").status_code == 200
        size = _act(c, A, "save", "2.bin").json()["n_written"]
        over = _act(c, A, "save", "3.bin")
        assert over.status_code == 403 and "quota is 2 files" in over.text
        assert _act(c, A, "save", "2.bin").status_code == 200     # overwriting is fine
        _ask(c, B)
        assert _act(c, B, "save", "3.bin").status_code == 200     # B's quota is B's
    assert len(os.listdir(tmp_path / _folder_of(KEYS[0]))) == 2
    (tmp_path / "b").mkdir()
    cap = size * 3 // 2
    app, _ = _app(tmp_path / "b", slot_save_bytes=cap)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, {})
        assert _act(c, {}, "save", "1.bin").json()["n_written"] == size
        over = _act(c, {}, "save", "2.bin")
        assert over.status_code == 403 and f"{cap} bytes" in over.text


def test_a_planted_symlink_is_replaced_not_followed(tmp_path: Path) -> None:
    """Low finding: a save followed a symlink planted in the folder out of it."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious")
    folder = tmp_path / "slots"
    folder.mkdir()
    (folder / "s.bin").symlink_to(outside)
    (folder / _folder_of(KEYS[1])).symlink_to(tmp_path)      # a key's folder, planted
    app, _ = _app(folder, api_key=",".join(KEYS))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, B)
        r = _act(c, B, "save", "s.bin")
        assert r.status_code == 500 and "never followed" in r.text
    app, _ = _app(folder)
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, {})
        assert _act(c, {}, "save", "s.bin").status_code == 200
    assert outside.read_bytes() == b"precious"
    assert not (folder / "s.bin").is_symlink()
    assert sorted(os.listdir(tmp_path)) == ["outside.txt", "slots"]


def test_restored_cells_keep_the_scales_they_were_computed_under(tmp_path: Path) -> None:
    """Finding 5: a slot restored from a file saved under other LoRA scales was reused by
    requests of the server's scales. The file carries its scales, and the engine reuses
    the cells only for requests of the same (Engine.cache_lora)."""
    backend = StateToy()
    engine = Engine(backend, SpyDrafter())
    slot = _Slot(engine)
    backend.eval([7, 8, 9], "none")
    engine.cache_lora[0] = (0.5,)
    assert slot_files.run(slot, "save", str(tmp_path), {"filename": "h.bin"})["n_saved"] == 3
    engine.cache_lora[0] = (1.0,)
    backend.truncate(0)
    assert slot_files.run(slot, "restore", str(tmp_path), {"filename": "h.bin"})[
        "n_restored"] == 3
    assert engine.cache_lora[0] == (0.5,) and backend.tokens == [7, 8, 9]


class _Slot:
    def __init__(self, engine: Engine) -> None:
        self.index, self.seq, self.engine, self.job = 0, 0, engine, None
        self.target = engine.batch.seq(0)

    @property
    def scope(self) -> str:
        return self.engine.scopes[0]


def test_prompt_cache_a_bad_file_is_a_warning_and_a_cold_start(tmp_path: Path,
                                                                caplog) -> None:
    """Finding 3's second half: a truncated --prompt-cache made serve exit at start (rc
    134). Each damaged file is now one warning, and the backend is handed nothing."""
    backend = StateToy()
    engine = Engine(backend, SpyDrafter())
    slot = _Slot(engine)
    slot.job, slot.last_used, slot.last_prompt = None, 1.0, [1, 2, 3]
    backend.eval([1, 2, 3, 4], "none")
    path = tmp_path / "cache.bin"
    cache = prompt_cache.PromptCache(str(path))
    assert prompt_cache.save(cache, [slot]) == 3
    good = path.read_bytes()
    for bad in (good[:-1], good[:10], b"", good[:-3] + b"xyz"):
        path.write_bytes(bad)
        caplog.clear()
        assert prompt_cache.restore(cache, [slot]) == 0
        assert "not used, serve starts cold" in caplog.text
    assert backend.handed == []
    path.write_bytes(good)
    assert prompt_cache.restore(cache, [slot]) == 3 and backend.tokens == [1, 2, 3]


# ------------------------------------------------------------ /stats.json, --api-key-file


def test_stats_json_lists_only_the_callers_requests(tmp_path: Path) -> None:
    """Low finding: /stats.json showed other keys' requests (sizes, timings) that /slots
    hides."""
    app, _ = _app(tmp_path, api_key=",".join(KEYS))
    with serve_app(app) as url, httpx.Client(base_url=url, timeout=30) as c:
        _ask(c, A, "a secret prompt of A")
        mine = c.get("/stats.json", headers=A).json()
        theirs = c.get("/stats.json", headers=B).json()
    assert mine["served"] == 1 and mine["recent"][0]["prompt_n"] == len("a secret prompt of A")
    assert theirs["served"] == 0 and theirs["recent"] == []


def test_api_key_file_lines_are_taken_whole(tmp_path: Path) -> None:
    """Low finding: a comma in an --api-key-file line made two keys."""
    from specwire.cli.commands.serve import _server_settings, api_keys
    from specwire.cli.main import build_parser
    keyfile = tmp_path / "keys"
    keyfile.write_text("# ops\ntenant,one\nplain\n")
    a = build_parser().parse_args(["serve", "--api-key-file", str(keyfile)])
    keys = api_keys(a)
    assert keys == ("tenant,one", "plain")
    settings = _server_settings(a, keys, {}, None)
    app = create_app(Engine(ToyBackend(delay=0.0), SpyDrafter()), settings)
    with serve_app(app) as url:
        def status(key: str) -> int:
            return httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                             timeout=30).status_code
        assert [status(k) for k in ("tenant,one", "plain", "tenant", "one")] == [
            200, 200, 401, 401]


def test_slot_quota_flags_reach_the_settings() -> None:
    from specwire.cli.commands.serve import _server_settings
    from specwire.cli.main import build_parser
    a = build_parser().parse_args(["serve", "--slot-save-files", "3",
                                   "--slot-save-bytes", "1000"])
    s = _server_settings(a, (), {}, None)
    assert (s.slot_save_files, s.slot_save_bytes) == (3, 1000)
    d = _server_settings(build_parser().parse_args(["serve"]), (), {}, None)
    assert (d.slot_save_files, d.slot_save_bytes) == (16, 8 << 30)


# ----------------------------------------------------------------- llama.cpp, real serve
#
# A random llama of 2 layers and 64 dimensions (0.5 MB, written in well under a second),
# a second one of the same shapes and other weights, and a LoRA adapter for it: serve
# starts on them in a second or two, and llama.cpp reads the same files it would of a
# real model. Main aborted (SIGABRT) on the truncated files below.

TINY = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_ff": 128}


def _tiny_model(path: Path, seed: int) -> str:
    import gguf
    import numpy as np
    rng = np.random.default_rng(seed)
    e, ff = TINY["n_embd"], TINY["n_ff"]
    toks = (["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
            + ["\u2581" + c for c in "abcdefghijklmnopqrstuvwxyz"]
            + list("abcdefghijklmnopqrstuvwxyz0123456789"))
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_name("tiny")
    w.add_context_length(512)
    w.add_embedding_length(e)
    w.add_block_count(TINY["n_layer"])
    w.add_feed_forward_length(ff)
    w.add_head_count(TINY["n_head"])
    w.add_head_count_kv(TINY["n_head"])
    w.add_rope_dimension_count(e // TINY["n_head"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(toks))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("llama")
    w.add_token_list(toks)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(toks) - 259)])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * (len(toks) - 259))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)

    def rand(name: str, *shape: int) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    rand("token_embd.weight", len(toks), e)
    w.add_tensor("output_norm.weight", np.ones(e, np.float32))
    rand("output.weight", len(toks), e)
    for i in range(TINY["n_layer"]):
        for norm in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{norm}.weight", np.ones(e, np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            rand(f"blk.{i}.{name}.weight", e, e)
        rand(f"blk.{i}.ffn_gate.weight", ff, e)
        rand(f"blk.{i}.ffn_up.weight", ff, e)
        rand(f"blk.{i}.ffn_down.weight", e, ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def _tiny_lora(path: Path) -> str:
    import gguf
    import numpy as np
    rng = np.random.default_rng(7)
    e, rank = TINY["n_embd"], 4
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 8.0)
    for i in range(TINY["n_layer"]):
        for name in ("attn_q", "attn_v"):
            w.add_tensor(f"blk.{i}.{name}.weight.lora_a",
                         rng.standard_normal((rank, e), dtype=np.float32) * 3 * e ** -0.5)
            w.add_tensor(f"blk.{i}.{name}.weight.lora_b",
                         rng.standard_normal((e, rank), dtype=np.float32) * 3 * rank ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("tiny")
    return {"model": _tiny_model(folder / "tiny.gguf", 0),
            "other": _tiny_model(folder / "tiny2.gguf", 1),
            "lora": _tiny_lora(folder / "lora.gguf")}


def _serve(model: str, *flags: str):
    from serve_process import run_serve
    return run_serve("-m", model, "--no-draft", "--no-warmup", "-t", "1", "-c", "256", *flags)


@pytest.fixture(scope="module")
def keyed_serve(tiny, tmp_path_factory):
    """One `serve` with two keys and a slot folder, for the module's attacks."""
    folder = tmp_path_factory.mktemp("slots")
    with _serve(tiny["model"], "--api-key", ",".join(KEYS), "--slot-save-path",
                str(folder)) as (url, log):
        yield url, folder, log


def _post(url: str, path: str, headers: dict, body: dict) -> httpx.Response:
    return httpx.post(url + path, headers=headers, json=body, timeout=120)


BODY = {"prompt": "abc def ghi jkl", "n_predict": 6, "temperature": 0, "return_tokens": True}


@pytest.mark.slow
def test_llama_a_truncated_slot_file_is_a_400_not_an_abort(keyed_serve) -> None:
    """Before: restoring a slot file truncated by one byte killed serve (GGML_ASSERT
    nread <= state_size, SIGABRT)."""
    url, folder, _ = keyed_serve
    first = _post(url, "/completion", A, BODY).json()
    assert _post(url, "/slots/0?action=save", A, {"filename": "t.bin"}).status_code == 200
    (saved,) = folder.rglob("t.bin")
    whole = saved.read_bytes()
    for cut in (1, len(whole) // 2):
        saved.write_bytes(whole[:-cut])
        r = _post(url, "/slots/0?action=restore", A, {"filename": "t.bin"})
        assert r.status_code == 400 and "truncated" in r.text, r.text
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    saved.write_bytes(whole)
    assert _post(url, "/slots/0?action=restore", A, {"filename": "t.bin"}).json()[
        "n_restored"] > 0
    again = _post(url, "/completion", A, BODY).json()
    assert again["timings"]["cache_n"] > 0 and again["tokens"] == first["tokens"]


@pytest.mark.slow
def test_llama_another_key_cannot_restore_or_erase(keyed_serve) -> None:
    """Before: B restored A's file (200, and cache_n then told B how much of its guess A's
    prompt shared: a PIN, digit by digit) and erased A's slot (200)."""
    url, _, _ = keyed_serve
    secret = {**BODY, "prompt": "pin 9316 pin"}
    assert _post(url, "/completion", A, secret).status_code == 200
    assert _post(url, "/slots/0?action=save", A, {"filename": "pin.bin"}).status_code == 200
    assert _post(url, "/slots/0?action=erase", B, {}).status_code == 403
    assert _post(url, "/slots/0?action=restore", B, {"filename": "pin.bin"}).status_code == 404
    guess = _post(url, "/completion", B, {**secret, "prompt": "pin 9"}).json()
    assert guess["timings"]["cache_n"] == 0


@pytest.mark.slow
def test_llama_a_file_of_another_model_is_refused(keyed_serve, tiny, tmp_path: Path) -> None:
    """Before: a file saved by another model of the same shapes was restored (200)."""
    url, folder, _ = keyed_serve
    assert _post(url, "/completion", A, BODY).status_code == 200
    assert _post(url, "/slots/0?action=save", A, {"filename": "m.bin"}).status_code == 200
    (saved,) = folder.rglob("m.bin")
    other = tmp_path / "slots"
    copy = other / saved.relative_to(folder)        # where this key's file would be
    copy.parent.mkdir(parents=True, exist_ok=True)
    copy.write_bytes(saved.read_bytes())
    with _serve(tiny["other"], "--api-key", ",".join(KEYS), "--slot-save-path",
                str(other)) as (url2, _):
        r = _post(url2, "/slots/0?action=restore", A, {"filename": "m.bin"})
    assert r.status_code == 400 and "saved under another model" in r.text


@pytest.mark.slow
def test_llama_a_truncated_prompt_cache_starts_cold(keyed_serve, tiny, tmp_path: Path) -> None:
    """Before: a --prompt-cache truncated by one byte made serve exit at start (SIGABRT)."""
    url, folder, _ = keyed_serve
    first = _post(url, "/completion", A, BODY).json()
    assert _post(url, "/slots/0?action=save", A, {"filename": "pc.bin"}).status_code == 200
    (saved,) = folder.rglob("pc.bin")
    cache = tmp_path / "cache.bin"
    cache.write_bytes(saved.read_bytes()[:-1])
    with _serve(tiny["model"], "--prompt-cache", str(cache), "--prompt-cache-ro") as (url2,
                                                                                    log):
        again = httpx.post(url2 + "/completion", json=BODY, timeout=120).json()
        text = log()
    assert "not used, serve starts cold" in text
    assert again["tokens"] == first["tokens"] and again["timings"]["cache_n"] == 0


@pytest.mark.slow
def test_llama_a_file_saved_under_other_lora_scales_is_not_reused(tiny, tmp_path: Path) -> None:
    """Before: a slot restored from a file saved under scale 0.5 was reused by a request of
    the server's scale 1.0 (cache_n 40), whose output then differed from plain decoding
    from its second token."""
    body = {**BODY, "prompt": [1, *range(260, 300)], "n_predict": 8, "speculative": False}
    half = [{"id": 0, "scale": 0.5}]
    with _serve(tiny["model"], "--lora", tiny["lora"], "--slot-save-path",
                str(tmp_path)) as (url, _):
        def ask(**kw) -> dict:
            r = httpx.post(url + "/completion", json={**body, **kw}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        def act(action: str) -> int:
            return httpx.post(f"{url}/slots/0?action={action}", json={"filename": "h.bin"},
                              timeout=60).status_code

        plain = ask(cache_prompt=False)["tokens"]
        at_half = ask(lora=half)["tokens"]
        assert at_half != plain
        assert act("save") == 200
        ask(prompt=[1, 270, 271])                   # the slot's cache: scale 1.0 now
        assert act("restore") == 200
        again = ask()
        assert again["tokens"] == plain and again["timings"]["cache_n"] == 0
        assert act("restore") == 200
        reused = ask(lora=half)
        assert reused["tokens"] == at_half and reused["timings"]["cache_n"] > 0
