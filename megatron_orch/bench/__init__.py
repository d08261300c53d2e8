"""Benchmarks: scripts that print figures and write JSON (speed and quality targets live here, not in tests)."""

from megatron_orch import quiet_megatron_core_warnings

quiet_megatron_core_warnings()  # before any benchmark imports megatron-core
