"""The real target the slow tests run: a Q8_0 copy of the bundled target, or the bundled F32
target itself for tests marked f32.

Q8_0 reads a quarter of the F32 target's bytes per token and, unlike F32, gives bitwise the
same rows whether a token is decoded alone or read among its drafts in one sequence
(tests/backend/test_batch_invariance.py), so it proves the lossless properties of one
sequence as the F32 target does, 2.6x faster on one core. Two kinds of test keep the F32
target (the f32 marker): several sequences in one context, whose interleaved KV cells
change the attention sums' last bits (docs/determinism.md), where these tests' prompts meet
a near-tie on the Q8_0 copy; and a drafter working beside the target, which must outpace it.
conftest.py names the test's target in $LLAMA_ARG_MODEL before its fixtures start, so a
`specwire` without -m, in this process or a child, runs it too.
"""

from __future__ import annotations

import os
from pathlib import Path

from specwire.assets import models

ENV = "LLAMA_ARG_MODEL"


def name_target(f32: bool) -> None:
    """Prepare the test's target and make it the default of every `specwire` command."""
    path = models.default_target(progress=False) if f32 else models.ensure_model("q8_0", False)
    os.environ[ENV] = str(path)


def target() -> Path:
    """The current test's target (name_target's), the Q8_0 copy when none was named."""
    named = os.environ.get(ENV)
    return Path(named) if named else models.ensure_model("q8_0", progress=False)
