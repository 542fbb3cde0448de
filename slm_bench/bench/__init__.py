"""Benchmarks: each of our components against the baseline a user would really run, measured side by side in one process."""
