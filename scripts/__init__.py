"""The commands of the studies and benchmarks: python -m scripts.NAME (or
python scripts/NAME.py). Entry points only: each parses its flags and
calls studies/ (or the rooms below); none imports another."""
