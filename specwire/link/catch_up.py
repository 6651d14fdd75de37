"""A draft session's history evaluated into its cache, a batch at a time.

A session starts from the best cached prefix of its history (node/kv_cache.py); the rest
goes into the cache a batch (-b) at a time before the first draft. A Close stops it, and
what was evaluated stays cached for the next session of the same conversation. A
synchronous session with a long history catches up on a thread of its own, so that it can
answer verdicts meanwhile (with empty chunks saying how far behind it is) and hear a Close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from specwire.backend.base import Backend, sync_prefix


class CatchUp:
    """The evaluation of `history` (but its last token, which the first draft decodes)."""

    def __init__(self, backend: Backend, history: Sequence[int], cached: int,
                 closed: Callable[[], bool]) -> None:
        """cached: history tokens the cache holds already; closed: the session's Close."""
        self.backend, self.history, self.closed = backend, list(history), closed
        self.caught = cached   # history tokens in the cache so far
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def run(self) -> None:
        """Evaluate the rest on this thread, stopping at a Close."""
        be, history = self.backend, self.history
        self.caught = pos = sync_prefix(be, history)
        step = max(1, getattr(getattr(be, "params", None), "n_batch", 512))
        while pos < len(history) - 1 and not self.closed():
            n = min(step, len(history) - 1 - pos)
            be.eval(history[pos : pos + n], logits="none")
            self.caught = pos = pos + n

    def start(self) -> None:
        """Run on a thread of its own (a synchronous session's)."""
        self._thread = threading.Thread(target=self._run_safely, name="draft-catch-up",
                                        daemon=True)
        self._thread.start()

    @property
    def started(self) -> bool:
        """On a thread of its own, and not yet `finish`ed."""
        return self._thread is not None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def behind(self, committed: int) -> int:
        """History tokens not yet evaluated, of `committed`."""
        return max(0, committed - self.caught)

    def finish(self) -> None:
        """Wait for the thread; raise what stopped it, once."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _run_safely(self) -> None:
        try:
            self.run()
        except Exception as e:  # noqa: BLE001 - raised by finish, on the session's thread
            self._error = e
