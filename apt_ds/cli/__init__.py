"""Command-line entry points (launch/train.py, launch/export.py)."""
