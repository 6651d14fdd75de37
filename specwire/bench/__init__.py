"""Benchmarks: prompt sets and the runs that measure speculation on them."""
