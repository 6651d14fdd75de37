"""The worst drafter there is: uniformly random tokens, never accepted.

Benchmarks use it to show what a useless drafter costs (the adaptive policy
should bring that near zero); tests use it to show that a draft that is always
wrong cannot change a single output token.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from specwire.drafters.base import Capabilities, Draft, StatelessDrafter


class RandomDrafter(StatelessDrafter):
    name = "random"
    # Its tokens come from a generator of its own, never from the target's draws: a point
    # mass at each is its q given that generator's state, which keeps rejection exact.
    capabilities = Capabilities(deterministic=True)

    def __init__(self, n_vocab: int, seed: int = 0) -> None:
        self.n_vocab = n_vocab
        self._rng = np.random.default_rng(seed)     # its own generator, never the global one

    def propose(self, history: Sequence[int], k: int) -> Draft:
        self.drafted += k
        return Draft([int(t) for t in self._rng.integers(0, self.n_vocab, k)])

