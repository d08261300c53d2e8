"""Lower bounds and sums as numpy computes them: what the partitioners stop at and compare against."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT


# ---------------------------------------------------------------------------------------------
# The floating-point steps are numpy's own (sums pairwise as np.sum adds, loads in item order as
# np.bincount does), so every compiled result equals partition()'s.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _block_sum(values, lo, n):
    """numpy's pairwise sum of at most 128 float64: a plain loop below 8, else 8 running sums."""
    if n < 8:
        total = 0.0
        for i in range(n):
            total += values[lo + i]
        return total
    r = values[lo:lo + 8].copy()
    i = 8
    while i < n - n % 8:
        for j in range(8):
            r[j] += values[lo + i + j]
        i += 8
    total = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
    while i < n:
        total += values[lo + i]
        i += 1
    return total


@numba.njit(**_JIT)
def numpy_sum(values):
    """``values.sum()`` bit for bit as numpy adds float64: halves (a multiple of 8 on the left) summed
    apart down to blocks of 128, then added up, left + right. Written with a stack: numba's cache
    cannot hold a function that calls itself. At most 128 values are one block, summed without the stack (a
    step's micro-batches: thousands of partitions of a rank's ~16 examples, each summed twice)."""
    if values.size <= 128:
        return _block_sum(values, 0, values.size)
    frame_lo = np.empty(64, dtype=np.int64)
    frame_n = np.empty(64, dtype=np.int64)
    frame_state = np.empty(64, dtype=np.int64)  # 0: left half next, 1: right half next, 2: add them
    partial = np.empty(64)
    frames, partials = 1, 0
    frame_lo[0], frame_n[0], frame_state[0] = 0, values.size, 0
    while frames:
        f = frames - 1
        lo, n = frame_lo[f], frame_n[f]
        half = n // 2 - (n // 2) % 8
        if n <= 128:
            partial[partials] = _block_sum(values, lo, n)
            partials += 1
            frames -= 1
        elif frame_state[f] < 2:
            child_lo, child_n = (lo, half) if frame_state[f] == 0 else (lo + half, n - half)
            frame_state[f] += 1
            frame_lo[frames], frame_n[frames], frame_state[frames] = child_lo, child_n, 0
            frames += 1
        else:
            partials -= 1
            partial[partials - 1] = partial[partials - 1] + partial[partials]
            frames -= 1
    return partial[0]


@numba.njit(**_JIT)
def _max_load(costs, bin_of_item, num_bins):
    load = np.zeros(num_bins)
    for i in range(costs.size):
        load[bin_of_item[i]] += costs[i]
    return load.max()


@numba.njit(**_JIT)
def pigeonhole_bound(costs, order, num_bins):
    """A lower bound on the max bin cost at least max(mean, largest item), tight for items of equal size:
    for every t >= 1, some bin holds t + 1 of the t*K + 1 largest items (``order``: by decreasing
    cost), so at least the sum of the t + 1 smallest of them."""
    n = costs.size
    if n == 0:
        return 0.0
    bound = max(numpy_sum(costs) / num_bins, costs.max())
    if n > num_bins:
        prefix = np.zeros(n + 1)
        for k in range(n):
            prefix[k + 1] = prefix[k] + costs[order[k]]
        for t in range(1, (n - 1) // num_bins + 1):
            bound = max(bound, prefix[t * num_bins + 1] - prefix[t * num_bins - t])
    return bound
