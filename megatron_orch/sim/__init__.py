"""Cluster simulator: the step time of every balancing method at DP sizes no test machine has.

``python -m megatron_orch.sim --model mllm_10b --dp 64,512,2560 --plot sim.png`` (see
:mod:`megatron_orch.sim.cluster` for the model and its assumptions). It plans with exactly what the
trainer runs (``plan_step`` on the sizes of a global batch drawn from the traces, item costs and bytes
from ``phase_items``), so the simulated plans are the training plans.
"""
