"""partition() compiled for many small groups at once: the packed micro-batches of every rank in one call."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels.auto import CONSTRUCTIONS, auto
from megatron_orch.balance._kernels.differencing import kk
from megatron_orch.balance._kernels.first_fit import bs_ffd
from megatron_orch.balance._kernels.longest_first import lpt
from megatron_orch.balance._kernels.order import decreasing


# ---------------------------------------------------------------------------------------------
# Many small partitions at once (the packed micro-batches of every rank): what partition() does,
# compiled, group after group, so every result equals partition()'s.
# ---------------------------------------------------------------------------------------------

METHOD_CODES = ("auto",) + CONSTRUCTIONS  # the ``method`` argument of partition_groups


@numba.njit(**_JIT)
def _partition_one(costs, num_bins, method, good_enough_rel, settled_rel, rel_tol, max_rounds, max_sweeps, partners,
                   cheapest_scan, memory, refused, bins):
    """partition(costs, num_bins, method=METHOD_CODES[method]) without memory (``memory``: zeros, one per item;
    ``refused``: auto's scratch) or home, into ``bins``: ``auto`` is :func:`auto` (refined), the others construct
    only."""
    order = decreasing(costs)
    if method == 1:
        lpt(costs, memory, np.inf, order, num_bins, bins)
    elif method == 2:
        kk(costs, order, 1, num_bins, bins)
    elif method == 3:
        bs_ffd(costs, memory, np.inf, order, num_bins, np.inf, rel_tol, max_rounds, bins)
    else:
        auto(costs, memory, np.inf, order, num_bins, True, good_enough_rel, settled_rel, rel_tol, max_rounds,
             max_sweeps, partners, cheapest_scan, bins, refused)


@numba.njit(**_JIT)
def _one_per_bin(costs, items, num_bins, order, bin_of_item):
    """A group of at most ``num_bins`` items of positive cost: item t by decreasing cost (ties: smaller id)
    in bin t, what ``auto`` gives it (LPT's assignment, at the bound: its largest item; first-fit at the bound
    is tried only on more items than bins). ``order``: scratch for the group's items. Returns whether it
    applied."""
    m = items.size
    if m > num_bins:
        return False
    for k in range(m):
        if not costs[items[k]] > 0.0:
            return False
    for u in range(m):  # insertion sort by decreasing cost, stable (items come by increasing id)
        item = items[u]
        v = u
        while v > 0 and costs[order[v - 1]] < costs[item]:
            order[v] = order[v - 1]
            v -= 1
        order[v] = item
    for t in range(m):
        bin_of_item[order[t]] = t
    return True


@numba.njit(**_JIT)
def partition_groups(costs, group, num_groups, num_bins, method, good_enough_rel, settled_rel, rel_tol, max_rounds,
                     max_sweeps, partners, cheapest_scan, bin_of_item):
    """The items of each group (item i in group ``group[i]``; a group's items by increasing id, as
    partition() would see ``costs[group == g]``) partitioned into ``num_bins`` bins on their own
    (:func:`_partition_one`; under ``auto`` a group of at most ``num_bins`` items directly:
    :func:`_one_per_bin`)."""
    start = np.zeros(num_groups + 1, dtype=np.int64)
    for i in range(group.size):
        start[group[i] + 1] += 1
    for g in range(num_groups):
        start[g + 1] += start[g]
    fill = start[:-1].copy()
    members = np.empty(group.size, dtype=np.int64)
    for i in range(group.size):
        members[fill[group[i]]] = i
        fill[group[i]] += 1
    largest = 0
    for g in range(num_groups):
        largest = max(largest, start[g + 1] - start[g])
    # a group's costs, bins, order and zero memory in scratch of the largest group's size, allocated once
    local, bins, memory = np.empty(largest), np.empty(largest, dtype=np.int64), np.zeros(largest)
    order = np.empty(largest, dtype=np.int64)
    refused = np.empty(len(CONSTRUCTIONS), dtype=np.int64)
    for g in range(num_groups):
        items = members[start[g]:start[g + 1]]
        if method == 0 and _one_per_bin(costs, items, num_bins, order, bin_of_item):
            continue
        m = items.size
        for k in range(m):
            local[k] = costs[items[k]]
        bins[:m] = 0
        _partition_one(local[:m], num_bins, method, good_enough_rel, settled_rel, rel_tol, max_rounds, max_sweeps,
                       partners, cheapest_scan, memory[:m], refused, bins[:m])
        for k in range(m):
            bin_of_item[items[k]] = bins[k]
