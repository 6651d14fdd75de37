"""The pure core: sampling, verification, keyed randomness, logprobs and constraints.

numpy only and no I/O: the target's reference sample at each position is decided here,
which is what makes speculative decoding lossless (verify.py names the vocabulary).
"""
