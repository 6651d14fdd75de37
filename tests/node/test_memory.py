"""Conversation memory on both ends: the draft node's KV cache and the server's slots.

* the node's memory in-process (node/kv_cache.py on the bundled draft model):
  saved states restore exactly, the budget and the sequence count evict least
  recently used first;
* draft nodes as subprocesses over real links: turn 2 of a chat reuses turn 1
  (draft_cache_n), eviction by --cache-sessions and --cache-ram, isolation
  between interleaved conversations (each gets the drafts a fresh node gives),
  output equal to plain decoding with a warm cache, and a 32k-token history
  that reaches the node while the target goes on without it;
* `specwire serve -np 2` with a draft node: a chat's next turn goes to the slot
  holding its prompt, timings carry cache_n, draft_cache_n and draft_prompt_n,
  cache_prompt false evaluates the whole prompt.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_process import run_serve
from wire_helpers import (
    GREEDY,
    N_CTX,
    SEEDED,
    NodeProcess,
    draft_model_path,
    node_process,
    request,
    run_to_end,
    wait_for,
)

from specwire.backend import llama
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import ModelParams
from specwire.engine.engine import Engine
from specwire.node.kv_cache import MIB, KvCache

ROOT = Path(__file__).resolve().parents[2]

#: Three unrelated conversations' openings (each well over NOTICE_AFTER tokens apart from
#: the shared chat header, so that a wrong reuse would show in the counts).
TEXTS = [
    "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a\n\n# Memoised version:\n",
    "The river runs from the mountains through three valleys before it reaches the sea; "
    "its name in the old language means",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
    "GROUP BY name ORDER BY",
]
HEADER = "<start_of_turn>user\nContinue the following text exactly as it would go on.\n"


def chat_prompt(target, i: int, repeat: int = 3) -> list[int]:
    """Conversation i's first prompt: a shared header, then its own text."""
    return target.tokens(HEADER + TEXTS[i] * repeat)


def turn(target, url: str, prompt: Sequence[int], n: int = 12, sampling=GREEDY,
         **draft) -> tuple[list[int], object]:
    """One request through a synchronous drafter on url (it waits for the node's first
    answer, so the node's cache figures are in); returns (tokens, stats)."""
    rd = target.drafter(url, pipelined=False, sync_timeout_s=30.0)
    try:
        g = Engine(target.backend, rd).generate(request(prompt, n, sampling, 4, **draft))
        tokens = run_to_end(g)
        return tokens, g.stats
    finally:
        rd.close()


# ================================================================== the memory in-process


@pytest.fixture(scope="module")
def draft_params() -> ModelParams:
    return ModelParams(draft_model_path(), n_ctx=N_CTX, n_threads=1)


def _filled(params: ModelParams, tokens: Sequence[int]) -> LlamaBackend:
    be = LlamaBackend(params, load_model(params))
    be.eval(tokens, logits="none")
    return be


@pytest.mark.slow
def test_saved_state_restores_the_same_logits(draft_params, target) -> None:
    """A sequence copied out and back into another context continues exactly as the
    original does."""
    tokens = chat_prompt(target, 0)
    a = _filled(draft_params, tokens[:-1])
    saved = llama.save(a)
    assert saved.size > 1000 * len(tokens[:-1])       # KV cells, not just the ids
    b = LlamaBackend(draft_params, a.model)
    assert llama.restore(b, saved) and list(b.tokens) == tokens[:-1]
    want = a.eval(tokens[-1:]).copy()
    got = b.eval(tokens[-1:])
    assert np.array_equal(want, got)
    a.close()
    b.close()


def _sequence_bytes(params: ModelParams, tokens: Sequence[int]) -> int:
    be = _filled(params, tokens)
    try:
        return llama.save(be).size
    finally:
        be.close()


@pytest.mark.slow
def test_memory_keeps_the_most_recent_within_budget_and_count(draft_params, target) -> None:
    """Three conversations through one pooled context: each one that is pushed out of
    the context is saved; the count and the byte budget evict least recently used first;
    a sequence larger than the whole budget is not kept."""
    model = load_model(draft_params)
    seqs = [chat_prompt(target, i, repeat=6) for i in range(3)]
    seqs = [s[:min(map(len, seqs))] for s in seqs]   # one length: one size in RAM
    size = _sequence_bytes(draft_params, seqs[0])

    def run(mem: KvCache, order: Sequence[int]) -> list[int]:
        """Sessions in this order; each ends holding its sequence. Returns, per session,
        how many tokens of its sequence the context it got already held."""
        held = []
        for i in order:
            be = mem.acquire(seqs[i])
            n = 0
            while n < min(len(be.tokens), len(seqs[i])) and be.tokens[n] == seqs[i][n]:
                n += 1
            held.append(n)
            be.truncate(n)
            if n < len(seqs[i]):
                be.eval(seqs[i][n:], logits="none")
            mem.release(be)
        return held

    header = len(target.tokens(HEADER))
    full = [len(s) for s in seqs]
    # By count, least recently used out: 0 and 1 saved, 0 used again, so 2's arrival in
    # RAM evicts 1, not 0 (first in, but used since).
    by_count = KvCache(draft_params, model, ram_mib=1024, sessions=2, max_contexts=1)
    held = run(by_count, [0, 1, 2, 0, 1, 2])
    assert held == [0, header, header, full[0], header, full[2]]
    assert by_count.counters.restores == 2 and by_count.counters.evictions >= 1
    by_count.close()
    one = KvCache(draft_params, model, ram_mib=1024, sessions=1, max_contexts=1)
    assert run(one, [0, 1, 2, 0]) == [0, header, header, header]
    one.close()
    # By bytes: room for one sequence, not two.
    budget_mib = -(-int(1.2 * size) // MIB)
    assert 2 * size > budget_mib * MIB
    by_bytes = KvCache(draft_params, model, ram_mib=budget_mib, sessions=32, max_contexts=1)
    assert run(by_bytes, [0, 1, 2, 1, 0]) == [0, header, header, full[1], header]
    assert by_bytes.saved_bytes <= budget_mib * MIB and by_bytes.counters.evictions >= 1
    by_bytes.close()
    # Larger than the whole budget: never kept.
    assert size > MIB, "the test sequences are too short to exceed 1 MiB"
    tiny = KvCache(draft_params, model, ram_mib=1, sessions=32, max_contexts=1)
    assert run(tiny, [0, 1, 0]) == [0, header, header] and tiny.counters.too_big >= 1
    tiny.close()


@pytest.mark.slow
def test_cached_sessions_are_forgotten_after_the_ttl(draft_params, target) -> None:
    """--cache-ttl: a saved state and a warm context unused for longer are forgotten (by
    expire at a given time, then by the sweeper on its own), and the next session with
    their history reuses nothing."""
    model = load_model(draft_params)
    seqs = [chat_prompt(target, i, repeat=2) for i in range(2)]

    def session(mem: KvCache, tokens: Sequence[int]) -> int:
        be = mem.acquire(tokens)
        n = 0
        while n < min(len(be.tokens), len(tokens)) and be.tokens[n] == tokens[n]:
            n += 1
        be.truncate(n)
        be.eval(tokens[n:], logits="none")
        mem.release(be)
        return n

    mem = KvCache(draft_params, model, ram_mib=1024, sessions=4, max_contexts=1, ttl_s=60)
    try:
        session(mem, seqs[0])
        session(mem, seqs[1])          # takes the context: seqs[0] is saved to RAM
        assert mem.pooled() == 1 and mem.saved_bytes > 0
        assert mem.expire(time.monotonic() + 30) == 0
        assert mem.expire(time.monotonic() + 61) == 2
        assert mem.pooled() == 0 and mem.saved_bytes == 0
        assert session(mem, seqs[0]) == 0           # nothing of it is left
    finally:
        mem.close()
    swept = KvCache(draft_params, model, ram_mib=1024, sessions=4, max_contexts=1, ttl_s=0.2)
    try:
        session(swept, seqs[0])
        assert swept.pooled() == 1
        deadline = time.monotonic() + 10
        while swept.pooled() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert swept.pooled() == 0
    finally:
        swept.close()


# ================================================================== draft nodes over links


@pytest.fixture(scope="module")
def cache_node(tmp_path_factory) -> Iterator[NodeProcess]:
    """A draft node of its own with the default memory, one session at a time."""
    with node_process(tmp_path_factory.mktemp("cache-node"), ["--max-sessions", "2"]) as n:
        yield n


@pytest.mark.slow
def test_turn_two_reuses_turn_one_and_equals_plain(target, cache_node) -> None:
    """Turn 2 of a chat (turn 1's prompt and reply, then a new message) finds turn 1 in
    the node's cache: it evaluates only what is new, and the output is plain decoding's,
    greedy and seeded."""
    prompt = chat_prompt(target, 0)
    out1, st1 = turn(target, cache_node.url, prompt)
    assert out1 == target.plain(prompt, GREEDY, 12)
    assert st1.draft_cache_n is not None and st1.draft_prompt_n is not None
    assert st1.draft_cache_n + st1.draft_prompt_n == len(prompt)
    second = prompt + out1 + target.tokens("\nAnd now in Rust:\n")[1:]
    for sampling in (GREEDY, SEEDED):
        out2, st2 = turn(target, cache_node.url, second, sampling=sampling)
        assert out2 == target.plain(second, sampling, 12)
        assert st2.draft_cache_n >= len(prompt), st2.timings()
        assert st2.draft_prompt_n == len(second) - st2.draft_cache_n
        assert st2.timings()["draft_cache_n"] == st2.draft_cache_n
        assert st2.draft_n_accepted > 0


@pytest.mark.slow
def test_node_without_memory_evaluates_every_turn(target, tmp_path) -> None:
    """--cache-ram 0: the node keeps nothing, so turn 2 evaluates its whole history."""
    prompt = chat_prompt(target, 1)
    with node_process(tmp_path, ["--cache-ram", "0"], name="nocache") as n:
        out1, _ = turn(target, n.url, prompt)
        second = prompt + out1 + target.tokens(" Next:")[1:]
        _, st = turn(target, n.url, second)
        assert st.draft_cache_n == 0 and st.draft_prompt_n == len(second)


@pytest.mark.slow
def test_cache_sessions_evicts_least_recently_used(target, tmp_path) -> None:
    """--cache-sessions 1 with one context: after conversations 0, 1, 2 the node holds
    2 in its context and 1 in RAM; 1 comes back whole, 0 only as the shared header."""
    prompts = [chat_prompt(target, i) for i in range(3)]
    header = len(target.tokens(HEADER))
    with node_process(tmp_path, ["--cache-sessions", "1", "--max-sessions", "1"],
                      name="lru") as n:
        for p in prompts:
            turn(target, n.url, p, n=8)
        _, st1 = turn(target, n.url, prompts[1], n=8)
        assert st1.draft_cache_n == len(prompts[1]) - 1        # all but the one re-evaluated
        _, st0 = turn(target, n.url, prompts[0], n=8)
        assert header - 1 <= st0.draft_cache_n < len(prompts[0]) - 1


@pytest.mark.slow
def test_interleaved_conversations_do_not_see_each_other(target, tmp_path) -> None:
    """Conversation B interleaved with A on a node with memory (A1 B1 A2 B2) drafts exactly
    what it drafts interleaved with another conversation A' of the same length, and its
    drafts recall the password stated at its own start: no token of A reaches B's drafts
    (a node that reused A's cells past the shared header drafts A's code here instead).
    A node without memory is no reference: the same tokens evaluated in other batches
    differ in the last bits, enough to flip a near tie in a draft."""
    header = len(target.tokens(HEADER))
    # B's drafts depend on its own first tokens: they recall the password stated there.
    b1 = target.tokens(HEADER + "The password is tulip-4817.\n" + TEXTS[2]
                       + "\nRepeat the password. The password is")
    a1 = chat_prompt(target, 0, repeat=6)
    other = chat_prompt(target, 1, repeat=6)
    n = min(len(a1), len(other))
    a1, other = a1[:n], other[:n]
    assert a1[:header] == other[:header] and a1[header:] != other[header:]

    def interleave(url: str, a: list[int]) -> tuple[list[list[int]], int]:
        out_a, _ = turn(target, url, a)
        out_b, _ = turn(target, url, b1)
        a2 = a + out_a + target.tokens(" Then:")[1:]
        b2 = b1 + out_b + target.tokens("\nOnce more, the password is")[1:]
        turn(target, url, a2)
        _, st = turn(target, url, b2)
        return _drafts(target, url, b2), st.draft_cache_n

    with node_process(tmp_path, ["--max-sessions", "2"], name="with-a") as x, \
            node_process(tmp_path, ["--max-sessions", "2"], name="with-other") as y:
        drafts_x, cached_x = interleave(x.url, a1)
        drafts_y, cached_y = interleave(y.url, other)
    assert drafts_x == drafts_y
    assert "tulip" in target.backend.detokenize(drafts_x[0]).decode(errors="replace")
    assert cached_x == cached_y >= len(b1)             # B2 found B1 in both


def _drafts(target, url: str, history: list[int]) -> list[list[int]]:
    """The node's first three synchronous drafts for history, each round keeping the whole
    draft and appending one token of the target's (greedy, no early stop)."""
    from specwire.config import DraftParams

    rd = target.drafter(url, pipelined=False, sync_timeout_s=30.0)
    try:
        rd.begin(history, GREEDY, DraftParams(n_max=6, p_min=0.0))
        wait_for(rd.transport.live, 10, "the session to open")   # as the target's prefill would
        h, out = list(history), []
        for _ in range(3):
            d = rd.propose(h, 6)
            out.append(list(d.tokens))
            h = h + list(d.tokens) + [d.tokens[0] if d.tokens else 1]
            rd.learn(h, len(d.tokens), len(d.tokens) + 1)
        rd.end()
        return out
    finally:
        rd.close()


# ================================================================== a long history


@pytest.mark.slow
def test_long_history_reaches_the_node_and_the_target_does_not_wait(target, tmp_path) -> None:
    """A 32k-token history: the Open fits gRPC's limits, the node says at once that it
    catches up on it (draft_prompt_n), and a synchronous target meanwhile gets empty
    drafts without waiting. Ended before the node has caught up (a 32k prefill takes this
    2-core machine many minutes), the node stops within a batch and keeps what it
    evaluated: the conversation's next session starts from there, not from zero."""
    from specwire.config import DraftParams

    chunk = target.tokens(TEXTS[1] + " " + TEXTS[0])[1:]
    history = ([target.backend.model.bos] + chunk * (32000 // len(chunk) + 1))[:32000]
    # One session: the node's context holds 2 x --max-sessions sequences of -c cells each,
    # and eight sessions' worth of 32k (9 GiB of KV) took 22 s to allocate here.
    with node_process(tmp_path, ["-c", "32768", "-tbd", "2", "--max-sessions", "1"],
                      name="long") as n:
        rd = target.drafter(n.url, pipelined=False, sync_timeout_s=5.0)
        try:
            rd.begin(history, GREEDY, DraftParams(n_max=4, p_min=0.0))
            wait_for(rd.transport.live, 20, "the session to open")   # as the target's prefill would
            h = list(history)
            waits = []
            for i in range(20):                   # the target decodes plainly meanwhile
                t0 = time.perf_counter()
                d = rd.propose(h, 4)
                waits.append(time.perf_counter() - t0)
                assert len(d) == 0
                if i == 0:                        # the first answer: the node's notice
                    assert rd.cache_use() == (0, 32000)
                h.append(chunk[len(h) % len(chunk)])
                rd.learn(h, 0, 1)
                time.sleep(0.1)
            print("waits for the node's answers (s):", [round(w, 3) for w in waits])
            # The first includes the node making a 32k context; none waits for the prefill.
            assert waits[0] < 5.0 and max(waits[1:]) < 0.5
            rd.end()
            wait_for(lambda: "session closes" in n.log(), 120, "the node to end the session")
            kept = int(n.log().split("session closes: ")[1].split()[0])
            assert 0 < kept < 32000
            rd.begin(h, GREEDY, DraftParams(n_max=4, p_min=0.0))
            wait_for(rd.transport.live, 20, "the second session to open")
            assert len(rd.propose(h, 4)) == 0
            assert rd.cache_use() == (kept, len(h) - kept)
            rd.end()
        finally:
            rd.close()


# ================================================================== the server's slots


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[str]:
    """`specwire serve -np 2` on the bundled target with a draft node (default memory)."""
    folder = tmp_path_factory.mktemp("served")
    with node_process(folder, ["--max-sessions", "2"], name="slots-node") as node, \
            run_serve("-t", "1", "-c", str(2 * N_CTX), "-np", "2", "--draft-url", node.url,
                      "--temp", "0") as (url, _):
        yield url


def _complete(url: str, prompt: str, **body) -> dict:
    r = httpx.post(url + "/completion", json={"prompt": prompt, "n_predict": 8, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_next_turn_goes_to_the_slot_holding_its_prompt(served: str) -> None:
    """Conversations A then B take the two slots; each one's next turn goes back to its
    own slot (most of its prompt cached there), not to the least recently used one, and
    reuses it in both caches; cache_prompt false makes the target evaluate the whole
    prompt again, with the same output."""
    a = HEADER + TEXTS[0] * 3
    b = TEXTS[2] * 3
    ra = _complete(served, a)
    rb = _complete(served, b)
    assert ra["id_slot"] != rb["id_slot"]
    # B's next turn: the least recently used slot is A's, but B's holds its prompt.
    rb2 = _complete(served, b + rb["content"] + " more")
    assert rb2["id_slot"] == rb["id_slot"] and rb2["timings"]["cache_n"] > 0
    a2 = a + ra["content"] + "\nAnd again:\n"
    r2 = _complete(served, a2)
    assert r2["id_slot"] == ra["id_slot"]
    t = r2["timings"]
    assert t["cache_n"] >= ra["tokens_evaluated"] - 1
    assert t["prompt_n"] == r2["tokens_evaluated"] - t["cache_n"]
    assert t["draft_cache_n"] >= ra["tokens_evaluated"] - 1
    assert t["draft_prompt_n"] == r2["tokens_evaluated"] - t["draft_cache_n"]
    r3 = _complete(served, a2, cache_prompt=False)
    assert r3["timings"]["cache_n"] == 0
    assert r3["timings"]["prompt_n"] == r3["tokens_evaluated"]
    assert r3["content"] == r2["content"]
    metrics = httpx.get(served + "/metrics").text
    assert "specwire:prompt_tokens_cached_total" in metrics


@pytest.mark.slow
def test_chat_timings_through_the_openai_client(served: str) -> None:
    """The OpenAI client sees llama-server's timings with cache_n on a chat's second turn."""
    from openai import OpenAI

    client = OpenAI(base_url=served + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Write a haiku about " + TEXTS[1]}]
    model = client.models.list().data[0].id
    r1 = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    messages += [{"role": "assistant", "content": r1.choices[0].message.content},
                 {"role": "user", "content": "Another one."}]
    r2 = client.chat.completions.create(model=model, messages=messages, max_tokens=8)
    t = r2.model_extra["timings"]
    assert t["cache_n"] > r1.usage.prompt_tokens // 2
    assert t["prompt_n"] + t["cache_n"] == r2.usage.prompt_tokens


@pytest.mark.slow
def test_cache_reuse_shifts_a_cached_chunk_into_place(target) -> None:
    """--cache-reuse 8: a prompt that drops a passage from the middle of the cached one
    (a client trimming its context) keeps the chunk after it, shifted to its new position;
    without --cache-reuse only the common prefix is kept."""
    from specwire.config import DraftParams
    from specwire.engine.engine import Request

    head = target.tokens(HEADER)
    dropped = target.tokens(" " + TEXTS[1])[1:]
    kept = target.tokens(" " + TEXTS[0])[1:]
    tail = target.tokens(" Now the tests.<end_of_turn>\n<start_of_turn>model\n")[1:]
    first, second = head + dropped + kept, head + kept + tail
    plain = DraftParams(enabled=False)
    for reuse, cached in ((8, len(head) + len(kept)), (0, len(head))):
        engine = Engine(target.backend)
        engine.cache_reuse = reuse
        engine.generate(Request(first, 4, GREEDY, plain)).run()
        g = engine.generate(Request(second, 8, GREEDY, plain))
        out = g.run()
        assert (g.stats.cache_n, g.stats.prompt_n) == (cached, len(second) - cached), reuse
        assert len(out) == 8
        assert list(target.backend.tokens[:len(second)]) == second


def test_cache_flags_are_refused_with_one_clear_line(specwire_cli) -> None:
    import argparse

    from specwire.cli.args import CliError
    from specwire.cli.commands import serve
    from specwire.server import ServerSettings, schemas
    from specwire.server.errors import ApiError

    for args, needle in ((["--cache-ram", "-1"], "--cache-ram"),
                         (["--cache-sessions", "-2"], "--cache-sessions")):
        r = specwire_cli("draft", *args)
        assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    for argv, needle in ((["-sps", "1.5"], "--slot-prompt-similarity"),
                         (["--cache-reuse", "-1"], "--cache-reuse")):
        args = parser.parse_args(["serve", "-m", "/nonexistent.gguf", *argv])
        with pytest.raises(CliError, match=needle):
            args.func(args)

    class Toy:
        name, n_vocab, n_ctx = "toy.gguf", 128, 64

        def tokenize(self, text, add_special=True, parse_special=True):
            return [1] + [min(ord(c), 127) for c in text]

    def parse(body):
        return schemas.completion(body, Toy(), ServerSettings(), ["toy"]).request

    assert parse({"prompt": "hi"}).cache_prompt
    assert not parse({"prompt": "hi", "cache_prompt": False}).cache_prompt
    with pytest.raises(ApiError, match="cache_prompt"):
        parse({"prompt": "hi", "cache_prompt": "no"})


@pytest.mark.slow
@pytest.mark.parametrize("threaded", [False, True], ids=["local", "local-pipelined"])
def test_a_local_draft_model_reports_what_it_reused(target, draft_params, threaded) -> None:
    """A draft model in this process keeps its cache between requests: turn 2 reports
    draft_cache_n covering turn 1's prompt, draft_prompt_n the rest; output is plain's."""
    from specwire.drafters.model import ModelDrafter
    from specwire.link.threaded import ThreadedDrafter

    backend = LlamaBackend(draft_params, load_model(draft_params))
    drafter = ThreadedDrafter(backend) if threaded else ModelDrafter(backend)
    try:
        engine = Engine(target.backend, drafter)
        first = chat_prompt(target, 1)
        g = engine.generate(request(first, 12, GREEDY, 4))
        out = run_to_end(g)
        assert (g.stats.draft_cache_n, g.stats.draft_prompt_n) == (0, len(first))
        second = first + out + target.tokens(" Then:")[1:]
        g = engine.generate(request(second, 12, GREEDY, 4))
        assert run_to_end(g) == target.plain(second, GREEDY, 12)
        assert g.stats.draft_cache_n >= len(first)
        assert g.stats.draft_prompt_n == len(second) - g.stats.draft_cache_n
    finally:
        if threaded:
            drafter.end()
        backend.close()
