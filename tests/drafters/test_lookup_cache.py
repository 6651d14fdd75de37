"""--lookup-cache-dynamic FILE: the n-gram drafter's cache of earlier requests, kept in a file.

Fast: the file format's round trip, the atomic write, every kind of bad file (cut short,
another format, version or vocabulary, corrupt) refused in one line naming the file, the
periodic and final saves, the drafters sharing the loaded cache, a restart on fakes
drafting from the file, and the flag's wiring in generate and serve (checked before any
model loads). Slow: `generate --draft-ngram -lcd F` twice on the bundled pair.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from fakes import FakeBackend, FakeModel

from specwire.build import build_drafter, lookup_file
from specwire.cli.args import CliError
from specwire.cli.main import build_parser
from specwire.cli.settings import engine_settings
from specwire.drafters.ngram import cache as cachemod
from specwire.drafters.ngram.cache import (
    MAGIC,
    LookupCache,
    LookupCacheError,
    encode,
    read_file,
)
from specwire.drafters.ngram.drafter import NgramDrafter
from specwire.drafters.ngram.persist import CacheFile
from specwire.engine.engine import Engine, Request
from specwire.settings import DraftSettings

V, FP = 48, "f" * 32
SEQS = [list(range(10)), [5, 6, 7, 8, 9, 1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 0, 1]]


def filled(*seqs: list[int], vocab: tuple[int, str] = (V, FP), **kw) -> LookupCache:
    c = LookupCache(vocab=vocab, **kw)
    for s in seqs:
        c.add(s)
    return c


def one_line(e: pytest.ExceptionInfo, path: Path, *needles: str) -> None:
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg, msg
    for n in needles:
        assert n in msg, msg


# --------------------------------------------------------------------------- round trip


def test_save_then_load_gives_the_same_sequences_oldest_first(tmp_path: Path) -> None:
    c = filled(*SEQS)
    c.add(SEQS[0])                      # held already: refreshed, now the newest
    path = tmp_path / "lookup.bin"
    c.save(path)
    back = LookupCache.load(path, V, FP)
    assert back.sequences() == c.sequences() == [tuple(SEQS[1]), tuple(SEQS[2]), tuple(SEQS[0])]
    assert back.tokens == c.tokens and back.vocab == (V, FP)
    for history in ([0, 5, 6, 7, 8], [3, 4, 5, 6], [42, 43, 44, 45], [1, 2, 3, 4]):
        assert back.match(history) == c.match(history), history
    back.add([9, 9, 9, 9, 9, 9])         # a loaded cache goes on learning, and saves again
    back.save(path)
    assert LookupCache.load(path, V, FP).sequences()[-1] == (9,) * 6


def test_the_header_says_format_version_and_vocabulary(tmp_path: Path) -> None:
    path = tmp_path / "lookup.bin"
    filled(*SEQS).save(path)
    data = path.read_bytes()
    assert data[:8] == MAGIC
    assert struct.unpack_from("<III", data, 8) == (2, V, len(FP))
    assert data[20:20 + len(FP)] == FP.encode()
    assert struct.unpack_from("<I", data, 20 + len(FP)) == (0,)     # no scope but ""
    got = read_file(path)
    assert got is not None and (got.n_vocab, got.fingerprint) == (V, FP)
    assert [s.tolist() for s in got.sequences] == SEQS
    assert got.scopes == [""] * len(SEQS)


def _version_1(seqs: list[list[int]]) -> bytes:
    """A file as version 1 wrote it: no scope table, no scope index."""
    body = (MAGIC + struct.pack("<III", 1, V, len(FP)) + FP.encode()
            + struct.pack("<IQ", len(seqs), sum(map(len, seqs))))
    for seq in seqs:
        body += struct.pack("<I", len(seq)) + struct.pack(f"<{len(seq)}I", *seq)
    return body + struct.pack("<I", zlib.crc32(body))


def test_a_version_1_file_is_read_as_scope_empty(tmp_path: Path) -> None:
    path = tmp_path / "v1.bin"
    path.write_bytes(_version_1(SEQS))
    back = LookupCache.load(path, V, FP)
    assert back.scoped() == [("", tuple(s)) for s in SEQS]
    assert back.match([0, 5, 6, 7, 8]) is not None


def test_each_sequence_keeps_its_scope_across_a_save(tmp_path: Path) -> None:
    c = LookupCache(vocab=(V, FP))
    c.add(SEQS[0], "a" * 32)
    c.add(SEQS[1], "")
    c.add(SEQS[2], "b" * 5)          # a length that needs padding to a word
    path = tmp_path / "scoped.bin"
    c.save(path)
    back = LookupCache.load(path, V, FP)
    assert back.scoped() == c.scoped()
    assert back.match([3, 4, 5, 6], "a" * 32) is not None
    assert back.match([3, 4, 5, 6]) is None and back.match([3, 4, 5, 6], "b" * 5) is None


def test_a_lookup_sees_its_own_scope_only() -> None:
    """The cross-tenant oracle: a sequence of scope A is never a match for scope B, and
    the same tokens kept in two scopes are two sequences, dropped one at a time."""
    c = LookupCache(max_tokens=100)
    secret = [7, 7, 1, 2, 3, 4, 9, 9, 9]
    c.add(secret, "A")
    assert c.match([1, 2, 3, 4], "A") is not None
    assert c.match([1, 2, 3, 4], "B") is None and c.match([1, 2, 3, 4]) is None
    c.add(secret, "B")
    assert len(c) == 2
    c.add(secret, "A")                # held already in A: refreshed, B's stays
    assert [sc for sc, _ in c.scoped()] == ["B", "A"]
    c._drop(next(iter(c._seqs)))
    assert c.match([1, 2, 3, 4], "B") is None and c.match([1, 2, 3, 4], "A") is not None


def _seq(scope_mark: int, i: int, n: int = 10) -> list[int]:
    """A sequence of n distinct tokens, unlike every other (scope_mark, i)'s."""
    return [1000 * scope_mark + 20 * i + j for j in range(n)]


def test_a_flooding_scope_evicts_its_own_sequences_never_anothers_share() -> None:
    """One bound, per-scope shares: the victim keeps its 30 tokens (its share is 40)
    while another scope floods the cache with 50 sequences; the flood makes room from
    its own oldest ones. Without shares (scope_share = the whole cache) the same flood
    evicts the victim's first, oldest first: the control."""
    for share, victim_kept in ((40, 3), (100, 0)):
        c = LookupCache(max_tokens=100, scope_share=share)
        for i in range(3):
            c.add(_seq(1, i), "victim")
        for i in range(50):
            c.add(_seq(2, i), "flood")
        assert c.tokens <= 100
        assert c.scope_tokens("victim") == 10 * victim_kept
        assert c.scope_tokens("flood") == c.tokens - 10 * victim_kept
        held = [seq for sc, seq in c.scoped() if sc == "flood"]
        assert held == [tuple(_seq(2, i)) for i in range(50 - len(held), 50)]  # the newest
        if victim_kept:
            assert c.match(_seq(1, 0)[:6], "victim") is not None


def test_with_no_scope_above_its_share_the_least_recently_used_scope_goes() -> None:
    """Scopes of 30 tokens each in a cache of 100 with shares of 40: none is above its
    share, so room comes from the least recently used scope; a lookup that finds a
    sequence marks its scope used."""
    c = LookupCache(max_tokens=100, scope_share=40)
    for s in range(3):
        for i in range(3):
            c.add(_seq(s, i), f"s{s}")
    assert c.match(_seq(0, 0)[:6], "s0") is not None     # s0 used: s1 is the oldest now
    c.add(_seq(3, 0), "s3")
    assert c.tokens == 100 and len(c) == 10               # at the bound: nothing out
    c.add(_seq(3, 1), "s3")
    assert c.scope_tokens("s1") == 20 and c.scope_tokens("s0") == 30
    assert c.scoped()[0] == ("s0", tuple(_seq(0, 0)))
    c.add(_seq(3, 2), "s3")
    c.add(_seq(3, 3), "s3")
    assert [c.scope_tokens(f"s{s}") for s in range(4)] == [30, 0, 30, 40]


def test_alone_a_scope_may_fill_the_whole_cache_oldest_out_first() -> None:
    """A single-tenant server (scope "") keeps what it kept before shares: the bound,
    oldest out first."""
    c = LookupCache(max_tokens=100)
    assert c.scope_share == 25                                  # the default: a quarter
    for i in range(15):
        c.add(_seq(0, i))
    assert c.sequences() == [tuple(_seq(0, i)) for i in range(5, 15)]


def test_a_negative_share_is_refused() -> None:
    with pytest.raises(ValueError, match="scope_share"):
        LookupCache(scope_share=-1)


def test_loading_keeps_the_newest_within_max_tokens(tmp_path: Path) -> None:
    path = tmp_path / "lookup.bin"
    filled(*SEQS).save(path)
    small = LookupCache.load(path, V, FP, max_tokens=20)
    assert small.sequences() == [tuple(SEQS[1]), tuple(SEQS[2])]


def test_a_missing_file_is_an_empty_cache_created_on_save(tmp_path: Path) -> None:
    path = tmp_path / "new.bin"
    c = LookupCache.load(path, V, FP)
    assert len(c) == 0 and not path.exists()
    f = CacheFile(path, V, FP)
    assert len(f.cache) == 0 and f.close() and path.exists()
    assert LookupCache.load(path, V, FP).sequences() == []


def test_save_needs_the_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        LookupCache().save(tmp_path / "x.bin")


# ------------------------------------------------------------------------ atomic write


def test_save_writes_a_temporary_file_fsyncs_it_then_renames(tmp_path: Path,
                                                             monkeypatch) -> None:
    path = tmp_path / "lookup.bin"
    path.write_bytes(b"old")
    calls: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:  # noqa: ANN001
        calls.append(("replace", f"{src} -> {dst}"))
        assert path.read_bytes() == b"old"          # untouched until the rename
        real_replace(src, dst)

    monkeypatch.setattr(cachemod.os, "fsync", fsync)
    monkeypatch.setattr(cachemod.os, "replace", replace)
    filled(*SEQS).save(path)
    kinds = [k for k, _ in calls]
    assert kinds[:2] == ["fsync", "replace"], calls          # the data, then the rename
    tmp = calls[0][1]
    assert os.path.dirname(tmp) == str(tmp_path) and tmp != str(path)   # beside it
    assert calls[1][1] == f"{tmp} -> {path}"
    assert kinds[2:] == ["fsync"] and calls[2][1] == str(tmp_path)      # then the folder
    assert sorted(os.listdir(tmp_path)) == ["lookup.bin"]
    assert LookupCache.load(path, V, FP).sequences() == [tuple(s) for s in SEQS]
    assert path.stat().st_mode & 0o777 == 0o600     # clients' prompts: the owner's only


def test_a_failed_save_leaves_the_old_file_and_no_temporary(tmp_path: Path,
                                                            monkeypatch) -> None:
    path = tmp_path / "lookup.bin"
    filled(SEQS[0]).save(path)
    before = path.read_bytes()

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cachemod.os, "fsync", full)
    with pytest.raises(LookupCacheError) as e:
        filled(*SEQS).save(path)
    one_line(e, path, "cannot write it: No space left on device")
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["lookup.bin"]


def test_saving_into_a_missing_folder_says_so(tmp_path: Path) -> None:
    path = tmp_path / "nowhere" / "lookup.bin"
    with pytest.raises(LookupCacheError) as e:
        filled(*SEQS).save(path)
    one_line(e, path, "cannot write it")
    with pytest.raises(LookupCacheError) as e:
        CacheFile(path, V, FP)
    one_line(e, path, "no such directory")


# ----------------------------------------------------------------------------- bad files


def _good(tmp_path: Path) -> bytes:
    filled(*SEQS).save(tmp_path / "good.bin")
    return (tmp_path / "good.bin").read_bytes()


def test_every_truncation_is_refused_naming_the_file(tmp_path: Path) -> None:
    data = _good(tmp_path)
    path = tmp_path / "cut.bin"
    for n in range(len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(LookupCacheError) as e:
            LookupCache.load(path, V, FP)
        one_line(e, path, "truncated")


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize("case, needle", [
    ("random", "not a specwire lookup cache"),
    ("llama.cpp", "not a specwire lookup cache"),
    ("version", "format version 3, this specwire reads versions 1 and 2 only"),
    ("trailing", "bytes past its end"),
    ("flipped", "checksum does not match"),
    ("miscounted", "do not add up"),
    ("overrun", "overrun"),
    ("fingerprint", "vocabulary fingerprint"),
    ("scope", "names scope 5 of 1"),
])
def test_a_file_of_another_format_or_version_or_corrupt_is_refused(
        tmp_path: Path, case: str, needle: str) -> None:
    good = _good(tmp_path)
    body = good[:-4]
    fp_end = 20 + len(FP) + 4         # the fingerprint, then an empty scope table
    if case == "random":
        data = bytes(range(256)) * 4
    elif case == "llama.cpp":
        # llama.cpp's common_ngram_cache file: ngrams and counts, no header
        data = struct.pack("<4i", 1, 2, 3, 4) + struct.pack("<i", 1) + struct.pack("<2i", 7, 3)
    elif case == "version":
        data = _with_crc(body[:8] + struct.pack("<I", 3) + body[12:])
    elif case == "trailing":
        data = good + b"\0\0\0\0"
    elif case == "flipped":
        at = len(good) - 10
        data = good[:at] + bytes([good[at] ^ 1]) + good[at + 1:]
    elif case == "miscounted":     # one sequence fewer announced, the tokens recounted
        n_seqs, n_tokens = struct.unpack_from("<IQ", body, fp_end)
        data = _with_crc(body[:fp_end] + struct.pack("<IQ", n_seqs - 1, n_tokens + 2)
                         + body[fp_end + 12:])
    elif case == "overrun":        # a sequence longer than what follows
        head = fp_end + 12 + 4     # past its scope index, its length
        data = _with_crc(body[:head] + struct.pack("<I", 1000) + body[head + 4:])
    elif case == "fingerprint":    # a fingerprint length no fingerprint has
        data = _with_crc(body[:16] + struct.pack("<I", 1 << 20) + body[20:])
    else:                          # a sequence naming a scope the table lacks
        data = _with_crc(body[:fp_end + 12] + struct.pack("<I", 5) + body[fp_end + 16:])
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    with pytest.raises(LookupCacheError) as e:
        LookupCache.load(path, V, FP)
    one_line(e, path, needle)


def test_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LookupCacheError) as e:
        LookupCache.load(tmp_path, V, FP)
    one_line(e, tmp_path, "is a directory")


# ---------------------------------------------------------------------------- vocabulary


@pytest.mark.parametrize("n_vocab, fingerprint", [(V + 1, FP), (V, "0" * 32), (V - 1, "x")])
def test_a_file_of_another_vocabulary_is_refused(tmp_path: Path, n_vocab: int,
                                                 fingerprint: str) -> None:
    path = tmp_path / "lookup.bin"
    filled(*SEQS).save(path)
    with pytest.raises(LookupCacheError) as e:
        LookupCache.load(path, n_vocab, fingerprint)
    one_line(e, path, "written for another vocabulary", f"{V} tokens, fingerprint {FP}",
             f"the target has {n_vocab} tokens, fingerprint {fingerprint}")


def test_no_token_outside_the_vocabulary_is_loaded(tmp_path: Path) -> None:
    """A file whose header matches but holding an id past the vocabulary (a checksum
    that matches too: written by a bug, not cut short) is refused whole."""
    path = tmp_path / "lookup.bin"
    path.write_bytes(encode([SEQS[0], [1, 2, 3, 4, V, 6]], V, FP))
    with pytest.raises(LookupCacheError) as e:
        LookupCache.load(path, V, FP)
    one_line(e, path, f"token id {V} is outside the vocabulary ({V} tokens)")


def test_the_vocabulary_is_the_handshakes_fingerprint(tmp_path: Path) -> None:
    target = FakeBackend(FakeModel(n_vocab=V))
    f = lookup_file(DraftSettings(kind="ngram", lookup_cache=str(tmp_path / "l.bin")), target)
    assert f is not None and f.cache.vocab == (V, target.vocab_fingerprint())
    assert lookup_file(DraftSettings(kind="ngram"), target) is None


# ------------------------------------------------------------------- saves while serving


def test_the_file_is_saved_every_few_sequences_and_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "lookup.bin"
    f = CacheFile(path, V, FP, every=2)
    seqs = [[i, i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(5)]
    for i, s in enumerate(seqs, 1):
        f.cache.add(s)
        if f._writer is not None:
            f._writer.join()
        if i == 2:
            assert LookupCache.load(path, V, FP).sequences() == [tuple(x) for x in seqs[:2]]
    assert f.saves == 2 and len(LookupCache.load(path, V, FP)) == 4   # the 5th is unsaved
    assert f.close() and f.saves == 3
    assert LookupCache.load(path, V, FP).sequences() == [tuple(x) for x in seqs]
    assert f.close() and f.saves == 3                                 # nothing new: no write


def test_a_failed_save_is_logged_and_retried_at_the_end(tmp_path: Path, caplog) -> None:
    folder = tmp_path / "d"
    folder.mkdir()
    f = CacheFile(folder / "lookup.bin", V, FP, every=1)
    folder.rmdir()
    with caplog.at_level(logging.ERROR):
        f.cache.add(SEQS[0])                     # the background save fails: logged
        f._writer.join()
        assert not f.close()                     # the final one too: False, logged
    assert caplog.text.count("cannot write it") == 2
    folder.mkdir()
    assert f.close() and len(LookupCache.load(folder / "lookup.bin", V, FP)) == 1


# --------------------------------------------------------------------- engines and drafters


def test_the_engines_ngram_drafters_share_the_loaded_cache(tmp_path: Path) -> None:
    target = FakeBackend(FakeModel(n_vocab=V))
    s = DraftSettings(kind="ngram", lookup_cache=str(tmp_path / "l.bin"))
    f = lookup_file(s, target)
    drafters = [build_drafter(s, target, cache=f.cache) for _ in range(3)]
    assert all(isinstance(d, NgramDrafter) and d.cache is f.cache for d in drafters)
    alone = [build_drafter(DraftSettings(kind="ngram"), target) for _ in range(2)]
    assert alone[0].cache is not alone[1].cache                  # without it: one each
    with pytest.raises(ValueError, match="only an n-gram drafter"):
        DraftSettings(kind="none", lookup_cache="x.bin")


def test_a_restarted_engine_drafts_from_the_file_and_the_output_is_unchanged(
        tmp_path: Path) -> None:
    model, path = FakeModel(n_vocab=V, seed=3), tmp_path / "lookup.bin"
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    plain = Engine(FakeBackend(model)).generate(Request(prompt, 40))
    for _ in plain:
        pass
    runs = []
    for _ in range(2):                                           # two "processes"
        target = FakeBackend(model)
        s = DraftSettings(kind="ngram", lookup_cache=str(path))
        f = lookup_file(s, target)
        gen = Engine(target, build_drafter(s, target, cache=f.cache)).generate(
            Request(prompt, 40))
        for _ in gen:
            pass
        f.close()
        runs.append((list(gen.tokens), gen.stats, f.loaded))
    (first, st1, loaded1), (second, st2, loaded2) = runs
    assert first == second == list(plain.tokens)
    assert (loaded1, loaded2) == (0, 1)
    assert st1.drafter.get("cache_drafts", 0) == 0 < st2.drafter["cache_drafts"]
    assert st2.draft_n_accepted > st1.draft_n_accepted


# -------------------------------------------------------------------------- the flag (CLI)


def parse(command: str, *argv: str):
    return build_parser().parse_args([command, "-m", "/nonexistent.gguf", *argv])


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("spelling", ["-lcd", "--lookup-cache-dynamic"])
def test_the_flag_reaches_the_drafter_settings(command: str, spelling: str,
                                               tmp_path: Path) -> None:
    path = str(tmp_path / "lookup.bin")
    a = parse(command, "--draft-ngram", spelling, path, *(["x"] if command == "generate" else []))
    assert a.lookup_cache_dynamic == path
    assert not hasattr(a, "compat_lookup_cache_dynamic")         # no longer an ignored flag
    assert engine_settings(a).draft.lookup_cache == path
    hybrid = parse(command, "--draft-url", "box:7070", "--draft-hybrid", spelling, path)
    assert engine_settings(hybrid).draft.lookup_cache == path


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_share_per_identity_reaches_the_drafters_caches(command: str,
                                                          tmp_path: Path) -> None:
    """--lookup-cache-per-identity TOKENS: each cache scope's share of the n-gram cache, in
    memory and in a file's; a negative one is refused naming the flag."""
    tail = ["x"] if command == "generate" else []
    a = parse(command, "--draft-ngram", "--lookup-cache-per-identity", "5000", *tail)
    s = engine_settings(a).draft
    assert s.lookup_share == 5000
    target = FakeBackend(FakeModel(n_vocab=V, seed=1))
    assert build_drafter(s, target).cache.scope_share == 5000
    assert engine_settings(parse(command, "--draft-ngram", *tail)).draft.lookup_share is None
    assert build_drafter(DraftSettings(kind="ngram"), target).cache.scope_share == \
        cachemod.DEFAULT_TOKENS // cachemod.DEFAULT_SHARE
    filed = DraftSettings(kind="ngram", lookup_cache=str(tmp_path / "l.bin"), lookup_share=64)
    assert lookup_file(filed, target).cache.scope_share == 64
    with pytest.raises(CliError, match="--lookup-cache-per-identity"):
        engine_settings(parse(command, "--draft-ngram", "--lookup-cache-per-identity", "-1",
                              *tail))


@pytest.mark.parametrize("argv, why", [
    (["--no-draft"], "there is no drafter (--no-draft)"),
    (["-md", "/nonexistent-draft.gguf"], "the draft model drafts alone"),
    (["--draft-url", "box:7070"], "add --draft-hybrid"),
])
def test_without_an_ngram_drafter_the_flag_warns_why(argv: list[str], why: str,
                                                     tmp_path: Path, caplog) -> None:
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"garbage")                                  # not even read
    with caplog.at_level(logging.WARNING, "specwire.flags"):
        s = engine_settings(parse("serve", "-lcd", str(bad), *argv))
    assert s.draft.lookup_cache is None
    [rec] = caplog.records
    assert rec.getMessage().startswith("--lookup-cache-dynamic: ignored: it is the n-gram")
    assert why in rec.getMessage()


@pytest.mark.parametrize("command", ["generate", "serve"])
@pytest.mark.parametrize("content, needle", [
    (b"garbage!", "not a specwire lookup cache"),
    (MAGIC + b"\1\0", "truncated"),
    (None, "no such directory"),
])
def test_a_bad_file_stops_the_command_before_the_model_loads(
        specwire_cli, command: str, content: bytes | None, needle: str,
        tmp_path: Path) -> None:
    path = tmp_path / ("lookup.bin" if content is not None else "gone/lookup.bin")
    if content is not None:
        path.write_bytes(content)
    extra = ["x"] if command == "generate" else []
    r = specwire_cli(command, "-m", "/nonexistent.gguf", "--draft-ngram", "-lcd", str(path),
                     *extra)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    [line] = [x for x in r.stderr.splitlines() if "error" in x]
    assert str(path) in line and needle in line, line


def test_serve_saves_the_cache_when_the_apps_lifespan_ends(tmp_path: Path) -> None:
    from fastapi import FastAPI

    from specwire.cli.commands.serve import _save_lookup_cache_at_shutdown

    path = tmp_path / "lookup.bin"
    f = CacheFile(path, V, FP, every=100)

    class Held:
        lookup_file = f

    app = FastAPI()
    _save_lookup_cache_at_shutdown(app, [Held()])

    async def life() -> None:
        async with app.router.lifespan_context(app):
            f.cache.add(SEQS[0])
            assert not path.exists()
    asyncio.run(life())
    assert LookupCache.load(path, V, FP).sequences() == [tuple(SEQS[0])]


# ---------------------------------------------------------------- the bundled model (slow)


def _generate(*args: str) -> dict:
    r = subprocess.run([sys.executable, "-m", "specwire", "generate", "--json", "--temp", "0",
                        "-c", "512", "-n", "48", *args], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.slow
def test_generate_twice_drafts_from_the_file_the_second_time(tmp_path: Path) -> None:
    prompt = "Write a Python function that returns the n-th Fibonacci number.\n"
    path = tmp_path / "lookup.bin"
    plain = _generate("--no-draft", prompt)
    first = _generate("--draft-ngram", "--lookup-cache-dynamic", str(path), prompt)
    assert path.exists()
    second = _generate("--draft-ngram", "-lcd", str(path), prompt)
    assert first["tokens"] == second["tokens"] == plain["tokens"]
    assert first["stats"]["drafter"].get("cache_drafts", 0) == 0
    assert second["stats"]["drafter"]["cache_drafts"] > 0
    assert second["timings"]["draft_n_accepted"] > first["timings"]["draft_n_accepted"]
