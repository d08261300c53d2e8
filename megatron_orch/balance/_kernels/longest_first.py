"""LPT (longest processing time first) and its equal-count form: the fast greedy partitions."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels._heap import _heap_pop, _heap_push, _sift_down


# ---------------------------------------------------------------------------------------------
# LPT: items in decreasing cost, each to the least-loaded bin that has memory room.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _least_loaded_rest(costs, order, start, bin_load, bin_of_item):
    """Items ``order[start:]``, each to the least-loaded bin (ties: the smaller id), bins starting at
    ``bin_load``: what the heap does, by a loser tree over the bins in id order (a node keeps the loser of the
    match between its subtrees' winners, by (load, id)). A bin that took an item replays its matches up from its
    leaf, one comparison with the kept loser per level: ~2.3x less CPU at 10,240 bins than a winner tree, which
    compares both children at every level (and ~3x less than sifting the heap)."""
    width = 1
    while width < bin_load.size:
        width *= 2
    load = np.full(width, np.inf)  # (padding: never the least)
    load[:bin_load.size] = bin_load
    loser = np.empty(width, dtype=np.int64)
    winner = np.empty(2 * width, dtype=np.int64)
    for b in range(width):
        winner[width + b] = b
    for k in range(width - 1, 0, -1):
        left, right = winner[2 * k], winner[2 * k + 1]
        if load[right] < load[left]:  # (ties: the left one, of smaller ids)
            winner[k], loser[k] = right, left
        else:
            winner[k], loser[k] = left, right
    # the items' costs in order, gathered in one pass first: the loop adds each on its chain of comparisons,
    # where a read scattered over the batch's costs waits for memory (~8% of the loop at DP 10240)
    cost_in_order = np.empty(order.size - start)
    for t in range(start, order.size):
        cost_in_order[t - start] = costs[order[t]]
    b = winner[1]
    for t in range(start, order.size):
        bin_of_item[order[t]] = b
        load[b] += cost_in_order[t - start]
        least, least_load = b, load[b]
        k = (width + b) // 2
        while k >= 1:
            other = loser[k]
            other_load = load[other]
            if other_load < least_load or (other_load == least_load and other < least):
                loser[k] = least
                least, least_load = other, other_load
            k //= 2
        b = least


@numba.njit(**_JIT)
def lpt(costs, memory, memory_cap, order, num_bins, bin_of_item):
    """Greedy longest-processing-time. ``order``: items by decreasing cost (ties: smaller id first).

    Returns -1, or the first item no bin has memory room for. A bin without room for even the
    smallest remaining memory leaves the heap for good (so a count cap - memory 1, cap n/K - costs
    no more than plain LPT); one that only lacks room for the current item is held aside.
    """
    n = order.size
    rest_min = np.empty(n + 1)  # smallest memory among order[t:]
    rest_min[n] = np.inf
    for t in range(n - 1, -1, -1):
        rest_min[t] = min(rest_min[t + 1], memory[order[t]])
    load = np.zeros(num_bins)
    ids = np.arange(num_bins)  # all loads zero and ids ascending: already a heap
    size = num_bins
    bin_mem = np.zeros(num_bins)
    held_key = np.empty(num_bins)
    held_id = np.empty(num_bins, dtype=np.int64)
    start = 0
    if memory_cap == np.inf and n > 0 and costs[order[0]] > 0:
        # Without a memory cap, the first run of equal costs (e.g. identical image tiles) goes
        # round robin in bin id order: on equal loads that is what the heap does (ties by id), and
        # after every full round the loads are equal again, bit for bit (a positive cost raises a
        # bin above the others; a zero cost would not, and stays on the heap path). O(run) instead of
        # O(run log K); the loads and the heap left behind are the ones the loop would leave.
        first = costs[order[0]]
        while start < n and costs[order[start]] == first:
            item = order[start]
            bin_of_item[item] = start % num_bins
            bin_mem[start % num_bins] += memory[item]
            start += 1
        per_bin = np.zeros(num_bins)
        for t in range(start // num_bins):
            per_bin[0] += first  # every bin adds the same costs in the same order
        rest = start % num_bins
        for k in range(num_bins):  # a heap: the lighter bins rest.. first, then 0..rest-1
            b = rest + k if rest + k < num_bins else rest + k - num_bins
            load[k] = per_bin[0] + first if b < rest else per_bin[0]
            ids[k] = b
    if memory_cap == np.inf:  # no bin ever lacks room: the least-loaded bin, nothing held aside
        bin_load = np.empty(num_bins)
        for k in range(num_bins):
            bin_load[ids[k]] = load[k]
        _least_loaded_rest(costs, order, start, bin_load, bin_of_item)
        return -1
    for t in range(start, n):
        item = order[t]
        held = 0
        while size > 0 and bin_mem[ids[0]] + memory[item] > memory_cap:
            k, b = _heap_pop(load, ids, size)
            size -= 1
            if bin_mem[b] + rest_min[t] <= memory_cap:
                held_key[held], held_id[held] = k, b
                held += 1
        if size == 0:
            return item
        b = ids[0]
        bin_of_item[item] = b
        bin_mem[b] += memory[item]
        load[0] += costs[item]
        if bin_mem[b] + rest_min[t + 1] > memory_cap:  # b is full for good
            _heap_pop(load, ids, size)
            size -= 1
        else:
            _sift_down(load, ids, size, 0)
        for h in range(held):
            _heap_push(load, ids, size, held_key[h], held_id[h])
            size += 1
    return -1


@numba.njit(**_JIT)
def slot_lpt(costs, order, num_bins, per_bin, target, bin_of_item):
    """Equal-count greedy by room per free slot: every bin takes ``per_bin`` items.

    Items in ``order`` (decreasing cost, ties by id), each to the bin with the largest
    (``target`` - load) / free slots (ties: the smaller bin id); a full bin leaves. A bin that took
    a long item has little room per slot left, so it takes nothing more until only items that small
    are left: it ends with the long item and short ones, where count-capped LPT gives it whatever
    comes when its load is the least (mid-sized items, on a heavy tail).
    """
    key = np.full(num_bins, -target / per_bin)  # (load - target) / free: the smallest first
    ids = np.arange(num_bins)  # equal keys, ids ascending: already a heap
    load = np.zeros(num_bins)
    free = np.full(num_bins, per_bin, dtype=np.int64)
    size = num_bins
    for item in order:
        b = ids[0]
        bin_of_item[item] = b
        load[b] += costs[item]
        free[b] -= 1
        if free[b] == 0:
            _heap_pop(key, ids, size)
            size -= 1
        else:
            key[0] = (load[b] - target) / free[b]
            _sift_down(key, ids, size, 0)
