"""A ThreadedDrafter on the bundled draft model that drafts an alternate wherever its draft
is at all unsure (AlternateParams' thresholds at their loosest, four a chunk, four tokens
long), so that many rounds of an invariance test verify one."""

from __future__ import annotations

from functools import partial

import pytest

from specwire.assets import models
from specwire.backend.llama import LlamaBackend, load_model
from specwire.config import ModelParams
from specwire.link import alternates
from specwire.link.alternates import AlternateParams
from specwire.link.threaded import ThreadedDrafter


def threaded_alternates_everywhere(monkeypatch: pytest.MonkeyPatch, n_ctx: int,
                                   value_min: float = 0.0) -> ThreadedDrafter:
    """The drafter, with the loosest AlternateParams patched in for the test's duration.
    value_min=1.0: no alternate is worth drafting, so each goes as its second choice alone
    (Open.second_choices)."""
    monkeypatch.setattr(alternates, "AlternateParams",
                        partial(AlternateParams, top_below=1.0, value_min=value_min))
    p = ModelParams(str(models.default_draft(progress=False)), n_ctx=n_ctx, n_threads=1)
    return ThreadedDrafter(LlamaBackend(p, load_model(p)),
                           alternates=AlternateParams(per_chunk=4, length=4))
