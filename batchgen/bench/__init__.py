"""Benchmarks behind `batchgen bench`. Shared helpers live in batchgen/bench/common.py."""
