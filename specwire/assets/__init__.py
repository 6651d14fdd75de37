"""Bundled model files: the default target/draft pair (models.py) and the tiny
mixture-of-experts GGUF that tests and benchmarks build (moe.py)."""
