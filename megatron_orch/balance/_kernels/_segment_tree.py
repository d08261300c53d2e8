"""Segment trees: over bins (least load, most memory room: first fit and least-loaded search in log time), and a
max tree (the last leaf above a threshold in log time: the refinement's slack of items)."""
import numba
import numpy as np

from megatron_orch.balance._jit import _INLINE, _JIT


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
# Max tree: leaf u at width + u, each node the maximum of its two children (built by its user).
# ---------------------------------------------------------------------------------------------

@numba.njit(**_INLINE)
def _tree_set_max(tree, width, leaf, value):
    v = width + leaf
    tree[v] = value
    v //= 2
    while v >= 1:
        tree[v] = max(tree[2 * v], tree[2 * v + 1])
        v //= 2


@numba.njit(**_INLINE)
def _tree_last_above(tree, width, lo, hi, threshold):
    """Last leaf in [lo, hi] of a max tree whose value exceeds ``threshold``, or -1: the subtrees left of leaf hi,
    nearest first (a node's range is examined once its value is known not to exceed)."""
    if lo > hi:
        return -1
    v = width + hi
    while tree[v] <= threshold:
        while v % 2 == 0:  # a left child: what lies left of it lies left of its parent
            v //= 2
        if v == 1:
            return -1
        v -= 1
    while v < width:
        v = 2 * v + 1 if tree[2 * v + 1] > threshold else 2 * v
    return v - width if v - width >= lo else -1
