"""The real target a slow test runs: the bundled F32 target, or for a test marked q8_0 a
Q8_0 copy of it.

The Q8_0 copy reads a quarter of the F32 file's bytes per token (44 against 15 tokens/s
on one core here) and, unlike F32, gives bitwise the rows of one-token decoding when it
verifies drafts in one sequence with flash attention (tests/backend/test_batch_invariance.py),
so it proves the same lossless properties, faster: the invariance tests of one sequence,
with drafters under fixed settings, run it. The rest keep F32: several sequences in one
context interleave their KV cells, which changes the Q8_0 copy's attention sums' last bits
(docs/determinism.md) and meets a near-tie in those tests' prompts; and where a drafter
works beside the target or a policy prices it, the draft (64 tokens/s) must outpace the
target by more than the Q8_0 copy leaves it. conftest.py names the test's target in
$LLAMA_ARG_MODEL before its fixtures start, so a `specwire` without -m, in this process or
a child, runs it too.
"""

from __future__ import annotations

import os
from pathlib import Path

from specwire.assets import models

ENV = "LLAMA_ARG_MODEL"


def name_target(q8_0: bool) -> None:
    """Prepare the test's target and make it the default of every `specwire` command."""
    role = "q8_0" if q8_0 else "target"
    path = models.ensure_model(role, progress=False)
    os.environ[ENV] = str(path)


def target() -> Path:
    """The current test's target (name_target's), the F32 file when none was named."""
    named = os.environ.get(ENV)
    return Path(named) if named else models.default_target(progress=False)
