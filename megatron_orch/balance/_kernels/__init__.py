"""Compiled hot loops of the partitioners (numba, GIL released), one module per algorithm.

Planning runs on a background thread beside the training loop, so every kernel is compiled with
``nogil=True``; ``cache=True`` keeps the one-time compile off later runs. Signatures are kept to one
per kernel: costs and memory are float64, item and bin ids int64, a missing memory constraint is
all-zero memory with an infinite cap. Kernels write the assignment into a caller-provided
``bin_of_item`` and report failure as the id of the item that could not be placed (``-1``: success),
so the Python side raises the error with context.

Ties are always broken by the smaller item id or bin id, so results are deterministic.

Modules: ``longest_first`` (LPT, equal-count LPT), ``differencing`` (Karmarkar-Karp), ``first_fit``
(first-fit decreasing, its binary search on capacity), ``local_search`` (swap sweeps, refinement),
``auto`` (every construction refined, the best kept), ``order`` (items by decreasing cost, bins by increasing
load), ``locality`` (quotas and LPT near home), ``repair`` (the plain plan localised, the locality repair),
``bounds`` (lower bounds, numpy's sums), ``groups`` (many small partitions in one call); ``_heap``
and ``_segment_tree`` are their shared parts (their numba options and cache stamp: ``balance/_jit.py``).
Callers use the names re-exported here.
"""
from megatron_orch.balance._kernels.auto import CONSTRUCTIONS, TRIED, auto
from megatron_orch.balance._kernels.bounds import pigeonhole_bound
from megatron_orch.balance._kernels.differencing import kk
from megatron_orch.balance._kernels.first_fit import bs_ffd
from megatron_orch.balance._kernels.groups import METHOD_CODES, partition_groups
from megatron_orch.balance._kernels.local_search import refine, refine_caps, swap_sweeps
from megatron_orch.balance._kernels.locality import fill_quotas, lpt_near_home
from megatron_orch.balance._kernels.longest_first import lpt, slot_lpt
from megatron_orch.balance._kernels.order import decreasing, increasing
from megatron_orch.balance._kernels.repair import (add_link_bytes, bytes_on_node, example_link_bytes, group_entries,
                                                   localize, repair_locality, shift_example, try_exchange)

__all__ = ["CONSTRUCTIONS", "METHOD_CODES", "TRIED", "add_link_bytes", "auto", "bs_ffd", "bytes_on_node", "decreasing",
           "example_link_bytes", "fill_quotas", "group_entries", "increasing", "kk", "localize", "lpt", "lpt_near_home",
           "partition_groups", "pigeonhole_bound", "refine", "refine_caps", "repair_locality", "shift_example",
           "slot_lpt", "swap_sweeps", "try_exchange"]
