"""The draft node: a server that drafts for remote targets.

It serves the draft link (specwire/wire/) with sessions of drafters/session.py,
keeps finished sessions' KV caches (kv_cache.py) and per-target calibrations,
and times out silent peers. Imports go one way: node -> drafters -> wire.
"""
