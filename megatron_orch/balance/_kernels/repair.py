"""The plain plan localised (balance/repair.py's ``localize``): examples swapped onto the node they want; the
repair's per-link byte counts and its trial exchanges (``repair_locality``), summed as its numpy code summed them."""
import numba
import numpy as np

from megatron_orch.balance._kernels._jit import _JIT
from megatron_orch.balance._kernels.bounds import numpy_sum
from megatron_orch.balance._kernels.local_search import _rank_index
from megatron_orch.balance._plan_kernels import _rank_starts


# ---------------------------------------------------------------------------------------------
# Ranks' examples in the order they arrived (a linked list per rank: O(1) removal and append).
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
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


@numba.njit(**_JIT)
def _append(head, tail, nxt, prv, r, e):
    prv[e] = tail[r]
    nxt[e] = -1
    if tail[r] >= 0:
        nxt[tail[r]] = e
    else:
        head[r] = e
    tail[r] = e


# ---------------------------------------------------------------------------------------------
# A node's examples by increasing (cost, id): a sorted row of a (nodes, width) table.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _pool_remove(pools, sizes, x, costs, e):
    at = _rank_index(costs, pools[x], 0, sizes[x], costs[e], e)
    if at < sizes[x] and pools[x, at] == e:
        for k in range(at, sizes[x] - 1):
            pools[x, k] = pools[x, k + 1]
        sizes[x] -= 1


@numba.njit(**_JIT)
def _pool_insert(pools, sizes, x, costs, e):
    """``pools`` with e inserted in row x (the table twice as wide when the row is full)."""
    if sizes[x] == pools.shape[1]:
        wider = np.empty((pools.shape[0], 2 * pools.shape[1]), dtype=np.int64)
        wider[:, :pools.shape[1]] = pools
        pools = wider
    at = _rank_index(costs, pools[x], 0, sizes[x], costs[e], e)
    for k in range(sizes[x], at, -1):
        pools[x, k] = pools[x, k - 1]
    pools[x, at] = e
    sizes[x] += 1
    return pools


# ---------------------------------------------------------------------------------------------
# localize
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _exchange(rank, load, costs, head, tail, nxt, prv, e, f):
    """e and f (on different ranks) trade ranks."""
    a, b = rank[e], rank[f]
    rank[e], rank[f] = b, a
    _unlink(head, tail, nxt, prv, a, e)
    _unlink(head, tail, nxt, prv, b, f)
    _append(head, tail, nxt, prv, a, f)
    _append(head, tail, nxt, prv, b, e)
    load[a] += costs[f] - costs[e]
    load[b] += costs[e] - costs[f]


@numba.njit(**_JIT)
def _relocate(rank, load, costs, head, tail, nxt, prv, e, to):
    a = rank[e]
    rank[e] = to
    _unlink(head, tail, nxt, prv, a, e)
    _append(head, tail, nxt, prv, to, e)
    load[a] -= costs[e]
    load[to] += costs[e]


@numba.njit(**_JIT)
def _max_room(load, capacity, node_ranks, node_start, x):
    least = np.inf
    for t in range(node_start[x], node_start[x + 1]):
        least = min(least, load[node_ranks[t]])
    return capacity - least


@numba.njit(**_JIT)
def _settle(rank, load, costs, head, tail, nxt, prv, node_of_rank, node_ranks, node_start, capacity, swaps_only, r,
            over):
    """One exchange between rank r and another rank q of its node that takes between ``over`` and q's room off
    r, the least such (keeping the most room), the first found when rank r's examples (in order) meet the
    node's other ranks' examples (rank by rank, each in order) and then (``swaps_only`` False) the ranks
    themselves (a move): applied, True; else False."""
    x = node_of_rank[r]
    most = -np.inf  # the most room of another rank of the node: none with less than ``over`` can take the excess
    for t in range(node_start[x], node_start[x + 1]):
        if node_ranks[t] != r:
            most = max(most, capacity - load[node_ranks[t]])
    if most < over:
        return False
    best, g, h, to = np.inf, -1, -1, -1
    i = head[r]
    while i >= 0:
        ci = costs[i]
        for t in range(node_start[x], node_start[x + 1]):
            q = node_ranks[t]
            room = capacity - load[q]
            if q == r or room < over:
                continue
            f = head[q]
            while f >= 0:
                d = ci - costs[f]
                if over <= d <= room and d < best:
                    best, g, h = d, i, f
                f = nxt[f]
        if not swaps_only:
            for t in range(node_start[x], node_start[x + 1]):
                q = node_ranks[t]
                room = capacity - load[q]
                if q == r or room < over:
                    continue
                d = ci - 0.0
                if over <= d <= room and d < best:
                    best, g, h, to = d, i, -1, q
        i = nxt[i]
    if g < 0:
        return False
    if h >= 0:
        _exchange(rank, load, costs, head, tail, nxt, prv, g, h)
    else:
        _relocate(rank, load, costs, head, tail, nxt, prv, g, to)
    return True


@numba.njit(**_JIT)
def localize(rank, costs, want, node_of_rank, capacity, swaps_only, weight, scan, passes, settle_tries):
    """balance/repair.py's ``localize`` on ``rank`` (in place); returns the examples brought home.

    ``weight``: the bytes an example pulls; ``scan``: swap partners looked at on either side of an
    example's cost; ``passes``: passes over the examples away from their node; ``settle_tries``: swaps
    that overfill a rank tried per example, the best first. Every choice and tie is the reference's
    (tests/balance/localize_reference.py): its lists become linked lists and sorted rows, in the same
    orders.
    """
    n = rank.size
    num_ranks = node_of_rank.size
    num_nodes = 0
    for r in range(num_ranks):
        num_nodes = max(num_nodes, node_of_rank[r] + 1)
    load = np.zeros(num_ranks)
    for e in range(n):
        load[rank[e]] += costs[e]
    node_start = _rank_starts(node_of_rank, num_nodes)
    node_ranks = np.empty(num_ranks, dtype=np.int64)
    fill = node_start[:-1].copy()
    for r in range(num_ranks):
        node_ranks[fill[node_of_rank[r]]] = r
        fill[node_of_rank[r]] += 1
    head = np.full(num_ranks, -1, dtype=np.int64)
    tail = np.full(num_ranks, -1, dtype=np.int64)
    nxt = np.full(n, -1, dtype=np.int64)
    prv = np.full(n, -1, dtype=np.int64)
    for e in range(n):
        _append(head, tail, nxt, prv, rank[e], e)
    sizes = np.zeros(num_nodes, dtype=np.int64)
    for e in range(n):
        sizes[node_of_rank[rank[e]]] += 1
    pools = np.empty((num_nodes, 2 * max(sizes.max() if num_nodes else 0, 1)), dtype=np.int64)
    sizes[:] = 0
    for e in np.argsort(costs, kind="mergesort"):  # by (cost, id): every row sorted
        x = node_of_rank[rank[e]]
        pools[x, sizes[x]] = e
        sizes[x] += 1
    start = 0
    for e in range(n):
        if node_of_rank[rank[e]] == want[e]:
            start += 1
    gains = np.empty(2 * scan)
    gaps = np.empty(2 * scan)
    partners = np.empty(2 * scan, dtype=np.int64)
    by_cost = np.argsort(-costs, kind="mergesort")  # decreasing cost, ties by id: sorted once, filtered per pass
    away = np.empty(n, dtype=np.int64)
    for _ in range(passes):  # the costliest first (fewest partners); again, as moves made room
        num_away = 0
        for e in by_cost:
            if node_of_rank[rank[e]] != want[e]:
                away[num_away] = e
                num_away += 1
        moved = 0
        for e in away[:num_away]:
            a = rank[e]
            x, y = node_of_rank[a], want[e]
            if x == y:
                continue
            c = costs[e]
            pick, pick_gain, pick_gap = -1, 0.0, 0.0
            num_unsettled = 0
            size = sizes[y]
            if size > 0:
                # no partner further in cost can fit, even settled: a costlier one overfills a by the gap less
                # a's room, a cheaper one its own rank by the gap less that rank's room
                up = capacity - load[a] + _max_room(load, capacity, node_ranks, node_start, x)
                down = 2 * _max_room(load, capacity, node_ranks, node_start, y)
                at = _rank_index(costs, pools[y], 0, size, c, -1)
                lo, hi = at - 1, at
                for _scan in range(2 * scan):  # outward from c, nearest cost first
                    up_fits = hi < size and costs[pools[y, hi]] - c <= up
                    down_fits = lo >= 0 and c - costs[pools[y, lo]] <= down
                    if up_fits and (not down_fits or costs[pools[y, hi]] - c <= c - costs[pools[y, lo]]):
                        k, hi = hi, hi + 1
                    elif down_fits:
                        k, lo = lo, lo - 1
                    else:
                        break
                    f = pools[y, k]
                    cf = costs[f]
                    gap = abs(cf - c)
                    # bytes brought home by the swap: e's, plus f's if it wants x, less f's if it was home
                    if want[f] == x:
                        gain = weight[e] + weight[f]
                    elif want[f] == y:
                        gain = weight[e] + -weight[f]
                    else:
                        gain = weight[e] + 0.0
                    if gain <= 0:
                        continue
                    b = rank[f]
                    if load[a] - c + cf > capacity or load[b] - cf + c > capacity:
                        gains[num_unsettled], gaps[num_unsettled], partners[num_unsettled] = gain, gap, f
                        num_unsettled += 1
                        continue
                    if pick < 0 or gain > pick_gain or (gain == pick_gain and gap < pick_gap):
                        pick, pick_gain, pick_gap = k, gain, gap
            partner = -1
            if pick >= 0:
                partner = pools[y, pick]
                for t in range(pick, size - 1):
                    pools[y, t] = pools[y, t + 1]
                sizes[y] -= 1
                _exchange(rank, load, costs, head, tail, nxt, prv, e, partner)
            else:  # the best swaps that overfill one rank, if its node can take the excess
                for _try in range(min(settle_tries, num_unsettled)):
                    best = _try  # the next best by (most bytes home, smallest gap, id)
                    for u in range(_try + 1, num_unsettled):
                        if (gains[u] > gains[best] or (gains[u] == gains[best] and (
                                gaps[u] < gaps[best] or (gaps[u] == gaps[best] and partners[u] < partners[best])))):
                            best = u
                    gains[_try], gains[best] = gains[best], gains[_try]
                    gaps[_try], gaps[best] = gaps[best], gaps[_try]
                    partners[_try], partners[best] = partners[best], partners[_try]
                    f = partners[_try]
                    b = rank[f]
                    _exchange(rank, load, costs, head, tail, nxt, prv, e, f)
                    heavy = a if load[a] > capacity else b
                    if _settle(rank, load, costs, head, tail, nxt, prv, node_of_rank, node_ranks, node_start,
                               capacity, swaps_only, heavy, load[heavy] - capacity):
                        _pool_remove(pools, sizes, y, costs, f)
                        partner = f
                        break
                    _exchange(rank, load, costs, head, tail, nxt, prv, e, f)
            if partner >= 0:
                _pool_remove(pools, sizes, x, costs, e)
                pools = _pool_insert(pools, sizes, y, costs, e)
                pools = _pool_insert(pools, sizes, x, costs, partner)
                moved += 1
                continue
            if not swaps_only:
                b = -1
                for t in range(node_start[y], node_start[y + 1]):  # the least-loaded rank of y (first of equals)
                    q = node_ranks[t]
                    if b < 0 or load[q] < load[b]:
                        b = q
                if b >= 0 and load[b] + c <= capacity:
                    _relocate(rank, load, costs, head, tail, nxt, prv, e, b)
                    _pool_remove(pools, sizes, x, costs, e)
                    pools = _pool_insert(pools, sizes, y, costs, e)
                    moved += 1
        if moved == 0:
            break
    home = 0
    for e in range(n):
        if node_of_rank[rank[e]] == want[e]:
            home += 1
    return home - start


@numba.njit(**_JIT)
def add_link_bytes(links, node_of_rank, src, dst, nbytes, sign):
    """``sign`` x bytes of entries moving ``src[i]`` -> ``dst[i]`` added to ``links`` ([sent on the node, received on
    the node, sent across nodes, received across nodes] x ranks), in entry order (as ``np.add.at`` per row adds:
    the same sums, bit for bit); an entry that stays on its rank adds nothing."""
    for i in range(src.size):
        s, d = src[i], dst[i]
        if s == d:
            continue
        b = nbytes[i] * sign
        if node_of_rank[s] != node_of_rank[d]:
            links[2, s] += b
            links[3, d] += b
        else:
            links[0, s] += b
            links[1, d] += b


@numba.njit(**_JIT)
def move_link_bytes(links, node_of_rank, src, nbytes, a, to):
    """The entries ``src`` -> rank ``a`` (``nbytes`` each) going to rank ``to`` instead, in ``links`` (as
    :func:`add_link_bytes`): subtracted as they were, then added, each pass in entry order (the same sums, bit for
    bit, as ``add_link_bytes`` with sign -1 towards ``a`` then +1 towards ``to``)."""
    for to_rank, sign in ((a, -1.0), (to, 1.0)):
        for i in range(src.size):
            s = src[i]
            if s == to_rank:
                continue
            b = nbytes[i] * sign
            if node_of_rank[s] != node_of_rank[to_rank]:
                links[2, s] += b
                links[3, to_rank] += b
            else:
                links[0, s] += b
                links[1, to_rank] += b


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
