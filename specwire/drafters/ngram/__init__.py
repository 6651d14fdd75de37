"""Prompt lookup: the n-gram drafter (drafter.py), its suffix index (index.py) and the
cache of what it learned across requests (cache.py)."""
