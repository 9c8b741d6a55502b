"""Benchmarks: ``python -m benchmarks.run --help``."""
