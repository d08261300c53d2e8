"""``_kernels.local_search._cheapest_swap`` as it tried every one of the batch's cheapest items in turn: the reference
the compiled one (which skips, through a tree of the items' slack, those that cannot beat the best) is tested
against. Plain Python: its float sums are numba's."""
import bisect


def cheapest_swap_reference(costs, memory, memory_cap, load, bin_mem, bin_of_item, top, top_items, order, scan,
                            best, floor):
    """Best swap of one item of the top bin for one of the last ``scan`` items of ``order`` (decreasing cost)
    outside the top bin, each against the top bin's item whose cost is nearest its own plus half the gap between
    their bins (``top_items``: by increasing cost), that beats ``best`` (a value below ``floor`` counts as
    ``floor``): (value, partner bin, item out, item in), or (best, -1, -1, -1)."""
    top_load = load[top]
    found, out, into = -1, -1, -1
    top_costs = [costs[i] for i in top_items]
    seen = 0
    for j in reversed(order):
        if seen == scan or costs[j] >= top_costs[-1]:
            break
        b = bin_of_item[j]
        if b == top:
            continue
        seen += 1
        gap = top_load - load[b]
        if gap <= 0.0 or 0.5 * (top_load + load[b]) * (1.0 - 1e-12) >= best:
            continue
        lo = bisect.bisect_left(top_costs, costs[j] + 0.5 * gap)
        for t in range(max(lo - 1, 0), min(lo + 1, len(top_items))):
            i = top_items[t]
            d = costs[i] - costs[j]
            if (0.0 < d < gap and bin_mem[b] + memory[i] - memory[j] <= memory_cap
                    and bin_mem[top] - memory[i] + memory[j] <= memory_cap):
                value = max(top_load - d, load[b] + d)
                if max(value, floor) < best:
                    best, found, out, into = value, b, i, j
    return best, found, out, into
