"""Partitions that keep items at home (equal items to quotas, LPT near home): the fewest bytes moved."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._kernels._segment_tree import _tree_least_loaded, _tree_new, _tree_set


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
    memory room if that does, else to the least-loaded rank anywhere with memory room (LPT's own choice;
    ties: the lower rank). Rank r is on node r // gpus_per_node. A rank keeps its largest items; what leaves
    goes first to its node; the last, smallest items even the ranks out as LPT does (with ``target`` = the mean,
    the max ends within about an item of it). Returns -1, or an item no rank has memory room for.

    A node's ranks are read directly (a few loads side by side); the segment tree over all ranks, needed only
    when the node has no room, takes the ranks whose loads changed since it was last read just before it is
    read (a tree's nodes are the min / max of its leaves: the same tree as updated at every item, ~half the
    CPU at DP 10240)."""
    load = np.zeros(num_bins)
    bin_mem = np.zeros(num_bins)
    tree_load, tree_room, width = _tree_new(load, np.full(num_bins, memory_cap))
    changed = np.zeros(num_bins, dtype=np.bool_)  # loads not yet in the tree, listed in ``changed_ranks``
    changed_ranks = np.empty(num_bins, dtype=np.int64)
    num_changed = 0
    for item in order:
        c, m = costs[item], memory[item]
        r = home[item]
        if load[r] + c > target or bin_mem[r] + m > memory_cap:
            lo = (r // gpus_per_node) * gpus_per_node
            r = -1
            for b in range(lo, min(num_bins, lo + gpus_per_node)):
                if memory_cap - bin_mem[b] >= m and (r < 0 or load[b] < load[r]):
                    r = b
            if r < 0 or load[r] + c > target:
                for k in range(num_changed):
                    b = changed_ranks[k]
                    _tree_set(tree_load, tree_room, width, b, load[b], memory_cap - bin_mem[b])
                    changed[b] = False
                num_changed = 0
                g = _tree_least_loaded(tree_load, tree_room, width, 0, num_bins, m)
                if g < 0:
                    return item
                if r < 0 or load[g] < load[r]:
                    r = g
        bin_of_item[item] = r
        load[r] += c
        bin_mem[r] += m
        if not changed[r]:
            changed[r] = True
            changed_ranks[num_changed] = r
            num_changed += 1
    return -1
