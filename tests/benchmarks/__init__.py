"""Tests of the benchmark scripts (``benchmarks/``)."""
