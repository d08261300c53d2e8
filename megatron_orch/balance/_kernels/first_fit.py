"""First-fit decreasing and the binary search on capacity around it (bs_ffd): the bin-packing partitioner."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels._segment_tree import _tree_first_fit, _tree_new, _tree_set
from megatron_orch.balance._kernels.bounds import _max_load, numpy_sum, pigeonhole_bound


# ---------------------------------------------------------------------------------------------
# First-fit decreasing at a capacity (the inner step of the binary search on capacity).
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def ffd(costs, memory, memory_cap, order, num_bins, capacity, bin_of_item):
    """Each item (by decreasing cost) to the lowest bin where it fits in cost and memory.

    Returns -1 on success, else the first item that fits nowhere.
    """
    return _first_fit(costs[order], memory, memory_cap, order, num_bins, capacity, bin_of_item)


@numba.njit(**_JIT)
def _first_fit(sorted_costs, memory, memory_cap, order, num_bins, capacity, bin_of_item):
    """:func:`ffd` given the costs in ``order`` (``sorted_costs[k]``: item ``order[k]``'s, gathered once by the
    binary search for all its passes)."""
    if memory_cap == np.inf:
        return _ffd_without_memory(sorted_costs, order, num_bins, capacity, bin_of_item)
    load = np.zeros(num_bins)
    bin_mem = np.zeros(num_bins)
    tree_load, tree_room, width = _tree_new(load, np.full(num_bins, memory_cap))
    for k in range(order.size):
        item = order[k]
        c = sorted_costs[k]
        b = _tree_first_fit(tree_load, tree_room, width, capacity - c, memory[item])
        if b < 0:
            return item
        bin_of_item[item] = b
        load[b] += c
        bin_mem[b] += memory[item]
        _tree_set(tree_load, tree_room, width, b, load[b], memory_cap - bin_mem[b])
    return -1


@numba.njit(**_JIT)
def _ffd_without_memory(sorted_costs, order, num_bins, capacity, bin_of_item):
    """:func:`ffd` without a memory cap (every bin has room): a tree of least loads alone, walked down once per
    item (the left child wherever it fits, so the lowest such bin) and updated upwards only while a node's least
    load changes. The same bins, loads summed in the same order, ~2.3x less CPU than the two-key tree (DP 10240).
    An item costing what the one before it cost goes where that one went if it still fits, without the walk:
    every lower bin was too full for that cost then, and loads only grow (runs of equal costs are long: tiles,
    clips of one length)."""
    width = 1
    while width < num_bins:
        width *= 2
    least = np.full(2 * width, np.inf)  # least[width + b]: bin b's load; above: the least load below a node
    least[width:width + num_bins] = 0.0
    for v in range(width - 1, 0, -1):
        least[v] = min(least[2 * v], least[2 * v + 1])
    v = 0  # the leaf the item before went to
    for k in range(order.size):
        c = sorted_costs[k]
        fits = capacity - c
        if not (k > 0 and c == sorted_costs[k - 1] and least[v] <= fits):
            if not least[1] <= fits:
                return order[k]
            v = 1
            while v < width:
                v = 2 * v if least[2 * v] <= fits else 2 * v + 1
        bin_of_item[order[k]] = v - width
        least[v] += c
        u = v // 2
        while u >= 1:
            lower = min(least[2 * u], least[2 * u + 1])
            if least[u] == lower:
                break
            least[u] = lower
            u //= 2
    return -1


ABOVE_UPPER = -2  # bs_ffd: first-fit decreasing does not place every item at the given upper capacity


@numba.njit(**_JIT)
def bs_ffd(costs, memory, memory_cap, order, num_bins, upper, rel_tol, max_rounds, bin_of_item):
    """Binary search on the bin capacity: the smallest (within ``rel_tol``, at most ``max_rounds``
    halvings) at which first-fit decreasing places every item, its assignment in ``bin_of_item``.

    Without memory, FFD always succeeds at mean + largest item, which starts the search. ``upper`` <
    inf asks only for results at most that good: :data:`ABOVE_UPPER` if FFD fails there. Returns -1,
    or the first item no bin has memory room for at any capacity.
    """
    n = costs.size
    if n == 0:
        return -1
    trial = np.empty(n, dtype=np.int64)
    sorted_costs = costs[order]
    hi = numpy_sum(costs) / num_bins + costs.max() if upper == np.inf else upper
    if _first_fit(sorted_costs, memory, memory_cap, order, num_bins, hi, bin_of_item) >= 0:
        if upper != np.inf:
            return ABOVE_UPPER
        item = _first_fit(sorted_costs, memory, memory_cap, order, num_bins, np.inf, bin_of_item)
        if item >= 0:
            return item
    hi = _max_load(costs, bin_of_item, num_bins)
    lo = pigeonhole_bound(costs, order, num_bins)
    for _ in range(max_rounds):
        if hi - lo <= rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if _first_fit(sorted_costs, memory, memory_cap, order, num_bins, mid, trial) >= 0:
            lo = mid
        else:
            bin_of_item[:] = trial
            hi = _max_load(costs, bin_of_item, num_bins)
    return -1
