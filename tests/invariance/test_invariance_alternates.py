"""Pre-drafted branches never change the output: the real bundled pair, greedy and seeded,
draft lengths 1, 2, 4 and 8, through a real draft node (pipelined) and on a thread.

The alternates only change what is drafted; each is verified like any draft. The
in-process runs draft an alternate wherever the draft is at all unsure (thresholds
at their loosest), so that many rounds verify one.
"""

from __future__ import annotations

import pytest
from alternates_everywhere import threaded_alternates_everywhere
from invariance_checks import taking_turns
from wire_helpers import CODE, GREEDY, PROSE, SEEDED, request, run_to_end

from specwire.engine.engine import Engine

pytestmark = [pytest.mark.slow, pytest.mark.q8_0]

DRAFT_LENGTHS = (1, 2, 4, 8)
N = 40


def _totals(stats: list[dict]) -> dict[str, float]:
    keys = ("alternates_received", "alternate_rounds", "rejections", "starved_rounds")
    return {k: sum(s.get(k, 0.0) for s in stats) for k in keys}


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_remote_pipelined_with_alternates_is_token_identical(target, node, sp) -> None:
    seen = []
    for text, k in taking_turns((CODE, PROSE), DRAFT_LENGTHS):
        prompt = target.tokens(text)
        want = target.plain(prompt, sp, N)
        remote = target.drafter(node.url, pipelined=True)
        assert remote.alternates is not None
        try:
            gen = Engine(target.backend, remote).generate(request(prompt, N, sp, n_max=k))
            assert run_to_end(gen) == want, (text[:10], k)
            seen.append(gen.stats.drafter)
        finally:
            remote.close()
    assert _totals(seen)["alternates_received"] > 0, _totals(seen)


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_threaded_with_alternates_everywhere_is_token_identical(target, sp,
                                                               monkeypatch) -> None:
    drafter = threaded_alternates_everywhere(monkeypatch, 1024)
    seen = []
    try:
        for text, k in taking_turns((CODE, PROSE), DRAFT_LENGTHS):
            prompt = target.tokens(text)
            want = target.plain(prompt, sp, N)
            before = drafter.stats()
            gen = Engine(target.backend, drafter).generate(request(prompt, N, sp, n_max=k))
            assert run_to_end(gen) == want, (text[:10], k)
            after = drafter.stats()
            seen.append({key: after[key] - before.get(key, 0.0) for key in after})
    finally:
        drafter.end()
    totals = _totals(seen)
    assert totals["alternates_received"] > 0, totals
