"""Segment tree over bins (least load, most memory room): first fit and least-loaded search in log time."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT


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
