"""The draft node: a server that drafts for remote targets.

It serves the draft link (specwire/link/transport/) with sessions of link/session.py,
keeps finished sessions' KV caches (kv_cache.py) and per-target calibrations,
and times out silent peers. Imports go one way: node -> drafters -> wire.
"""
