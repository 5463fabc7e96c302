"""Benchmarks: each module is a command (`python -m experiments.bench.NAME`) that measures moepipe
itself or against a peer and prints its figures."""
