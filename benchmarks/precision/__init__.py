"""Benchmarks of the precision plan: ``python -m benchmarks plan_time``."""
