"""Local search after a construction: swap sweeps between bins and moves/swaps out of the fullest bin."""
import numba
import numpy as np

from megatron_orch.balance._jit import _INLINE, _JIT
from megatron_orch.balance._kernels._segment_tree import _tree_last_above, _tree_set_max
from megatron_orch.balance._kernels.order import increasing


_PAIR_ITEMS = 32  # two-for-two swaps are tried between bins of at most this many items (496 pairs each)
_PAIR_PARTNERS = 2  # with the least-loaded this many partners (the largest gaps): each costs a sort of its pairs
_WIDEN = 8  # a refinement step that finds nothing with its partners tries this many times as many
_INSERTION_ITEMS = 32  # a bin of at most this many items is sorted by insertion


# ---------------------------------------------------------------------------------------------
# Local search: moves and swaps out of the most-loaded bin.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _rank_index(load, rank, lo, hi, key, b):
    """First index in ``rank[lo:hi]`` (bins by increasing (load, id)) not before (key, b)."""
    while lo < hi:
        mid = (lo + hi) // 2
        r = rank[mid]
        if load[r] < key or (load[r] == key and r < b):
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(**_JIT)
def _reposition(load, rank, b, old_load):
    """Restore ``rank`` after bin ``b``'s load changed from ``old_load`` (every other bin is in
    place): binary searches for its old and new places, then a shift of the bins in between (thousands of them
    where a refinement's top bin drops among the many near the mean: indexed unsigned, the shift compiles to a
    block move, ~6x faster than with numba's signed indices, which wrap around below 0)."""
    new_load = load[b]
    load[b] = old_load
    p = _rank_index(load, rank, 0, rank.size, old_load, b)
    load[b] = new_load
    if new_load > old_load:
        q = _rank_index(load, rank, p + 1, rank.size, new_load, b) - 1
        for t in range(p, q):
            rank[np.uint64(t)] = rank[np.uint64(t + 1)]
    else:
        q = _rank_index(load, rank, 0, p, new_load, b)
        for t in range(p, q, -1):
            rank[np.uint64(t)] = rank[np.uint64(t - 1)]
    rank[q] = b


@numba.njit(**_INLINE)
def _gather_sorted(head, nxt, costs, b, out):
    """Items of bin ``b`` by increasing (cost, id) into ``out``; returns how many.

    Insertion sort in place (Shell sort above :data:`_INSERTION_ITEMS` items): bins hold tens of items and this
    runs for a dozen bins per refinement step, where allocating sort buffers would cost more than the sorting (and
    insertion alone, for a bin of 16 items, ~1.7x less than Shell's gaps of 4 and 1).
    """
    m = 0
    i = head[b]
    while i != -1:
        out[m] = i
        m += 1
        i = nxt[i]
    gap = 1
    while m > _INSERTION_ITEMS and gap < m // 3:
        gap = 3 * gap + 1
    while gap >= 1:
        for u in range(gap, m):
            item = out[u]
            c = costs[item]
            v = u
            while v >= gap and (costs[out[v - gap]] > c or (costs[out[v - gap]] == c and out[v - gap] > item)):
                out[v] = out[v - gap]
                v -= gap
            out[v] = item
        gap //= 3
    return m


@numba.njit(**_INLINE)
def _sorted_items(head, nxt, costs, b, out, cache, cached, width):
    """:func:`_gather_sorted` of bin ``b``, kept in ``cache[b * width:]`` (``cached[b]`` items; -1: to gather
    again) until the bin changes: a step that widens to every bin reads thousands of bins, two of which change."""
    m = cached[b]
    if m >= 0:
        base = b * width
        for u in range(m):
            out[u] = cache[base + u]
        return m
    m = _gather_sorted(head, nxt, costs, b, out)
    if m <= width:
        base = b * width
        for u in range(m):
            cache[base + u] = out[u]
        cached[b] = m
    return m


@numba.njit(**_JIT)
def _greedy_subset(costs, memory, items, count, target, limit, chosen):
    """Items (of ``items[:count]``, increasing cost) summing close to ``target`` and below ``limit``.

    Takes items from the most costly down while the sum stays <= target, then, if the sum is still
    below target, the cheapest item not taken if that keeps it below ``limit`` (it ends nearest
    above the target). Writes them to ``chosen``; returns (how many, their cost, their memory).
    """
    m = 0
    total = 0.0
    mem = 0.0
    cheapest_left = -1
    for u in range(count - 1, -1, -1):
        c = costs[items[u]]
        if total + c <= target:
            chosen[m] = items[u]
            m += 1
            total += c
            mem += memory[items[u]]
        else:
            cheapest_left = items[u]
    if total < target and cheapest_left >= 0 and total + costs[cheapest_left] < limit:
        chosen[m] = cheapest_left
        m += 1
        total += costs[cheapest_left]
        mem += memory[cheapest_left]
    return m, total, mem


@numba.njit(**_INLINE)
def _exchange_with(costs, memory, memory_cap, load, bin_mem, top, b, top_items, num_top, partner_items,
                   num_b, kind, allow_moves, swap_cap, chosen, best, best_out, best_in, floor):
    """Best exchange between the top bin and bin ``b`` that beats ``best`` (the larger new load).

    ``kind`` 0: moves (if ``allow_moves``) and one-for-one swaps; 1: one-for-several either way.
    Writes an improving exchange into ``best_out`` (top -> b) and ``best_in`` (b -> top) and
    returns (its value, len(out), len(in)); returns (best, -1, -1) if none beats ``best``. A value below
    ``floor`` counts as ``floor`` (here and in the other exchanges: :func:`refine`'s early stop).
    """
    top_load = load[top]
    gap = top_load - load[b]
    num_out, num_in = -1, -1
    if kind == 1:
        # one of the top bin for several of b (equal items give the same answer)
        for t in range(num_top):
            i = top_items[t]
            if t > 0 and costs[i] == costs[top_items[t - 1]] and memory[i] == memory[top_items[t - 1]]:
                continue
            m, total, mem = _greedy_subset(costs, memory, partner_items, num_b,
                                           costs[i] - 0.5 * gap, costs[i], chosen)
            d = costs[i] - total
            if (m >= 2 and 0.0 < d < gap and bin_mem[b] + memory[i] - mem <= memory_cap
                    and bin_mem[top] - memory[i] + mem <= memory_cap):
                value = max(top_load - d, load[b] + d)
                if max(value, floor) < best:
                    best, num_out, num_in = value, 1, m
                    best_out[0] = i
                    best_in[:m] = chosen[:m]
        # several of the top bin for one of b
        for u in range(num_b):
            j = partner_items[u]
            if u > 0 and costs[j] == costs[partner_items[u - 1]] and memory[j] == memory[partner_items[u - 1]]:
                continue
            m, total, mem = _greedy_subset(costs, memory, top_items, num_top,
                                           costs[j] + 0.5 * gap, costs[j] + gap, chosen)
            d = total - costs[j]
            if (m >= 2 and 0.0 < d < gap and bin_mem[b] - memory[j] + mem <= memory_cap
                    and bin_mem[top] + memory[j] - mem <= memory_cap):
                value = max(top_load - d, load[b] + d)
                if max(value, floor) < best:
                    best, num_out, num_in = value, m, 1
                    best_out[:m] = chosen[:m]
                    best_in[0] = j
        return best, num_out, num_in
    if allow_moves:
        for t in range(num_top):
            i = top_items[t]
            if 0.0 < costs[i] < gap and bin_mem[b] + memory[i] <= memory_cap:
                value = max(top_load - costs[i], load[b] + costs[i])
                if max(value, floor) < best:
                    best, num_out, num_in = value, 1, 0
                    best_out[0] = i
    up = 0  # first item of b with cost >= target; targets rise with the top item's cost
    for t in range(num_top):
        i = top_items[t]
        if costs[i] > swap_cap:  # (items by increasing cost: the rest cost more)
            break
        target = costs[i] - 0.5 * gap
        while up < num_b and costs[partner_items[up]] < target:
            up += 1
        # the nearest feasible item of b below the target, then at or above it
        for direction in (-1, 1):
            u = up - 1 if direction < 0 else up
            while 0 <= u < num_b:
                j = partner_items[u]
                d = costs[i] - costs[j]
                if not 0.0 < d < gap:
                    break
                if (bin_mem[b] + memory[i] - memory[j] <= memory_cap
                        and bin_mem[top] - memory[i] + memory[j] <= memory_cap):
                    value = max(top_load - d, load[b] + d)
                    if max(value, floor) < best:
                        best, num_out, num_in = value, 1, 1
                        best_out[0] = i
                        best_in[0] = j
                    break
                u += direction
    return best, num_out, num_in


@numba.njit(**_INLINE)
def _cannot_beat(top_load, partner_load, best):
    """No exchange between bins of these loads gives both below ``best``: the larger of the two new loads is at
    least their mean (with a margin far above the rounding of the loads' sums)."""
    return 0.5 * (top_load + partner_load) * (1.0 - 1e-12) >= best


@numba.njit(**_INLINE)
def _scan_start(costs, order, top_items, num_top, scan):
    """Position in ``order`` (decreasing cost, ties by id) of the ``scan``-th item from its end outside the top bin
    (``top_items[:num_top]``, by increasing cost); 0 if there are fewer."""
    n = order.size
    low = n - scan
    while low > 0:  # the largest low with scan items outside the top bin at low or after: from above, a fixpoint
        ref = order[low]
        inside = 0  # the top bin's items at low or after (those cheaper than ref, or as costly and of larger id)
        for t in range(num_top):
            i = top_items[t]
            if costs[i] > costs[ref]:
                break
            if costs[i] < costs[ref] or i >= ref:
                inside += 1
        if n - scan - inside == low:
            break
        low = n - scan - inside
    return max(low, 0)


@numba.njit(**_INLINE)
def _sheds(top_load, c_top, c, best):
    """An item of cost ``c`` traded for the top bin's item costing ``c_top`` takes the top bin below ``best``, as
    :func:`_cheapest_swap` computes it (then so does every cheaper item, and for it every costlier item of the
    top bin: the rounding of ``-`` keeps the order)."""
    d = c_top - c
    return 0.0 < d and top_load - d < best


@numba.njit(**_INLINE)
def _first_shedding(costs, order, lo, hi, top_load, c_top, best):
    """First position in ``order[lo:hi]`` (decreasing cost) from which on every item :func:`_sheds` for ``c_top``;
    ``hi`` if none."""
    while lo < hi:
        mid = (lo + hi) // 2
        if _sheds(top_load, c_top, costs[order[mid]], best):
            hi = mid
        else:
            lo = mid + 1
    return lo


@numba.njit(**_JIT)
def _slack_tree(costs, load, bin_of_item, order, lo):
    """:func:`_cheapest_swap`'s max tree over positions ``lo..`` of ``order``: leaf u - lo holds the item's cost
    less its bin's load. Returns (tree, width, every item's leaf or -1)."""
    n = order.size
    width = 1
    while width < n - lo:
        width *= 2
    tree = np.full(2 * width, -np.inf)
    leaf = np.full(n, -1, dtype=np.int64)
    for u in range(lo, n):
        j = order[u]
        leaf[j] = u - lo
        tree[width + u - lo] = costs[j] - load[bin_of_item[j]]
    for v in range(width - 1, 0, -1):
        tree[v] = max(tree[2 * v], tree[2 * v + 1])
    return tree, width, leaf


@numba.njit(**_INLINE)
def _refresh(tree, costs, load, head, nxt, stale, stale_bins, num_stale, w):
    """Slack tree ``tree`` (w: its row of ``stale``, ``stale_bins``, ``num_stale``) brought up to date: the items of
    the bins changed since it was last read set again from their loads, each bin once."""
    slack, width, leaf = tree
    for k in range(num_stale[w]):
        b = stale_bins[w, k]
        stale[w, b] = False
        i = head[b]
        while i != -1:
            if leaf[i] >= 0:
                _tree_set_max(slack, width, leaf[i], costs[i] - load[b])
            i = nxt[i]
    num_stale[w] = 0


@numba.njit(**_INLINE)
def _next_taker(costs, order, top_items, num_top, top_load, best, cap, start, u, p, slack, width, slack_lo):
    """The next position at or below u (down to ``start``) in ``order`` (decreasing cost) of an item j that a top
    item i costing at most ``cap`` can take below ``best``: i must shed (:func:`_sheds`: d = c_i - c_j > L - best, L
    the top bin's load), and j's bin b must stay below it (L_b + d < best); the cheapest i that sheds gives the
    smallest d, so j qualifies iff c_j - L_b > c_i - best for that i. ``slack`` (a max tree over positions
    ``slack_lo..`` of c_j - L_b, :func:`_slack_tree`) finds it in log time; the margin of 1e-9 of the costs lets
    through every j the float sums would take. ``p``: the cheapest top item that may still shed (it only rises, as
    costs rise and best falls). Returns (position or -1, p)."""
    while u >= start and p < num_top and costs[top_items[p]] <= cap:
        c_p = costs[top_items[p]]
        if not _sheds(top_load, c_p, costs[order[u]], best):
            p += 1
            continue
        lo = _first_shedding(costs, order, start, u + 1, top_load, c_p, best)
        v = _tree_last_above(slack, width, lo - slack_lo, u - slack_lo, c_p - best - 1e-9 * (c_p + top_load))
        if v >= 0:
            return v + slack_lo, p
        u = lo - 1
        p += 1
    return -1, p


@numba.njit(**_INLINE)
def _mark_takers(costs, order, bin_of_item, top_items, num_top, top_load, best, cap, tree, marks, stamp):
    """``marks`` of the bins holding an item that a top item costing at most ``cap`` can take below ``best``
    (:func:`_next_taker`, ``tree``: the slack tree over every item) set to ``stamp``: a bin left out has no swap
    with the top bin that beats ``best`` (:func:`_exchange_with` tries, for each top item, the partner's items
    nearest half the gap on either side; if one of the bin's items takes the top bin below ``best``, so does the
    nearer of those two, on its side)."""
    slack, width, _ = tree
    u, p = order.size - 1, 0
    while True:
        u, p = _next_taker(costs, order, top_items, num_top, top_load, best, cap, 0, u, p, slack, width, 0)
        if u < 0:
            return
        marks[bin_of_item[order[u]]] = stamp
        u -= 1


@numba.njit(**_INLINE)
def _first_shed(costs, top_items, num_top, top_load, best):
    """The cheapest of the top bin's items (``top_items``: by increasing cost) whose move takes it below ``best``
    (num_top if none): a move to bin b beats ``best`` only if this one's cost added to b's load stays below it."""
    t = 0
    while t < num_top and not top_load - costs[top_items[t]] < best:
        t += 1
    return t


@numba.njit(**_INLINE)
def _cheapest_swap(costs, memory, memory_cap, load, bin_mem, bin_of_item, top, top_items, num_top, order, start,
                   slack, width, slack_lo, best, best_out, best_in, floor):
    """Best swap of one item of the top bin for one of the batch's cheapest items that beats ``best``.

    The items of ``order`` (decreasing cost) from ``start`` on outside the top bin (:func:`_scan_start`), each
    against the top bin's item whose cost is nearest its own plus half the gap between their bins
    (``top_items``: by increasing cost), cheapest first. Returns (value, partner bin) with the swap in
    ``best_out[0]`` / ``best_in[0]``, or (best, -1) if none beats it.

    Only an item some top item takes below ``best`` is tried (:func:`_next_taker`): one skipped cannot beat
    ``best`` as it then stood, so the result is that of trying every item in turn.
    """
    top_load = load[top]
    found = -1
    u = order.size - 1  # positions above u are done
    p = 0
    while best > floor:
        u, p = _next_taker(costs, order, top_items, num_top, top_load, best, np.inf, start, u, p, slack, width,
                           slack_lo)
        if u < 0:
            break
        j = order[u]
        u -= 1
        b = bin_of_item[j]
        if b == top:
            continue
        gap = top_load - load[b]
        if gap <= 0.0 or _cannot_beat(top_load, load[b], best):
            continue
        target = costs[j] + 0.5 * gap
        lo, hi = 0, num_top  # the first of the top bin's items costing >= target
        while lo < hi:
            mid = (lo + hi) // 2
            if costs[top_items[mid]] < target:
                lo = mid + 1
            else:
                hi = mid
        for t in range(max(lo - 1, 0), min(lo + 1, num_top)):
            i = top_items[t]
            d = costs[i] - costs[j]
            if (0.0 < d < gap and bin_mem[b] + memory[i] - memory[j] <= memory_cap
                    and bin_mem[top] - memory[i] + memory[j] <= memory_cap):
                value = max(top_load - d, load[b] + d)
                if max(value, floor) < best:
                    best, found = value, b
                    best_out[0] = i
                    best_in[0] = j
    return best, found


@numba.njit(**_JIT)
def _pair_sums(costs, items, count, sums, first, second):
    """Every pair of ``items[:count]`` (by increasing cost): their cost sums, by increasing sum (ties: the pair found
    first, by first item then second), into ``sums`` / ``first`` / ``second``; returns how many.

    The pairs of each item with the costlier ones rise with the second item: each such row is merged, from the
    back, into the pairs of the rows before it (a row's pair goes after their equal sums), in place: ~4x less CPU
    than a sort, and no buffers, for a bin's ~100 pairs sorted at every step."""
    m = 0
    for u in range(count - 1):
        a = items[u]
        c = costs[a]
        w = m + count - 1 - u  # (the merged rows' length)
        k = m - 1  # the last of the earlier rows' pairs not yet placed
        for v in range(count - 1, u, -1):
            s = c + costs[items[v]]
            while k >= 0 and sums[k] > s:
                w -= 1
                sums[w], first[w], second[w] = sums[k], first[k], second[k]
                k -= 1
            w -= 1
            sums[w], first[w], second[w] = s, a, items[v]
        m += count - 1 - u
    return m


@numba.njit(**_INLINE)
def _distinct_pairs(memory, sums, first, second, count):
    """``sums`` / ``first`` / ``second`` (:func:`_pair_sums`) kept, in place, without a pair whose sum and memories
    equal the last kept one's; returns how many are kept. As the top bin's pairs of :func:`_pair_swap`, such a pair
    meets the partner's pairs the one before it met, with the same differences, and cannot beat what that one gave:
    a top bin of a few item sizes (a long item and many equal short ones) has a few distinct pairs of its ~100."""
    if count == 0:
        return 0
    m = 1
    for t in range(1, count):
        k = m - 1
        if not (sums[t] == sums[k] and memory[first[t]] == memory[first[k]]
                and memory[second[t]] == memory[second[k]]):
            sums[m], first[m], second[m] = sums[t], first[t], second[t]
            m += 1
    return m


@numba.njit(**_INLINE)
def _cached_pair_sums(costs, items, count, b, pair_cache, pair_cached):
    """:func:`_pair_sums` of bin ``b``'s ``items[:count]`` (by cost), kept in row b of ``pair_cache`` (sums,
    first, second; ``pair_cached[b]`` pairs, -1: to build again) until the bin changes: a locality refinement's
    step that widens to every bin of the batch sorts the pairs of dozens of bins, two of which change per step.
    Returns b's rows and how many pairs they hold."""
    sums, first, second = pair_cache
    if pair_cached[b] < 0:
        pair_cached[b] = _pair_sums(costs, items, count, sums[b], first[b], second[b])
    return (sums[b], first[b], second[b]), pair_cached[b]


@numba.njit(**_INLINE)
def _pair_within(costs, items, count, top_sums, num_top_pairs, gap, near):
    """Whether two of ``items[:count]`` (by increasing cost) sum to s with 0 < t - s < ``gap`` for a sum t of
    ``top_sums[:num_top_pairs]``, in floats as :func:`_pair_swap` takes the difference: if not, bin b has no
    two-for-two swap with the top bin that beats its load. For each t, the largest pair sum below it (t - s is the
    least there) is among those two pointers meet: ~count steps, where sorting b's pairs takes ~8x as long. The
    items' costs are read once, into ``near`` (at least ``count`` long), for every t; a t at or below the least pair
    sum has none below it, and above the largest that one is nearest, for it and every later t (no walks)."""
    for u in range(count):
        near[u] = costs[items[u]]
    least, most = near[0] + near[1], near[count - 2] + near[count - 1]
    for k in range(num_top_pairs):
        t = top_sums[k]
        if least >= t:  # (no pair below t)
            continue
        if most < t:  # (the largest pair is the one below t and every later one)
            return t - most < gap
        u, v = 0, count - 1
        while u < v:
            s = near[u] + near[v]
            if s < t:
                if t - s < gap:
                    return True
                u += 1
            else:
                v -= 1
    return False


@numba.njit(**_JIT)
def _pair_swap(costs, memory, memory_cap, load, bin_mem, top, b, best, best_out, best_in,
               top_pairs, num_top_pairs, partner_pairs, num_pairs, floor):
    """Best swap of two items of the top bin for two of bin ``b`` (counts kept) beating ``best``.

    Where one-for-one swaps are stuck (a few items per bin, no single difference near half the gap),
    two-for-two differences are many more. Each pair of the top bin meets b's pair whose sum is
    nearest its own minus half the gap (pairs by sum: b's searched from the last one found on); refine passes the
    top bin's distinct pairs (:func:`_distinct_pairs`).
    ``top_pairs``: the top bin's ``num_top_pairs`` pairs, ``partner_pairs``: b's ``num_pairs``
    (:func:`_pair_sums`). Returns (value, 2) with the swap in ``best_out`` / ``best_in``, or (best, -1).
    """
    top_sum, top_first, top_second = top_pairs
    sums, first, second = partner_pairs
    top_load = load[top]
    gap = top_load - load[b]
    found = -1
    lo = 0  # b's first pair summing to >= target: targets rise with the top bin's pairs' sums, so from the last on
    for t in range(num_top_pairs):
        target = top_sum[t] - 0.5 * gap
        if lo < num_pairs and sums[lo] < target:  # steps doubling while below, then halving
            step = 1
            while lo + step < num_pairs and sums[lo + step] < target:
                lo += step
                step *= 2
            hi = min(lo + step, num_pairs)
            lo += 1
            while lo < hi:
                mid = (lo + hi) // 2
                if sums[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid
        for u in range(max(lo - 1, 0), min(lo + 1, num_pairs)):
            d = top_sum[t] - sums[u]
            if not 0.0 < d < gap:
                continue
            moved = memory[top_first[t]] + memory[top_second[t]] - memory[first[u]] - memory[second[u]]
            if bin_mem[b] + moved <= memory_cap and bin_mem[top] - moved <= memory_cap:
                value = max(top_load - d, load[b] + d)
                if max(value, floor) < best:
                    best, found = value, 2
                    best_out[0], best_out[1] = top_first[t], top_second[t]
                    best_in[0], best_in[1] = first[u], second[u]
    return best, found


@numba.njit(**_INLINE)
def _node_load(load, top, node_size):
    """Summed load of the bins on the top bin's node (bin r on node r // node_size)."""
    total = 0.0
    for b in range((top // node_size) * node_size, min(load.size, (top // node_size + 1) * node_size)):
        total += load[b]
    return total


@numba.njit(**_JIT)
def _partners(load, rank, top, node_size, partners, out):
    """Candidate partners of the top bin, least-loaded first; returns how many.

    ``node_size > 0``: the other bins of the top bin's node. Else up to ``partners`` of the
    least-loaded bins, one per distinct load: bins of equal load mostly hold the same kinds of
    items, and a search that is stuck needs variety.
    """
    num_bins = rank.size
    count = 0
    if node_size > 0:
        lo = (top // node_size) * node_size
        for b in range(lo, min(num_bins, lo + node_size)):
            if b != top and load[b] < load[top]:
                out[count] = b
                count += 1
        for u in range(1, count):  # by increasing load, ties by id (an insertion sort: up to 7 bins, no buffers)
            b = out[u]
            v = u
            while v > 0 and load[out[v - 1]] > load[b]:
                out[v] = out[v - 1]
                v -= 1
            out[v] = b
        return count
    for p in range(num_bins - 1):
        b = rank[p]
        if load[b] >= load[top] or count == partners:
            break
        if p == 0 or load[b] != load[rank[p - 1]]:
            out[count] = b
            count += 1
    return count


@numba.njit(**_INLINE)
def _exchange(items, rank_at, cost_at, lo, hi, t, in_item, in_rank, in_cost):
    """The item at ``items[t]`` leaves the bin of ``items[lo:hi]`` (listed by decreasing rank in ``order``, kept
    beside them in ``rank_at``: increasing cost, ties by decreasing id; their costs in ``cost_at``) and ``in_item``
    (of rank ``in_rank``, cost ``in_cost``) takes its place in that order: the items between its place and ``t``
    move one step towards ``t`` (a swap's two items are near in cost: a few steps)."""
    if in_rank > rank_at[t]:  # it comes earlier in the list
        while t > lo and rank_at[t - 1] < in_rank:
            items[t], rank_at[t], cost_at[t] = items[t - 1], rank_at[t - 1], cost_at[t - 1]
            t -= 1
    else:
        while t < hi - 1 and rank_at[t + 1] > in_rank:
            items[t], rank_at[t], cost_at[t] = items[t + 1], rank_at[t + 1], cost_at[t + 1]
            t += 1
    items[t], rank_at[t], cost_at[t] = in_item, in_rank, in_cost


@numba.njit(**_JIT)
def swap_sweeps(costs, order, num_bins, bin_of_item, stop_at, max_sweeps, group_size):
    """Even out many bins at once by one-for-one swaps, in place; returns the number of sweeps.

    Bins come in groups of ``group_size`` consecutive ids (the GPUs of a node; ``num_bins``: one
    group). A sweep pairs, in every group, the k-th most-loaded bin with the k-th least-loaded
    (while the former is above ``stop_at``) and, in every pair, swaps the item of the heavier bin and
    the cheaper item of the lighter one whose cost difference d is nearest half the gap. Both new
    loads lie strictly between the old ones, so the maximum never rises and counts stay. Where LPT
    leaves a plateau of bins just above the mean, :func:`refine` would take them down one at a time
    (thousands of steps at DP 2560); a few sweeps take most of them down together. ``order``: items
    by decreasing cost. Stops when the maximum is at most ``stop_at``, a sweep swaps nothing, or
    after ``max_sweeps``. Every bin's items are listed once (a swap then updates its two bins' lists in
    place: counts stay, so every bin keeps its place); the loads are summed again at every sweep, by item
    id, as the decisions need them bit for bit.
    """
    n = costs.size
    load = np.zeros(num_bins)
    start = np.zeros(num_bins + 1, dtype=np.int64)
    items = np.empty(n, dtype=np.int64)  # bin by bin, each bin's items by increasing cost (ties: decreasing id)
    rank_at = np.empty(n, dtype=np.int64)  # beside each listed item, its rank in order
    cost_at = np.empty(n)  # and its cost (the pairs' scans read it in a row, not through the item: 0.94x their CPU)
    for i in range(n):
        start[bin_of_item[i] + 1] += 1
    fill = np.empty(num_bins, dtype=np.int64)
    for b in range(num_bins):
        start[b + 1] += start[b]
        fill[b] = start[b]
    for k in range(n - 1, -1, -1):
        i = order[k]
        b = bin_of_item[i]
        items[fill[b]], rank_at[fill[b]], cost_at[fill[b]] = i, k, costs[i]
        fill[b] += 1
    grouped = np.empty(num_bins, dtype=np.int64)  # group by group, each group's bins by increasing load
    num_groups = (num_bins + group_size - 1) // group_size
    sweeps = 0
    while sweeps < max_sweeps:
        load[:] = 0.0
        for i in range(n):
            load[bin_of_item[i]] += costs[i]
        if load.max() <= stop_at:
            break
        rank = increasing(load)  # increasing load, ties by bin id
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
                best, out_at, in_at = half, -1, -1  # |d - half| < half <=> 0 < d < gap
                u = start[light]  # first item of the light bin costing >= the target (targets rise)
                for t in range(start[heavy], start[heavy + 1]):
                    c = cost_at[t]
                    target = c - half
                    while u < start[light + 1] and cost_at[u] < target:
                        u += 1
                    for v in range(max(u - 1, start[light]), min(u + 1, start[light + 1])):
                        miss = abs(c - cost_at[v] - half)
                        if miss < best:
                            best, out_at, in_at = miss, t, v
                if out_at >= 0:
                    out_item, in_item = items[out_at], items[in_at]
                    bin_of_item[out_item], bin_of_item[in_item] = light, heavy
                    out_rank, in_rank = rank_at[out_at], rank_at[in_at]
                    out_cost, in_cost = cost_at[out_at], cost_at[in_at]
                    _exchange(items, rank_at, cost_at, start[heavy], start[heavy + 1], out_at, in_item, in_rank,
                              in_cost)
                    _exchange(items, rank_at, cost_at, start[light], start[light + 1], in_at, out_item, out_rank,
                              out_cost)
                    swapped += 1
        sweeps += 1
        if swapped == 0:
            break
    return sweeps


@numba.njit(**_INLINE)
def _set_stale(stale, stale_bins, num_stale, slack_lo, n, b):
    """Bin ``b``'s load changed: its items' slack is set again in each slack tree built (``slack_lo[w] <= n``) when
    that is next read (:func:`_refresh`)."""
    for w in range(2):
        if slack_lo[w] <= n and not stale[w, b]:
            stale[w, b] = True
            stale_bins[w, num_stale[w]] = b
            num_stale[w] += 1


@numba.njit(**_JIT)
def refine(costs, memory, memory_cap, num_bins, bin_of_item, allow_moves, stop_at, partners, node_size,
           max_steps, order, cheapest_scan, cross_swap_cap=np.inf, settle_at_stop=False):
    """Lower the maximum bin cost by local search, in place; returns the number of steps taken.

    Each step takes the most-loaded bin M and applies the exchange with one partner bin b that
    minimises the larger of the two new loads, provided that is below M's load and memory stays
    under the cap. With loads L > Lb and a net cost d moved from M to b, the new pair is
    (L - d, Lb + d): the best d is the one nearest (L - Lb) / 2. Exchanges tried, in rounds (a
    round runs only if the ones before found nothing): one item of M for one cheaper item of b
    (keeps counts) and, if ``allow_moves``, one item moved from M to b; (``allow_moves``) one item
    of M for several of b or several of M for one of b (found greedily; what evening out items of a
    few fixed sizes takes); two items of M for two of b (bins of at most :data:`_PAIR_ITEMS` items,
    the :data:`_PAIR_PARTNERS` least-loaded partners, :func:`_pair_swap`); last, one item of M for one
    of the batch's cheapest items, wherever it is (:func:`_cheapest_swap`: the last ``cheapest_scan``
    items of ``order``, items by decreasing cost, outside M). Partners (:func:`_partners`) hold their
    bins' typical items, where a bin with one long item needs the batch's shortest for its other slots.
    With ``node_size > 0`` (bin r on node r // node_size) the rounds run with the bins of M's node
    first (every item of the node: no round of cheapest items there), then anywhere with ``partners``
    least-loaded bins (a step that finds nothing there tries :data:`_WIDEN` times as many, all but those it tried; with
    ``node_size``, and so on up to every bin, the one-for-one round of those wider searches only with the bins
    where one could beat the best, :func:`_mark_takers`); there, with a finite ``cross_swap_cap``, only moves, trades
    with the cheapest items and one-for-one swaps of items costing at most that (a swap that evens out two
    bins across nodes can move two long items, many bytes, for a small difference). ``settle_at_stop``
    (a locality refinement, whose target ``stop_at`` is a capacity to meet, not a bound to approach): an
    exchange that brings M to ``stop_at`` or below counts as the best, so the first found is taken (the
    cheapest items are tried first: few bytes, and a bin fixed in one step rather than evened out with
    partner after partner), and with ``node_size > 0`` a node holding more than its bins' share of
    ``stop_at`` looks anywhere first (no exchange inside it can fix that). On the balance sweep's batches
    this took the packed locality plan's refinement from ~25,000 steps to ~2,500 at DP 2560 and its bytes
    across nodes from 9.5% to 7.2% on average. Stops at a local optimum, once the maximum is at most
    ``stop_at``, or after ``max_steps``.
    """
    return refine_caps(costs, memory, memory_cap, num_bins, bin_of_item, allow_moves, stop_at, partners, node_size,
                       max_steps, order, cheapest_scan, np.array([cross_swap_cap]), settle_at_stop)


@numba.njit(**_JIT)
def refine_caps(costs, memory, memory_cap, num_bins, bin_of_item, allow_moves, stop_at, partners, node_size,
                max_steps, order, cheapest_scan, cross_swap_caps, settle_at_stop):
    """:func:`refine` with each of ``cross_swap_caps`` in turn, while the maximum is above ``stop_at`` (the locality
    refinements' small items across nodes first): the bins and steps of as many calls, which would each build the
    items' lists, sorted bins and trees again (~2.5 ms at DP 10240 for a call that finds nothing). Returns the
    number of steps taken."""
    n = costs.size
    load = np.zeros(num_bins)
    for i in range(n):
        load[bin_of_item[i]] += costs[i]
    if load.max() <= stop_at:  # nothing to gain: leave before building the per-item lists
        return 0
    load[:] = 0.0
    bin_mem = np.zeros(num_bins)
    head = np.full(num_bins, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    prv = np.full(n, -1, dtype=np.int64)
    for i in range(n):
        b = bin_of_item[i]
        load[b] += costs[i]
        bin_mem[b] += memory[i]
        if head[b] >= 0:
            prv[head[b]] = i
        nxt[i] = head[b]
        head[b] = i
    rank = increasing(load).astype(np.int32)  # bins by increasing load, ties by id (32 bits: half the bytes to shift)
    cache_width = 2 * (n // num_bins + 1)  # each bin's items by cost, while it holds at most this many
    cache = np.empty(num_bins * cache_width, dtype=np.int64)
    cached = np.full(num_bins, -1, dtype=np.int64)
    top_items = np.empty(n, dtype=np.int64)
    partner_items = np.empty(n, dtype=np.int64)
    near = np.empty(_PAIR_ITEMS)  # a partner's item costs, for _pair_within
    chosen = np.empty(n, dtype=np.int64)
    best_out = np.empty(n, dtype=np.int64)  # items of the best exchange going M -> b
    best_in = np.empty(n, dtype=np.int64)   # and b -> M
    plist = np.empty(max(num_bins, node_size), dtype=np.int64)
    num_pairs = _PAIR_ITEMS * (_PAIR_ITEMS - 1) // 2
    top_pairs = (np.empty(num_pairs), np.empty(num_pairs, dtype=np.int64), np.empty(num_pairs, dtype=np.int64))
    partner_pairs = (np.empty(num_pairs), np.empty(num_pairs, dtype=np.int64), np.empty(num_pairs, dtype=np.int64))
    cached_rows = num_bins if node_size > 0 else 0  # bins' pairs kept between steps: the locality refinements only
    pair_cache = (np.empty((cached_rows, num_pairs)), np.empty((cached_rows, num_pairs), dtype=np.int64),
                  np.empty((cached_rows, num_pairs), dtype=np.int64))
    pair_cached = np.full(cached_rows, -1, dtype=np.int64)

    floor = stop_at if settle_at_stop else -np.inf
    # the items' slack trees (:func:`_slack_tree`): 0 over the cheapest items (the trades with them), 1 over every
    # item (the widest searches); each built when first needed, brought up to date when read
    slack_lo = np.array([n + 1, n + 1])
    cheap = every = (np.empty(0), 0, np.empty(0, dtype=np.int64))
    stale = np.zeros((2, num_bins), dtype=np.bool_)  # bins whose items' slack changed since the tree was read
    stale_bins, num_stale = np.empty((2, num_bins), dtype=np.int64), np.zeros(2, dtype=np.int64)
    marks, stamp = np.zeros(num_bins, dtype=np.int64), 0  # bins holding an item a top item can take (this stamp)
    # A step that found nothing and widens runs again on the same loads with the same best: per scope and kind, the
    # partners it has tried (those again give nothing; num_bins: a round that does not depend on the partners, its
    # cheapest-item trades), whether the marks are its top bin's takers (marked_top), and its top bin's pairs
    tried, shed = np.zeros((2, 4), dtype=np.int64), 0
    # partners anywhere: widened when they give nothing, up to every bin with node_size (the locality refinements,
    # which start far from balance), else _WIDEN times (a plain plan stuck within its tolerance of a bound it may not
    # reach)
    widest = num_bins - 1 if node_size > 0 else min(num_bins - 1, _WIDEN * partners)
    total = 0
    for call in range(cross_swap_caps.size):
        cross_swap_cap = cross_swap_caps[call]
        if call > 0:  # loads summed afresh (bits as a call of its own sums them), bins ranked afresh
            fresh, fresh_mem = np.zeros(num_bins), np.zeros(num_bins)
            for i in range(n):
                fresh[bin_of_item[i]] += costs[i]
                fresh_mem[bin_of_item[i]] += memory[i]
            for b in range(num_bins):
                if fresh[b] != load[b]:
                    _set_stale(stale, stale_bins, num_stale, slack_lo, n, b)
            load, bin_mem = fresh, fresh_mem
            if load.max() <= stop_at:
                break
            rank = increasing(load).astype(np.int32)
        tried[:] = 0
        marked_top = False
        num_top_pairs = -1  # the top bin's pairs, built when a two-for-two round needs them (kept while it widens)
        width = partners
        steps = 0
        while steps < max_steps:
            top = np.int64(rank[num_bins - 1])
            best = load[top]
            if best <= stop_at:
                break
            best_b, num_out, num_in = -1, 0, 0
            num_top = _sorted_items(head, nxt, costs, top, top_items, cache, cached, cache_width)
            node_full = settle_at_stop and node_size > 0 and _node_load(load, top, node_size) > node_size * stop_at
            for turn in range(2):  # M's node (if node_size > 0), then anywhere; the other way round if M's node is full
                scope = 1 - turn if node_full else turn  # 0: M's node; 1: anywhere
                if best_b >= 0:
                    break
                if scope == 0 and node_size <= 0:
                    continue
                num_p = _partners(load, rank, top, node_size if scope == 0 else 0, width, plist)
                for kind in range(4):  # 0: moves and swaps; 1: one for several; 2: two for two; 3: the cheapest items
                    if best_b >= 0:
                        break
                    if ((kind == 1 and not allow_moves) or (kind == 2 and not 2 <= num_top <= _PAIR_ITEMS)
                            or (kind == 3 and scope == 0)  # (on M's node, partners are all its bins: every item)
                            or (kind in (1, 2) and scope == 1 and cross_swap_cap < np.inf)):
                        continue
                    if tried[scope, kind] == num_bins:
                        continue
                    if kind == 3:
                        tried[scope, kind] = num_bins
                        start = _scan_start(costs, order, top_items, num_top, cheapest_scan)
                        if start < slack_lo[0]:  # (first use, or a top bin holding many of the cheapest items)
                            slack_lo[0] = max(0, start - cheapest_scan)
                            cheap = _slack_tree(costs, load, bin_of_item, order, slack_lo[0])
                        _refresh(cheap, costs, load, head, nxt, stale, stale_bins, num_stale, 0)
                        best, b = _cheapest_swap(costs, memory, memory_cap, load, bin_mem, bin_of_item, top, top_items,
                                                 num_top, order, start, cheap[0], cheap[1], slack_lo[0], best,
                                                 best_out, best_in, floor)
                        if b >= 0:
                            best_b, num_out, num_in = b, 1, 1
                        continue
                    if kind == 2 and num_top_pairs < 0:
                        num_top_pairs = _distinct_pairs(memory, top_pairs[0], top_pairs[1], top_pairs[2], _pair_sums(
                            costs, top_items, num_top, top_pairs[0], top_pairs[1], top_pairs[2]))
                    marked = kind == 0 and scope == 1 and width > _WIDEN * partners
                    if marked and not marked_top:  # (hundreds of partners or more: those with a swap or room for a
                        # move, in log time)
                        marked_top = True
                        if slack_lo[1] > 0:
                            slack_lo[1] = 0
                            every = _slack_tree(costs, load, bin_of_item, order, 0)
                        _refresh(every, costs, load, head, nxt, stale, stale_bins, num_stale, 1)
                        stamp += 1
                        _mark_takers(costs, order, bin_of_item, top_items, num_top, load[top], best, cross_swap_cap,
                                     every, marks, stamp)
                        shed = _first_shed(costs, top_items, num_top, load[top], best)
                    count = num_p if kind < 2 else min(num_p, _PAIR_PARTNERS * width // partners)
                    for q in range(tried[scope, kind], count):
                        b = plist[q]
                        if _cannot_beat(load[top], load[b], best):  # (partners by increasing load: nor any later one)
                            break
                        if marked and marks[b] != stamp and not (allow_moves and shed < num_top
                                                                 and load[b] + costs[top_items[shed]] < best):
                            continue
                        kept = kind == 2 and node_size > 0 and pair_cached[b] >= 0  # (b's pairs kept: its items unread)
                        num_b = 0 if kept else _sorted_items(head, nxt, costs, b, partner_items, cache, cached,
                                                             cache_width)
                        if kind < 2:
                            best, o, i = _exchange_with(costs, memory, memory_cap, load, bin_mem, top, b, top_items,
                                                        num_top, partner_items, num_b, kind, allow_moves,
                                                        np.inf if scope == 0 else cross_swap_cap, chosen,
                                                        best, best_out, best_in, floor)
                        elif kept or 2 <= num_b <= _PAIR_ITEMS:  # (pairs are kept only of such bins)
                            if not (kept or _pair_within(costs, partner_items, num_b, top_pairs[0], num_top_pairs,
                                                         load[top] - load[b], near)):
                                continue  # (most of a widened search's partners: their pairs not sorted)
                            if node_size > 0:
                                b_pairs, num_b_pairs = _cached_pair_sums(costs, partner_items, num_b, b, pair_cache,
                                                                         pair_cached)
                            else:
                                b_pairs = partner_pairs
                                num_b_pairs = _pair_sums(costs, partner_items, num_b, b_pairs[0], b_pairs[1],
                                                         b_pairs[2])
                            best, o = _pair_swap(costs, memory, memory_cap, load, bin_mem, top, b, best, best_out,
                                                 best_in, top_pairs, num_top_pairs, b_pairs, num_b_pairs, floor)
                            i = o
                        else:
                            continue
                        if o >= 0:
                            best_b, num_out, num_in = b, o, i
                        if best <= floor:  # settled: no later partner can beat it
                            break
                    tried[scope, kind] = count
            if best_b < 0:
                if width < widest:
                    width = min(widest, _WIDEN * width)  # stuck among the least-loaded: again with more of them
                    continue
                break
            width = partners
            tried[:] = 0
            marked_top, num_top_pairs = False, -1
            top_load, partner_load = load[top], load[best_b]
            for k in range(num_out + num_in):
                item = best_out[k] if k < num_out else best_in[k - num_out]
                src, dst = (top, best_b) if k < num_out else (best_b, top)
                if prv[item] >= 0:  # unlink from src, push on dst
                    nxt[prv[item]] = nxt[item]
                else:
                    head[src] = nxt[item]
                if nxt[item] >= 0:
                    prv[nxt[item]] = prv[item]
                prv[item] = -1
                nxt[item] = head[dst]
                if head[dst] >= 0:
                    prv[head[dst]] = item
                head[dst] = item
                bin_of_item[item] = dst
                load[src] -= costs[item]
                load[dst] += costs[item]
                bin_mem[src] -= memory[item]
                bin_mem[dst] += memory[item]
            cached[top] = cached[best_b] = -1
            _set_stale(stale, stale_bins, num_stale, slack_lo, n, top)
            _set_stale(stale, stale_bins, num_stale, slack_lo, n, best_b)
            if node_size > 0:
                pair_cached[top] = pair_cached[best_b] = -1
            new_partner_load = load[best_b]  # reposition one bin at a time, the other still in place
            load[best_b] = partner_load
            _reposition(load, rank, top, top_load)
            load[best_b] = new_partner_load
            _reposition(load, rank, best_b, partner_load)
            steps += 1
        total += steps
    return total
