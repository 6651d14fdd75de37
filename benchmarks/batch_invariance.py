"""Is a model's verification batch-invariant on this machine's llama.cpp kernels?

Greedy-decodes N tokens one at a time (the reference rows), then re-reads the same tokens in
chunks of width w with every row kept, as a verification of w drafted tokens reads them, and
compares each row with the reference: bitwise, and by its argmax. Speculative decoding is
token-identical to plain decoding exactly when every width gives the reference's argmax.
Also reports one thread's plain decoding speed, so that a cheaper test target can be chosen
by what it saves.

    python benchmarks/batch_invariance.py MODEL.gguf [--tokens 64] [--widths 2,3,4,8,16] [-fa off]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from specwire.backend.llama import LlamaBackend
from specwire.config import ModelParams

PROMPTS = (
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The history of the printing press begins in",
    "Q: What is the capital of Australia?\nA:",
)


def reference(be: LlamaBackend, prompt: list[int], n: int) -> tuple[list[int], np.ndarray, float]:
    """Greedy tokens, their one-at-a-time rows (n, V), and seconds per token."""
    be.truncate(0)
    row = be.eval(prompt)[-1]
    tokens, rows = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        tok = int(np.argmax(row))
        tokens.append(tok)
        rows.append(row.copy())
        row = be.eval([tok])[-1]
    return tokens, np.stack(rows), (time.perf_counter() - t0) / n


def chunked(be: LlamaBackend, prompt: list[int], tokens: list[int], w: int) -> np.ndarray:
    """The same positions' rows, read w tokens per decode as a verification reads them."""
    be.truncate(0)
    rows = [be.eval(prompt)[-1].copy()]
    for i in range(0, len(tokens) - 1, w):
        chunk = tokens[i:i + w]
        rows.extend(r.copy() for r in be.eval(chunk, logits="all"))
    return np.stack(rows[:len(tokens)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--widths", default="2,3,4,5,8,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("-fa", "--flash-attn", default="auto", choices=("on", "off", "auto"))
    a = ap.parse_args()
    be = LlamaBackend(ModelParams(a.model, n_ctx=a.ctx, n_threads=a.threads,
                                  flash_attn=a.flash_attn))
    widths = [int(w) for w in a.widths.split(",")]
    print(f"{a.model}: {a.threads} thread(s), -fa {a.flash_attn}, {a.tokens} tokens per prompt")
    worst = {w: [0, 0, 0.0] for w in widths}   # bitwise-differing rows, argmax changes, max |d|
    speeds = []
    for text in PROMPTS:
        prompt = list(be.tokenize(text))
        tokens, ref, s = reference(be, prompt, a.tokens)
        speeds.append(1 / s)
        for w in widths:
            got = chunked(be, prompt, tokens, w)
            diff = np.abs(got - ref).max(axis=1)
            worst[w][0] += int((diff > 0).sum())
            worst[w][1] += int((got.argmax(axis=1) != ref.argmax(axis=1)).sum())
            worst[w][2] = max(worst[w][2], float(diff.max()))
    n = a.tokens * len(PROMPTS)
    print(f"plain decoding: {np.mean(speeds):.1f} tokens/s")
    for w, (differ, flips, mx) in worst.items():
        print(f"width {w:2d}: {differ}/{n} rows differ bitwise, {flips} argmax changes, "
              f"max |diff| {mx:.3g}")


if __name__ == "__main__":
    main()
