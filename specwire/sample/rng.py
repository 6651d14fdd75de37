"""A counter-based random generator keyed by (seed, domain, position, token).

Speculative decoding is only reproducible if the random numbers do not depend on how the
work was split into rounds: a stateful generator would be advanced a different number of
times with and without a draft, a keyed one returns the same number for the same key
whoever asks and whenever. That lets the draft node, on another machine, sample with the
target's noise (coupled sampling) sharing nothing but the seed. The mixer is SplitMix64's
finaliser applied twice over the folded key: cheap, vectorised with numpy, and passing
BigCrush as a counter-based generator.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30 = np.uint64(30)
_S27 = np.uint64(27)
_S31 = np.uint64(31)
_S11 = np.uint64(11)
_TWO_M53 = 1.0 / (1 << 53)
_BELOW_ONE = 1.0 - _TWO_M53       # the largest float64 below 1

#: Independent streams. Coupled sampling uses GUMBEL on both sides on purpose;
#: rejection sampling must keep the draft's draw independent of the target's.
GUMBEL, DRAFT, ACCEPT, RESIDUAL = 1, 2, 3, 4


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def uniform(seed: int, domain: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1), one per token id; same key, same number, always.

    tokens: (n,) integer ids. Returns (n,) float64.
    """
    with np.errstate(over="ignore"):
        head = _mix(np.uint64(seed & 0xFFFFFFFFFFFFFFFF) * _GOLDEN + np.uint64(domain))
        head = _mix(head ^ (np.uint64(position) * _GOLDEN))
        x = _mix(head ^ (tokens.astype(np.uint64) * _GOLDEN + _GOLDEN))
    # 53 random bits, shifted off zero so that log() never sees 0. The top draw
    # (2**53 - 1 + 0.5) rounds up to 2**53 in float64, i.e. to 1.0, whose Gumbel
    # noise is +inf: clamp it to the largest float below 1.
    return np.minimum(((x >> _S11).astype(np.float64) + 0.5) * _TWO_M53, _BELOW_ONE)


def gumbel(seed: int, domain: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise, one per token id. tokens: (n,) -> (n,) float64."""
    return -np.log(-np.log(uniform(seed, domain, position, tokens)))


def scalar(seed: int, domain: int, position: int) -> float:
    """One uniform in (0, 1) for a (seed, domain, position) key."""
    return float(uniform(seed, domain, position, _ZERO)[0])


_ZERO = np.zeros(1, dtype=np.int64)
