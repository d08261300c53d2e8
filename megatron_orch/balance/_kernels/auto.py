"""``auto``: every built-in construction refined, the best kept (partition()'s default, and each group's in
partition_groups)."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels.bounds import _max_load, numpy_sum, pigeonhole_bound
from megatron_orch.balance._kernels.differencing import kk
from megatron_orch.balance._kernels.first_fit import ABOVE_UPPER, bs_ffd, ffd
from megatron_orch.balance._kernels.local_search import refine as refine_bins, swap_sweeps
from megatron_orch.balance._kernels.longest_first import lpt

CONSTRUCTIONS = ("lpt", "kk", "bs_ffd")  # the built-in partitioners, as registered (a winner is an index here)
# The order auto tries them in: bs_ffd before kk. Where lpt refined stays above the bound (a heavy tail), bs_ffd
# refined is the one that reaches it on the benchmarks' batches (kk refined never beat lpt refined there), and kk
# (tens of ms at DP 10240) is then not run.
TRIED = (0, 2, 1)
_BS_FFD = 2  # CONSTRUCTIONS.index("bs_ffd"): the winner when first-fit at the bound places every item


@numba.njit(**_JIT)
def _fits_memory(bin_of_item, memory, memory_cap, num_bins):
    if memory_cap == np.inf:
        return True
    return _max_load(memory, bin_of_item, num_bins) <= memory_cap


@numba.njit(**_JIT)
def _tail_first_fit(costs, memory, memory_cap, order, num_bins, bound, good_enough, bin_of_item):
    """First-fit decreasing at the pigeonhole ``bound``, then at ``good_enough``, into ``bin_of_item``, where
    items outnumber bins and the bound lies above the mean; returns whether one placed every item (at the
    bound: an optimal plan; at ``good_enough``: one within the refinement's tolerance, nothing left to gain).

    A heavy tail whose longest items set the bound leaves the other bins room to spare, and first-fit fills
    them up to the capacity in one pass: on every such batch of the planning sweep (heavy-tail-rare, DP 512 to
    10240) at the bound itself, ~3 ms at DP 10240, where LPT refined can stay ~0.7% above it (a bin holding a
    long item and a mid-sized one, with no exchange that takes it down) and the binary search after it takes
    ~50 ms. Where the bound is the mean there is no room and first-fit at the bound fails at the last items
    (every such batch of the sweep): not tried."""
    if costs.size <= num_bins or not bound > numpy_sum(costs) / num_bins:  # (one item per bin: LPT's, optimal)
        return False
    for capacity in (bound, good_enough):
        if ffd(costs, memory, memory_cap, order, num_bins, capacity, bin_of_item) < 0:
            return _fill_empty_bins(memory, memory_cap, order, num_bins, bin_of_item)
    return False


@numba.njit(**_JIT)
def _fill_empty_bins(memory, memory_cap, order, num_bins, bin_of_item):
    """Every bin first-fit left empty (it fills the lowest bins up to the capacity: with room to spare, the last
    ones get nothing) takes one of the cheapest items (the last of ``order``) of a bin holding two or more, as LPT
    leaves no bin empty: no DP rank or micro-batch without an example. An item alone costs at most the largest,
    so at most the bound, and its old bin loses it: the maximum does not rise. Returns False (the caller then
    tries the other constructions) only where memory leaves no such item room in an empty bin."""
    count = np.zeros(num_bins, dtype=np.int64)
    for b in bin_of_item:
        count[b] += 1
    k = order.size - 1  # items outnumber bins: some bin holds two or more while one is empty
    for b in range(num_bins):
        if count[b] > 0:
            continue
        while k >= 0 and (count[bin_of_item[order[k]]] < 2 or memory[order[k]] > memory_cap):
            k -= 1
        if k < 0:
            return False
        item = order[k]
        count[bin_of_item[item]] -= 1
        bin_of_item[item] = b
        count[b] = 1
        k -= 1
    return True


@numba.njit(**_JIT)
def auto(costs, memory, memory_cap, order, num_bins, refine, good_enough_rel, settled_rel, rel_tol, max_rounds,
         max_sweeps, partners, cheapest_scan, bin_of_item, refused):
    """Each of :data:`CONSTRUCTIONS` that honours the memory cap (``memory_cap``: np.inf for none), refined if
    ``refine`` (without a cap: swap sweeps first; then the local search, both stopping within
    ``good_enough_rel`` of the pigeonhole bound), until one is within ``settled_rel`` of it; the best (ties:
    the earlier tried, in the order :data:`TRIED`) into ``bin_of_item``. bs_ffd is asked only for results better
    than the best so far. Where items outnumber bins and the bound lies above the mean (long items set it: the
    other bins have room to spare), first-fit decreasing at the bound (or within ``good_enough_rel`` of it)
    comes first (:func:`_tail_first_fit`); if it places every item, that is the result (the winner: bs_ffd) and
    nothing else is tried.
    ``order``: items by decreasing cost (ties by id). Returns the index of the winner in
    :data:`CONSTRUCTIONS`, or -1 if none honours the cap; ``refused[c]`` is then, for construction c, the
    item lpt or bs_ffd found no memory room for, or 0 when kk's result exceeds the cap (-1: not refused).
    """
    n = costs.size
    refused[:] = -1
    bound = pigeonhole_bound(costs, order, num_bins)
    good_enough, settled = (1.0 + good_enough_rel) * bound, (1.0 + settled_rel) * bound
    trial = np.zeros(n, dtype=np.int64)
    if _tail_first_fit(costs, memory, memory_cap, order, num_bins, bound, good_enough, trial):
        bin_of_item[:] = trial
        return _BS_FFD
    best_cost = np.inf
    winner = -1
    for construction in TRIED:
        if best_cost <= settled:
            break
        trial[:] = 0
        if construction == 0:
            item = lpt(costs, memory, memory_cap, order, num_bins, trial)
            if item >= 0:
                refused[0] = item
                continue
        elif construction == 1:
            kk(costs, order, 1, num_bins, trial)
            if not _fits_memory(trial, memory, memory_cap, num_bins):
                refused[1] = 0
                continue
        else:
            status = bs_ffd(costs, memory, memory_cap, order, num_bins, best_cost, rel_tol, max_rounds, trial)
            if status == ABOVE_UPPER:
                continue
            if status >= 0:
                refused[2] = status
                continue
        if refine and n > 0:
            if memory_cap == np.inf:  # (swaps keep counts, not memory)
                swap_sweeps(costs, order, num_bins, trial, good_enough, max_sweeps, num_bins)
            refine_bins(costs, memory, memory_cap, num_bins, trial, True, good_enough, partners, 0, n + num_bins,
                        order, cheapest_scan)
        cost = _max_load(costs, trial, num_bins)
        if cost < best_cost:
            best_cost = cost
            winner = construction
            bin_of_item[:] = trial
    return winner
