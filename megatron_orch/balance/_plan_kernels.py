"""Compiled helpers of plans and step planning (numba, GIL released, cached): slots of a placement,
micro-batches by length, the bytes a move sends within and across nodes and the rank pairs it connects (the one
byte accountant).

Each is an O(n + ranks) counting pass where numpy would sort (``lexsort`` of ~200k items takes
~20 ms and holds the GIL); results equal the numpy definitions they replace, ties by item id.
"""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT


@numba.njit(**_JIT)
def _rank_starts(rank, num_ranks):
    """Where each rank's items start in rank order (num_ranks + 1 offsets)."""
    start = np.zeros(num_ranks + 1, dtype=np.int64)
    for i in range(rank.size):
        start[rank[i] + 1] += 1
    for r in range(num_ranks):
        start[r + 1] += start[r]
    return start


@numba.njit(**_JIT)
def slots_in_order(rank, order, num_ranks):
    """Slot of each item when every rank lists its items in the order they appear in ``order``
    (a permutation of the item ids)."""
    fill = _rank_starts(rank, num_ranks)[:-1].copy()
    base = fill.copy()
    slot = np.empty(rank.size, dtype=np.int64)
    for t in range(order.size):
        i = order[t]
        r = rank[i]
        slot[i] = fill[r] - base[r]
        fill[r] += 1
    return slot


@numba.njit(**_JIT)
def slots_in_id_order(rank, num_ranks):
    """Slot of each item when every rank lists its items by increasing id, and the first item whose rank lies
    outside ``0..num_ranks - 1`` (-1: none; then the slots are not computed), checked in the same pass."""
    fill = np.zeros(num_ranks, dtype=np.int64)
    slot = np.empty(rank.size, dtype=np.int64)
    for i in range(rank.size):
        r = rank[i]
        if r < 0 or r >= num_ranks:
            return slot, i
        slot[i] = fill[r]
        fill[r] += 1
    return slot, -1


@numba.njit(**_JIT)
def gather(values, index):
    """(``values[index]``, the first position of ``index`` outside ``0..values.size - 1``, -1: none; the values
    from there on are not gathered): numpy's take with the range checked in the same pass."""
    out = np.empty(index.size, dtype=np.int64)
    for j in range(index.size):
        k = index[j]
        if k < 0 or k >= values.size:
            return out, j
        out[j] = values[k]
    return out, -1


@numba.njit(**_JIT)
def expand_slots(parent_rank, parent_slot, num_ranks, parent):
    """Slot of every child item that lives with its parent ``parent[j]`` (in ``0..num_parents - 1``): on a rank,
    children are ordered by their parent's slot, then by child id. Children listed by parent (an example's items,
    as the loader lists them) are written run by run, one fill per parent."""
    num_parents = parent_rank.size
    children = np.zeros(num_parents, dtype=np.int64)
    by_parent = True  # parent non-decreasing: each parent's children are one run, in id order
    run_parent, run = -1, 0  # children in a row of one parent, counted in a register
    for j in range(parent.size):
        p = parent[j]
        if p == run_parent:
            run += 1
            continue
        if run_parent >= 0:
            children[run_parent] += run
            by_parent = by_parent and p > run_parent
        run_parent, run = p, 1
    if run_parent >= 0:
        children[run_parent] += run
    # parents in (rank, slot) order: position start[rank] + slot
    start = _rank_starts(parent_rank, num_ranks)
    by_position = np.empty(num_parents, dtype=np.int64)
    for p in range(num_parents):
        by_position[start[parent_rank[p]] + parent_slot[p]] = p
    first = np.empty(num_parents, dtype=np.int64)  # slot of a parent's first child on its rank
    for r in range(num_ranks):
        offset = 0
        for t in range(start[r], start[r + 1]):
            p = by_position[t]
            first[p] = offset
            offset += children[p]
    slot = np.empty(parent.size, dtype=np.int64)
    if by_parent:
        j = 0
        for p in range(num_parents):
            f = first[p]
            for k in range(children[p]):
                slot[j] = f + k
                j += 1
        return slot
    for j in range(parent.size):  # children by id: each takes its parent's next slot
        p = parent[j]
        slot[j] = first[p]
        first[p] += 1
    return slot


@numba.njit(**_JIT)
def repeat_parents(counts, parent_value):
    """``np.repeat(np.arange(counts.size), counts)`` and ``np.repeat(parent_value, counts)`` (counts >= 0) in one
    pass: the parent of every child item, children listed parent by parent, and the parent's value (an encoder
    phase's items, example by example, and their home ranks: ~800k at DP 10240)."""
    total = 0
    for p in range(counts.size):
        total += counts[p]
    parent = np.empty(total, dtype=np.int64)
    value = np.empty(total, dtype=np.int64)
    j = 0
    for p in range(counts.size):
        v = parent_value[p]
        for _ in range(counts[p]):
            parent[j] = p
            value[j] = v
            j += 1
    return parent, value


@numba.njit(**_JIT)
def slots_by_key(rank, key, key_bound, num_ranks):
    """Slot of each item on its rank when a rank's items are ordered by ``key`` (0 <= key <
    ``key_bound``), ties by item id: a stable counting sort by key, then by rank."""
    return slots_in_order(rank, stably_by(key, np.arange(key.size), key_bound), num_ranks)


_COUNTED_SPAN = 1 << 20  # lengths spanning at most this many values (a 1M-token sequence) are ordered by counting


@numba.njit(**_JIT)
def longest_first_microbatches(rank, num_tokens, num_ranks, micro_batch_size):
    """Micro-batch of every example on its rank: the rank's examples by decreasing length (ties by
    id), ``micro_batch_size`` at a time. (Lengths spanning up to :data:`_COUNTED_SPAN` are ordered by one
    counting pass, ~5x less CPU than numba's merge sort at DP 10240; wider ones by the merge sort.)"""
    n = num_tokens.size
    longest = num_tokens.max() if n else 0
    span = longest - num_tokens.min() + 1 if n else 0
    if span <= _COUNTED_SPAN:
        order = stably_by(longest - num_tokens, np.arange(n), span)
    else:
        order = np.argsort(-num_tokens, kind="mergesort")
    slot = slots_in_order(rank, order, num_ranks)
    return slot // micro_batch_size


@numba.njit(**_JIT)
def moved_bytes(src_rank, dst_rank, node_of_rank, nbytes, with_pairs):
    """Bytes of items moving ``src_rank[i]`` -> ``dst_rank[i]``: (all of them, those that leave their GPU
    but stay on their node, those that cross nodes, and per rank [sent on its node, received on its node,
    sent across nodes, received across nodes] as a (4, ranks) array, and the distinct rank pairs that
    exchange bytes, each ``low * ranks + high``, sorted; none unless ``with_pairs``: finding them takes most of the
    time, and a candidate plan is judged by its bytes alone). An item moving between the same two ranks as the one
    before it (an example's items travel together) adds no pair to deduplicate."""
    num_ranks = node_of_rank.size
    per_rank = np.zeros((4, num_ranks))
    lows = np.empty(src_rank.size, dtype=np.int64)
    highs = np.empty(src_rank.size, dtype=np.int64)
    num_pairs = 0
    last_low, last_high = -1, -1
    total = 0.0
    intra = 0.0
    inter = 0.0
    for i in range(src_rank.size):
        src, dst, b = src_rank[i], dst_rank[i], nbytes[i]
        total += b
        if src == dst or b <= 0:
            continue
        low, high = min(src, dst), max(src, dst)
        if with_pairs and (low != last_low or high != last_high):
            lows[num_pairs], highs[num_pairs] = low, high
            num_pairs += 1
            last_low, last_high = low, high
        if node_of_rank[src] == node_of_rank[dst]:
            intra += b
            per_rank[0, src] += b
            per_rank[1, dst] += b
        else:
            inter += b
            per_rank[2, src] += b
            per_rank[3, dst] += b
    return total, intra, inter, per_rank, distinct_pairs(lows[:num_pairs], highs[:num_pairs], num_ranks)


@numba.njit(**_JIT)
def stably_by(keys, items, key_bound):
    """``items`` (indices into ``keys``, 0 <= key < ``key_bound``) stably ordered by their keys: one counting pass."""
    count = np.zeros(key_bound + 1, dtype=np.int64)
    for k in items:
        count[keys[k] + 1] += 1
    for r in range(key_bound):
        count[r + 1] += count[r]
    out = np.empty(items.size, dtype=np.int64)
    for k in items:
        out[count[keys[k]]] = k
        count[keys[k]] += 1
    return out


@numba.njit(**_JIT)
def distinct_pairs(lows, highs, num_ranks):
    """``np.unique(lows * num_ranks + highs)`` in linear time (a sort of a batch's hundreds of thousands of
    moved items took most of a default plan's time at DP 10240): two stable counting passes, by ``high`` then by
    ``low``, put the pairs in order, and repeats are dropped as they come."""
    order = stably_by(lows, stably_by(highs, np.arange(lows.size), num_ranks), num_ranks)
    out = np.empty(lows.size, dtype=np.int64)
    n = 0
    for k in order:
        pair = lows[k] * num_ranks + highs[k]
        if n == 0 or pair != out[n - 1]:
            out[n] = pair
            n += 1
    return out[:n]


@numba.njit(**_JIT)
def sorted_union(a, b):
    """``np.union1d(a, b)`` of two sorted arrays of distinct values, by one merge (connections joined over a
    step's moves and a run's steps) without a branch on the values: each step writes the smaller head and moves
    past it in either array or both (~2x less CPU than branching on which is smaller, whose outcome the
    processor cannot predict)."""
    out = np.empty(a.size + b.size, dtype=np.int64)
    i = j = count = 0
    while i < a.size and j < b.size:
        x, y = a[i], b[j]
        least = min(x, y)
        out[count] = least
        i += x == least
        j += y == least
        count += 1
    while i < a.size:
        out[count] = a[i]
        i += 1
        count += 1
    while j < b.size:
        out[count] = b[j]
        j += 1
        count += 1
    return out[:count]


@numba.njit(**_JIT)
def _sums(key, weights, num_keys):
    """``np.bincount(key, weights, minlength=num_keys)``, summed in item order as numpy sums (bit for bit the same);
    a key's items in a row are summed in a register."""
    out = np.zeros(num_keys)
    n = key.size
    i = 0
    while i < n:
        k = key[i]
        acc = out[k]
        while i < n and key[i] == k:
            acc += weights[i]
            i += 1
        out[k] = acc
    return out


@numba.njit(**_JIT)
def counts(key, num_keys):
    """``np.bincount(key, minlength=num_keys)`` of keys in ``0..num_keys - 1``; a key's items in a row are counted
    in a register (a batch's items come in long runs of one rank)."""
    out = np.zeros(num_keys, dtype=np.int64)
    n = key.size
    i = 0
    while i < n:
        k = key[i]
        start = i
        while i < n and key[i] == k:
            i += 1
        out[k] += i - start
    return out


@numba.njit(**_JIT)
def row_max(values):
    """``values.max(axis=1)`` of a 2-D array (a NaN in a row makes its maximum NaN, as numpy's): one pass, where
    numpy's reduction over short rows is slow (a step's (rank, micro-batch) cells, 16 to a rank)."""
    if values.shape[1] == 0:
        raise ValueError("row_max of rows without values")
    out = np.empty(values.shape[0])
    for r in range(values.shape[0]):
        most = values[r, 0]
        for c in range(1, values.shape[1]):
            value = values[r, c]
            if value > most or value != value:
                most = value
        out[r] = most
    return out


@numba.njit(**_JIT)
def rank_loads_max(rank, weights, num_ranks):
    """The largest per-rank sum of ``weights`` (``np.bincount(rank, weights).max()``, summed in item order as
    numpy sums, so bit for bit the same; 0 for no items)."""
    load = _sums(rank, weights, num_ranks)
    return load.max() if num_ranks else 0.0


@numba.njit(**_JIT)
def loads_before_after(before_rank, after_rank, weights, num_ranks):
    """(per-rank sums of ``weights`` by ``before_rank``, the largest per-rank sum by ``after_rank``):
    ``np.bincount(before_rank, weights)`` and :func:`rank_loads_max` of ``after_rank``, each summed in item order
    as numpy sums, so bit for bit the same (a phase's loads as loaded and as planned)."""
    before = np.zeros(num_ranks)
    after = np.zeros(num_ranks)
    before_key, after_key = -1, -1  # each sum's current rank, its sum in a register while the rank repeats
    before_acc, after_acc = 0.0, 0.0
    for i in range(weights.size):
        if before_rank[i] != before_key:
            if before_key >= 0:
                before[before_key] = before_acc
            before_key = before_rank[i]
            before_acc = before[before_key]
        if after_rank[i] != after_key:
            if after_key >= 0:
                after[after_key] = after_acc
            after_key = after_rank[i]
            after_acc = after[after_key]
        before_acc += weights[i]
        after_acc += weights[i]
    if before_key >= 0:
        before[before_key] = before_acc
        after[after_key] = after_acc
    return before, after.max() if num_ranks else 0.0


@numba.njit(**_JIT)
def sums_by_parent(parent_key, parent, weights, num_keys):
    """``np.bincount(parent_key[parent], weights, minlength=num_keys)`` without building ``parent_key[parent]``
    (child items summed into their parent's key, in item order as numpy sums: bit for bit the same; the children
    of one parent in a row are summed in a register)."""
    out = np.zeros(num_keys)
    n = parent.size
    j = 0
    while j < n:
        p = parent[j]
        k = parent_key[p]
        acc = out[k]
        while j < n and parent[j] == p:
            acc += weights[j]
            j += 1
        out[k] = acc
    return out


@numba.njit(**_JIT)
def padded_sums(key, values, num_keys):
    """Per key, the count of its items times their largest value (``np.bincount(key) * longest`` where
    ``np.maximum.at(longest, key, values)``: rows padded to their longest), in one pass."""
    count = np.zeros(num_keys)
    longest = np.zeros(num_keys)
    for i in range(key.size):
        count[key[i]] += 1.0
        if values[i] > longest[key[i]]:
            longest[key[i]] = values[i]
    return count * longest


@numba.njit(**_JIT)
def sources_by_example(home, at_home, example, item_rank, item_bytes):
    """Adds to ``at_home[e]`` the bytes of the items of example e computed on its home rank, and returns the
    others as (example, rank, bytes) arrays (in one pass: the outputs are allocated for every item, and only the
    pages of those written are touched)."""
    out_example = np.empty(example.size, dtype=np.int64)
    out_rank = np.empty(example.size, dtype=np.int64)
    out_bytes = np.empty(example.size, dtype=np.int64)
    k = 0
    for j in range(example.size):
        e = example[j]
        if item_rank[j] == home[e]:
            at_home[e] += item_bytes[j]
        else:
            out_example[k] = e
            out_rank[k] = item_rank[j]
            out_bytes[k] = item_bytes[j]
            k += 1
    return out_example[:k], out_rank[:k], out_bytes[:k]


@numba.njit(**_JIT)
def runs(example, rank, nbytes):
    """Entries (``example``, ``rank``, int64 ``nbytes``) with each run of consecutive entries of one example and
    one rank merged into one, its bytes summed: (example, rank, bytes, entries) arrays, ``entries`` how many it
    stands for. Moved wherever their example goes, the runs send what the entries send, to the byte (integer sums;
    an encoder phase's items come example by example, most of an example's on one rank): the step model judges
    candidates by them, the locality repair holds its moves as them."""
    out_example = np.empty(example.size, dtype=np.int64)
    out_rank = np.empty(example.size, dtype=np.int64)
    out_bytes = np.empty(example.size, dtype=np.int64)
    out_entries = np.empty(example.size, dtype=np.int64)
    k = -1
    for j in range(example.size):
        if k < 0 or example[j] != out_example[k] or rank[j] != out_rank[k]:
            k += 1
            out_example[k], out_rank[k], out_bytes[k], out_entries[k] = example[j], rank[j], 0, 0
        out_bytes[k] += nbytes[j]
        out_entries[k] += 1
    return out_example[:k + 1], out_rank[:k + 1], out_bytes[:k + 1], out_entries[:k + 1]


@numba.njit(**_JIT)
def all_equal(values):
    """Whether every value equals the first (``values.min() == values.max()`` of finite values): one pass, which
    stops at the first that differs."""
    for i in range(values.size):
        if values[i] != values[0]:
            return False
    return True


@numba.njit(**_JIT)
def peer_counts(pairs, node_of_rank):
    """Per rank, its distinct peers on its node and across nodes (two int64 arrays), of distinct rank pairs
    ``low * ranks + high`` (:class:`~megatron_orch.balance.plan.Connections`): one pass."""
    num_ranks = node_of_rank.size
    intra = np.zeros(num_ranks, dtype=np.int64)
    inter = np.zeros(num_ranks, dtype=np.int64)
    for k in range(pairs.size):
        low, high = pairs[k] // num_ranks, pairs[k] % num_ranks
        if node_of_rank[low] == node_of_rank[high]:
            intra[low] += 1
            intra[high] += 1
        else:
            inter[low] += 1
            inter[high] += 1
    return intra, inter


_FINGERPRINT_START = np.uint64(0xCBF29CE484222325)


@numba.njit(**_JIT)
def _fingerprint_step(h, value):
    """The fingerprint ``h`` with one more int64 ``value``."""
    x = np.uint64(value) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(29)
    return (h ^ x) * np.uint64(0x100000001B3)


@numba.njit(**_JIT)
def pull_ranks(home, example, source, nbytes, num_ranks):
    """For every example (``home[e]``: its home rank), the source rank of most of its entries' bytes (``example``,
    ``source``, ``nbytes``: one entry each; each (example, rank)'s bytes summed in float64 in entry order, as
    ``np.bincount`` sums them), ties to the home rank, then to the lower rank; the home rank where it has none."""
    n = home.size
    start = _rank_starts(example, n)
    fill = start[:-1].copy()
    by_example = np.empty(example.size, dtype=np.int64)  # entries example by example, in entry order
    for j in range(example.size):
        by_example[fill[example[j]]] = j
        fill[example[j]] += 1
    total = np.zeros(num_ranks)
    pull = home.copy()
    for e in range(n):
        for t in range(start[e], start[e + 1]):
            total[source[by_example[t]]] += nbytes[by_example[t]]
        best = -1
        for t in range(start[e], start[e + 1]):
            q = source[by_example[t]]
            if best < 0 or total[q] > total[best] or (total[q] == total[best] and best != home[e] and (
                    q == home[e] or q < best)):
                best = q
        if best >= 0:
            pull[e] = best
        for t in range(start[e], start[e + 1]):
            total[source[by_example[t]]] = 0.0
    return pull


@numba.njit(**_JIT)
def fingerprint(values):
    """A 64-bit fingerprint of int64 ``values`` (order-sensitive; a word at a time, so a pass costs a
    fraction of a byte-wise CRC): what a plan digest hashes."""
    h = _FINGERPRINT_START
    for i in range(values.size):
        h = _fingerprint_step(h, values[i])
    return h


@numba.njit(**_JIT)
def fingerprint_pair(a, b):
    """(:func:`fingerprint` of ``a``, of ``b``) in one loop: each is a chain of multiplies, so the two chains
    side by side take about the time of one."""
    ha = _FINGERPRINT_START
    hb = _FINGERPRINT_START
    both = min(a.size, b.size)
    for i in range(both):
        ha = _fingerprint_step(ha, a[i])
        hb = _fingerprint_step(hb, b[i])
    for i in range(both, a.size):
        ha = _fingerprint_step(ha, a[i])
    for i in range(both, b.size):
        hb = _fingerprint_step(hb, b[i])
    return ha, hb
