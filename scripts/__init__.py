"""Benchmarks and studies: python -m scripts.NAME (or python scripts/NAME.py)."""
