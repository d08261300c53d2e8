"""Pipeline-schedule kernels: a replica's step through Megatron's 1F1B / interleaved order, and the
pipeline-aware local search of the backbone plan (:mod:`megatron_orch.balance.pipeline_schedule`).

A schedule is a list of operations in a topological order (``prev``: the operation before it on its stage,
``dep``: the one whose output it takes; -1: none) with ``slot``: which duration it runs (forward or
backward of one virtual stage and micro-batch, ``kind * V * M + virtual_stage * M + microbatch``). The
end of an operation is ``max(end[prev], end[dep]) + duration``; the step is the last end.
"""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT

# How a replica's examples are packed into its micro-batches inside the local search.
PACK_LONGEST_FIRST = 0  # packed rows: longest first onto the lightest micro-batch (ties: lower id)
PACK_EQUAL_COUNT = 1    # equal-count rows: longest first, ``rows`` consecutive examples per micro-batch


@numba.njit(**_JIT)
def _replica_seconds(durations, slot, prev, dep, end):
    """The step of one replica: ``durations`` (2 * V * M,) seconds of every (kind, virtual stage, micro-batch)."""
    last = 0.0
    for i in range(slot.size):
        start = 0.0
        if prev[i] >= 0:
            start = end[prev[i]]
        if dep[i] >= 0 and end[dep[i]] > start:
            start = end[dep[i]]
        end[i] = start + durations[slot[i]]
        if end[i] > last:
            last = end[i]
    return last


@numba.njit(**_JIT)
def replica_seconds(durations, slot, prev, dep):
    """Step seconds of every replica: ``durations`` (replicas, 2 * V * M)."""
    out = np.zeros(durations.shape[0])
    end = np.empty(slot.size)
    for r in range(durations.shape[0]):
        out[r] = _replica_seconds(durations[r], slot, prev, dep, end)
    return out


@numba.njit(**_JIT)
def _fill_durations(mb_cost, forward_share, num_virtual, durations):
    """Each micro-batch's training cost split evenly over the virtual stages, ``forward_share`` of it forward."""
    m_count = mb_cost.size
    for v in range(num_virtual):
        for m in range(m_count):
            durations[v * m_count + m] = mb_cost[m] * forward_share / num_virtual
            durations[(num_virtual + v) * m_count + m] = mb_cost[m] * (1.0 - forward_share) / num_virtual


@numba.njit(**_JIT)
def _pack(items, count, costs, num_mb, mode, rows, mb_of, mb_cost, order_buf):
    """Pack ``items[:count]`` (sorted by cost, longest first, ties by id) into ``num_mb`` micro-batches:
    ``mb_of[k]`` for the k-th item, ``mb_cost`` their sums."""
    for m in range(num_mb):
        mb_cost[m] = 0.0
    for k in range(count):
        if mode == PACK_EQUAL_COUNT:
            m = min(k // rows, num_mb - 1)
        else:
            m = 0
            for j in range(1, num_mb):
                if mb_cost[j] < mb_cost[m]:
                    m = j
        mb_of[k] = m
        mb_cost[m] += costs[items[k]]


@numba.njit(**_JIT)
def _fill_order(idx, num_mb, kind, order):
    """``order[j]``, the micro-batch run j-th, of ``idx`` (heaviest first): ``kind`` 0 heaviest first, 1 lightest
    first, 2 the heaviest in the middle and the rest alternating outwards."""
    half = num_mb // 2
    for j in range(num_mb):
        if kind == 0:
            order[j] = idx[j]
        elif kind == 1:
            order[j] = idx[num_mb - 1 - j]
        elif j % 2 == 0:
            order[half + j // 2] = idx[j]
        else:
            order[half - 1 - j // 2] = idx[j]


@numba.njit(**_JIT)
def _best_order(mb_cost, num_mb, forward_share, num_virtual, slot, prev, dep, end, durations, order, ordered):
    """The order of the micro-batches (``order[j]``: the micro-batch run j-th) that the schedule finishes
    soonest, of three (:func:`_fill_order`; ties: the first found). Returns its seconds and writes ``order``."""
    idx = np.argsort(-mb_cost[:num_mb], kind="mergesort")
    best = np.inf
    best_kind = 0
    for kind in range(3):
        _fill_order(idx, num_mb, kind, order)
        for j in range(num_mb):
            ordered[j] = mb_cost[order[j]]
        _fill_durations(ordered[:num_mb], forward_share, num_virtual, durations)
        seconds = _replica_seconds(durations, slot, prev, dep, end)
        if seconds < best:
            best = seconds
            best_kind = kind
    _fill_order(idx, num_mb, best_kind, order)
    return best


@numba.njit(**_JIT)
def _sorted_members(members, count, costs):
    """``members[:count]`` sorted longest first, ties by the lower id (insertion sort: a replica holds few)."""
    for a in range(1, count):
        x = members[a]
        b = a - 1
        while b >= 0 and (costs[members[b]] < costs[x] or (costs[members[b]] == costs[x] and members[b] > x)):
            members[b + 1] = members[b]
            b -= 1
        members[b + 1] = x


@numba.njit(**_JIT)
def _evaluate(members, count, costs, num_mb, mode, rows, forward_share, num_virtual, slot, prev, dep, work):
    """Seconds of a replica holding ``members[:count]`` (sorted in place), packed and ordered at its best."""
    end, durations, mb_of, mb_cost, order, ordered = work
    if count == 0:
        return 0.0
    _sorted_members(members, count, costs)
    _pack(members, count, costs, num_mb, mode, rows, mb_of, mb_cost, order)
    return _best_order(mb_cost, num_mb, forward_share, num_virtual, slot, prev, dep, end, durations, order, ordered)


@numba.njit(**_JIT)
def pipeline_local_search(costs, bin_of_item, num_bins, num_mb, mode, rows, forward_share, num_stages, num_virtual,
                          slot, prev, dep, max_rounds, microbatch_of_item):
    """Lower the slowest replica's modeled pipelined step by moving (``PACK_LONGEST_FIRST``) or swapping
    (both modes; ``PACK_EQUAL_COUNT`` keeps every replica's count) one example at a time between the slowest
    replica and the two fastest, each time taking the change that lowers the larger of the two replicas' new
    steps most (a swap only where no move does; for each example of the slowest, the two partners nearest to
    evening the two loads), until none lowers it (or ``max_rounds``). ``num_stages``: the
    pipeline stages (a replica's step is at least its load over them), ``num_virtual``: the virtual stages. Writes ``bin_of_item`` in place and
    ``microbatch_of_item`` (each replica's packing, its micro-batches numbered in the order they run);
    returns every replica's modeled step."""
    n = costs.size
    capacity = np.zeros(num_bins, dtype=np.int64)
    for i in range(n):
        capacity[bin_of_item[i]] += 1
    most = 1
    for b in range(num_bins):
        if capacity[b] > most:
            most = capacity[b]
    members = np.full((num_bins, 2 * most + 16), -1, dtype=np.int64)  # a replica grows by moves: bounded below
    width = members.shape[1]
    count = np.zeros(num_bins, dtype=np.int64)
    for i in range(n):
        b = bin_of_item[i]
        members[b, count[b]] = i
        count[b] += 1
    k_dur = 2 * num_virtual * num_mb
    work = (np.empty(slot.size), np.empty(k_dur), np.empty(max(width, n + 1), dtype=np.int64),
            np.empty(num_mb), np.empty(num_mb, dtype=np.int64), np.empty(num_mb))
    seconds = np.zeros(num_bins)
    load = np.zeros(num_bins)
    for i in range(n):
        load[bin_of_item[i]] += costs[i]
    for b in range(num_bins):
        seconds[b] = _evaluate(members[b], count[b], costs, num_mb, mode, rows, forward_share, num_virtual, slot, prev,
                               dep, work)
    scratch_a = np.empty(width + n + 1, dtype=np.int64)
    scratch_b = np.empty(width + n + 1, dtype=np.int64)
    for _ in range(max_rounds):
        slow = 0
        for b in range(1, num_bins):
            if seconds[b] > seconds[slow]:
                slow = b
        fast0, fast1 = -1, -1  # the two fastest other replicas
        for b in range(num_bins):
            if b == slow:
                continue
            if fast0 < 0 or seconds[b] < seconds[fast0]:
                fast1 = fast0
                fast0 = b
            elif fast1 < 0 or seconds[b] < seconds[fast1]:
                fast1 = b
        if fast0 < 0:
            break
        best = seconds[slow]
        best_item, best_other, best_target = -1, -1, -1
        best_pair = (0.0, 0.0)
        # moves first (packed rows); swaps only where no move lowers the slowest replica
        for swaps in range(2):
            if swaps == 0 and mode == PACK_EQUAL_COUNT:
                continue
            if swaps == 1 and best_item >= 0:
                break
            for t in range(2):
                target = fast0 if t == 0 else fast1
                if target < 0:
                    continue
                for a in range(count[slow]):
                    item = members[slow, a]
                    # a swap partner: the lighter examples of the target whose cost is nearest below and above
                    # the one that would even the two loads
                    below, above = -1, -1
                    if swaps:
                        wanted = costs[item] - 0.5 * (load[slow] - load[target])
                        for c in range(count[target]):
                            x = costs[members[target, c]]
                            if x >= costs[item]:
                                continue
                            if x <= wanted and (below < 0 or x > costs[members[target, below]]):
                                below = c
                            if x > wanted and (above < 0 or x < costs[members[target, above]]):
                                above = c
                    for pick in range(2 if swaps else 1):
                        c = (below if pick == 0 else above) if swaps else 0
                        if swaps and c < 0:
                            continue
                        other = members[target, c] if swaps else -1
                        if swaps == 0 and count[target] + 1 >= width:
                            continue
                        gain = costs[item] - (costs[other] if other >= 0 else 0.0)
                        # the target's stages work its new load: no faster than that share of it
                        if (load[target] + gain) / num_stages >= best:
                            continue
                        na = 0
                        for k in range(count[slow]):
                            if k != a:
                                scratch_a[na] = members[slow, k]
                                na += 1
                        if other >= 0:
                            scratch_a[na] = other
                            na += 1
                        nb = 0
                        for k in range(count[target]):
                            if k != c or not swaps:
                                scratch_b[nb] = members[target, k]
                                nb += 1
                        scratch_b[nb] = item
                        nb += 1
                        sa = _evaluate(scratch_a, na, costs, num_mb, mode, rows, forward_share, num_virtual, slot,
                                       prev, dep, work)
                        if sa >= best:
                            continue
                        sb = _evaluate(scratch_b, nb, costs, num_mb, mode, rows, forward_share, num_virtual, slot,
                                       prev, dep, work)
                        worse = max(sa, sb)
                        if worse < best:
                            best = worse
                            best_item, best_other, best_target = item, other, target
                            best_pair = (sa, sb)
        if best_item < 0 or not best < seconds[slow] * (1.0 - 1e-12):
            break
        # apply: the item to the target, the other (a swap) to the slow replica
        na = 0
        for k in range(count[slow]):
            if members[slow, k] != best_item:
                members[slow, na] = members[slow, k]
                na += 1
        nb = 0
        for k in range(count[best_target]):
            if members[best_target, k] != best_other:
                members[best_target, nb] = members[best_target, k]
                nb += 1
        if best_other >= 0:
            members[slow, na] = best_other
            na += 1
            bin_of_item[best_other] = slow
        members[best_target, nb] = best_item
        nb += 1
        bin_of_item[best_item] = best_target
        count[slow], count[best_target] = na, nb
        seconds[slow], seconds[best_target] = best_pair
        gain = costs[best_item] - (costs[best_other] if best_other >= 0 else 0.0)
        load[slow] -= gain
        load[best_target] += gain
    # the final packing and order of every replica
    end, durations, mb_of, mb_cost, order, ordered = work
    rank_of_mb = np.empty(num_mb, dtype=np.int64)
    for b in range(num_bins):
        c = count[b]
        if c == 0:
            continue
        seconds[b] = _evaluate(members[b], c, costs, num_mb, mode, rows, forward_share, num_virtual, slot, prev, dep,
                               work)
        for j in range(num_mb):
            rank_of_mb[order[j]] = j
        for k in range(c):
            microbatch_of_item[members[b, k]] = rank_of_mb[mb_of[k]]
    return seconds
