"""SWE-Bench-Verified environment (see env.py)."""
