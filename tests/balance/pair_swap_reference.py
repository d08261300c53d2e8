"""``_kernels.local_search._pair_swap`` as it searched the partner's pairs afresh (a binary search) for every pair of
the top bin: the reference the compiled one (which searches on from the last pair found: the targets rise) is tested
against. Plain Python: its float sums are numba's."""
import bisect


def pair_swap_reference(memory, memory_cap, load, bin_mem, top, b, best, top_pairs, partner_pairs, floor):
    """Best swap of two items of the top bin for two of bin ``b`` beating ``best`` (a value below ``floor`` counts as
    ``floor``): each pair of the top bin (``top_pairs``: (sum, first, second) by increasing sum) against b's pairs
    (likewise) whose sums are nearest its own less half the gap, on either side. Returns (value, found: 2 or -1, the
    pair out, the pair in)."""
    top_load = load[top]
    gap = top_load - load[b]
    sums = [p[0] for p in partner_pairs]
    found, out, into = -1, None, None
    for top_sum, i1, i2 in top_pairs:
        lo = bisect.bisect_left(sums, top_sum - 0.5 * gap)
        for u in range(max(lo - 1, 0), min(lo + 1, len(sums))):
            s, j1, j2 = partner_pairs[u]
            d = top_sum - s
            moved = memory[i1] + memory[i2] - memory[j1] - memory[j2]
            if 0.0 < d < gap and bin_mem[b] + moved <= memory_cap and bin_mem[top] - moved <= memory_cap:
                value = max(top_load - d, load[b] + d)
                if max(value, floor) < best:
                    best, found, out, into = value, 2, (i1, i2), (j1, j2)
    return best, found, out, into
