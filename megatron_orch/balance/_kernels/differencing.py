"""Karmarkar-Karp K-way largest differencing: near-optimal partitions of many items of mixed sizes."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels._heap import _heap_push, _sift_down, _sift_up


# ---------------------------------------------------------------------------------------------
# Karmarkar-Karp largest differencing, K-way.
#
# A *tuple* is a partial K-way partition: up to K non-empty subsets ("entries"); missing entries are
# empty (sum 0). Repeatedly the two tuples with the largest spread (max - min sum) are combined by
# pairing the i-th largest entry of one with the i-th smallest of the other, which cancels their
# imbalances. Entries are linked lists of items (an entry's id is its first item), so combining two
# entries is O(1). Tuples live in an arena of (sum, entry) slots, either sorted by decreasing sum or
# as a min-heap: absorbing a single item (the common merge: items arrive by decreasing cost) only
# adds it to the smallest entry, O(log K) on a heap; two multi-entry tuples are merged sorted.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _kk_reserve(arena_sum, arena_ent, start, cap, alive, top, t, need, num_bins):
    """Give tuple ``t`` room for ``need`` slots, keeping its contents; returns the new arena top.

    Capacities at least double, so every capacity is below twice its tuple's length and live
    tuples never need more than 2n slots: with an arena of 3n + 2K slots, compacting the live
    tuples (in place, by increasing start) always frees enough room.
    """
    if cap[t] >= need:
        return top
    new_cap = min(num_bins, max(need, 2 * cap[t]))
    if top + new_cap > arena_sum.size:
        owner = np.full(top, -1, dtype=np.int64)  # live tuples by increasing start
        for u in range(alive.size):
            if alive[u]:
                owner[start[u]] = u
        top = 0
        for s in range(owner.size):
            u = owner[s]
            if u < 0:
                continue
            for j in range(cap[u]):  # forward copy: the destination never passes the source
                arena_sum[top + j] = arena_sum[s + j]
                arena_ent[top + j] = arena_ent[s + j]
            start[u] = top
            top += cap[u]
    for j in range(cap[t]):
        arena_sum[top + j] = arena_sum[start[t] + j]
        arena_ent[top + j] = arena_ent[start[t] + j]
    start[t] = top
    cap[t] = new_cap
    return top + new_cap


@numba.njit(**_JIT)
def _run_end(key, lo, m):
    """The end of the run of non-increasing keys from ``lo`` in ``key[:m]``."""
    end = lo + 1
    while end < m and key[end] <= key[end - 1]:
        end += 1
    return end


@numba.njit(**_JIT)
def _sort_pairs_desc(key, val, s, m, tmp_key, tmp_val):
    """Sort ``key/val[s:s + m]`` by decreasing key, stably (a natural merge sort: each pass merges pairs of
    adjacent non-increasing runs, the left first on ties; no allocation; ``tmp_*`` hold at least m). The sums
    it orders come in runs (a merge's met entries: one tuple's decreasing sums plus the other's increasing ones):
    fewer passes than merging from runs of one, 8.2 -> 6.6 ms for equal-count KK at DP 10240."""
    src_k, src_v, dst_k, dst_v = key[s:s + m], val[s:s + m], tmp_key[:m], tmp_val[:m]
    if m == 0 or _run_end(src_k, 0, m) == m:
        return
    in_tmp = False
    runs = 2
    while runs > 1:
        runs = 0
        lo = 0
        while lo < m:
            mid = _run_end(src_k, lo, m)
            hi = _run_end(src_k, mid, m) if mid < m else m
            i, j = lo, mid
            for w in range(lo, hi):
                if j >= hi or (i < mid and src_k[i] >= src_k[j]):
                    dst_k[w] = src_k[i]
                    dst_v[w] = src_v[i]
                    i += 1
                else:
                    dst_k[w] = src_k[j]
                    dst_v[w] = src_v[j]
                    j += 1
            lo = hi
            runs += 1
        src_k, src_v, dst_k, dst_v = dst_k, dst_v, src_k, src_v
        in_tmp = not in_tmp
    if in_tmp:
        for w in range(m):
            key[s + w] = src_k[w]
            val[s + w] = src_v[w]


@numba.njit(**_JIT)
def _kk_sort(arena_sum, arena_ent, start, length, is_heap, t, scratch_sum, scratch_ent):
    """Put tuple ``t`` in decreasing-sum order."""
    if not is_heap[t]:
        return
    _sort_pairs_desc(arena_sum, arena_ent, start[t], length[t], scratch_sum, scratch_ent)
    is_heap[t] = False


@numba.njit(**_JIT)
def _kk_join(nxt, tail, ea, eb):
    """Append entry ``eb``'s items to entry ``ea``."""
    nxt[tail[ea]] = eb
    tail[ea] = tail[eb]


@numba.njit(**_JIT)
def _kk_absorb(arena_sum, arena_ent, start, cap, length, tmax, is_heap, alive, nxt, tail, top, x, c, e,
               num_bins):
    """Tuple ``x`` takes a single item (sum ``c``, entry ``e``): into an empty entry if it has one,
    else into its smallest entry (x is kept as a min-heap for this). Returns the arena top."""
    sx, m = start[x], length[x]
    if not is_heap[x]:  # decreasing order reversed is a min-heap
        for j in range(m // 2):
            u, v = sx + j, sx + m - 1 - j
            arena_sum[u], arena_sum[v] = arena_sum[v], arena_sum[u]
            arena_ent[u], arena_ent[v] = arena_ent[v], arena_ent[u]
        is_heap[x] = True
    if m < num_bins:
        top = _kk_reserve(arena_sum, arena_ent, start, cap, alive, top, x, m + 1, num_bins)
        sx = start[x]
        arena_sum[sx + m] = c
        arena_ent[sx + m] = e
        _sift_up(arena_sum, arena_ent, m, sx)
        length[x] = m + 1
        tmax[x] = max(tmax[x], c)
    else:
        _kk_join(nxt, tail, arena_ent[sx], e)
        arena_sum[sx] += c
        tmax[x] = max(tmax[x], arena_sum[sx])
        _sift_down(arena_sum, arena_ent, m, 0, sx)
    return top


@numba.njit(**_JIT)
def _kk_merge(arena_sum, arena_ent, start, cap, length, tmax, is_heap, alive, nxt, tail, top, x, y,
              num_bins, scratch_sum, scratch_ent):
    """Combine two multi-entry tuples into ``x``: x's j-th largest entry with y's j-th smallest.
    Returns the arena top."""
    _kk_sort(arena_sum, arena_ent, start, length, is_heap, x, scratch_sum, scratch_ent)
    _kk_sort(arena_sum, arena_ent, start, length, is_heap, y, scratch_sum, scratch_ent)
    a, b = length[x], length[y]
    sx, sy = start[x], start[y]
    ov_sum, mg_sum = scratch_sum[:num_bins], scratch_sum[num_bins:]
    ov_ent, mg_ent = scratch_ent[:num_bins], scratch_ent[num_bins:]
    # x's j-th largest meets y's (K-1-j)-th largest; both are non-empty for j in [ov_lo, a)
    ov_lo = max(0, num_bins - b)
    num_ov = max(0, a - ov_lo)
    for j in range(ov_lo, a):
        _kk_join(nxt, tail, arena_ent[sx + j], arena_ent[sy + num_bins - 1 - j])
        ov_sum[j - ov_lo] = arena_sum[sx + j] + arena_sum[sy + num_bins - 1 - j]
        ov_ent[j - ov_lo] = arena_ent[sx + j]
    _sort_pairs_desc(ov_sum, ov_ent, 0, num_ov, mg_sum, mg_ent)
    # y's entries facing x's empty slots are its largest min(b, K-a): merge them with the met
    # entries into mg, then mg into x's unmet prefix, from the back, in place
    q = min(b, num_bins - a)
    i = 0
    k = 0
    for w in range(q + num_ov):
        if k >= num_ov or (i < q and arena_sum[sy + i] >= ov_sum[k]):
            mg_sum[w] = arena_sum[sy + i]
            mg_ent[w] = arena_ent[sy + i]
            i += 1
        else:
            mg_sum[w] = ov_sum[k]
            mg_ent[w] = ov_ent[k]
            k += 1
    p = a - num_ov
    r = p + q + num_ov
    top = _kk_reserve(arena_sum, arena_ent, start, cap, alive, top, x, r, num_bins)
    sx = start[x]
    i = p - 1
    k = q + num_ov - 1
    w = r - 1
    while k >= 0:
        if i >= 0 and arena_sum[sx + i] < mg_sum[k]:
            arena_sum[sx + w] = arena_sum[sx + i]
            arena_ent[sx + w] = arena_ent[sx + i]
            i -= 1
        else:
            arena_sum[sx + w] = mg_sum[k]
            arena_ent[sx + w] = mg_ent[k]
            k -= 1
        w -= 1
    length[x] = r
    tmax[x] = arena_sum[sx]
    return top


@numba.njit(**_JIT)
def kk(costs, order, tuple_size, num_bins, bin_of_item):
    """K-way largest differencing. ``order``: items by decreasing cost (ties by id).

    The initial tuples are consecutive runs of ``tuple_size`` items of ``order``, each item its own
    entry: ``tuple_size=1`` is plain KK; ``tuple_size=num_bins`` makes every merge combine full
    tuples, so every bin ends with exactly one item of each run (equal-count KK).
    """
    n = order.size
    if n == 0 or num_bins == 1:
        for i in range(n):
            bin_of_item[i] = 0
        return
    num_tuples = n // tuple_size
    nxt = np.full(n, -1, dtype=np.int64)   # next item of an entry's linked list
    tail = np.arange(n)                    # last item of the entry whose first item is the index
    arena_sum = np.empty(3 * n + 2 * num_bins)
    arena_ent = np.empty(3 * n + 2 * num_bins, dtype=np.int64)
    for j in range(n):
        arena_sum[j] = costs[order[j]]
        arena_ent[j] = order[j]
    top = n
    start = np.arange(num_tuples) * tuple_size
    cap = np.full(num_tuples, tuple_size, dtype=np.int64)
    length = np.full(num_tuples, tuple_size, dtype=np.int64)
    tmax = np.empty(num_tuples)
    for t in range(num_tuples):
        tmax[t] = arena_sum[start[t]]
    is_heap = np.zeros(num_tuples, dtype=np.bool_)
    alive = np.ones(num_tuples, dtype=np.bool_)
    scratch_sum = np.empty(2 * num_bins)
    scratch_ent = np.empty(2 * num_bins, dtype=np.int64)

    # Tuples by decreasing spread, ties by smaller id (larger items): single items are already in
    # that order (a single item's spread is its cost), so only multi-entry tuples need a heap,
    # a min-heap on -spread. (The hot loop is written inline: calls cost more than its work.)
    num_single = num_tuples if tuple_size == 1 else 0
    next_single = 0
    hkey = np.empty(num_tuples)
    hid = np.empty(num_tuples, dtype=np.int64)
    size = 0
    for t in range(num_single, num_tuples):
        spread = tmax[t] - arena_sum[start[t] + num_bins - 1]  # full, sorted
        _heap_push(hkey, hid, size, -spread, t)
        size += 1
    picked = np.empty(2, dtype=np.int64)
    for _ in range(num_tuples - 1):
        for p in range(2):
            if next_single < num_single and (size == 0 or costs[order[next_single]] > -hkey[0] or (
                    costs[order[next_single]] == -hkey[0] and next_single < hid[0])):
                picked[p] = next_single
                next_single += 1
            else:
                picked[p] = hid[0]
                size -= 1
                hkey[0], hid[0] = hkey[size], hid[size]
                _sift_down(hkey, hid, size, 0)
        x, y = picked[0], picked[1]
        if length[x] == 1 and length[y] > 1:
            x, y = y, x
        alive[y] = False
        if length[y] == 1 and length[x] == num_bins and is_heap[x]:  # the common case, inline
            sx = start[x]
            _kk_join(nxt, tail, arena_ent[sx], arena_ent[start[y]])
            arena_sum[sx] += arena_sum[start[y]]
            tmax[x] = max(tmax[x], arena_sum[sx])
            _sift_down(arena_sum, arena_ent, num_bins, 0, sx)
        elif length[y] == 1:
            top = _kk_absorb(arena_sum, arena_ent, start, cap, length, tmax, is_heap, alive, nxt, tail,
                             top, x, arena_sum[start[y]], arena_ent[start[y]], num_bins)
        else:
            top = _kk_merge(arena_sum, arena_ent, start, cap, length, tmax, is_heap, alive, nxt, tail,
                            top, x, y, num_bins, scratch_sum, scratch_ent)
        spread = tmax[x]
        if length[x] == num_bins:
            spread -= arena_sum[start[x]] if is_heap[x] else arena_sum[start[x] + num_bins - 1]
        _heap_push(hkey, hid, size, -spread, x)
        size += 1

    last = hid[0] if size == 1 else next_single
    for j in range(length[last]):
        item = arena_ent[start[last] + j]
        while item != -1:
            bin_of_item[item] = j
            item = nxt[item]
