"""A partitioner and a placement method registered from outside the package (docs/integration.md, "Extending").

Import this module before the argument parser is built (in a launch script, or name it in
``MEGATRON_ORCH_PLUGINS=toy_partitioner`` with this folder on ``PYTHONPATH``), then pick them with
``--orch-post-balancing --orch-algorithm round_robin --orch-placement reversed``.
"""
import numpy as np

from megatron_orch.balance.registry import register_partitioner, register_placement


@register_partitioner("round_robin")
def round_robin(costs, num_bins, memory, memory_cap):
    """Item i to bin i mod K, ignoring the costs (a toy: it balances counts, not work)."""
    bins = np.arange(costs.size) % num_bins
    if np.bincount(bins, weights=memory, minlength=num_bins).max(initial=0.0) > memory_cap:
        raise ValueError(f"round robin exceeds the memory cap {memory_cap}")
    return bins


@register_placement("reversed")
def reversed_ranks(traffic, topology, config):
    """Bin b on rank K-1-b (a toy: it ignores where the bytes are)."""
    return np.arange(traffic.num_bins)[::-1].copy(), "reversed"
