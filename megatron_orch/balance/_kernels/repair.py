"""The plain plan localised (balance/repair.py's ``localize``): examples swapped onto the node they want; the
locality repair (``repair_locality``): its per-link byte counts, trial exchanges and loop, every sum and choice as its
numpy code made them."""
import numba
import numpy as np

from megatron_orch.balance._jit import _INLINE, _JIT, _NO_REFCOUNT
from megatron_orch.balance._kernels.bounds import numpy_sum
from megatron_orch.balance._kernels.order import decreasing
from megatron_orch.balance._plan_kernels import _rank_starts


# ---------------------------------------------------------------------------------------------
# Ranks' examples in the order they arrived (a linked list per rank: O(1) removal and append).
# ---------------------------------------------------------------------------------------------

@numba.njit(**_INLINE)
def _unlink(head, tail, nxt, prv, r, e):
    if prv[e] >= 0:
        nxt[prv[e]] = nxt[e]
    else:
        head[r] = nxt[e]
    if nxt[e] >= 0:
        prv[nxt[e]] = prv[e]
    else:
        tail[r] = prv[e]
    nxt[e] = -1
    prv[e] = -1


@numba.njit(**_INLINE)
def _append(head, tail, nxt, prv, r, e):
    prv[e] = tail[r]
    nxt[e] = -1
    if tail[r] >= 0:
        nxt[tail[r]] = e
    else:
        head[r] = e
    tail[r] = e


@numba.njit(**_JIT)
def _lists_by_rank(rank, num_ranks):
    """Every rank's examples as a doubly linked list in id order: (head, tail, next, previous), each example's links
    written in place in one pass each way (appending them one by one writes each rank's last example's, scattered
    over the examples: 5.7 -> 0.9 ms at DP 10240)."""
    n = rank.size
    head = np.full(num_ranks, -1, dtype=np.int64)
    tail = np.full(num_ranks, -1, dtype=np.int64)
    nxt = np.empty(n, dtype=np.int64)
    prv = np.empty(n, dtype=np.int64)
    for e in range(n):
        prv[e] = tail[rank[e]]
        tail[rank[e]] = e
    for e in range(n - 1, -1, -1):
        nxt[e] = head[rank[e]]
        head[rank[e]] = e
    return head, tail, nxt, prv


# ---------------------------------------------------------------------------------------------
# A node's examples by increasing (cost, id): a sorted row of a (nodes, width) table, their costs and the nodes they
# want in the same place of two others (read along the row, not through the example).
# ---------------------------------------------------------------------------------------------

@numba.njit(**_INLINE)
def _pool_at(pools, pool_costs, x, size, c, e):
    """First place in row x (``size`` examples) not before (cost c, example e)."""
    lo, hi = 0, size
    while lo < hi:
        mid = (lo + hi) // 2
        if pool_costs[x, mid] < c or (pool_costs[x, mid] == c and pools[x, mid] < e):
            lo = mid + 1
        else:
            hi = mid
    return lo


@numba.njit(**_INLINE)
def _pool_copy(pools, pool_costs, pool_wants, x, src, dst):
    """Place ``src`` of row x copied to place ``dst`` in the three tables."""
    pools[x, dst], pool_costs[x, dst], pool_wants[x, dst] = pools[x, src], pool_costs[x, src], pool_wants[x, src]


@numba.njit(**_INLINE)
def _pool_remove(pools, pool_costs, pool_wants, sizes, x, costs, e):
    at = _pool_at(pools, pool_costs, x, sizes[x], costs[e], e)
    if at < sizes[x] and pools[x, at] == e:
        for k in range(at, sizes[x] - 1):
            _pool_copy(pools, pool_costs, pool_wants, x, k + 1, k)
        sizes[x] -= 1


@numba.njit(**_JIT)
def _wider(table, width):
    """``table`` (a row per node, or per rank) ``width`` wide, its entries in place."""
    wider = np.empty((table.shape[0], width), dtype=table.dtype)
    wider[:, :table.shape[1]] = table
    return wider


@numba.njit(**_INLINE)
def _pool_insert(pools, pool_costs, pool_wants, sizes, x, costs, want, e):
    """e inserted in row x of the tables (the row has room: see :func:`_wider`)."""
    at = _pool_at(pools, pool_costs, x, sizes[x], costs[e], e)
    for k in range(sizes[x], at, -1):
        _pool_copy(pools, pool_costs, pool_wants, x, k - 1, k)
    pools[x, at], pool_costs[x, at], pool_wants[x, at] = e, costs[e], want[e]
    sizes[x] += 1


@numba.njit(**_INLINE)
def _pool_replace(pools, pool_costs, pool_wants, x, size, costs, want, out, e):
    """Example ``out`` of row x replaced by e, the rows kept sorted: only the entries between their two places move
    (a swap's two examples cost about the same)."""
    c = costs[e]
    k = _pool_at(pools, pool_costs, x, size, costs[out], out)
    while k > 0 and (pool_costs[x, k - 1] > c or (pool_costs[x, k - 1] == c and pools[x, k - 1] > e)):
        _pool_copy(pools, pool_costs, pool_wants, x, k - 1, k)
        k -= 1
    while k < size - 1 and (pool_costs[x, k + 1] < c or (pool_costs[x, k + 1] == c and pools[x, k + 1] < e)):
        _pool_copy(pools, pool_costs, pool_wants, x, k + 1, k)
        k += 1
    pools[x, k], pool_costs[x, k], pool_wants[x, k] = e, c, want[e]


# ---------------------------------------------------------------------------------------------
# localize
# ---------------------------------------------------------------------------------------------

# A rank's examples in the order they arrived: a row of a (ranks, width) table, their costs in the same place of another
# (read along the row, not through the example; the row's few entries move up when one leaves).

@numba.njit(**_INLINE)
def _leave(members, member_costs, counts, r, e):
    k = _list_position(members, r, e)
    for k in range(k, counts[r] - 1):
        members[r, k], member_costs[r, k] = members[r, k + 1], member_costs[r, k + 1]
    counts[r] -= 1


@numba.njit(**_INLINE)
def _arrive(members, member_costs, counts, r, e, c):
    """e appended to rank r's row (the row has room: see :func:`_passes`)."""
    members[r, counts[r]], member_costs[r, counts[r]] = e, c
    counts[r] += 1


@numba.njit(**_INLINE)
def _exchange(rank, load, costs, members, member_costs, counts, e, f):
    """e and f (on different ranks) trade ranks."""
    a, b = rank[e], rank[f]
    rank[e], rank[f] = b, a
    _leave(members, member_costs, counts, a, e)
    _leave(members, member_costs, counts, b, f)
    _arrive(members, member_costs, counts, a, f, costs[f])
    _arrive(members, member_costs, counts, b, e, costs[e])
    load[a] += costs[f] - costs[e]
    load[b] += costs[e] - costs[f]


@numba.njit(**_INLINE)
def _relocate(rank, load, costs, members, member_costs, counts, e, to):
    a = rank[e]
    rank[e] = to
    _leave(members, member_costs, counts, a, e)
    _arrive(members, member_costs, counts, to, e, costs[e])
    load[a] -= costs[e]
    load[to] += costs[e]


@numba.njit(**_INLINE)
def _max_room(load, capacity, node_ranks, node_start, x):
    least = np.inf
    for t in range(node_start[x], node_start[x + 1]):
        least = min(least, load[node_ranks[t]])
    return capacity - least


@numba.njit(**_INLINE)
def _list_position(members, q, f):
    """Place of example f in rank q's row (the order its examples arrived in)."""
    k = 0
    while members[q, k] != f:
        k += 1
    return k


@numba.njit(**_INLINE)
def _settle(rank, load, costs, members, member_costs, counts, node_of_rank, node_ranks, node_start, capacity,
            swaps_only, r, over, pool, pool_cost, size):
    """One exchange between rank r and another rank q of its node that takes between ``over`` and q's room off
    r, the least such (keeping the most room), the first found when rank r's examples (in order) meet the
    node's other ranks' examples (rank by rank, each in order) and then (``swaps_only`` False) the ranks
    themselves (a move): applied, True; else False.

    ``pool[:size]``: the node's examples by (cost, id) (``pool_cost``: their costs), from before the trial swap that
    overfilled r (the one it sent off the node is skipped; the one it brought is on r). For each example i of r, its
    swaps from the least difference up: from the costliest example f with c_i - c_f >= ``over`` down, while the
    difference stays below the best found and the node's most room (it only grows, the rounding of ``-`` keeps the
    order); the first that fits its rank's room is i's best, ties (an equal difference) to the first rank of the
    node, then the first example in that rank's order."""
    x = node_of_rank[r]
    most = -np.inf  # the most room of another rank of the node: none with less than ``over`` can take the excess
    for t in range(node_start[x], node_start[x + 1]):
        if node_ranks[t] != r:
            most = max(most, capacity - load[node_ranks[t]])
    if most < over:
        return False
    best, g, h, to = np.inf, -1, -1, -1
    for j in range(counts[r]):
        i, ci = members[r, j], member_costs[r, j]
        lo = 0  # the first example of the pool whose difference to i is below over: those before it counted (the
        # difference only shrinks along the row; a count runs in vector lanes, a search's steps wait on each other)
        for k in range(size):
            lo += ci - pool_cost[k] >= over
        least, least_q, least_f = np.inf, -1, -1
        for k in range(lo - 1, -1, -1):
            f = pool[k]
            d = ci - pool_cost[k]
            if d >= best or d > most or (least_f >= 0 and d != least):
                break
            q = rank[f]
            if q == r or node_of_rank[q] != x or d > capacity - load[q]:
                continue
            if least_f < 0 or q < least_q or (q == least_q and _list_position(members, q, f)
                                               < _list_position(members, q, least_f)):
                least, least_q, least_f = d, q, f
        if least_f >= 0:
            best, g, h = least, i, least_f
        d = ci - 0.0
        if not swaps_only and over <= d <= most and d < best:  # a move: to the node's first rank with room for i
            for t in range(node_start[x], node_start[x + 1]):
                q = node_ranks[t]
                if q != r and d <= capacity - load[q]:
                    best, g, h, to = d, i, -1, q
                    break
    if g < 0:
        return False
    if h >= 0:
        _exchange(rank, load, costs, members, member_costs, counts, g, h)
    else:
        _relocate(rank, load, costs, members, member_costs, counts, g, to)
    return True


@numba.njit(**_JIT)
def localize(rank_by_id, costs_by_id, want_by_id, node_of_rank, capacity, swaps_only, weight_by_id, scan, passes,
             settle_tries):
    """balance/repair.py's ``localize`` on ``rank_by_id`` (in place); returns the examples brought home.

    ``costs_by_id``: finite, >= 0 (sorted by their bits); ``weight_by_id``: the bytes an example pulls (>= 0);
    ``scan``: swap partners looked at on either side of an example's cost; ``passes``: passes over the examples away
    from their node; ``settle_tries``: swaps that overfill a rank tried per example, the best first. Every choice and
    tie is the reference's (tests/balance/localize_reference.py): its lists become rows of tables, in the same orders,
    and its examples are renumbered by decreasing cost (0.87x localize's CPU in a plan at DP 10240, packed
    heavy-tail: a pass reads its examples in order, a swap's partners close to them), ids compared where the
    reference compares them.
    """
    n = rank_by_id.size
    num_ranks = node_of_rank.size
    num_nodes = 0
    for r in range(num_ranks):
        num_nodes = max(num_nodes, node_of_rank[r] + 1)
    load = np.zeros(num_ranks)
    for e in range(n):  # (in id order: the same sums)
        load[rank_by_id[e]] += costs_by_id[e]
    # the examples renumbered by decreasing cost, ties by id (each pass takes them in this order; a swap's partners,
    # close in cost, sit close by): within equal costs ids keep their order, so every (cost, id) order is the same;
    # ids, ranks and nodes in 32 bits in the tables the passes read (fewer of their cache lines: 0.92-0.95x)
    by_cost = decreasing(costs_by_id)
    rank, costs, want, weight = (rank_by_id[by_cost].astype(np.int32), costs_by_id[by_cost],
                                 want_by_id[by_cost].astype(np.int32), weight_by_id[by_cost])
    node_start = _rank_starts(node_of_rank, num_nodes)
    node_ranks = np.empty(num_ranks, dtype=np.int64)
    fill = node_start[:-1].copy()
    for r in range(num_ranks):
        node_ranks[fill[node_of_rank[r]]] = r
        fill[node_of_rank[r]] += 1
    counts = np.zeros(num_ranks, dtype=np.int64)
    for e in range(n):
        counts[rank[e]] += 1
    # rows a multiple of 8 entries (64-byte cache lines) wide, with room for more where moves add to ranks' counts
    # (measured at DP 10240, packed: 0.93x localize's time against rows as wide as the fullest, widened at once)
    fullest = counts.max() if num_ranks else 0
    members = np.empty((num_ranks, max((fullest + (0 if swaps_only else 1) + 7) // 8 * 8, 8)), dtype=np.int32)
    member_costs = np.empty(members.shape)
    counts[:] = 0
    renumbered = np.empty(n, dtype=np.int64)
    renumbered[by_cost] = np.arange(n)
    for old in range(n):  # in id order
        e = renumbered[old]
        _arrive(members, member_costs, counts, rank[e], e, costs[e])
    sizes = np.zeros(num_nodes, dtype=np.int64)
    for e in range(n):
        sizes[node_of_rank[rank[e]]] += 1
    pools = np.empty((num_nodes, max(sizes.max() if num_nodes else 0, 1)), dtype=np.int32)
    pool_costs = np.empty(pools.shape)
    pool_wants = np.empty(pools.shape, dtype=np.int32)
    sizes[:] = 0
    last = n - 1
    while last >= 0:  # by (cost, id): every row sorted (runs of equal costs from the cheapest, each in id order)
        first = last
        while first > 0 and costs[first - 1] == costs[last]:
            first -= 1
        for e in range(first, last + 1):
            x = node_of_rank[rank[e]]
            pools[x, sizes[x]], pool_costs[x, sizes[x]], pool_wants[x, sizes[x]] = e, costs[e], want[e]
            sizes[x] += 1
        last = first - 1
    start = 0
    for e in range(n):
        if node_of_rank[rank[e]] == want[e]:
            start += 1
    gains = np.empty(settle_tries)  # the swaps that overfill a rank to try, the best first
    gaps = np.empty(settle_tries)
    partners = np.empty(settle_tries, dtype=np.int64)
    away = np.empty(n, dtype=np.int64)
    arriving = np.zeros(num_nodes, dtype=np.int64)
    progress = np.zeros(5, dtype=np.int64)
    while _passes(rank, costs, want, node_of_rank, capacity, swaps_only, weight, scan, passes, settle_tries, load,
                  node_start, node_ranks, members, member_costs, counts, sizes, pools, pool_costs, pool_wants, gains,
                  gaps, partners, by_cost, away, arriving, progress):
        width = progress[1]
        if width > 0:
            pools, pool_costs, pool_wants = _wider(pools, width), _wider(pool_costs, width), _wider(pool_wants, width)
            progress[1] = 0
        else:
            members, member_costs = _wider(members, 2 * members.shape[1]), _wider(member_costs, 2 * members.shape[1])
    home = 0
    for e in range(n):
        if node_of_rank[rank[e]] == want[e]:
            home += 1
    rank_by_id[by_cost] = rank
    return home - start


@numba.njit(**_INLINE)
def _away(rank, want, node_of_rank, away, arriving):
    """The examples away from the node they want, in order, into ``away`` (their number returned); ``arriving``: per
    node, those that want it, added."""
    num_away = 0
    for e in range(rank.size):
        if node_of_rank[rank[e]] != want[e]:
            away[num_away] = e
            num_away += 1
            arriving[want[e]] += 1
    return num_away


@numba.njit(**_NO_REFCOUNT)
def _passes(rank, costs, want, node_of_rank, capacity, swaps_only, weight, scan, passes, settle_tries, load, node_start,
            node_ranks, members, member_costs, counts, sizes, pools, pool_costs, pool_wants, gains, gaps, partners,
            by_cost, away, arriving, progress):
    """:func:`localize`'s passes from pass ``progress[0]`` (its examples from ``progress[2]`` where that is not 0: of
    ``progress[3]`` away, ``progress[4]`` moved); True where it stopped before a pass whose moves could overfill a
    node's row (its examples and those away that want it; ``progress[1]``: the width it needs), or before an example
    whose move could overfill a rank's row (an example's move, or the one that settles its swap, adds one to a rank's
    count; ``progress[1]`` 0): the caller widens the rows (:func:`_wider`) and calls again. Allocates nothing, so it
    runs without reference counts (each inlined helper would otherwise count every array it is passed). ``arriving``:
    a zero per node, left zero."""
    fullest = 0  # the most examples on a rank, kept as moves add to one
    for r in range(counts.size):
        fullest = max(fullest, counts[r])
    for p in range(progress[0], passes):  # the costliest first (fewest partners); again, as moves made room
        if progress[2] > 0:  # resumed inside the pass
            first, num_away, moved = progress[2], progress[3], progress[4]
            progress[2] = 0
        else:
            first, num_away, moved = 0, _away(rank, want, node_of_rank, away, arriving), 0
            need = 0  # (a pass moves an example once at most; swaps leave every node's count as it is)
            for y in range(sizes.size):
                need = max(need, sizes[y] + arriving[y])
                arriving[y] = 0
            if not swaps_only and need > pools.shape[1]:
                progress[0], progress[1] = p, need
                return True
        for j in range(first, num_away):
            e = away[j]
            a = rank[e]
            x, y = node_of_rank[a], want[e]
            if x == y:
                continue
            if not swaps_only and fullest == members.shape[1]:
                progress[0], progress[2], progress[3], progress[4] = p, j, num_away, moved
                return True
            c = costs[e]
            pick, pick_gain, pick_gap = -1, 0.0, 0.0
            num_unsettled = 0
            wanting = -1  # whether an example on y wants x (1) or not (0); -1: not asked yet
            size = sizes[y]
            if size > 0:
                # no partner further in cost can fit, even settled: a costlier one overfills a by the gap less
                # a's room, a cheaper one its own rank by the gap less that rank's room
                up = capacity - load[a] + _max_room(load, capacity, node_ranks, node_start, x)
                down = 2 * _max_room(load, capacity, node_ranks, node_start, y)
                at = _pool_at(pools, pool_costs, y, size, c, -1)
                lo, hi = at - 1, at
                for _scan in range(2 * scan):  # outward from c, nearest cost first
                    up_fits = hi < size and pool_costs[y, hi] - c <= up
                    down_fits = lo >= 0 and c - pool_costs[y, lo] <= down
                    if up_fits and (not down_fits or pool_costs[y, hi] - c <= c - pool_costs[y, lo]):
                        k, hi = hi, hi + 1
                    elif down_fits:
                        k, lo = lo, lo - 1
                    else:
                        break
                    # partners come nearest first: one further on beats the pick only by bringing more bytes home,
                    # which (bytes >= 0) only one wanting x can; where none on y does, that is all
                    if pick >= 0 and weight[e] + 0.0 <= pick_gain:
                        if wanting < 0:
                            wanting = 0
                            for t in range(size):
                                if pool_wants[y, t] == x:
                                    wanting = 1
                                    break
                        if wanting == 0:
                            break
                        if pool_wants[y, k] != x:
                            continue
                    f = pools[y, k]
                    cf = pool_costs[y, k]
                    gap = abs(cf - c)
                    # bytes brought home by the swap: e's, plus f's if it wants x, less f's if it was home
                    if pool_wants[y, k] == x:
                        gain = weight[e] + weight[f]
                    elif pool_wants[y, k] == y:
                        gain = weight[e] + -weight[f]
                    else:
                        gain = weight[e] + 0.0
                    if gain <= 0:
                        continue
                    b = rank[f]
                    if load[a] - c + cf > capacity or load[b] - cf + c > capacity:
                        if pick < 0:  # (kept for the tries, which only run if none fits) the best settle_tries
                            # by (most bytes home, smallest gap, id)
                            t = min(num_unsettled, settle_tries)
                            while t > 0 and (gain > gains[t - 1] or (gain == gains[t - 1] and (
                                    gap < gaps[t - 1] or (gap == gaps[t - 1]
                                                          and by_cost[f] < by_cost[partners[t - 1]])))):
                                if t < settle_tries:
                                    gains[t], gaps[t], partners[t] = gains[t - 1], gaps[t - 1], partners[t - 1]
                                t -= 1
                            if t < settle_tries:
                                gains[t], gaps[t], partners[t] = gain, gap, f
                            num_unsettled += 1
                        continue
                    if pick < 0 or gain > pick_gain or (gain == pick_gain and gap < pick_gap):
                        pick, pick_gain, pick_gap = k, gain, gap
            partner = -1
            if pick >= 0:
                partner = pools[y, pick]
                _exchange(rank, load, costs, members, member_costs, counts, e, partner)
            else:  # the best swaps that overfill one rank, if its node can take the excess
                for _try in range(min(settle_tries, num_unsettled)):
                    f = partners[_try]
                    b = rank[f]
                    _exchange(rank, load, costs, members, member_costs, counts, e, f)
                    heavy = a if load[a] > capacity else b
                    if _settle(rank, load, costs, members, member_costs, counts, node_of_rank, node_ranks, node_start,
                               capacity, swaps_only, heavy, load[heavy] - capacity,
                               pools[node_of_rank[heavy]], pool_costs[node_of_rank[heavy]], sizes[node_of_rank[heavy]]):
                        partner = f
                        z = node_of_rank[heavy]
                        for t in range(node_start[z], node_start[z + 1]):
                            fullest = max(fullest, counts[node_ranks[t]])
                        break
                    _exchange(rank, load, costs, members, member_costs, counts, e, f)
            if partner >= 0:  # e takes the partner's place among y's examples, the partner e's among x's
                _pool_replace(pools, pool_costs, pool_wants, y, sizes[y], costs, want, partner, e)
                _pool_replace(pools, pool_costs, pool_wants, x, sizes[x], costs, want, e, partner)
                moved += 1
                continue
            if not swaps_only:
                b = -1
                for t in range(node_start[y], node_start[y + 1]):  # the least-loaded rank of y (first of equals)
                    q = node_ranks[t]
                    if b < 0 or load[q] < load[b]:
                        b = q
                if b >= 0 and load[b] + c <= capacity:
                    _relocate(rank, load, costs, members, member_costs, counts, e, b)
                    fullest = max(fullest, counts[b])
                    _pool_remove(pools, pool_costs, pool_wants, sizes, x, costs, e)
                    _pool_insert(pools, pool_costs, pool_wants, sizes, y, costs, want, e)
                    moved += 1
        if moved == 0:
            break
    return False


@numba.njit(**_JIT)
def group_entries(example, src, nbytes, entries, num_examples, num_ranks):
    """One all-to-all's entries (entry i: ``nbytes[i]`` from rank ``src[i]`` to example ``example[i]``, standing for
    ``entries[i]`` of the caller's: a run of them, :func:`_plan_kernels.runs`, or 1) grouped as balance/repair.py's
    ``_Move`` holds them: (sources and bytes (float64) by example, where each example's begin (``num_examples`` + 1),
    where each source rank's begin among the next (``num_ranks`` + 1), the examples of the entries by source rank,
    how many entries each of those stands for), each group in entry order: ``np.argsort(kind="stable")``'s orders,
    the groups' starts counted (:func:`_rank_starts`), then every entry placed in both in one pass. Every value within
    range (the caller checks)."""
    n = example.size
    start = _rank_starts(example, num_examples)
    by_src_start = _rank_starts(src, num_ranks)
    fill = start[:-1].copy()
    src_fill = by_src_start[:-1].copy()
    grouped_src = np.empty(n, dtype=np.int64)
    grouped_bytes = np.empty(n, dtype=np.float64)
    by_src_example = np.empty(n, dtype=np.int64)
    by_src_count = np.empty(n, dtype=np.int64)
    for i in range(n):
        e, s = example[i], src[i]
        grouped_src[fill[e]] = s
        grouped_bytes[fill[e]] = nbytes[i]
        fill[e] += 1
        by_src_example[src_fill[s]] = e
        by_src_count[src_fill[s]] = entries[i]
        src_fill[s] += 1
    return grouped_src, grouped_bytes, start, by_src_start, by_src_example, by_src_count


@numba.njit(**_INLINE)
def _add_entry(links, node_of_rank, s, d, b):
    """(Its callers run without reference counts: each call would count ``links`` and ``node_of_rank`` otherwise.)"""
    if s == d:
        return
    if node_of_rank[s] != node_of_rank[d]:
        links[2, s] += b
        links[3, d] += b
    else:
        links[0, s] += b
        links[1, d] += b


@numba.njit(**_NO_REFCOUNT)
def add_link_bytes(links, node_of_rank, src, dst, nbytes, sign):
    """``sign`` x bytes of entries moving ``src[i]`` -> ``dst[i]`` added to ``links`` ([sent on the node, received on
    the node, sent across nodes, received across nodes] x ranks), in entry order (as ``np.add.at`` per row adds:
    the same sums, bit for bit); an entry that stays on its rank adds nothing."""
    for i in range(src.size):
        _add_entry(links, node_of_rank, src[i], dst[i], nbytes[i] * sign)


@numba.njit(**_NO_REFCOUNT)
def example_link_bytes(links, node_of_rank, src, nbytes, offset, rank):
    """Every move's entries (move m's of example e: ``src`` / ``nbytes`` at ``offset[m, e]:offset[m, e + 1]``) added
    to ``links[m]``, each towards its example's rank ``rank[e]``: :func:`add_link_bytes` of the move's entries in
    their order (the same sums, bit for bit), without spelling out each entry's destination."""
    for m in range(offset.shape[0]):
        move_links = links[m]
        for e in range(rank.size):
            d = rank[e]
            for i in range(offset[m, e], offset[m, e + 1]):
                _add_entry(move_links, node_of_rank, src[i], d, nbytes[i] * 1.0)


@numba.njit(**_NO_REFCOUNT)
def move_link_bytes(links, node_of_rank, src, nbytes, a, to):
    """The entries ``src`` -> rank ``a`` (``nbytes`` each) going to rank ``to`` instead, in ``links`` (as
    :func:`add_link_bytes`): subtracted as they were, then added, each pass in entry order (the same sums, bit for
    bit, as ``add_link_bytes`` with sign -1 towards ``a`` then +1 towards ``to``)."""
    for to_rank, sign in ((a, -1.0), (to, 1.0)):
        for i in range(src.size):
            _add_entry(links, node_of_rank, src[i], to_rank, nbytes[i] * sign)


# ---------------------------------------------------------------------------------------------
# The repair's trial exchanges (balance/repair.py's ``repair_locality``): the excess over the plain plan's limits
# before and after, every sum as numpy takes it, so the same actions win.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def bytes_on_node(src, nbytes, offset, node_of_rank, examples, on_node):
    """For each of ``examples``: the bytes of its entries (every move's: ``src`` / ``nbytes`` at ``offset[m, e]:
    offset[m, e + 1]``) sent from node ``on_node``, summed as balance/repair.py sums them (each move's with numpy's
    sum, :func:`~megatron_orch.balance._kernels.bounds.numpy_sum`, then move after move)."""
    out = np.empty(examples.size)
    for k in range(examples.size):
        e = examples[k]
        total = 0.0
        for m in range(offset.shape[0]):
            lo, hi = offset[m, e], offset[m, e + 1]
            picked = np.empty(hi - lo)
            count = 0
            for i in range(lo, hi):
                if node_of_rank[src[i]] == on_node:
                    picked[count] = nbytes[i]
                    count += 1
            total += numpy_sum(picked[:count])
        out[k] = total
    return out


@numba.njit(**_JIT)
def shift_example(links, node_of_rank, src, nbytes, offset, rank, load, costs, e, to):
    """Example e's entries of every move m (``src`` / ``nbytes`` at ``offset[m, e]:offset[m, e + 1]``) and its cost
    moved from its rank to rank ``to`` (``links``: per move, :func:`add_link_bytes`'s four rows)."""
    a = rank[e]
    if a == to:
        return
    for m in range(links.shape[0]):
        lo, hi = offset[m, e], offset[m, e + 1]
        if hi > lo:
            move_link_bytes(links[m], node_of_rank, src[lo:hi], nbytes[lo:hi], a, to)
    rank[e] = to
    load[a] -= costs[e]
    load[to] += costs[e]


@numba.njit(**_JIT)
def _excess_and_inter(links, load, ranks, limits, capacity, cap_scale):
    """(the excess of ``ranks`` over the limits, their bytes sent across nodes) as balance/repair.py defines them;
    ``limits``: per move, (NIC limit, NVLink limit, NIC scale, NVLink scale)."""
    num_moves, k = links.shape[0], ranks.size
    nic = np.empty(num_moves * k)
    nvl = np.empty(num_moves * k)
    inter = np.empty(num_moves * k)
    for t in range(k):  # rank by rank, the moves inside: the order numpy sums ``links[:, 2, ranks]`` in (its memory's)
        r = ranks[t]
        for m in range(num_moves):
            nic[t * num_moves + m] = max(max(links[m, 2, r], links[m, 3, r]) - limits[m, 0], 0.0) / limits[m, 2]
            nvl[t * num_moves + m] = max(max(links[m, 0, r], links[m, 1, r]) - limits[m, 1], 0.0) / limits[m, 3]
            inter[t * num_moves + m] = links[m, 2, r]
    comp = np.empty(k)
    for t in range(k):
        comp[t] = max(load[ranks[t]] - capacity, 0.0)
    over = numpy_sum(nic) + numpy_sum(nvl)
    return over + numpy_sum(comp[:k]) / cap_scale, numpy_sum(inter)


@numba.njit(**_JIT)
def try_exchange(links, node_of_rank, src, nbytes, offset, rank, load, costs, e, to, partners, limits, capacity,
                 cap_scale):
    """(excess change, bytes across nodes change) of moving example e to rank ``to`` and ``partners`` to e's rank,
    over the ranks either touches (their own and those their entries come from); undone, in the reverse order."""
    a = rank[e]
    size = 2
    for m in range(links.shape[0]):
        size += offset[m, e + 1] - offset[m, e]
        for f in partners:
            size += offset[m, f + 1] - offset[m, f]
    touched = np.empty(size, dtype=np.int64)
    touched[0], touched[1] = a, to
    count = 2
    for m in range(links.shape[0]):
        for i in range(offset[m, e], offset[m, e + 1]):
            touched[count] = src[i]
            count += 1
        for f in partners:
            for i in range(offset[m, f], offset[m, f + 1]):
                touched[count] = src[i]
                count += 1
    ranks = np.unique(touched)
    before, bytes_before = _excess_and_inter(links, load, ranks, limits, capacity, cap_scale)
    shift_example(links, node_of_rank, src, nbytes, offset, rank, load, costs, e, to)
    for f in partners:
        shift_example(links, node_of_rank, src, nbytes, offset, rank, load, costs, f, a)
    after, bytes_after = _excess_and_inter(links, load, ranks, limits, capacity, cap_scale)
    for f in partners:
        shift_example(links, node_of_rank, src, nbytes, offset, rank, load, costs, f, to)
    shift_example(links, node_of_rank, src, nbytes, offset, rank, load, costs, e, a)
    return after - before, bytes_after - bytes_before


# ---------------------------------------------------------------------------------------------
# The repair (balance/repair.py's ``repair_locality``): every choice and tie as its numpy code made them
# (tests/balance/repair_reference.py), sorts of whole arrays become partial selections.
# ---------------------------------------------------------------------------------------------

_NIC, _NVL, _COMPUTE = 1, 2, 0  # kinds of limit, coded in the order the reference's names sort ("nvl" > "nic")


@numba.njit(**_JIT)
def _smallest(values, k, out):
    """Indices of the ``k`` smallest ``values``, ties by index, in that order, into ``out``; returns how many
    (``np.argsort(values, kind="stable")[:k]``)."""
    count = 0
    if k <= 0:
        return 0
    for i in range(values.size):
        v = values[i]
        if count == k and not v < values[out[k - 1]]:
            continue
        t = count if count < k else k - 1
        while t > 0 and v < values[out[t - 1]]:
            out[t] = out[t - 1]
            t -= 1
        out[t] = i
        if count < k:
            count += 1
    return count


@numba.njit(**_JIT)
def _members(head, nxt, r, out):
    """Examples on rank r by increasing id into ``out`` (``np.flatnonzero(rank == r)``); returns how many."""
    m = 0
    i = head[r]
    while i >= 0:
        t = m
        while t > 0 and out[t - 1] > i:
            out[t] = out[t - 1]
            t -= 1
        out[t] = i
        m += 1
        i = nxt[i]
    return m


@numba.njit(**_JIT)
def _worst(links, load, limits, capacity, cap_scale, stuck, tol, worst_count):
    """(kind, move, rank) furthest over its limit among each kind's ``worst_count`` furthest, those ``stuck`` left
    out, (-1, -1, -1) if none; the furthest by (excess, kind, move, rank) (move -1 for compute)."""
    num_moves, num_ranks = links.shape[0], load.size
    best_v, best_kind, best_m, best_r = -np.inf, -1, -1, -1
    top = np.empty(worst_count, dtype=np.int64)
    for kind in (_NIC, _NVL, _COMPUTE):
        size = num_ranks if kind == _COMPUTE else num_moves * num_ranks
        neg = np.empty(size)  # minus the excess where over the tolerance, else +inf
        values = np.empty(size)
        for k in range(size):
            m, r = k // num_ranks, k % num_ranks
            if kind == _COMPUTE:
                v = (load[r] - capacity) / cap_scale
            elif kind == _NIC:
                v = (max(links[m, 2, r], links[m, 3, r]) - limits[m, 0]) / limits[m, 2]
            else:
                v = (max(links[m, 0, r], links[m, 1, r]) - limits[m, 1]) / limits[m, 3]
            values[k] = v
            neg[k] = -v if v > tol else np.inf
        for t in range(_smallest(neg, worst_count, top)):
            k = top[t]
            v = values[k]
            if not v > tol:
                break
            m, r = (-1, k) if kind == _COMPUTE else (k // num_ranks, k % num_ranks)
            if stuck[kind, m + 1, r]:
                continue
            if (v > best_v or (v == best_v and (kind > best_kind or (kind == best_kind and (
                    m > best_m or (m == best_m and r > best_r)))))):
                best_v, best_kind, best_m, best_r = v, kind, m, r
    return best_kind, best_m, best_r


@numba.njit(**_JIT)
def _on_link(node, kind, s, r):
    """An entry between ranks s and r crosses the link of this kind: across nodes (NIC), or on the node off the GPU
    (NVLink)."""
    if kind == _NIC:
        return node[s] != node[r]
    return node[s] == node[r] and s != r


@numba.njit(**_JIT)
def _candidates(kind, m, r, links, node, src, nbytes, offset, by_src_start, by_src_example, rank, costs, head, nxt,
                num_candidates, mine, out):
    """Examples whose move off their rank (or onto another) can lower rank r's excess, the most promising first,
    into ``out``; returns how many."""
    num = _members(head, nxt, r, mine)
    if kind == _COMPUTE:
        neg = np.empty(num)
        for k in range(num):
            neg[k] = -costs[mine[k]]
        pick = np.empty(num_candidates, dtype=np.int64)
        count = _smallest(neg, num_candidates, pick)
        for t in range(count):
            out[t] = mine[pick[t]]
        return count
    if kind == _NIC:
        receiving = links[m, 3, r] >= links[m, 2, r]
    else:
        receiving = links[m, 1, r] >= links[m, 0, r]
    if not receiving:  # examples that rank r sends entries of move m to, over that link
        sent = np.unique(by_src_example[by_src_start[m, r]:by_src_start[m, r + 1]])
        num = 0
        for e in sent:
            if _on_link(node, kind, rank[e], r):
                mine[num] = e
                num += 1
    weight = np.empty(num)
    picked = np.empty(offset[m, -1] - offset[m, 0])
    for k in range(num):
        e = mine[k]
        count = 0
        for i in range(offset[m, e], offset[m, e + 1]):
            if (_on_link(node, kind, src[i], r) if receiving else src[i] == r):
                picked[count] = nbytes[i]
                count += 1
        weight[k] = numpy_sum(picked[:count])
    kept = 0
    for k in range(num):
        if weight[k] > 0:
            mine[kept], weight[kept] = mine[k], weight[k]
            kept += 1
    pick = np.empty(num_candidates, dtype=np.int64)
    count = _smallest(-weight[:kept], num_candidates, pick)
    for t in range(count):
        out[t] = mine[pick[t]]
    return count


@numba.njit(**_JIT)
def _targets(e, r, kind, m, links, node, num_nodes, src, nbytes, offset, by_src_start, by_src_example, by_src_count,
             rank, load, target_nodes, spread, seen, out):
    """Ranks to try example e on, in order, into ``out``; returns how many: those of the nodes its bytes come from
    most (and rank r's node, when r sends it), the ranks holding examples whose bytes of move m come from r's node
    (swap partners), then the ranks with the least on the over-limit link (to spread what r has). ``seen``: a
    scratch of zeros per rank, left zero."""
    num_ranks = node.size
    per_node = np.zeros(num_nodes)
    for mm in range(offset.shape[0]):
        for i in range(offset[mm, e], offset[mm, e + 1]):
            per_node[node[src[i]]] += nbytes[i]
    top = np.empty(max(target_nodes, spread), dtype=np.int64)
    nodes = np.empty(target_nodes + 1, dtype=np.int64)
    num = 0
    if kind != _COMPUTE and rank[e] != r:
        nodes[0] = node[r]
        num = 1
    for t in range(_smallest(-per_node, target_nodes, top)):
        if per_node[top[t]] > 0:
            nodes[num] = top[t]
            num += 1
    if num == 0:
        nodes[0] = node[rank[e]]
        num = 1
    count = 0
    for q in range(num_ranks):  # (by rank)
        for t in range(num):
            if node[q] == nodes[t]:
                out[count] = q
                count += 1
                break
    if kind != _COMPUTE:
        held = np.zeros(num_ranks)
        nonzero = 0
        for q in range(num_ranks):
            if node[q] != node[r]:
                continue
            for j in range(by_src_start[m, q], by_src_start[m, q + 1]):
                h = rank[by_src_example[j]]
                if (node[h] != node[r]) if kind == _NIC else (h != r):
                    if held[h] == 0:
                        nonzero += 1
                    held[h] -= by_src_count[j]  # the entries it stands for
        for t in range(_smallest(held, min(spread, nonzero), top)):
            out[count] = top[t]
            count += 1
    busy = np.empty(num_ranks)
    for q in range(num_ranks):
        if kind == _NIC:
            busy[q] = max(links[m, 2, q], links[m, 3, q])
        elif kind == _NVL:
            busy[q] = max(links[m, 0, q], links[m, 1, q])
        else:
            busy[q] = load[q]
    for t in range(_smallest(busy, spread, top)):
        out[count] = top[t]
        count += 1
    kept = 0
    for t in range(count):  # the first of each, not e's own
        q = out[t]
        if seen[q] == 0:
            seen[q] = 1
            if q != rank[e]:
                out[kept] = q
                kept += 1
    seen[rank[e]] = 0
    for t in range(kept):
        seen[out[t]] = 0
    return kept


@numba.njit(**_JIT)
def _options(e, a, to, kind, src, nbytes, offset, node, load, costs, capacity, swaps_only, head, nxt, num_partners,
             others, set_start, set_items):
    """Partner sets for moving e from a to ``to`` that keep both ranks within the capacity, into ``set_items`` (set s
    at ``set_start[s]:set_start[s + 1]``): none (a move), one example of ``to`` (a swap; the closest in cost, those
    with most bytes on a's node first), or (packed) several whose costs add up to what fits; returns how many."""
    c = costs[e]
    num_sets = 0
    set_start[0] = 0
    low = load[to] + c - capacity      # what must leave ``to``
    high = capacity - load[a] + c      # what ``a`` can take
    if kind == _COMPUTE:
        high = min(high, c * (1 - 1e-12)) if load[a] <= capacity else c * (1 - 1e-12)
    if not swaps_only and low <= 0:
        num_sets += 1
        set_start[num_sets] = 0
    num_others = _members(head, nxt, to, others)
    if num_others == 0 or high <= 0:
        return num_sets
    fit = np.empty(num_others, dtype=np.int64)
    num_fit = 0
    for k in range(num_others):
        f = others[k]
        if costs[f] >= low and costs[f] <= high:
            fit[num_fit] = f
            num_fit += 1
    if num_fit:
        gap = np.empty(num_fit)
        for k in range(num_fit):
            gap[k] = abs(costs[fit[k]] - c)
        closest = np.empty(4 * num_partners, dtype=np.int64)
        num_closest = _smallest(gap, 4 * num_partners, closest)
        for k in range(num_closest):
            closest[k] = fit[closest[k]]
        near_a = bytes_on_node(src, nbytes, offset, node, closest[:num_closest], node[a])
        pick = np.empty(num_partners, dtype=np.int64)
        for t in range(_smallest(-near_a, num_partners, pick)):
            set_items[set_start[num_sets]] = closest[pick[t]]
            set_start[num_sets + 1] = set_start[num_sets] + 1
            num_sets += 1
    if not swaps_only and low > 0:  # several of to's examples, largest first, while they fit
        neg = np.empty(num_others)
        for k in range(num_others):
            neg[k] = -costs[others[k]]
        base = set_start[num_sets]
        chosen, total = 0, 0.0
        for k in np.argsort(neg, kind="mergesort"):
            f = others[k]
            if total + costs[f] <= high:
                set_items[base + chosen] = f
                chosen += 1
                total += costs[f]
                if total >= low:
                    break
        if total >= low and chosen > 1:
            set_start[num_sets + 1] = base + chosen
            num_sets += 1
    return num_sets


@numba.njit(**_JIT)
def repair_locality(links, node, src, nbytes, offset, by_src_start, by_src_example, by_src_count, rank, load, costs,
                    limits, capacity, cap_scale, swaps_only, max_rounds, num_candidates, num_partners, target_nodes,
                    tol, spread, worst_count):
    """balance/repair.py's ``repair_locality`` on ``rank`` (in place, with ``links`` and ``load``); returns the
    actions taken. ``by_src_start[m, q]:by_src_start[m, q + 1]``: the entries of ``by_src_example`` (the examples of
    move m's entries rank q sends) and of ``by_src_count`` (how many of the caller's entries each stands for: an
    entry may be a run of them, :func:`_plan_kernels.runs`); ``limits``: per move, (NIC limit, NVLink limit, NIC
    scale, NVLink scale); the rest: balance/repair.py's constants. Each round takes the (kind, move, rank) furthest
    over its limit and keeps the first candidate's best action (lowest excess change, then bytes across nodes) that
    lowers the excess; a round that finds none marks it stuck until the next action."""
    n, num_ranks, num_moves = rank.size, node.size, links.shape[0]
    num_nodes = 0
    for q in range(num_ranks):
        num_nodes = max(num_nodes, node[q] + 1)
    head, tail, nxt, prv = _lists_by_rank(rank, num_ranks)
    stuck = np.zeros((3, num_moves + 1, num_ranks), dtype=np.bool_)
    mine = np.empty(n, dtype=np.int64)
    others = np.empty(n, dtype=np.int64)
    candidates = np.empty(num_candidates, dtype=np.int64)
    targets = np.empty(num_ranks + 2 * spread, dtype=np.int64)
    seen = np.zeros(num_ranks, dtype=np.int64)
    set_start = np.empty(num_partners + 3, dtype=np.int64)
    set_items = np.empty(n + num_partners, dtype=np.int64)
    best_partners = np.empty(n, dtype=np.int64)
    actions = 0
    while actions < max_rounds:
        kind, m, r = _worst(links, load, limits, capacity, cap_scale, stuck, tol, worst_count)
        if kind < 0:
            break
        found, best_gain, best_moved, best_e, best_to, num_best = False, 0.0, 0.0, -1, -1, 0
        for c in range(_candidates(kind, m, r, links, node, src, nbytes, offset, by_src_start, by_src_example, rank,
                                   costs, head, nxt, num_candidates, mine, candidates)):
            e = candidates[c]
            a = rank[e]
            for t in range(_targets(e, r, kind, m, links, node, num_nodes, src, nbytes, offset, by_src_start,
                                    by_src_example, by_src_count, rank, load, target_nodes, spread, seen, targets)):
                to = targets[t]
                for s in range(_options(e, a, to, kind, src, nbytes, offset, node, load, costs, capacity, swaps_only,
                                        head, nxt, num_partners, others, set_start, set_items)):
                    partners = set_items[set_start[s]:set_start[s + 1]]
                    gain, moved = try_exchange(links, node, src, nbytes, offset, rank, load, costs, e, to, partners,
                                               limits, capacity, cap_scale)
                    if gain < -tol and (not found or gain < best_gain or (gain == best_gain and moved < best_moved)):
                        found, best_gain, best_moved, best_e, best_to = True, gain, moved, e, to
                        num_best = partners.size
                        best_partners[:num_best] = partners
            if found:  # the first example (most bytes on the link) that can go: taken
                break
        if not found:
            stuck[kind, m + 1, r] = True
            continue
        a = rank[best_e]
        shift_example(links, node, src, nbytes, offset, rank, load, costs, best_e, best_to)
        _unlink(head, tail, nxt, prv, a, best_e)
        _append(head, tail, nxt, prv, best_to, best_e)
        for k in range(num_best):
            f = best_partners[k]
            shift_example(links, node, src, nbytes, offset, rank, load, costs, f, a)
            _unlink(head, tail, nxt, prv, best_to, f)
            _append(head, tail, nxt, prv, a, f)
        stuck[:] = False
        actions += 1
    return actions
