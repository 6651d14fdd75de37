"""Drafters: what proposes the tokens the target verifies (base.py's protocol).

One module per way of drafting (a draft model in this process, n-gram lookup, a
remote node, a llama-server, their hybrid and wrappers), so the engine loop is
the same whatever drafts. The two ends of a remote session and their transport are
specwire/link/; drafters/ imports nothing of it.
"""
