"""A cache that lost cells of a prompt's attention window is not reused (fakes only).

llama.cpp's sliding-window layers drop the start of a sequence that ran past their
window; a later prompt sharing only that start must be evaluated again, else its
first token comes from a cache that attends to nothing there. The backend says so
with `holds_window(n)`; base.window_kept and the engine's prompt reuse ask it.
"""

from __future__ import annotations

from fakes import FakeBackend, FakeModel

from specwire.backend.base import sync_prefix, usable_prefix, window_kept
from specwire.config import DraftParams, SamplingParams
from specwire.engine.engine import Engine, Request


class WindowBackend(FakeBackend):
    """A FakeBackend whose cache lost the cells before position `lost_below`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lost_below = 0
        self.asked: list[int] = []

    def holds_window(self, n: int) -> bool:
        self.asked.append(n)
        return self.lost_below == 0 or n >= self.lost_below + 4   # a window of 4


def _backend() -> WindowBackend:
    return WindowBackend(FakeModel(n_vocab=64, seed=3), n_ctx=256)


def test_window_kept_asks_the_backend_and_keeps_none_when_the_window_is_gone() -> None:
    be = _backend()
    be.eval(list(range(1, 21)), "none")
    assert window_kept(be, 10) == 10
    be.lost_below = 8
    assert window_kept(be, 10) == 0      # position 10 attends to 7..9: 7 is gone
    assert window_kept(be, 12) == 12     # 9..11 are all there
    plain = FakeBackend(FakeModel(n_vocab=64, seed=3))   # no holds_window: all kept
    plain.eval(list(range(1, 21)), "none")
    assert window_kept(plain, 10) == 10


def test_sync_prefix_starts_over_where_the_prefix_lost_its_window() -> None:
    be = _backend()
    be.eval(list(range(1, 21)), "none")
    be.lost_below = 8
    assert usable_prefix(be, [1, 2, 3, 99]) == 0
    assert sync_prefix(be, [1, 2, 3, 99]) == 0 and be.n_past == 0
    be.eval(list(range(1, 21)), "none")
    be.lost_below = 2
    assert sync_prefix(be, [*range(1, 11), 99]) == 10 and be.n_past == 10


def _run(engine: Engine, prompt: list[int]):
    req = Request(prompt, 3, SamplingParams(temperature=0.0), DraftParams(enabled=False))
    gen = engine.generate(req)
    gen.run()
    return gen


def test_the_engine_evaluates_a_prompt_again_when_its_cached_prefix_lost_its_window() -> None:
    be = _backend()
    engine = Engine(be)
    long = list(range(1, 41))
    _run(engine, long)
    be.lost_below = 20        # the sliding window dropped the start of the long sequence
    alone = _run(Engine(_backend()), [1, 2, 3, 50]).tokens
    gen = _run(engine, [1, 2, 3, 50])
    assert be.asked and be.asked[-1] == 3
    assert gen.stats.cache_n == 0 and gen.stats.prompt_n == 4
    assert gen.tokens == alone
    be.lost_below = 0
    again = _run(engine, [1, 2, 3, 50, 7])
    assert again.stats.cache_n == 4          # an intact window is reused as before
