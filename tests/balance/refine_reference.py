"""``_kernels.local_search.refine`` as every step searched afresh: loads summed, bins ranked and sorted anew, every
partner tried in every round (no marks), each round run again in full when the step widens, all of the top bin's pairs
met. The reference the compiled one (which skips, on a widened step, what it tried on the same loads, and pairs or
bins that cannot beat the best) is tested against. It calls the compiled exchanges (each tested against its own
reference) and the plain-Python trade with the cheapest items; costs and memory must be integers (sums then exact,
as refine's loads kept up to date are)."""
import numpy as np
from cheapest_swap_reference import cheapest_swap_reference

from megatron_orch.balance._kernels import local_search


def _by_cost(costs, bins, b):
    return np.array(sorted(np.flatnonzero(bins == b).tolist(), key=lambda i: (costs[i], i)), dtype=np.int64)


def _pairs(costs, items):
    rows = max(1, items.size * (items.size - 1) // 2)
    pairs = (np.empty(rows), np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64))
    return pairs, local_search._pair_sums(costs, items, items.size, *pairs)


def refine_reference(costs, memory, memory_cap, num_bins, bins, allow_moves, stop_at, partners, node_size,
                     max_steps, order, scan, cross_swap_cap, settle_at_stop):
    """refine's exchanges on ``bins`` (in place); returns the number of steps."""
    n = costs.size
    floor = stop_at if settle_at_stop else -np.inf
    widest = num_bins - 1 if node_size > 0 else min(num_bins - 1, local_search._WIDEN * partners)
    width, steps = partners, 0
    scratch = [np.empty(n, dtype=np.int64) for _ in range(3)]
    while steps < max_steps:
        load = np.bincount(bins, weights=costs, minlength=num_bins)
        bin_mem = np.bincount(bins, weights=memory, minlength=num_bins)
        rank = np.argsort(load, kind="stable")
        top = int(rank[-1])
        best = load[top]
        if best <= stop_at:
            break
        top_items = _by_cost(costs, bins, top)
        node_full = (settle_at_stop and node_size > 0
                     and local_search._node_load(load, top, node_size) > node_size * stop_at)
        found = None
        for turn in range(2):
            scope = 1 - turn if node_full else turn
            if found is not None or (scope == 0 and node_size <= 0):
                continue
            plist = np.empty(max(num_bins, node_size), dtype=np.int64)
            num_p = local_search._partners(load, rank, top, node_size if scope == 0 else 0, width, plist)
            for kind in range(4):
                if found is not None or ((kind == 1 and not allow_moves)
                                         or (kind == 2 and not 2 <= top_items.size <= local_search._PAIR_ITEMS)
                                         or (kind == 3 and scope == 0)
                                         or (kind in (1, 2) and scope == 1 and cross_swap_cap < np.inf)):
                    continue
                if kind == 3:
                    best, b, out, into = cheapest_swap_reference(costs, memory, memory_cap, load, bin_mem, bins, top,
                                                                 top_items.tolist(), order.tolist(), scan, best, floor)
                    if b >= 0:
                        found = (b, [out], [into])
                    continue
                count = num_p if kind < 2 else min(num_p, local_search._PAIR_PARTNERS * width // partners)
                for b in plist[:count]:
                    if local_search._cannot_beat(load[top], load[b], best):
                        break
                    partner_items = _by_cost(costs, bins, b)
                    if kind < 2:
                        best, o, i = local_search._exchange_with(
                            costs, memory, memory_cap, load, bin_mem, top, b, top_items, top_items.size,
                            partner_items, partner_items.size, kind, allow_moves,
                            np.inf if scope == 0 else cross_swap_cap, scratch[0], best, scratch[1], scratch[2], floor)
                    elif 2 <= partner_items.size <= local_search._PAIR_ITEMS:
                        best, o = local_search._pair_swap(costs, memory, memory_cap, load, bin_mem, top, b, best,
                                                          scratch[1], scratch[2], *_pairs(costs, top_items),
                                                          *_pairs(costs, partner_items), floor)
                        i = o
                    else:
                        continue
                    if o >= 0:
                        found = (b, scratch[1][:o].tolist(), scratch[2][:i].tolist())
                    if best <= floor:
                        break
        if found is None:
            if width < widest:
                width = min(widest, local_search._WIDEN * width)
                continue
            break
        width = partners
        b, out, into = found
        bins[out], bins[into] = b, top
        steps += 1
    return steps
