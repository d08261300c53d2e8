"""``_kernels.swap_sweeps`` as it rebuilt every bin's loads and item lists from all items at the start of every
sweep: the reference the compiled one (which lists the items once and updates the lists of the bins a sweep swapped) is tested against."""
import numba
import numpy as np


@numba.njit(cache=True)
def swap_sweeps_reference(costs, order, num_bins, bin_of_item, stop_at, max_sweeps, group_size):
    """Even out many bins at once by one-for-one swaps, in place; returns the number of sweeps.

    Bins come in groups of ``group_size`` consecutive ids (the GPUs of a node; ``num_bins``: one
    group). A sweep pairs, in every group, the k-th most-loaded bin with the k-th least-loaded
    (while the former is above ``stop_at``) and, in every pair, swaps the item of the heavier bin and
    the cheaper item of the lighter one whose cost difference d is nearest half the gap. Both new
    loads lie strictly between the old ones, so the maximum never rises and counts stay. Where LPT
    leaves a plateau of bins just above the mean, :func:`refine` would take them down one at a time
    (thousands of steps at DP 2560); a few sweeps take most of them down together. ``order``: items
    by decreasing cost. Stops when the maximum is at most ``stop_at``, a sweep swaps nothing, or
    after ``max_sweeps``.
    """
    n = costs.size
    load = np.zeros(num_bins)
    start = np.zeros(num_bins + 1, dtype=np.int64)
    fill = np.zeros(num_bins, dtype=np.int64)
    items = np.empty(n, dtype=np.int64)  # bin by bin, each bin's items by increasing cost
    grouped = np.empty(num_bins, dtype=np.int64)  # group by group, each group's bins by increasing load
    num_groups = (num_bins + group_size - 1) // group_size
    sweeps = 0
    while sweeps < max_sweeps:
        load[:] = 0.0
        start[:] = 0
        for i in range(n):
            load[bin_of_item[i]] += costs[i]
            start[bin_of_item[i] + 1] += 1
        for b in range(num_bins):
            start[b + 1] += start[b]
            fill[b] = start[b]
        for k in range(n - 1, -1, -1):
            i = order[k]
            b = bin_of_item[i]
            items[fill[b]] = i
            fill[b] += 1
        if load.max() <= stop_at:
            break
        rank = np.argsort(load, kind="mergesort")  # increasing load, ties by bin id
        group_fill = np.arange(num_groups) * group_size
        for b in rank:
            g = b // group_size
            grouped[group_fill[g]] = b
            group_fill[g] += 1
        swapped = 0
        for g in range(num_groups):
            lo = g * group_size
            size = min(group_size, num_bins - lo)
            for p in range(size // 2):
                heavy, light = grouped[lo + size - 1 - p], grouped[lo + p]
                if load[heavy] <= stop_at:
                    break
                gap = load[heavy] - load[light]
                half = 0.5 * gap
                best, out_item, in_item = half, -1, -1  # |d - half| < half <=> 0 < d < gap
                u = start[light]  # first item of the light bin costing >= the target (targets rise)
                for t in range(start[heavy], start[heavy + 1]):
                    a = items[t]
                    target = costs[a] - half
                    while u < start[light + 1] and costs[items[u]] < target:
                        u += 1
                    for v in range(max(u - 1, start[light]), min(u + 1, start[light + 1])):
                        miss = abs(costs[a] - costs[items[v]] - half)
                        if miss < best:
                            best, out_item, in_item = miss, a, items[v]
                if out_item >= 0:
                    bin_of_item[out_item], bin_of_item[in_item] = light, heavy
                    swapped += 1
        sweeps += 1
        if swapped == 0:
            break
    return sweeps
