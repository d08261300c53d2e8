"""Benchmarks: scripts that print figures and write JSON (speed and quality targets live here, not in tests)."""
