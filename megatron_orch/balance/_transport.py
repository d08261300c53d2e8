"""Compiled exact placement (numba, GIL released): bins -> nodes, then bins -> GPUs inside each node.

Bins -> nodes is a transportation problem: every bin goes to one node, node ``n`` takes exactly
``cap[n]`` bins (``cap.sum()`` is the number of bins), and the bytes a bin finds on its node
(``W[b, n]``) are maximised, i.e. the inter-node bytes minimised. ``W`` is sparse (a bin pulls from
few nodes) and stored by bin (CSR); a bin can go to any node, where it has no bytes the weight is 0.

:func:`transport` solves it exactly by successive shortest augmenting paths with node potentials
(a Hungarian / Jonker-Volgenant scheme for capacitated columns), in four stages that all keep every
placed bin at a best node under the potentials (dual feasibility):

1. greedy start (potentials 0): heaviest bins first, each to one of its heaviest nodes with room,
   the one the fewest later bins could take (an instance of ties only, as LPT's round robin of
   identical image tiles makes, is then solved without any search);
2. augmenting row reduction (JV), bounded: a free bin takes its best node, whose potential drops
   until its least attached member leaves and bids in turn;
3. augmenting paths of zero reduced cost (bins moving between equally good nodes), breadth first;
4. the rest, one Dijkstra search over *nodes* each (a full node passes the search on through the
   bins it holds: one of them moves on to another node), bins renumbered node by node first so a
   node's bins have their rows side by side in memory.

Zero-weight arcs are never listed: a "hub" label carries the cheapest way to leave a node for a node
where the moving bin has nothing; rows go by decreasing weight and are cut where an arc cannot beat
the best label of a node with room, so a search reads only the arcs that can matter: a bin whose
heaviest arc off its own node (``away``) cannot beat that bound is passed over without reading its row,
and a full node is queued only with a label below it (no label at or over the bound is ever settled).

The solution is certified: :func:`transport` returns the node prices, and :func:`dual_gap` checks
that the primal weight equals the dual bound (LP duality: gap 0 means optimal). All arithmetic is
int64; ties go to the smaller node or bin id, so results are deterministic.

:func:`assign_in_nodes` then solves, node by node, the assignment of a node's bins to its GPUs that
maximises the bytes a bin already finds on its own GPU (Hungarian algorithm, O(G^3) per node).
"""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels._heap import _heap_pop, _heap_push
from megatron_orch.balance._kernels.order import decreasing

_INF = np.int64(1) << np.int64(62)


# ---------------------------------------------------------------------------------------------
# Sparse traffic: merge (bin, key, bytes) triples, grouped by bin in one counting pass.
# ---------------------------------------------------------------------------------------------

_DENSE_PER_PAIR = 4  # dense merge while the matrix has at most this many cells per pair


@numba.njit(**_JIT)
def _merge_dense(rows, cols, values, num_rows, num_cols):
    """:func:`merge_pairs` through a dense row-major matrix: one scattered pass, one ordered scan."""
    dense = np.zeros(num_rows * num_cols, dtype=np.int64)
    for i in range(rows.size):
        dense[rows[i] * num_cols + cols[i]] += values[i]
    m = 0
    for k in range(dense.size):
        m += dense[k] != 0
    row_start = np.zeros(num_rows + 1, dtype=np.int64)
    out_col = np.empty(m, dtype=np.int64)
    out_val = np.empty(m, dtype=np.int64)
    m = 0
    for r in range(num_rows):
        base = r * num_cols
        for c in range(num_cols):
            v = dense[base + c]
            if v != 0:
                out_col[m] = c
                out_val[m] = v
                m += 1
        row_start[r + 1] = m
    return row_start, out_col, out_val


_SHORT_ROW = 32  # a row of at most this many columns is put in order without a sort call (allocates nothing)


@numba.njit(**_JIT)
def merge_pairs(rows, cols, values, num_rows, num_cols):
    """Sum ``values`` per (row, col) pair: (row_start [num_rows + 1], col, value) sorted by row then
    col, pairs with value 0 dropped. Where the dense matrix is small next to the pairs (at most
    ``_DENSE_PER_PAIR`` cells per pair), values are summed straight into it and read back in order;
    else one counting pass groups the pairs by row, and each row is summed into one column-indexed
    scratch row (its columns put in order as they are read back): O(n) without a sort of the keys."""
    n = rows.size
    if num_rows * num_cols <= _DENSE_PER_PAIR * n:
        return _merge_dense(rows, cols, values, num_rows, num_cols)
    fill = np.zeros(num_rows + 1, dtype=np.int64)
    for i in range(n):
        fill[rows[i] + 1] += 1
    for r in range(num_rows):
        fill[r + 1] += fill[r]
    row_end = fill[1:].copy()
    by_row_col = np.empty(n, dtype=np.int64)
    by_row_value = np.empty(n, dtype=np.int64)
    for i in range(n):
        r = rows[i]
        by_row_col[fill[r]] = cols[i]
        by_row_value[fill[r]] = values[i]
        fill[r] += 1
    total = np.zeros(num_cols, dtype=np.int64)
    seen = np.full(num_cols, -1, dtype=np.int64)  # the last row that listed the column
    row_start = np.zeros(num_rows + 1, dtype=np.int64)
    out_col = np.empty(n, dtype=np.int64)
    out_val = np.empty(n, dtype=np.int64)
    m = 0
    lo = 0
    for r in range(num_rows):
        hi = row_end[r]
        first = m  # the row's distinct columns go to out_col[first:m], then its non-zero sums stay
        for k in range(lo, hi):
            c = by_row_col[k]
            if seen[c] != r:
                seen[c] = r
                total[c] = 0
                out_col[m] = c
                m += 1
            total[c] += by_row_value[k]
        if m - first <= _SHORT_ROW:
            for t in range(first + 1, m):
                c = out_col[t]
                u = t
                while u > first and out_col[u - 1] > c:
                    out_col[u] = out_col[u - 1]
                    u -= 1
                out_col[u] = c
        else:
            out_col[first:m] = np.sort(out_col[first:m])
        kept = first
        for t in range(first, m):
            c = out_col[t]
            if total[c] != 0:
                out_col[kept] = c
                out_val[kept] = total[c]
                kept += 1
        m = kept
        row_start[r + 1] = m
        lo = hi
    return row_start, out_col[:m].copy(), out_val[:m].copy()


# ---------------------------------------------------------------------------------------------
# Bins -> nodes: the transportation problem.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _remove(b, old, node_of_bin, members, member_start, count, pos):
    """Take bin ``b`` out of node ``old``."""
    last = members[member_start[old] + count[old] - 1]
    members[member_start[old] + pos[b]] = last
    pos[last] = pos[b]
    count[old] -= 1
    node_of_bin[b] = -1


@numba.njit(**_JIT)
def _move(b, old, new, node_of_bin, members, member_start, count, pos):
    """Take bin ``b`` out of node ``old`` (-1: nowhere) and put it into node ``new``."""
    if old >= 0:
        _remove(b, old, node_of_bin, members, member_start, count, pos)
    members[member_start[new] + count[new]] = b
    pos[b] = count[new]
    count[new] += 1
    node_of_bin[b] = new

@numba.njit(**_JIT)
def _ahead(v, i, j):
    """Whichever of nodes i and j (-1: none) has the larger ``v`` (ties: the smaller id)."""
    if j < 0:
        return i
    if i < 0:
        return j
    return i if v[i] > v[j] or (v[i] == v[j] and i < j) else j


@numba.njit(**_JIT)
def _tree_of_nodes(v):
    """A tournament tree over ``v``: ``tree[width + n] = n``, every parent the :func:`_ahead` of its two
    children (leaves past ``v.size``: -1), so ``tree[1]`` is the node of largest v."""
    width = 1
    while width < v.size:
        width *= 2
    tree = np.full(2 * width, -1, dtype=np.int64)
    for n in range(v.size):
        tree[width + n] = n
    for k in range(width - 1, 0, -1):
        tree[k] = _ahead(v, tree[2 * k], tree[2 * k + 1])
    return tree


@numba.njit(**_JIT)
def _tree_update(tree, v, n):
    """The tree after ``v[n]`` changed."""
    k = (tree.size // 2 + n) // 2
    while k >= 1:
        tree[k] = _ahead(v, tree[2 * k], tree[2 * k + 1])
        k //= 2


@numba.njit(**_JIT)
def _top_two(tree, v):
    """Node of largest ``v`` (ties: smaller id) and the largest ``v`` over the other nodes: the winners of
    the subtrees beside the top's path to the root."""
    first = tree[1]
    second = -_INF
    k = tree.size // 2 + first
    while k > 1:
        other = tree[k ^ 1]
        if other >= 0:
            second = max(second, v[other])
        k //= 2
    return first, second


@numba.njit(**_JIT)
def _best_two(b, row_start, row_node, row_w, v, v_max, top, second_v):
    """Bin ``b``'s best node (largest W[b, n] + v[n]; ties: smaller id), W there, that value, and the
    best value over the other nodes. Unlisted nodes have W = 0 (the best of them is ``top``, the
    node of largest v). Rows are sorted by decreasing weight, so the scan stops once no arc can
    reach the second value."""
    best_n, best_w, best_val, other = top, np.int64(0), v[top], second_v
    for j in range(row_start[b], row_start[b + 1]):
        w = row_w[j]
        if w + v_max < other:
            break
        x = row_node[j]
        val = w + v[x]
        if val > best_val or (val == best_val and x < best_n):
            if x != best_n:
                other = max(other, best_val)
            best_n, best_w, best_val = x, w, val
        elif x != best_n:
            other = max(other, val)
    return best_n, best_w, best_val, other


@numba.njit(**_JIT)
def _alternative(b, avoid, row_start, row_node, row_w, v, v_max, top, second_v):
    """Best value of bin ``b`` over the nodes other than ``avoid``."""
    alt = v[top] if top != avoid else second_v
    for j in range(row_start[b], row_start[b + 1]):
        w = row_w[j]
        if w + v_max <= alt:
            break
        x = row_node[j]
        if x != avoid:
            alt = max(alt, w + v[x])
    return alt


@numba.njit(**_JIT)
def _price_rounds(queue, num_free, max_bids, row_start, row_node, row_w, cap, v, node_of_bin, wcur,
                  members, member_start, count, pos):
    """Place free bins while every placed bin stays at a best node (Jonker-Volgenant's augmenting
    row reduction, for nodes of several slots). A free bin takes its best node; a full node lowers
    its potential until the bin is indifferent to its second choice or the node's least attached
    member is to its own, and that member leaves and bids in turn. Stops after ``max_bids`` bids
    (ties can make bins swap forever). ``queue[:num_free]``: the free bins, a ring; returns how
    many are still free, left at the front of ``queue``."""
    size = queue.size
    head, tail = 0, num_free
    bids = 0
    tree = _tree_of_nodes(v)  # (a bid lowers one potential: O(log nodes) to keep, not a scan of all)
    while head < tail and bids < max_bids:
        b = queue[head % size]
        head += 1
        bids += 1
        top, second_v = _top_two(tree, v)
        v_max = v[top]
        n1, w1, u1, u2 = _best_two(b, row_start, row_node, row_w, v, v_max, top, second_v)
        if count[n1] < cap[n1]:
            _move(b, -1, n1, node_of_bin, members, member_start, count, pos)
            wcur[b] = w1
            continue
        out, out_slack = -1, _INF
        for k in range(member_start[n1], member_start[n1] + count[n1]):
            m = members[k]
            slack = wcur[m] + v[n1] - _alternative(m, n1, row_start, row_node, row_w, v, v_max, top, second_v)
            if slack < out_slack or (slack == out_slack and m < out):
                out, out_slack = m, slack
        v[n1] -= min(u1 - u2, out_slack)
        _tree_update(tree, v, n1)
        _remove(out, n1, node_of_bin, members, member_start, count, pos)
        _move(b, -1, n1, node_of_bin, members, member_start, count, pos)
        wcur[b] = w1
        queue[tail % size] = out
        tail += 1
    remaining = tail - head
    out_q = np.empty(remaining, dtype=np.int64)
    for t in range(remaining):
        out_q[t] = queue[(head + t) % size]
    queue[:remaining] = out_q
    return remaining


@numba.njit(**_JIT)
def _sort_rows(row_start, row_node, row_w):
    """Rows by decreasing weight, ties by increasing node (copies; rows come by increasing node). An arc of a row
    of at most ``_SHORT_ROW`` arcs (a bin pulls from few nodes) goes straight to its rank, the arcs before it
    at least as heavy and the arcs after it heavier (a stable sort: comparisons without branches, no allocation,
    ~1.7x faster than insertion on DP 10240's rows); a longer row by a stable argsort."""
    node = np.empty_like(row_node)
    w = np.empty_like(row_w)
    for b in range(row_start.size - 1):
        lo, hi = row_start[b], row_start[b + 1]
        if hi - lo <= _SHORT_ROW:
            for i in range(lo, hi):
                wi = row_w[i]
                rank = lo
                for j in range(lo, i):
                    rank += row_w[j] >= wi
                for j in range(i + 1, hi):
                    rank += row_w[j] > wi
                node[rank] = row_node[i]
                w[rank] = wi
            continue
        order = np.argsort(-row_w[lo:hi], kind="mergesort")
        for t in range(hi - lo):
            node[lo + t] = row_node[lo + order[t]]
            w[lo + t] = row_w[lo + order[t]]
    return node, w


@numba.njit(**_JIT)
def transport(row_start, row_node, row_w, cap):
    """Max-weight assignment of bins to nodes with node capacities (see the module docstring).

    ``row_start/row_node/row_w``: W by bin (CSR, weights > 0, nodes increasing in a row). ``cap``:
    bins per node, summing to the number of bins. Returns (node_of_bin, v): node potentials ``v``
    certify optimality through :func:`dual_gap`.
    """
    num_bins = row_start.size - 1
    num_nodes = cap.size
    row_node, row_w = _sort_rows(row_start, row_node, row_w)
    node_of_bin = np.full(num_bins, -1, dtype=np.int64)
    wcur = np.zeros(num_bins, dtype=np.int64)  # W[b, node_of_bin[b]]
    member_start = np.zeros(num_nodes + 1, dtype=np.int64)
    for n in range(num_nodes):
        member_start[n + 1] = member_start[n] + cap[n]
    members = np.empty(num_bins, dtype=np.int64)
    count = np.zeros(num_nodes, dtype=np.int64)
    pos = np.zeros(num_bins, dtype=np.int64)
    # Node potentials (min-cost form: the reduced cost of bin b on node n is
    # W[b, m] + v[m] - W[b, n] - v[n] >= 0, m its node). They only decrease, and only on full
    # nodes: a node with room keeps v = 0 = max(v).
    v = np.zeros(num_nodes, dtype=np.int64)

    # Start: heaviest bins first, each to a node of its largest weight that has room. With v = 0
    # every placed bin is at a best node: dual feasible.
    best_w = np.zeros(num_bins, dtype=np.int64)
    for b in range(num_bins):
        if row_start[b + 1] > row_start[b]:
            best_w[b] = row_w[row_start[b]]
    # Heaviest bins first (ties: by id), each to one of its heaviest nodes with room: the one the
    # fewest bins still to come could take (a matching heuristic: use the node that is about to run
    # out of candidates; on interval-like instances, as LPT's round robin makes, it is exact),
    # ties: first in the row.
    order = decreasing(best_w)
    demand = np.zeros(num_nodes, dtype=np.int64)  # bins not yet placed with a best arc to the node
    for b in range(num_bins):
        for j in range(row_start[b], row_start[b + 1]):
            if row_w[j] < best_w[b]:
                break
            demand[row_node[j]] += 1
    queue = np.empty(num_bins, dtype=np.int64)
    num_free = 0
    for t in range(num_bins):
        b = order[t]
        n = -1
        for j in range(row_start[b], row_start[b + 1]):
            if row_w[j] < best_w[b]:
                break
            y = row_node[j]
            demand[y] -= 1
            if count[y] < cap[y] and (n < 0 or demand[y] < demand[n]):
                n = y
        if n >= 0:
            _move(b, -1, n, node_of_bin, members, member_start, count, pos)
            wcur[b] = best_w[b]
        else:
            queue[num_free] = b
            num_free += 1
    num_free = _price_rounds(queue, num_free, 4 * num_free, row_start, row_node, row_w, cap, v,
                             node_of_bin, wcur, members, member_start, count, pos)
    free = queue[:num_free]

    # The rest: one shortest augmenting path each. Bins are renumbered node by node first (free bins
    # last): the bins a search visits together, the members of a node, then have their rows next to
    # each other in memory.
    first_new = np.zeros(num_nodes + 1, dtype=np.int64)  # a counting sort by node (free bins last), by id
    for n in range(num_nodes):
        first_new[n + 1] = first_new[n] + count[n]
    old_of_new = np.empty(num_bins, dtype=np.int64)
    new_of_old = np.empty(num_bins, dtype=np.int64)
    for b in range(num_bins):
        n = node_of_bin[b] if node_of_bin[b] >= 0 else num_nodes
        new_of_old[b] = first_new[n]
        old_of_new[first_new[n]] = b
        first_new[n] += 1
    new_start = np.zeros(num_bins + 1, dtype=np.int64)
    for t in range(num_bins):
        b = old_of_new[t]
        new_start[t + 1] = new_start[t] + row_start[b + 1] - row_start[b]
    new_node = np.empty_like(row_node)
    new_w = np.empty_like(row_w)
    new_bin_node = np.full(num_bins, -1, dtype=np.int64)
    new_wcur = np.empty(num_bins, dtype=np.int64)
    away = np.zeros(num_bins, dtype=np.int64)  # W off a placed bin's node, at most: see _shortest_paths
    count[:] = 0
    for t in range(num_bins):
        b = old_of_new[t]
        lo = row_start[b]
        for j in range(row_start[b + 1] - lo):
            new_node[new_start[t] + j] = row_node[lo + j]
            new_w[new_start[t] + j] = row_w[lo + j]
        new_wcur[t] = wcur[b]
        if node_of_bin[b] >= 0:
            _move(t, -1, node_of_bin[b], new_bin_node, members, member_start, count, pos)
            away[t] = _away(t, node_of_bin[b], new_start, new_node, new_w)
    new_free = np.sort(new_of_old[free])
    num_free = _tight_paths(new_free, new_start, new_node, new_w, cap, v, new_bin_node, new_wcur, away, members,
                            member_start, count, pos)
    _shortest_paths(new_free[:num_free], new_start, new_node, new_w, cap, v, new_bin_node, new_wcur, away,
                    members, member_start, count, pos)
    return new_bin_node[new_of_old], v


@numba.njit(**_JIT)
def _weight_on(b, node, row_start, row_node, row_w):
    """Bin ``b``'s arc weight to ``node`` (0 without an arc)."""
    for j in range(row_start[b], row_start[b + 1]):
        if row_node[j] == node:
            return row_w[j]
    return np.int64(0)


@numba.njit(**_JIT)
def _queue_tight(b, val, tail, row_start, row_node, row_w, v, cap, count, seen, pred, pred_w, queue):
    """Queue the unseen nodes where bin ``b``'s arc is tight (weight + v = ``val``: a prefix of its row,
    rows by decreasing weight), recording ``b`` as who moves there. Returns (new tail, the first queued
    node with room, or -1)."""
    for j in range(row_start[b], row_start[b + 1]):
        w = row_w[j]
        if w < val:
            break
        y = row_node[j]
        if w + v[y] == val and not seen[y]:
            seen[y] = True
            pred[y], pred_w[y] = b, w
            queue[tail] = y
            tail += 1
            if count[y] < cap[y]:
                return tail, y
    return tail, np.int64(-1)


@numba.njit(**_JIT)
def _away(b, node, row_start, row_node, row_w):
    """Bin ``b``'s heaviest arc to a node other than ``node`` (0: none): the first such in its row."""
    for j in range(row_start[b], row_start[b + 1]):
        if row_node[j] != node:
            return row_w[j]
    return np.int64(0)


@numba.njit(**_JIT)
def _augment(end, pred, pred_w, node_of_bin, wcur, away, row_start, row_node, row_w, members, member_start, count,
             pos):
    """Walk an augmenting path back from ``end``, a node with room: ``pred[x]`` is the bin that moves
    into node x (with weight ``pred_w[x]`` there), each bin one node on, until a bin that was free."""
    x = end
    while True:
        b = pred[x]
        old = node_of_bin[b]
        _move(b, old, x, node_of_bin, members, member_start, count, pos)
        wcur[b] = pred_w[x]
        away[b] = _away(b, x, row_start, row_node, row_w)
        if old < 0:
            break
        x = old


@numba.njit(**_JIT)
def _tight_paths(free, row_start, row_node, row_w, cap, v, node_of_bin, wcur, away, members, member_start, count,
                 pos):
    """Place free bins along augmenting paths of zero reduced cost (each bin moved to another of
    its best nodes), found breadth first; potentials do not change. Returns how many bins are left,
    moved to the front of ``free`` (in order).

    Every placed bin is at a best node, and v <= 0 with v = 0 on nodes with room, so a bin at
    value ``val`` = W[b, its node] + v[its node] has its other best nodes among the arcs of weight
    >= val: a prefix of its row (rows by decreasing weight). If val = 0 it may also drop to any node
    with room. In a degenerate instance (many ties) this places most bins without a search.
    """
    num_nodes = cap.size
    seen = np.zeros(num_nodes, dtype=np.bool_)
    pred = np.empty(num_nodes, dtype=np.int64)  # bin that moves into the node
    pred_w = np.empty(num_nodes, dtype=np.int64)
    queue = np.empty(num_nodes, dtype=np.int64)
    first_room = 0
    left = 0
    for f in range(free.size):
        b0 = free[f]
        while first_room < num_nodes and count[first_room] >= cap[first_room]:
            first_room += 1
        # the free bin's best value (the hub: 0 on a node with room)
        val0 = np.int64(0)
        for j in range(row_start[b0], row_start[b0 + 1]):
            val0 = max(val0, row_w[j] + v[row_node[j]])
        end = -1
        head, tail = 0, 0
        if val0 == 0:
            end = first_room
            pred[end], pred_w[end] = b0, _weight_on(b0, end, row_start, row_node, row_w)
        else:
            tail, end = _queue_tight(b0, val0, tail, row_start, row_node, row_w, v, cap, count, seen, pred,
                                     pred_w, queue)
        while end < 0 and head < tail:
            x = queue[head]
            head += 1
            for k in range(member_start[x], member_start[x] + count[x]):
                b = members[k]
                val = wcur[b] + v[x]
                if val == 0 and first_room < num_nodes:
                    end = first_room
                    pred[end], pred_w[end] = b, _weight_on(b, end, row_start, row_node, row_w)
                    break
                tail, end = _queue_tight(b, val, tail, row_start, row_node, row_w, v, cap, count, seen, pred,
                                         pred_w, queue)
                if end >= 0:
                    break
        for t in range(tail):
            seen[queue[t]] = False
        if end < 0:
            free[left] = b0
            left += 1
            continue
        _augment(end, pred, pred_w, node_of_bin, wcur, away, row_start, row_node, row_w, members, member_start,
                 count, pos)
    return left


@numba.njit(**_JIT)
def _shortest_paths(free, row_start, row_node, row_w, cap, v, node_of_bin, wcur, away, members, member_start,
                    count, pos):
    """Place every bin of ``free``, one shortest augmenting path each (see :func:`transport`)."""
    num_nodes = cap.size
    # The rest: one shortest augmenting path each: Dijkstra over the full nodes, ending at a node
    # with room. Potentials only drop on full nodes, so every node with room has v = 0 = max(v):
    # moving a bin to a node where it has no bytes (the "hub") is cheapest into a node with room,
    # and the hub only matters there. Nodes with room are never queued: ``bound`` is their best
    # label (or the hub's), and the search ends once no queued label is below it. Only the labels of
    # settled nodes and of nodes with room reach the result (potentials, path), so a full node's
    # label at or over the bound (which never rises) is not even recorded.
    dist = np.full(num_nodes, _INF, dtype=np.int64)
    pred = np.full(num_nodes, -1, dtype=np.int64)
    pred_w = np.zeros(num_nodes, dtype=np.int64)
    finished = np.empty(num_nodes, dtype=np.int64)
    heap_key = np.empty(row_node.size + num_nodes + 1, dtype=np.int64)
    heap_node = np.empty(row_node.size + num_nodes + 1, dtype=np.int64)
    first_room = 0  # (nodes only fill up)
    for f in range(free.size):
        b0 = free[f]
        while count[first_room] >= cap[first_room]:
            first_room += 1
        # A bin's ``base`` = its distance + W[b, its node] + v[its node]; moving it to node x costs
        # base - W[b, x] - v[x] >= its distance (v <= 0: at least base - W[b, x], so a row, by
        # decreasing weight, is cut where that reaches the bound). The free bin's base is 0.
        hub, hub_bin = np.int64(0), b0
        room_d, room_n = _INF, -1  # best explicit label of a node with room
        size = 0
        for j in range(row_start[b0], row_start[b0 + 1]):
            x = row_node[j]
            cand = -row_w[j] - v[x]
            if count[x] < cap[x]:
                dist[x] = cand
                pred[x] = b0
                pred_w[x] = row_w[j]
                if cand < room_d or (cand == room_d and x < room_n):
                    room_d, room_n = cand, x
            elif cand < min(room_d, hub):
                dist[x] = cand
                pred[x] = b0
                pred_w[x] = row_w[j]
                _heap_push(heap_key, heap_node, size, cand, x)
                size += 1
        num_done = 0
        while True:
            bound = min(room_d, hub)
            x = -1
            while size > 0:
                k, y = heap_key[0], heap_node[0]
                if k != dist[y]:  # stale: the node was labelled lower since, or is done (its entry popped)
                    _heap_pop(heap_key, heap_node, size)
                    size -= 1
                    continue
                if k < bound:
                    _heap_pop(heap_key, heap_node, size)
                    size -= 1
                    x = y
                break
            if x < 0:
                break
            finished[num_done] = x
            num_done += 1
            d = dist[x]
            dv = d + v[x]
            for k in range(member_start[x], member_start[x] + count[x]):
                b = members[k]
                base = dv + wcur[b]
                if base < hub or (base == hub and b < hub_bin):
                    hub, hub_bin = base, b
                bound = min(room_d, hub)
                if base - away[b] >= bound:  # no arc off its own node (a step of cost 0 to a done node) counts
                    continue
                for j in range(row_start[b], row_start[b + 1]):
                    w = row_w[j]
                    if base - w >= bound:
                        break
                    y = row_node[j]
                    cand = base - w - v[y]
                    if cand >= dist[y]:  # (a done node's label is at most d, and cand at least d)
                        continue
                    if count[y] < cap[y]:
                        dist[y] = cand
                        pred[y] = b
                        pred_w[y] = w
                        if cand < room_d or (cand == room_d and y < room_n):
                            room_d, room_n = cand, y
                            bound = min(room_d, hub)
                    elif cand < bound:
                        dist[y] = cand
                        pred[y] = b
                        pred_w[y] = w
                        _heap_push(heap_key, heap_node, size, cand, y)
                        size += 1
        # End: the best node with room, by an explicit arc or through the hub (ties: explicit).
        if room_d <= hub:
            end, d_end = room_n, room_d
        else:
            end, d_end = first_room, hub
            dist[end], pred[end], pred_w[end] = hub, hub_bin, 0
        for t in range(num_done):
            x = finished[t]
            v[x] += dist[x] - d_end
        _augment(end, pred, pred_w, node_of_bin, wcur, away, row_start, row_node, row_w, members, member_start,
                 count, pos)
        dist[:] = _INF


@numba.njit(**_JIT)
def dual_gap(row_start, row_node, row_w, cap, node_of_bin, v):
    """Dual bound minus primal weight of a bins -> nodes assignment under node potentials ``v``
    (0: the assignment is optimal; > 0: not proven). -1 if the assignment breaks a capacity."""
    num_bins = row_start.size - 1
    num_nodes = cap.size
    count = np.zeros(num_nodes, dtype=np.int64)
    for b in range(num_bins):
        if node_of_bin[b] < 0 or node_of_bin[b] >= num_nodes:
            return np.int64(-1)
        count[node_of_bin[b]] += 1
    for n in range(num_nodes):
        if count[n] != cap[n]:
            return np.int64(-1)
    v_max = -_INF
    for n in range(num_nodes):
        v_max = max(v_max, v[n])
    primal = np.int64(0)
    dual = np.int64(0)
    for b in range(num_bins):
        best = v_max  # W[b, n] + v[n] maximised; 0 off the listed nodes
        for j in range(row_start[b], row_start[b + 1]):
            x = row_node[j]
            best = max(best, row_w[j] + v[x])
            if x == node_of_bin[b]:
                primal += row_w[j]
        dual += best  # = -u[b]
    for n in range(num_nodes):
        dual -= cap[n] * v[n]
    return dual - primal


# ---------------------------------------------------------------------------------------------
# Bins -> GPUs inside each node.
# ---------------------------------------------------------------------------------------------

@numba.njit(**_JIT)
def _hungarian_max(weight, size, out):
    """Max-weight perfect assignment of a ``size`` x ``size`` int64 matrix; ``out[row] = column``.

    The classic O(size^3) shortest-augmenting-path form with row and column potentials (1-based
    internally; cost = -weight)."""
    u = np.zeros(size + 1, dtype=np.int64)
    p = np.zeros(size + 1, dtype=np.int64)
    way = np.zeros(size + 1, dtype=np.int64)
    col_row = np.zeros(size + 1, dtype=np.int64)  # row matched to column j (0: none)
    minv = np.empty(size + 1, dtype=np.int64)
    used = np.empty(size + 1, dtype=np.bool_)
    for i in range(1, size + 1):
        col_row[0] = i
        j0 = 0
        minv[:] = _INF
        used[:] = False
        while True:
            used[j0] = True
            i0 = col_row[j0]
            delta = _INF
            j1 = -1
            for j in range(1, size + 1):
                if not used[j]:
                    cur = -weight[i0 - 1, j - 1] - u[i0] - p[j]
                    if cur < minv[j]:
                        minv[j] = cur
                        way[j] = j0
                    if minv[j] < delta:
                        delta = minv[j]
                        j1 = j
            for j in range(size + 1):
                if used[j]:
                    u[col_row[j]] += delta
                    p[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if col_row[j0] == 0:
                break
        while True:
            j1 = way[j0]
            col_row[j0] = col_row[j1]
            j0 = j1
            if j0 == 0:
                break
    for j in range(1, size + 1):
        out[col_row[j] - 1] = j - 1


@numba.njit(**_JIT)
def assign_in_nodes(traffic_bin, traffic_rank, traffic_bytes, node_of_bin, node_of_rank, num_nodes):
    """Rank of every bin: inside each node, the assignment of its bins to its ranks that maximises
    the bytes each bin pulls from its own rank. Bins of a node in ascending id, ranks ascending."""
    num_bins = node_of_bin.size
    # Local index of every bin and rank inside its node.
    size = np.zeros(num_nodes, dtype=np.int64)
    local_bin = np.empty(num_bins, dtype=np.int64)
    for b in range(num_bins):
        n = node_of_bin[b]
        local_bin[b] = size[n]
        size[n] += 1
    rank_size = np.zeros(num_nodes, dtype=np.int64)
    local_rank = np.empty(node_of_rank.size, dtype=np.int64)
    for r in range(node_of_rank.size):
        n = node_of_rank[r]
        local_rank[r] = rank_size[n]
        rank_size[n] += 1
    start = np.zeros(num_nodes + 1, dtype=np.int64)
    for n in range(num_nodes):
        start[n + 1] = start[n] + size[n] * size[n]
    weight = np.zeros(start[num_nodes], dtype=np.int64)
    for t in range(traffic_bin.size):
        b, r = traffic_bin[t], traffic_rank[t]
        n = node_of_bin[b]
        if node_of_rank[r] == n:
            weight[start[n] + local_bin[b] * size[n] + local_rank[r]] += traffic_bytes[t]
    ranks = np.empty(node_of_rank.size, dtype=np.int64)  # ranks of each node, ascending
    rank_start = np.zeros(num_nodes + 1, dtype=np.int64)
    for n in range(num_nodes):
        rank_start[n + 1] = rank_start[n] + rank_size[n]
    for r in range(node_of_rank.size):
        n = node_of_rank[r]
        ranks[rank_start[n] + local_rank[r]] = r
    bins = np.empty(num_bins, dtype=np.int64)
    for b in range(num_bins):
        n = node_of_bin[b]
        bins[rank_start[n] + local_bin[b]] = b
    rank_of_bin = np.empty(num_bins, dtype=np.int64)
    out = np.empty(num_bins, dtype=np.int64)
    for n in range(num_nodes):
        g = size[n]
        block = weight[start[n]:start[n + 1]].reshape((g, g))
        _hungarian_max(block, g, out)
        for i in range(g):
            rank_of_bin[bins[rank_start[n] + i]] = ranks[rank_start[n] + out[i]]
    return rank_of_bin
