"""partition()'s ``auto`` as a Python loop over the built-in partitioners (where long items set the bound, first-fit
decreasing at it; then lpt, bs_ffd, kk): the reference the compiled one (balance/_kernels/auto.py) is tested
against."""
import math

import numpy as np

from megatron_orch.balance import _kernels
from megatron_orch.balance._kernels.first_fit import ABOVE_UPPER, ffd
from megatron_orch.balance.partition import (_AUTO_SETTLED, _BS_FFD_MAX_ROUNDS, _BS_FFD_REL_TOL, _CHEAPEST_SCAN,
                                             _GOOD_ENOUGH, _REFINE_PARTNERS, _SWAP_SWEEPS, _decreasing, _max_cost,
                                             _refusal)
from megatron_orch.balance.registry import PARTITIONERS

AUTO_ORDER = ("lpt", "bs_ffd", "kk")  # the order auto tries the built-in partitioners in


def auto_reference(costs, num_bins, memory=None, memory_cap=None, refine=True):
    """(bin_of_item, method name) of ``partition(costs, num_bins, memory=..., memory_cap=...)`` (no home), or
    the ValueError it raises."""
    costs = np.asarray(costs, dtype=np.float64)
    n = costs.size
    memory = np.zeros(n) if memory is None else np.asarray(memory, dtype=np.float64)
    cap = math.inf if memory_cap is None else float(memory_cap)
    refine = refine and n > 0
    order = _decreasing(costs)
    best, best_cost, winner, reasons = None, math.inf, None, []
    bound = _kernels.pigeonhole_bound(costs, order, num_bins)
    good_enough, settled = (1.0 + _GOOD_ENOUGH) * bound, (1.0 + _AUTO_SETTLED) * bound
    if n > num_bins and bound > costs.sum() / num_bins:  # room to spare: first-fit at the bound, then its tolerance
        for capacity in (bound, good_enough):
            bins = np.zeros(n, dtype=np.int64)
            if ffd(costs, memory, cap, order, num_bins, capacity, bins) < 0:
                if _fill_empty_bins(bins, memory, cap, order, num_bins):
                    return bins, "auto:bs_ffd" + ("+refine" if refine else "")
                break
    for entry in (PARTITIONERS.get(name) for name in AUTO_ORDER):
        if best_cost <= settled:
            break
        bins = np.zeros(n, dtype=np.int64)
        if entry.name == "lpt":
            item = _kernels.lpt(costs, memory, cap, order, num_bins, bins)
            if item >= 0:
                reasons.append(_refusal("lpt", item, memory, cap))
                continue
        elif entry.name == "kk":
            _kernels.kk(costs, order, 1, num_bins, bins)
            if cap < math.inf and np.bincount(bins, weights=memory, minlength=num_bins).max() > cap:
                reasons.append(_refusal("kk", 0, memory, cap))
                continue
        else:
            status = _kernels.bs_ffd(costs, memory, cap, order, num_bins, best_cost, _BS_FFD_REL_TOL,
                                     _BS_FFD_MAX_ROUNDS, bins)
            if status == ABOVE_UPPER:
                continue
            if status >= 0:
                reasons.append(_refusal("bs_ffd", status, memory, cap))
                continue
        if refine:
            if cap == math.inf:
                _kernels.swap_sweeps(costs, order, num_bins, bins, good_enough, _SWAP_SWEEPS, num_bins)
            _kernels.refine(costs, memory, cap, num_bins, bins, True, good_enough, _REFINE_PARTNERS, 0, n + num_bins,
                            order, _CHEAPEST_SCAN, math.inf)
        cost = _max_cost(costs, bins, num_bins)
        if cost < best_cost:
            best, best_cost, winner = bins, cost, entry.name
    if best is None:
        return ValueError("no method honours the memory cap: " + "; ".join(reasons))
    return best, f"auto:{winner}" + ("+refine" if refine else "")


def _fill_empty_bins(bins, memory, cap, order, num_bins):
    """Each empty bin, in id order, takes the cheapest item not yet taken whose bin holds two or more and that fits
    the memory cap alone; False if none is left."""
    counts = np.bincount(bins, minlength=num_bins).tolist()
    donors = iter(order[::-1].tolist())
    for b in range(num_bins):
        if counts[b]:
            continue
        item = next((i for i in donors if counts[bins[i]] >= 2 and memory[i] <= cap), None)
        if item is None:
            return False
        counts[bins[item]] -= 1
        bins[item], counts[b] = b, 1
    return True
