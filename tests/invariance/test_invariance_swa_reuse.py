"""Invariance under prompt-cache reuse after a sequence ran past the sliding window
(the soak's losslessness failure, issue 23), on the real bundled target.

The bundled target (Gemma 3) has sliding-window layers of 512 positions. Two
sequences share one unified KV cache (serve -np 2); one keeps reading prompts longer
than the window while the other answers a short one, and each short prompt goes to
whichever sequence is free, sharing only BOS with what that sequence's cache holds.
llama.cpp reuses the cells that fell out of a long sequence's window and drops that
sequence's cells up to them, BOS included; a prompt keeping BOS from such a cache
answered " 1000..." where plain decoding answers " the". Every short answer must be
plain decoding's, and the run must have met a cache whose window was gone.
"""

from __future__ import annotations

import random

import bundled
import pytest

from specwire.backend.base import reusable_prefix
from specwire.backend.llama import LlamaBackend
from specwire.config import DraftParams, ModelParams, SamplingParams
from specwire.engine.engine import Engine, Request

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]

LONG = ("The committee met on Tuesday to review the budget, the schedule and the list of "
        "open questions from the previous meeting. ") * 24      # ~550 tokens: past 512
SHORT = "The capital of France is"
GREEDY = SamplingParams(temperature=0.0)


def test_short_prompts_beside_long_ones_answer_as_plain_decoding() -> None:
    target = LlamaBackend(ModelParams(str(bundled.target()), n_ctx=1024), n_seq=2)
    assert target.n_swa > 0 and len(target.tokenize(LONG)) > target.n_swa
    engine = Engine(target)

    def request(text: str, n: int) -> Request:
        return Request(target.tokenize(text), n, GREEDY, DraftParams(enabled=False))

    plain = engine.generate(request(SHORT, 4), seq=0).run()
    rng = random.Random(0)
    gens: list = [None, None]
    short: list[bool] = [False, False]
    answers, window_gone = [], 0
    for _ in range(160):     # a bound: the loop ends once it has met what it proves
        if window_gone and len(answers) >= 10:
            break
        for s in (0, 1):
            if gens[s] is not None and not gens[s].done:
                continue
            if gens[s] is not None and short[s]:
                answers.append(gens[s].tokens)
            short[s] = rng.random() >= 0.4
            req = request(SHORT, 4) if short[s] else request(LONG, 8)
            view = target.seq(s)
            kept = reusable_prefix(view.tokens, req.prompt)
            window_gone += short[s] and kept > 0 and not view.holds_window(kept)
            gens[s] = engine.generate(req, seq=s)
        engine.step()
    assert window_gone, "the run never met a cache whose sliding window was gone"
    assert len(answers) >= 10
    assert [a for a in answers if a != plain] == [], f"plain decoding gives {plain}"
