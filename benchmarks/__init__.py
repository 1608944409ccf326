"""Benchmarks: ``python -m benchmarks.bench`` (leases), ``python benchmarks/threads.py``."""
