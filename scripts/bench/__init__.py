"""Benchmarks (`python -m scripts.bench.NAME --help`); what they share: `scripts.bench.common`."""
