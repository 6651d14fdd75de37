"""Research benchmarks: scripts that answer questions about speculative decoding here.

Not installed and not part of `specwire bench`; run from the repository root as
`python -m benchmarks.NAME --help`. Their tests: `python -m pytest benchmarks/tests`.
"""
