"""specwire: speculative decoding with the draft model on another machine, lossless."""

__version__ = "0.1.0"
