"""LPT (longest processing time first) and its equal-count form: the fast greedy partitions."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels._heap import _heap_pop, _heap_push, _sift_down
from megatron_orch.balance._kernels.order import increasing


# ---------------------------------------------------------------------------------------------
# LPT: items in decreasing cost, each to the least-loaded bin that has memory room.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _before(load_a, bin_a, load_b, bin_b):
    """Whether bin a (at ``load_a``) comes before bin b (at ``load_b``) in LPT's choice: by load, ties by id."""
    return load_a < load_b or (load_a == load_b and bin_a < bin_b)


@numba.njit(**_JIT)
def _merge(src_load, src_bin, lo, mid, hi, dst_load, dst_bin):
    """(load, bin) pairs ``[lo, mid)`` and ``[mid, hi)`` of ``src``, each in order, merged into ``dst[lo:hi]``."""
    i, j = lo, mid
    for k in range(lo, hi):
        if j >= hi or (i < mid and not _before(src_load[j], src_bin[j], src_load[i], src_bin[i])):
            dst_load[k], dst_bin[k] = src_load[i], src_bin[i]
            i += 1
        else:
            dst_load[k], dst_bin[k] = src_load[j], src_bin[j]
            j += 1


@numba.njit(**_JIT)
def _in_order(load, bins, n, other_load, other_bin, run_start):
    """The (load, bin) pairs ``[:n]`` in order (:func:`_before`), a natural merge sort: runs in order, or in
    reverse order (reversed in place), merged pairwise between the pairs' arrays and ``other_*``. Returns the
    arrays that hold the result."""
    runs = 0
    k = 0
    while k < n:
        run_start[runs] = k
        runs += 1
        end = k + 1
        if end < n and _before(load[end], bins[end], load[k], bins[k]):
            while end < n and _before(load[end], bins[end], load[end - 1], bins[end - 1]):
                end += 1
            lo, hi = k, end - 1
            while lo < hi:
                load[lo], load[hi] = load[hi], load[lo]
                bins[lo], bins[hi] = bins[hi], bins[lo]
                lo += 1
                hi -= 1
        else:
            while end < n and not _before(load[end], bins[end], load[end - 1], bins[end - 1]):
                end += 1
        k = end
    run_start[runs] = n
    while runs > 1:
        merged = 0
        for r in range(0, runs, 2):
            lo = run_start[r]
            if r + 1 < runs:
                _merge(load, bins, lo, run_start[r + 1], run_start[r + 2], other_load, other_bin)
            else:
                other_load[lo:n] = load[lo:n]
                other_bin[lo:n] = bins[lo:n]
            run_start[merged] = lo
            merged += 1
        run_start[merged] = n
        runs = merged
        load, bins, other_load, other_bin = other_load, other_bin, load, bins
    return load, bins


@numba.njit(**_JIT)
def _least_loaded_rest(costs, order, start, bin_load, bin_of_item):
    """Items ``order[start:]``, each to the least-loaded bin (ties: the smaller id), bins starting at
    ``bin_load``: what the heap does, in batches. With the bins in order (by load, ties by id), the next items
    go to the first bins in turn while each comes before every bin that took an item in the batch; the first
    that does not ends it, and the bins that took one are put in order (:func:`_in_order`: a batch's new loads
    come in few runs) and merged with the others. Items by decreasing cost raise the least-loaded bins past
    most of the rest: at DP 10240 a batch places ~10,000 items, ~18 batches in all, ~2x less CPU than a loser
    tree, which replays 14 matches per item. Each bin's load is summed in the loop's order."""
    num_bins = bin_load.size
    # the items' costs in order, gathered in one pass first (a scattered read on the loop's chain waits for memory)
    cost_in_order = np.empty(order.size - start)
    for t in range(start, order.size):
        cost_in_order[t - start] = costs[order[t]]
    ranked_bin = increasing(bin_load)
    ranked_load = bin_load[ranked_bin]
    took_load, took_bin = np.empty(num_bins), np.empty(num_bins, dtype=np.int64)
    other_load, other_bin = np.empty(num_bins), np.empty(num_bins, dtype=np.int64)
    next_load, next_bin = np.empty(num_bins), np.empty(num_bins, dtype=np.int64)
    run_start = np.empty(num_bins + 1, dtype=np.int64)
    t = start
    while t < order.size:
        i = 0
        least, least_load = num_bins, np.inf  # the first in order of the bins that took an item
        while t < order.size and i < num_bins:
            b, load = ranked_bin[i], ranked_load[i]
            if _before(least_load, least, load, b):
                break
            bin_of_item[order[t]] = b
            load += cost_in_order[t - start]
            took_load[i], took_bin[i] = load, b
            if _before(load, b, least_load, least):
                least, least_load = b, load
            t += 1
            i += 1
        took_load_sorted, took_bin_sorted = _in_order(took_load, took_bin, i, other_load, other_bin, run_start)
        a, c = 0, i
        for k in range(num_bins):
            if c >= num_bins or (a < i and _before(took_load_sorted[a], took_bin_sorted[a], ranked_load[c],
                                                   ranked_bin[c])):
                next_load[k], next_bin[k] = took_load_sorted[a], took_bin_sorted[a]
                a += 1
            else:
                next_load[k], next_bin[k] = ranked_load[c], ranked_bin[c]
                c += 1
        ranked_load, next_load = next_load, ranked_load
        ranked_bin, next_bin = next_bin, ranked_bin


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
