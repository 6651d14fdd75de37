"""The research benchmarks' tests run outside the product suite, under the same
fast-suite guard (tests/support/fast_guard.py):
`python -m pytest benchmarks/tests -m "not slow"`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "support"))

pytest_plugins = ("fast_guard",)
