"""Token probabilities -> the JSON each API reports them in.

* llama-server's /completion: `completion_probabilities`, one entry per token
  with id, token, bytes and logprob + top_logprobs, or, with
  post_sampling_probs, prob + top_probs (probabilities, not logs);
* OpenAI chat: `logprobs: {"content": [{token, logprob, bytes, top_logprobs}]}`;
* OpenAI completions: `logprobs: {tokens, token_logprobs, top_logprobs, text_offset}`.

A probability of zero (a token a filter removed) is written as log-probability
-9999, as OpenAI does: JSON has no -inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from specwire.sample.logprobs import TokenProb

Piece = Callable[[int], bytes]

#: OpenAI's stand-in for log(0).
LOG_ZERO = -9999.0


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOG_ZERO


def _text(piece: Piece, token: int) -> tuple[str, list[int]]:
    raw = piece(token)
    return raw.decode("utf-8", errors="replace"), list(raw)


def llama(probs: Sequence[TokenProb], piece: Piece, post: bool) -> list[dict]:
    out = []
    for p in probs:
        text, raw = _text(piece, p.token)
        entry: dict = {"id": p.token, "token": text, "bytes": raw}
        alts = []
        for t, lp in p.top:
            at, ab = _text(piece, t)
            alts.append({"id": t, "token": at, "bytes": ab,
                         **({"prob": math.exp(lp)} if post else {"logprob": _lp(lp)})})
        if post:
            entry.update(prob=math.exp(p.logprob), top_probs=alts)
        else:
            entry.update(logprob=_lp(p.logprob), top_logprobs=alts)
        out.append(entry)
    return out


def chat(probs: Sequence[TokenProb], piece: Piece) -> dict:
    content = []
    for p in probs:
        text, raw = _text(piece, p.token)
        top = []
        for t, lp in p.top:
            at, ab = _text(piece, t)
            top.append({"token": at, "logprob": _lp(lp), "bytes": ab})
        content.append({"token": text, "logprob": _lp(p.logprob), "bytes": raw,
                        "top_logprobs": top})
    return {"content": content, "refusal": None}


def completions(probs: Sequence[TokenProb], piece: Piece, offset: int = 0) -> dict:
    tokens, logprobs, tops, offsets = [], [], [], []
    for p in probs:
        text, _ = _text(piece, p.token)
        tokens.append(text)
        logprobs.append(_lp(p.logprob))
        tops.append({_text(piece, t)[0]: _lp(lp) for t, lp in p.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}
