"""How the invariance tests compare outputs that must be the same: log-probabilities to a
tolerance, and where two greedy outputs first differ."""

from __future__ import annotations

import numpy as np

#: llama.cpp's rows for one position differ in the last bits between a batch of k + 1
#: (verification) and a batch of 1 (plain decoding): measured up to 2.4e-3 in log-probability
#: on the bundled F32 target with flash attention off, 1.5e-2 after sampling at T = 0.8 with
#: -fa auto (llama.cpp's default, which turns it on here). Tokens are compared exactly; the
#: probabilities to this.
LOGPROB_TOLERANCE = 3e-2


def same_alternatives(a: list, b: list) -> None:
    """Two top-n lists of (token, logprob): the same values, rank by rank, to the tolerance.

    The tokens are the same except at a near tie: at a rank where they differ, a
    neighbouring rank holds a value as close (or it is the last rank: its rival may be
    the first token outside the list).
    """
    assert len(a) == len(b)
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b, strict=True)):
        assert abs(la - lb) <= LOGPROB_TOLERANCE, (a, b)
        if ta != tb and i + 1 < len(a):
            near = [abs(la - a[j][1]) for j in (i - 1, i + 1) if 0 <= j < len(a)]
            assert min(near) <= 2 * LOGPROB_TOLERANCE, (a, b)


def explain_mismatch(target, prompt: str, ref: list[int], got: list[int]) -> str:
    """Where the outputs diverge: the target's top-2 logits there, plain vs batched."""
    i = next(j for j, (a, b) in enumerate(zip(ref, got, strict=False)) if a != b)
    history = target.tokenize(prompt) + ref[:i]
    target.truncate(0)
    single = target.eval(history, logits="last")[-1].copy()
    target.truncate(0)
    target.eval(history[:-4], logits="none")
    batched = target.eval(history[-4:], logits="all")[-1].copy()
    target.truncate(0)
    lines = [f"first difference at generated token {i}: plain {ref[i]}, speculative {got[i]}"]
    for name, row in (("plain", single), ("batched", batched)):
        top = np.argsort(-row)[:2]
        lines.append(f"  {name:8s} top-2 {top[0]}:{row[top[0]]:.6f} {top[1]}:{row[top[1]]:.6f} "
                     f"gap {row[top[0]] - row[top[1]]:.6f}")
    lines.append(f"  max |plain - batched| = {np.abs(single - batched).max():.6f}")
    return "\n".join(lines)


def taking_turns(texts: tuple, lengths: tuple) -> list[tuple]:
    """(text, draft length) pairs: every draft length once, the prompts taking turns, so
    each length and each prompt is verified without their cross product (which doubled
    the suite's slowest tests; docs/testing.md). A draft length that misses a near tie on
    one prompt would miss it on the other as likely."""
    return [(texts[i % len(texts)], k) for i, k in enumerate(lengths)]
