"""The premise of the tests' target (tests/support/bundled.py): on this CPU, the Q8_0 copy
of the bundled target gives bitwise the same logit rows whether a token is decoded alone or
read among others in one sequence, as a verification reads its drafts, with flash attention
on (-fa auto's choice here; off, the rows differ by up to 1.4). If a llama.cpp upgrade
breaks it, this fails by name, before an invariance test fails on a near-tie. The F32
target's rows differ by up to 0.03 at every width: lossless by its argmax's margin
(benchmarks/batch_invariance.py measures both)."""

from __future__ import annotations

import bundled
import numpy as np
import pytest

from specwire.backend.llama import LlamaBackend
from specwire.config import ModelParams

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]
PROMPT = "def mean(values):\n    return sum(values) /"
N = 20


def test_the_tests_target_reads_the_same_rows_at_every_width() -> None:
    be = LlamaBackend(ModelParams(str(bundled.target()), n_ctx=256))
    prompt = be.tokenize(PROMPT)
    rows = [be.eval(prompt)[-1].copy()]
    tokens = []
    for _ in range(N):                     # the reference: one token per decode
        tokens.append(int(np.argmax(rows[-1])))
        rows.append(be.eval(tokens[-1:])[-1].copy())
    alone = np.stack(rows[1:])             # (N, V): the row after each token
    for width in (2, 3, 5, 8, 16):
        be.truncate(len(prompt))
        read = np.concatenate([be.eval(tokens[i:i + width], logits="all").copy()
                               for i in range(0, N, width)])   # eval's rows are reused
        differ = np.flatnonzero(np.abs(read - alone).max(axis=1) > 0)
        assert differ.size == 0, f"width {width}: rows {differ.tolist()} differ from one-by-one"
