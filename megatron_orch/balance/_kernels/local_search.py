"""Compiled hot loops of the partitioners (numba, GIL released).

Planning runs on a background thread beside the training loop, so every kernel is compiled with
``nogil=True``; ``cache=True`` keeps the one-time compile off later runs. Signatures are kept to one
per kernel: costs and memory are float64, item and bin ids int64, a missing memory constraint is
all-zero memory with an infinite cap. Kernels write the assignment into a caller-provided
``bin_of_item`` and report failure as the id of the item that could not be placed (``-1``: success),
so the Python side raises the error with context.

Ties are always broken by the smaller item id or bin id, so results are deterministic.
"""
import numba
import numpy as np

_JIT = dict(cache=True, nogil=True)
# Helpers called in the refinement's inner loop are inlined (measured: the loop runs ~1.6x faster
# than with calls that pass a dozen arrays).
_INLINE = dict(_JIT, inline="always")
_PAIR_ITEMS = 32  # two-for-two swaps are tried between bins of at most this many items (496 pairs each)
_PAIR_PARTNERS = 2  # with the least-loaded this many partners (the largest gaps): each costs a sort of its pairs
_WIDEN = 8  # a refinement step that finds nothing with its partners tries this many times as many


# ---------------------------------------------------------------------------------------------
# Binary min-heap over (key, id) pairs, lexicographic: the smaller key first, then the smaller id.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _sift_down(key, ids, size, pos, base=0):
    """Move the pair at ``pos`` down to its place in the heap ``key/ids[base:base + size]``."""
    k, i = key[base + pos], ids[base + pos]
    while True:
        child = 2 * pos + 1
        if child >= size:
            break
        c = base + child
        if child + 1 < size and (key[c + 1] < key[c] or (key[c + 1] == key[c] and ids[c + 1] < ids[c])):
            child += 1
            c += 1
        if key[c] < k or (key[c] == k and ids[c] < i):
            key[base + pos] = key[c]
            ids[base + pos] = ids[c]
            pos = child
        else:
            break
    key[base + pos] = k
    ids[base + pos] = i


@numba.njit(**_JIT)
def _sift_up(key, ids, pos, base=0):
    """Move the pair at ``pos`` up to its place in the heap ``key/ids[base:]``."""
    k, i = key[base + pos], ids[base + pos]
    while pos > 0:
        parent = (pos - 1) // 2
        if key[base + parent] < k or (key[base + parent] == k and ids[base + parent] < i):
            break
        key[base + pos] = key[base + parent]
        ids[base + pos] = ids[base + parent]
        pos = parent
    key[base + pos] = k
    ids[base + pos] = i


@numba.njit(**_JIT)
def _heap_pop(key, ids, size):
    """Remove the root of a heap of ``size`` pairs; returns it. The caller decrements its size."""
    top_key, top_id = key[0], ids[0]
    key[0], ids[0] = key[size - 1], ids[size - 1]
    _sift_down(key, ids, size - 1, 0)
    return top_key, top_id


@numba.njit(**_JIT)
def _heap_push(key, ids, size, k, i):
    """Insert (k, i) into a heap of ``size`` pairs. The caller increments its size."""
    key[size], ids[size] = k, i
    _sift_up(key, ids, size)


# ---------------------------------------------------------------------------------------------
# LPT: items in decreasing cost, each to the least-loaded bin that has memory room.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def lpt(costs, memory, memory_cap, order, num_bins, bin_of_item):
    """Greedy longest-processing-time. ``order``: items by decreasing cost (ties: smaller id first).

    Returns -1, or the first item no bin has memory room for. A bin without room for even the
    smallest remaining memory leaves the heap for good (so a count cap - memory 1, cap n/K - costs
    no more than plain LPT); one that only lacks room for the current item is held aside.
    """
    n = order.size
    rest_min = np.empty(n + 1)  # smallest memory among order[t:]
    rest_min[n] = np.inf
    for t in range(n - 1, -1, -1):
        rest_min[t] = min(rest_min[t + 1], memory[order[t]])
    load = np.zeros(num_bins)
    ids = np.arange(num_bins)  # all loads zero and ids ascending: already a heap
    size = num_bins
    bin_mem = np.zeros(num_bins)
    held_key = np.empty(num_bins)
    held_id = np.empty(num_bins, dtype=np.int64)
    start = 0
    if memory_cap == np.inf and n > 0 and costs[order[0]] > 0:
        # Without a memory cap, the leading run of equal costs (e.g. identical image tiles) goes
        # round robin in bin id order: on equal loads that is what the heap does (ties by id), and
        # after every full round the loads are equal again, bit for bit (a positive cost raises a
        # bin above the others; a zero cost would not, and stays on the heap path). O(run) instead of
        # O(run log K); the loads and the heap left behind are the ones the loop would leave.
        first = costs[order[0]]
        while start < n and costs[order[start]] == first:
            item = order[start]
            bin_of_item[item] = start % num_bins
            bin_mem[start % num_bins] += memory[item]
            start += 1
        per_bin = np.zeros(num_bins)
        for t in range(start // num_bins):
            per_bin[0] += first  # every bin adds the same costs in the same order
        rest = start % num_bins
        for k in range(num_bins):  # a heap: the lighter bins rest.. first, then 0..rest-1
            b = rest + k if rest + k < num_bins else rest + k - num_bins
            load[k] = per_bin[0] + first if b < rest else per_bin[0]
            ids[k] = b
    if memory_cap == np.inf:  # no bin ever lacks room: the least-loaded bin, nothing held aside
        for t in range(start, n):
            item = order[t]
            bin_of_item[item] = ids[0]
            load[0] += costs[item]
            _sift_down(load, ids, size, 0)
        return -1
    for t in range(start, n):
        item = order[t]
        held = 0
        while size > 0 and bin_mem[ids[0]] + memory[item] > memory_cap:
            k, b = _heap_pop(load, ids, size)
            size -= 1
            if bin_mem[b] + rest_min[t] <= memory_cap:
                held_key[held], held_id[held] = k, b
                held += 1
        if size == 0:
            return item
        b = ids[0]
        bin_of_item[item] = b
        bin_mem[b] += memory[item]
        load[0] += costs[item]
        if bin_mem[b] + rest_min[t + 1] > memory_cap:  # b is full for good
            _heap_pop(load, ids, size)
            size -= 1
        else:
            _sift_down(load, ids, size, 0)
        for h in range(held):
            _heap_push(load, ids, size, held_key[h], held_id[h])
            size += 1
    return -1


@numba.njit(**_JIT)
def slot_lpt(costs, order, num_bins, per_bin, target, bin_of_item):
    """Equal-count greedy by room per free slot: every bin takes ``per_bin`` items.

    Items in ``order`` (decreasing cost, ties by id), each to the bin with the largest
    (``target`` - load) / free slots (ties: the smaller bin id); a full bin leaves. A bin that took
    a long item has little room per slot left, so it takes nothing more until only items that small
    are left: it ends with the long item and short ones, where count-capped LPT gives it whatever
    comes when its load is the least (mid-sized items, on a heavy tail).
    """
    key = np.full(num_bins, -target / per_bin)  # (load - target) / free: the smallest first
    ids = np.arange(num_bins)  # equal keys, ids ascending: already a heap
    load = np.zeros(num_bins)
    free = np.full(num_bins, per_bin, dtype=np.int64)
    size = num_bins
    for item in order:
        b = ids[0]
        bin_of_item[item] = b
        load[b] += costs[item]
        free[b] -= 1
        if free[b] == 0:
            _heap_pop(key, ids, size)
            size -= 1
        else:
            key[0] = (load[b] - target) / free[b]
            _sift_down(key, ids, size, 0)


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
def _sort_pairs_desc(key, val, s, m, tmp_key, tmp_val):
    """Sort ``key/val[s:s + m]`` by decreasing key, stably (bottom-up merge sort, no allocation;
    ``tmp_*`` hold at least m)."""
    width = 1
    src_k, src_v, dst_k, dst_v = key[s:s + m], val[s:s + m], tmp_key[:m], tmp_val[:m]
    in_tmp = False
    while width < m:
        for lo in range(0, m, 2 * width):
            mid = min(lo + width, m)
            hi = min(lo + 2 * width, m)
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
        src_k, src_v, dst_k, dst_v = dst_k, dst_v, src_k, src_v
        in_tmp = not in_tmp
        width *= 2
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


# ---------------------------------------------------------------------------------------------
# Segment tree over bins: per node the minimum load and the maximum memory room below it.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _tree_new(load, mem_room):
    width = 1
    while width < load.size:
        width *= 2
    tree_load = np.full(2 * width, np.inf)
    tree_room = np.full(2 * width, -np.inf)
    tree_load[width:width + load.size] = load
    tree_room[width:width + load.size] = mem_room
    for v in range(width - 1, 0, -1):
        tree_load[v] = min(tree_load[2 * v], tree_load[2 * v + 1])
        tree_room[v] = max(tree_room[2 * v], tree_room[2 * v + 1])
    return tree_load, tree_room, width


@numba.njit(**_JIT)
def _tree_set(tree_load, tree_room, width, b, load, mem_room):
    v = width + b
    tree_load[v] = load
    tree_room[v] = mem_room
    v //= 2
    while v >= 1:
        tree_load[v] = min(tree_load[2 * v], tree_load[2 * v + 1])
        tree_room[v] = max(tree_room[2 * v], tree_room[2 * v + 1])
        v //= 2


@numba.njit(**_JIT)
def _tree_first_fit(tree_load, tree_room, width, max_load, need_mem):
    """Lowest bin with load <= max_load and memory room >= need_mem, or -1."""
    stack = np.empty(64, dtype=np.int64)
    stack[0] = 1
    depth = 1
    while depth > 0:
        depth -= 1
        v = stack[depth]
        if tree_load[v] > max_load or tree_room[v] < need_mem:
            continue
        if v >= width:
            return v - width
        stack[depth] = 2 * v + 1
        stack[depth + 1] = 2 * v
        depth += 2
    return -1


@numba.njit(**_JIT)
def _tree_least_loaded(tree_load, tree_room, width, lo, hi, need_mem):
    """Least-loaded bin in [lo, hi) with memory room >= need_mem (ties: lower bin), or -1."""
    best, best_load = -1, np.inf
    stack = np.empty(64, dtype=np.int64)
    stack[0] = 1
    depth = 1
    while depth > 0:
        depth -= 1
        v = stack[depth]
        if tree_room[v] < need_mem or tree_load[v] > best_load:
            continue
        first, span = v, 1  # leaf range of v: [first - width, first - width + span)
        while first < width:
            first *= 2
            span *= 2
        first -= width
        if first >= hi or first + span <= lo or (tree_load[v] == best_load and first > best):
            continue
        if v >= width:
            b = v - width
            if tree_load[v] < best_load or (tree_load[v] == best_load and b < best):
                best, best_load = b, tree_load[v]
            continue
        # visit the child with the smaller load first (the left one on ties)
        if tree_load[2 * v + 1] < tree_load[2 * v]:
            stack[depth] = 2 * v
            stack[depth + 1] = 2 * v + 1
        else:
            stack[depth] = 2 * v + 1
            stack[depth + 1] = 2 * v
        depth += 2
    return best


# ---------------------------------------------------------------------------------------------
# First-fit decreasing at a capacity (the inner step of the binary search on capacity).
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def ffd(costs, memory, memory_cap, order, num_bins, capacity, bin_of_item):
    """Each item (by decreasing cost) to the lowest bin where it fits in cost and memory.

    Returns -1 on success, else the first item that fits nowhere.
    """
    load = np.zeros(num_bins)
    bin_mem = np.zeros(num_bins)
    tree_load, tree_room, width = _tree_new(load, np.full(num_bins, memory_cap))
    for item in order:
        c = costs[item]
        b = _tree_first_fit(tree_load, tree_room, width, capacity - c, memory[item])
        if b < 0:
            return item
        bin_of_item[item] = b
        load[b] += c
        bin_mem[b] += memory[item]
        _tree_set(tree_load, tree_room, width, b, load[b], memory_cap - bin_mem[b])
    return -1


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
    place): binary searches for its old and new places, then a shift of the bins in between."""
    new_load = load[b]
    load[b] = old_load
    p = _rank_index(load, rank, 0, rank.size, old_load, b)
    load[b] = new_load
    if new_load > old_load:
        q = _rank_index(load, rank, p + 1, rank.size, new_load, b) - 1
        for t in range(p, q):
            rank[t] = rank[t + 1]
    else:
        q = _rank_index(load, rank, 0, p, new_load, b)
        for t in range(p, q, -1):
            rank[t] = rank[t - 1]
    rank[q] = b


@numba.njit(**_INLINE)
def _gather_sorted(head, nxt, costs, b, out):
    """Items of bin ``b`` by increasing (cost, id) into ``out``; returns how many.

    Shell sort in place: bins hold tens of items and this runs for a dozen bins per refinement
    step, where allocating sort buffers would cost more than the sorting.
    """
    m = 0
    i = head[b]
    while i != -1:
        out[m] = i
        m += 1
        i = nxt[i]
    gap = 1
    while gap < m // 3:
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
                   num_b, kind, allow_moves, swap_cap, chosen, best, best_out, best_in):
    """Best exchange between the top bin and bin ``b`` that beats ``best`` (the larger new load).

    ``kind`` 0: moves (if ``allow_moves``) and one-for-one swaps; 1: one-for-several either way.
    Writes an improving exchange into ``best_out`` (top -> b) and ``best_in`` (b -> top) and
    returns (its value, len(out), len(in)); returns (best, -1, -1) if none beats ``best``.
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
                if value < best:
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
                if value < best:
                    best, num_out, num_in = value, m, 1
                    best_out[:m] = chosen[:m]
                    best_in[0] = j
        return best, num_out, num_in
    if allow_moves:
        for t in range(num_top):
            i = top_items[t]
            if 0.0 < costs[i] < gap and bin_mem[b] + memory[i] <= memory_cap:
                value = max(top_load - costs[i], load[b] + costs[i])
                if value < best:
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
                    if value < best:
                        best, num_out, num_in = value, 1, 1
                        best_out[0] = i
                        best_in[0] = j
                    break
                u += direction
    return best, num_out, num_in


@numba.njit(**_INLINE)
def _cheapest_swap(costs, memory, memory_cap, load, bin_mem, bin_of_item, top, top_items, num_top, order, scan,
                   best, best_out, best_in):
    """Best swap of one item of the top bin for one of the batch's cheapest items that beats ``best``.

    The last items of ``order`` (decreasing cost) outside the top bin, up to ``scan`` of them, each
    against the top bin's item whose cost is nearest its own plus half the gap between their bins
    (``top_items``: by increasing cost). Returns (value, partner bin) with the swap in
    ``best_out[0]`` / ``best_in[0]``, or (best, -1) if none beats it.
    """
    top_load = load[top]
    found = -1
    seen = 0
    for u in range(order.size - 1, -1, -1):
        j = order[u]
        if seen == scan or costs[j] >= costs[top_items[num_top - 1]]:
            break  # enough tried, or no item of the top bin costs more
        b = bin_of_item[j]
        if b == top:
            continue
        seen += 1
        gap = top_load - load[b]
        if gap <= 0.0:
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
                if value < best:
                    best, found = value, b
                    best_out[0] = i
                    best_in[0] = j
    return best, found


@numba.njit(**_JIT)
def _pair_sums(costs, items, count, sums, first, second):
    """Every pair of ``items[:count]``: their cost sums, by increasing sum (ties: the pair found
    first), into ``sums`` / ``first`` / ``second``; returns how many."""
    m = 0
    for u in range(count):
        for v in range(u + 1, count):
            sums[m] = costs[items[u]] + costs[items[v]]
            first[m] = items[u]
            second[m] = items[v]
            m += 1
    by_sum = np.argsort(sums[:m], kind="mergesort")
    sums[:m] = sums[:m][by_sum]
    first[:m] = first[:m][by_sum]
    second[:m] = second[:m][by_sum]
    return m


@numba.njit(**_JIT)
def _pair_swap(costs, memory, memory_cap, load, bin_mem, top, b, partner_items, num_b, best, best_out, best_in,
               top_pairs, num_top_pairs, partner_pairs):
    """Best swap of two items of the top bin for two of bin ``b`` (counts kept) beating ``best``.

    Where one-for-one swaps are stuck (a few items per bin, no single difference near half the gap),
    two-for-two differences are many more. Each pair of the top bin meets b's pair whose sum is
    nearest its own minus half the gap (pairs by sum, binary search). ``top_pairs``: the top bin's
    ``num_top_pairs`` pairs (:func:`_pair_sums`); ``partner_pairs``: scratch for b's. Returns
    (value, 2) with the swap in ``best_out`` / ``best_in``, or (best, -1).
    """
    top_sum, top_first, top_second = top_pairs
    sums, first, second = partner_pairs
    num_pairs = _pair_sums(costs, partner_items, num_b, sums, first, second)
    top_load = load[top]
    gap = top_load - load[b]
    found = -1
    for t in range(num_top_pairs):
        target = top_sum[t] - 0.5 * gap
        lo, hi = 0, num_pairs  # b's first pair summing to >= target
        while lo < hi:
            mid = (lo + hi) // 2
            if sums[mid] < target:
                lo = mid + 1
            else:
                hi = mid
        for u in range(max(lo - 1, 0), min(lo + 1, num_pairs)):
            d = top_sum[t] - sums[u]
            moved = memory[top_first[t]] + memory[top_second[t]] - memory[first[u]] - memory[second[u]]
            if 0.0 < d < gap and bin_mem[b] + moved <= memory_cap and bin_mem[top] - moved <= memory_cap:
                value = max(top_load - d, load[b] + d)
                if value < best:
                    best, found = value, 2
                    best_out[0], best_out[1] = top_first[t], top_second[t]
                    best_in[0], best_in[1] = first[u], second[u]
    return best, found


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
        if count > 1:
            out[:count] = out[:count][np.argsort(load[out[:count]], kind="mergesort")]
        return count
    for p in range(num_bins - 1):
        b = rank[p]
        if load[b] >= load[top] or count == partners:
            break
        if p == 0 or load[b] != load[rank[p - 1]]:
            out[count] = b
            count += 1
    return count


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
    after ``max_sweeps``.
    """
    n = costs.size
    load = np.zeros(num_bins)
    start = np.zeros(num_bins + 1, dtype=np.int64)
    fill = np.zeros(num_bins, dtype=np.int64)
    items = np.empty(n, dtype=np.int64)  # bin by bin, each bin's items by increasing cost
    grouped = np.empty(num_bins, dtype=np.int64)  # group by group, each group's bins by increasing load
    num_groups = (num_bins + group_size - 1) // group_size
    sweeps = 0
    while sweeps < max_sweeps:
        load[:] = 0.0
        start[:] = 0
        for i in range(n):
            load[bin_of_item[i]] += costs[i]
            start[bin_of_item[i] + 1] += 1
        for b in range(num_bins):
            start[b + 1] += start[b]
            fill[b] = start[b]
        for k in range(n - 1, -1, -1):
            i = order[k]
            b = bin_of_item[i]
            items[fill[b]] = i
            fill[b] += 1
        if load.max() <= stop_at:
            break
        rank = np.argsort(load, kind="mergesort")  # increasing load, ties by bin id
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
                best, out_item, in_item = half, -1, -1  # |d - half| < half <=> 0 < d < gap
                u = start[light]  # first item of the light bin costing >= the target (targets rise)
                for t in range(start[heavy], start[heavy + 1]):
                    a = items[t]
                    target = costs[a] - half
                    while u < start[light + 1] and costs[items[u]] < target:
                        u += 1
                    for v in range(max(u - 1, start[light]), min(u + 1, start[light + 1])):
                        miss = abs(costs[a] - costs[items[v]] - half)
                        if miss < best:
                            best, out_item, in_item = miss, a, items[v]
                if out_item >= 0:
                    bin_of_item[out_item], bin_of_item[in_item] = light, heavy
                    swapped += 1
        sweeps += 1
        if swapped == 0:
            break
    return sweeps


@numba.njit(**_JIT)
def refine(costs, memory, memory_cap, num_bins, bin_of_item, allow_moves, stop_at, partners, node_size,
           max_steps, order, cheapest_scan, cross_swap_cap=np.inf):
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
    least-loaded bins (a step that finds nothing there tries :data:`_WIDEN` times as many; with
    ``node_size``, and so on up to every bin); there, with a finite ``cross_swap_cap``, only moves, trades with the cheapest items
    and one-for-one swaps of items costing at most that (a swap that evens out two bins across nodes
    can move two long items, many bytes, for a small difference). Stops at a local optimum, once the
    maximum is at most ``stop_at``, or after ``max_steps``.
    """
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
    rank = np.argsort(load, kind="mergesort")  # bins by increasing load, ties by id
    top_items = np.empty(n, dtype=np.int64)
    partner_items = np.empty(n, dtype=np.int64)
    chosen = np.empty(n, dtype=np.int64)
    best_out = np.empty(n, dtype=np.int64)  # items of the best exchange going M -> b
    best_in = np.empty(n, dtype=np.int64)   # and b -> M
    plist = np.empty(max(num_bins, node_size), dtype=np.int64)
    num_pairs = _PAIR_ITEMS * (_PAIR_ITEMS - 1) // 2
    top_pairs = (np.empty(num_pairs), np.empty(num_pairs, dtype=np.int64), np.empty(num_pairs, dtype=np.int64))
    partner_pairs = (np.empty(num_pairs), np.empty(num_pairs, dtype=np.int64), np.empty(num_pairs, dtype=np.int64))

    steps = 0
    width = partners  # partners anywhere: widened when they give nothing, up to every bin with node_size (the
    # locality refinements, which start far from balance), else _WIDEN times (a plain plan stuck within its
    # tolerance of a bound it may not reach)
    widest = num_bins - 1 if node_size > 0 else min(num_bins - 1, _WIDEN * partners)
    while steps < max_steps:
        top = rank[num_bins - 1]
        best = load[top]
        if best <= stop_at:
            break
        best_b, num_out, num_in = -1, 0, 0
        num_top = _gather_sorted(head, nxt, costs, top, top_items)
        num_top_pairs = -1  # the top bin's pairs, built when a two-for-two round needs them
        for scope in range(2):  # 0: M's node (if node_size > 0); 1: anywhere
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
                if kind == 3:
                    best, b = _cheapest_swap(costs, memory, memory_cap, load, bin_mem, bin_of_item, top, top_items,
                                             num_top, order, cheapest_scan, best, best_out, best_in)
                    if b >= 0:
                        best_b, num_out, num_in = b, 1, 1
                    continue
                if kind == 2 and num_top_pairs < 0:
                    num_top_pairs = _pair_sums(costs, top_items, num_top, top_pairs[0], top_pairs[1], top_pairs[2])
                for q in range(num_p if kind < 2 else min(num_p, _PAIR_PARTNERS * width // partners)):
                    b = plist[q]
                    num_b = _gather_sorted(head, nxt, costs, b, partner_items)
                    if kind < 2:
                        best, o, i = _exchange_with(costs, memory, memory_cap, load, bin_mem, top, b, top_items,
                                                    num_top, partner_items, num_b, kind, allow_moves,
                                                    np.inf if scope == 0 else cross_swap_cap, chosen,
                                                    best, best_out, best_in)
                    elif 2 <= num_b <= _PAIR_ITEMS:
                        best, o = _pair_swap(costs, memory, memory_cap, load, bin_mem, top, b, partner_items, num_b,
                                             best, best_out, best_in, top_pairs, num_top_pairs, partner_pairs)
                        i = o
                    else:
                        continue
                    if o >= 0:
                        best_b, num_out, num_in = b, o, i
        if best_b < 0:
            if width < widest:
                width = min(widest, _WIDEN * width)  # stuck among the least-loaded: again with more of them
                continue
            break
        width = partners
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
        new_partner_load = load[best_b]  # reposition one bin at a time, the other still in place
        load[best_b] = partner_load
        _reposition(load, rank, top, top_load)
        load[best_b] = new_partner_load
        _reposition(load, rank, best_b, partner_load)
        steps += 1
    return steps


# ---------------------------------------------------------------------------------------------
# Equal items: keep them at home up to each rank's quota, send the rest to free quota near home.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def fill_quotas(home, quota, node_of_bin, bins_by_node, node_start, bin_of_item):
    """Every item to a bin, bin b taking at most ``quota[b]`` items (``quota.sum()`` >= items).

    Items stay in their home bin up to its quota (the first ones by id); the others go, by id, to a
    bin with free quota on their home node if there is one, then to any bin with free quota (bins
    by id). ``bins_by_node[node_start[n]:node_start[n + 1]]``: the bins of node n, ascending.
    """
    n = home.size
    room = quota.copy()
    surplus = np.empty(n, dtype=np.int64)
    num_surplus = 0
    for i in range(n):
        b = home[i]
        if room[b] > 0:
            bin_of_item[i] = b
            room[b] -= 1
        else:
            surplus[num_surplus] = i
            num_surplus += 1
    cursor = node_start[:-1].copy()  # per node: first of its bins that may have room
    left = 0
    for k in range(num_surplus):
        i = surplus[k]
        node = node_of_bin[home[i]]
        while cursor[node] < node_start[node + 1] and room[bins_by_node[cursor[node]]] == 0:
            cursor[node] += 1
        if cursor[node] < node_start[node + 1]:
            b = bins_by_node[cursor[node]]
            bin_of_item[i] = b
            room[b] -= 1
        else:
            surplus[left] = i
            left += 1
    b = 0
    for k in range(left):
        while room[b] == 0:
            b += 1
        bin_of_item[surplus[k]] = b
        room[b] -= 1


# ---------------------------------------------------------------------------------------------
# Locality: LPT that keeps items at home, then on their node, where the balance allows.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def lpt_near_home(costs, memory, memory_cap, home, order, num_bins, gpus_per_node, target, bin_of_item):
    """LPT that prefers home: items in ``order`` (decreasing cost, ties by id), each to its home rank if
    that stays within ``target`` (and the memory cap), else to the least-loaded rank of its home node with
    memory room if that does, else to the least-loaded rank anywhere with memory room (LPT's own choice).
    Rank r is on node r // gpus_per_node. A rank keeps its largest items; what leaves goes first to its
    node; the last, smallest items even the ranks out as LPT does (with ``target`` = the mean, the max ends
    within about an item of it). Returns -1, or an item no rank has memory room for."""
    load = np.zeros(num_bins)
    bin_mem = np.zeros(num_bins)
    tree_load, tree_room, width = _tree_new(load, np.full(num_bins, memory_cap))
    for item in order:
        c, m = costs[item], memory[item]
        r = home[item]
        if load[r] + c > target or bin_mem[r] + m > memory_cap:
            lo = (r // gpus_per_node) * gpus_per_node
            r = _tree_least_loaded(tree_load, tree_room, width, lo, min(num_bins, lo + gpus_per_node), m)
            if r < 0 or load[r] + c > target:
                g = _tree_least_loaded(tree_load, tree_room, width, 0, num_bins, m)
                if g < 0:
                    return item
                if r < 0 or load[g] < load[r]:
                    r = g
        bin_of_item[item] = r
        load[r] += c
        bin_mem[r] += m
        _tree_set(tree_load, tree_room, width, r, load[r], memory_cap - bin_mem[r])
    return -1


# ---------------------------------------------------------------------------------------------
# The binary search on capacity, and many small partitions at once (the packed micro-batches of
# every rank): what partition() does, compiled, group after group. The floating-point steps are
# numpy's own (sums pairwise as np.sum adds, loads in item order as np.bincount does), so every
# result equals partition()'s.
# ---------------------------------------------------------------------------------------------

METHOD_CODES = ("auto", "lpt", "kk", "bs_ffd")  # the ``method`` argument of partition_groups


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
def _numpy_sum(values):
    """``values.sum()`` bit for bit as numpy adds float64: halves (a multiple of 8 on the left) summed
    apart down to blocks of 128, then added up, left + right. Written with a stack: numba's cache
    cannot hold a function that calls itself."""
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
    bound = max(_numpy_sum(costs) / num_bins, costs.max())
    if n > num_bins:
        prefix = np.zeros(n + 1)
        for k in range(n):
            prefix[k + 1] = prefix[k] + costs[order[k]]
        for t in range(1, (n - 1) // num_bins + 1):
            bound = max(bound, prefix[t * num_bins + 1] - prefix[t * num_bins - t])
    return bound


ABOVE_UPPER = -2  # bs_ffd: first-fit decreasing does not place every item at the given upper capacity


@numba.njit(**_JIT)
def bs_ffd(costs, memory, memory_cap, order, num_bins, upper, rel_tol, max_rounds, bin_of_item):
    """Binary search on the bin capacity: the smallest (within ``rel_tol``, at most ``max_rounds``
    halvings) at which first-fit decreasing places every item, its assignment in ``bin_of_item``.

    Without memory, FFD always succeeds at mean + largest item, which starts the search. ``upper`` <
    inf asks only for results at most that good: :data:`ABOVE_UPPER` if FFD fails there. Returns -1,
    or the first item no bin has memory room for at any capacity.
    """
    n = costs.size
    if n == 0:
        return -1
    trial = np.empty(n, dtype=np.int64)
    hi = _numpy_sum(costs) / num_bins + costs.max() if upper == np.inf else upper
    if ffd(costs, memory, memory_cap, order, num_bins, hi, bin_of_item) >= 0:
        if upper != np.inf:
            return ABOVE_UPPER
        item = ffd(costs, memory, memory_cap, order, num_bins, np.inf, bin_of_item)
        if item >= 0:
            return item
    hi = _max_load(costs, bin_of_item, num_bins)
    lo = pigeonhole_bound(costs, order, num_bins)
    for _ in range(max_rounds):
        if hi - lo <= rel_tol * hi:
            break
        mid = 0.5 * (lo + hi)
        if ffd(costs, memory, memory_cap, order, num_bins, mid, trial) >= 0:
            lo = mid
        else:
            bin_of_item[:] = trial
            hi = _max_load(costs, bin_of_item, num_bins)
    return -1


@numba.njit(**_JIT)
def _partition_one(costs, num_bins, method, good_enough_rel, settled_rel, rel_tol, max_rounds, max_sweeps, partners,
                   cheapest_scan, bins):
    """partition(costs, num_bins, method=METHOD_CODES[method]) without memory or home, into ``bins``:
    ``auto`` is lpt, kk and bs_ffd, each refined (swap sweeps, then the local search, stopping within
    ``good_enough_rel`` of the pigeonhole bound) until one is within ``settled_rel``, the best kept; the
    others construct only."""
    n = costs.size
    order = np.argsort(-costs, kind="mergesort")
    memory = np.zeros(n)
    if method == 1:
        lpt(costs, memory, np.inf, order, num_bins, bins)
        return
    if method == 2:
        kk(costs, order, 1, num_bins, bins)
        return
    if method == 3:
        bs_ffd(costs, memory, np.inf, order, num_bins, np.inf, rel_tol, max_rounds, bins)
        return
    bound = pigeonhole_bound(costs, order, num_bins)
    good_enough, settled = (1.0 + good_enough_rel) * bound, (1.0 + settled_rel) * bound
    trial = np.zeros(n, dtype=np.int64)
    best_cost = np.inf
    for construction in range(3):
        if best_cost <= settled:
            break
        trial[:] = 0
        if construction == 0:
            lpt(costs, memory, np.inf, order, num_bins, trial)
        elif construction == 1:
            kk(costs, order, 1, num_bins, trial)
        elif bs_ffd(costs, memory, np.inf, order, num_bins, best_cost, rel_tol, max_rounds, trial) != -1:
            continue
        if n > 0:
            swap_sweeps(costs, order, num_bins, trial, good_enough, max_sweeps, num_bins)
            refine(costs, memory, np.inf, num_bins, trial, True, good_enough, partners, 0, n + num_bins, order,
                   cheapest_scan)
        cost = _max_load(costs, trial, num_bins)
        if cost < best_cost:
            best_cost = cost
            bins[:] = trial


@numba.njit(**_JIT)
def _one_per_bin(costs, items, num_bins, bin_of_item):
    """A group of at most ``num_bins`` items of positive cost: item t by decreasing cost (ties: smaller id)
    in bin t, what ``auto`` gives it (LPT's assignment, at the bound: its largest item). Returns whether it
    applied."""
    m = items.size
    if m > num_bins:
        return False
    for k in range(m):
        if not costs[items[k]] > 0.0:
            return False
    order = items.copy()
    for u in range(1, m):  # insertion sort by decreasing cost, stable (items come by increasing id)
        item = order[u]
        v = u
        while v > 0 and costs[order[v - 1]] < costs[item]:
            order[v] = order[v - 1]
            v -= 1
        order[v] = item
    for t in range(m):
        bin_of_item[order[t]] = t
    return True


@numba.njit(**_JIT)
def partition_groups(costs, group, num_groups, num_bins, method, good_enough_rel, settled_rel, rel_tol, max_rounds,
                     max_sweeps, partners, cheapest_scan, bin_of_item):
    """The items of each group (item i in group ``group[i]``; a group's items by increasing id, as
    partition() would see ``costs[group == g]``) partitioned into ``num_bins`` bins on their own
    (:func:`_partition_one`; under ``auto`` a group of at most ``num_bins`` items directly:
    :func:`_one_per_bin`)."""
    start = np.zeros(num_groups + 1, dtype=np.int64)
    for i in range(group.size):
        start[group[i] + 1] += 1
    for g in range(num_groups):
        start[g + 1] += start[g]
    fill = start[:-1].copy()
    members = np.empty(group.size, dtype=np.int64)
    for i in range(group.size):
        members[fill[group[i]]] = i
        fill[group[i]] += 1
    for g in range(num_groups):
        items = members[start[g]:start[g + 1]]
        if method == 0 and _one_per_bin(costs, items, num_bins, bin_of_item):
            continue
        local = np.empty(items.size)
        for k in range(items.size):
            local[k] = costs[items[k]]
        bins = np.zeros(items.size, dtype=np.int64)
        _partition_one(local, num_bins, method, good_enough_rel, settled_rel, rel_tol, max_rounds, max_sweeps,
                       partners, cheapest_scan, bins)
        for k in range(items.size):
            bin_of_item[items[k]] = bins[k]
