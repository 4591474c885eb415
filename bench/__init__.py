"""Benchmarks of the gateway: ``python -m bench`` (see bench/README.md)."""
