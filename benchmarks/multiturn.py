"""A long multi-turn chat against a draft node: what the caches on both ends save.

Each turn pastes a new stretch of a document (by default Python's own
argparse.py, the same text on every machine with the same Python) and asks
about it; the history grows by about --turn-tokens a turn, to about 8k tokens
after 8 turns. The chat is run three times on the same target, each from an
empty target cache:

  plain   no drafter; the target keeps its prompt cache (the tokens/s reference)
  cold    a draft node with --cache-ram 0, requests with cache_prompt false: both
          ends evaluate the whole history every turn (the behaviour before caches)
  warm    a draft node with its default conversation memory, cache_prompt true

Per turn: prompt tokens evaluated by the target (prompt_n; cache_n reused) and
by the node (draft_prompt_n; draft_cache_n reused), time to first token, and
decoding tokens/s against plain decoding of the same turn. Greedy decoding, so
every run must produce the same replies (checked).

    python -m benchmarks.multiturn [--turns 8] [--turn-tokens 1000] [-n 64]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from specwire.backend.llama import LlamaBackend
from specwire.bench import cpus
from specwire.bench.modes import DraftNode
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.engine.engine import Engine, Request
from specwire.link.remote import RemoteDrafter
from specwire.link.transport.channel import Link, LinkSettings
from specwire.text import chat

GREEDY = SamplingParams(temperature=0.0)
QUESTION = "Explain briefly what the code above does."


@dataclass(slots=True)
class Turn:
    turn: int
    prompt_tokens: int
    prompt_n: int  # evaluated by the target
    cache_n: int  # reused by the target
    draft_prompt_n: int | None  # evaluated by the drafter
    draft_cache_n: int | None  # reused by the drafter
    ttft_ms: float
    predicted_n: int
    tokens_per_s: float
    acceptance: float
    reply: list[int]


def document(n_chunks: int, chunk_tokens: int, target: LlamaBackend) -> list[str]:
    """n_chunks consecutive stretches of argparse.py of about chunk_tokens tokens each."""
    import argparse as source

    lines = inspect.getsource(source).splitlines(keepends=True)
    chunks, cur, cur_n = [], [], 0
    for line in lines:
        cur.append(line)
        cur_n += len(target.tokenize(line, add_special=False))
        if cur_n >= chunk_tokens:
            chunks.append("".join(cur))
            cur, cur_n = [], 0
            if len(chunks) == n_chunks:
                break
    return chunks


def run_chat(engine: Engine, chunks: list[str], n_predict: int, draft: bool,
             cache_prompt: bool) -> list[Turn]:
    """The whole conversation, turn by turn, from an empty target cache."""
    target = engine.target
    target.truncate(0)
    messages: list[dict] = [{"role": "system", "content": "You are a concise code reviewer."}]
    out = []
    for i, text in enumerate(chunks):
        messages.append({"role": "user", "content": f"```python\n{text}```\n{QUESTION}"})
        prompt = target.tokenize(chat.render_for(target, messages, None), add_special=False,
                                 parse_special=True)
        req = Request(prompt, n_predict, GREEDY, DraftParams(enabled=draft),
                      cache_prompt=cache_prompt)
        t0 = time.perf_counter()
        gen = engine.generate(req)
        ttft = None
        for _ in gen:
            if ttft is None:
                ttft = time.perf_counter() - t0
        st = gen.stats
        out.append(Turn(i + 1, len(prompt), st.prompt_n, st.cache_n, st.draft_prompt_n,
                        st.draft_cache_n, 1000 * (ttft or 0.0), st.predicted_n,
                        st.predicted_per_second, st.acceptance, list(gen.tokens)))
        reply = target.detokenize(gen.tokens).decode("utf-8", errors="replace")
        messages.append({"role": "assistant", "content": reply})
    return out


def remote(target: LlamaBackend, address: str) -> RemoteDrafter:
    link = Link(address, LinkSettings(), target.vocab_fingerprint(), target.n_vocab, target.name)
    drafter = RemoteDrafter([link], target.n_vocab, pipelined=True)
    errors = drafter.handshake()
    if errors[0]:
        raise SystemExit(f"draft node {address}: {errors[0]}")
    return drafter


def node_argv(a: argparse.Namespace, draft_path: str, cache: bool) -> list[str]:
    return [sys.executable, "-m", "specwire", "draft", "-m", draft_path, "--host", "127.0.0.1",
            "--port", "0", "--max-sessions", "2", "-c", str(a.ctx_size), "-td",
            str(a.threads_draft), *([] if cache else ["--cache-ram", "0"])]


def table(runs: dict[str, list[Turn]]) -> str:
    plain = runs["plain"]
    head = ("| run | turn | prompt | target eval | target cached | draft eval | draft cached "
            "| TTFT ms | tok/s | vs plain | accepted |")
    rows = [head, "|" + "---|" * 11]
    for name, turns in runs.items():
        for t, p in zip(turns, plain, strict=True):
            def num(x):
                return "-" if x is None else str(x)
            rows.append(
                f"| {name} | {t.turn} | {t.prompt_tokens} | {t.prompt_n} | {t.cache_n} "
                f"| {num(t.draft_prompt_n)} | {num(t.draft_cache_n)} | {t.ttft_ms:.0f} "
                f"| {t.tokens_per_s:.1f} | {t.tokens_per_s / p.tokens_per_s:.2f}x "
                f"| {100 * t.acceptance:.0f}% |")
    for name, turns in runs.items():
        ttft = sum(t.ttft_ms for t in turns)
        evald = sum(t.prompt_n for t in turns)
        devald = sum(t.draft_prompt_n or 0 for t in turns)
        rows.append(f"\n{name}: target evaluated {evald} prompt tokens, draft {devald}; "
                    f"time to first token summed over turns {ttft / 1000:.1f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from specwire.assets import models

    p = argparse.ArgumentParser(prog="python -m benchmarks.multiturn",
                                description=__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-tokens", type=int, default=1000, help="document tokens per turn")
    p.add_argument("-n", "--n-predict", type=int, default=64, help="reply tokens per turn")
    p.add_argument("-c", "--ctx-size", type=int, default=12288)
    p.add_argument("-t", "--threads", type=int, default=1)
    p.add_argument("-td", "--threads-draft", type=int, default=1)
    p.add_argument("--runs", default="cold,warm",
                   help="drafted runs, of cold,warm (plain always runs: the reference)")
    p.add_argument("--out", default="bench-multiturn.json", help="JSON results")
    a = p.parse_args(argv)
    target_path, draft_path = str(models.default_target()), str(models.default_draft())
    split = cpus.halves()
    if split is not None:
        cpus.pin_process(split[0])
    target = LlamaBackend(ModelParams(target_path, n_ctx=a.ctx_size, n_threads=a.threads))
    chunks = document(a.turns, a.turn_tokens, target)
    runs: dict[str, list[Turn]] = {}
    wanted = a.runs.split(",")
    runs["plain"] = run_chat(Engine(target), chunks, a.n_predict, False, True)  # the reference
    print("plain done", file=sys.stderr)
    for name in ("cold", "warm"):
        if name not in wanted:
            continue
        log = Path(a.out).with_suffix(f".{name}-node.log")
        with DraftNode(node_argv(a, draft_path, name == "warm"), log,
                       split[1] if split else None) as node:
            drafter = remote(target, node.start())
            try:
                runs[name] = run_chat(Engine(target, drafter), chunks, a.n_predict, True,
                                      name == "warm")
            finally:
                drafter.close()
        print(f"{name} done", file=sys.stderr)
    for name, turns in runs.items():
        for t, ref in zip(turns, runs["plain"], strict=True):
            if t.reply != ref.reply:
                print(f"WARNING: {name} turn {t.turn}: reply differs from plain decoding",
                      file=sys.stderr)
    Path(a.out).write_text(json.dumps({k: [asdict(t) for t in v] for k, v in runs.items()},
                                      indent=1))
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
