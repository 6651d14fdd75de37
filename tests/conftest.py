"""Shared test set-up: the fast-suite guard (tests/fast_guard.py) and pytester for its own
test."""

pytest_plugins = ("fast_guard", "pytester")
