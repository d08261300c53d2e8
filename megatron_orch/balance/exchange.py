"""Fewer peers at the same balance: items that are alike (equal cost, bytes and memory: many examples share a
length, many images a resolution) exchanged between bins so that each bin draws from fewer source ranks.

A partition fixes what each bin holds; which of several alike items a bin gets does not change its cost, bytes or
memory, but it does change which ranks it pulls from (the all-to-all's peers: each connected pair keeps its buffers
for the communicator's life). :func:`exchange_alike` re-deals the places of every class of alike items between
them, so every bin's multiset of items, and with it the balance, are the plan's by construction: first each item
whose source rank is one of the places' bins takes that place (an item at home stays home, and more may come
home), then each item whose source's node holds one of the places takes it (no more items of a class cross nodes
than in the plan: the most that can stay on their node do), then the others; each time sources in (node, rank)
order to places in (node, rank) order, so a source's items of a class go to few, neighbouring bins, and the
classes pair the same ranks.
"""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT
from megatron_orch.balance._plan_kernels import stably_by



def classes_of(*columns) -> np.ndarray:
    """Class id of every item (0..k-1, by first appearance): items whose values are equal in every column (numbers;
    floats compared by their bits, which never joins unequal values) share one. One hashing pass, no sort."""
    if not columns:
        raise ValueError("classes_of: no columns")
    rows = np.empty((len(columns), np.asarray(columns[0]).size), dtype=np.int64)
    for row, column in zip(rows, columns):
        column = np.asarray(column)
        if np.issubdtype(column.dtype, np.floating):
            column = column.astype(np.float64, copy=False).view(np.int64)
        row[:] = column
    return _class_ids(rows)


@numba.njit(**_JIT)
def _class_ids(rows):
    """Dense ids of the distinct columns of ``rows`` (open addressing on a hash of each column)."""
    width, n = rows.shape
    size = 1
    while size < 2 * n:
        size *= 2
    first = np.full(size, -1, dtype=np.int64)  # the first item of each occupied slot's class
    ids = np.empty(n, dtype=np.int64)
    count = 0
    for i in range(n):
        h = np.uint64(1469598103934665603)
        for c in range(width):
            h = (h ^ np.uint64(rows[c, i])) * np.uint64(1099511628211)
        h = (h ^ (h >> np.uint64(33))) * np.uint64(0xFF51AFD7ED558CCD)  # every bit reaches the slot's
        h = h ^ (h >> np.uint64(33))
        slot = np.int64(h & np.uint64(size - 1))
        while True:
            j = first[slot]
            if j < 0:
                first[slot] = i
                ids[i] = count
                count += 1
                break
            same = True
            for c in range(width):
                if rows[c, j] != rows[c, i]:
                    same = False
                    break
            if same:
                ids[i] = ids[j]
                break
            slot = (slot + 1) & (size - 1)
    return ids


def exchange_alike(bin_of_item, source_of_item, class_of_item, node_of_rank) -> np.ndarray:
    """``taken``: item i takes the place of item ``taken[i]`` (its bin, and whatever else the caller keeps per
    place: a micro-batch), a permutation within each class of the items (ids 0..k-1), so ``bin_of_item[taken]``
    gives every bin the same multiset of classes (module docstring). Per class, no fewer items stay home, and no
    more cross nodes."""
    bins = np.ascontiguousarray(bin_of_item, dtype=np.int64)
    sources = np.ascontiguousarray(source_of_item, dtype=np.int64)
    classes = np.ascontiguousarray(class_of_item, dtype=np.int64)
    node = np.ascontiguousarray(node_of_rank, dtype=np.int64)
    if not bins.size == sources.size == classes.size:
        raise ValueError(f"exchange_alike: {bins.size} bins, {sources.size} sources and {classes.size} classes "
                         "of items")
    if bins.size == 0:
        return np.zeros(0, dtype=np.int64)
    num_ranks = node.size
    for name, values, top in (("bin", bins, num_ranks), ("source", sources, num_ranks),
                              ("class", classes, bins.size)):
        if values.min() < 0 or values.max() >= top:
            raise ValueError(f"exchange_alike: a {name} outside 0..{top - 1}")
    position = np.empty(num_ranks, dtype=np.int64)  # a rank's place in (node, rank) order
    position[np.argsort(node, kind="stable")] = np.arange(num_ranks)
    source_at, bin_at = position[sources], position[bins]
    by_source = _by_class_then(classes, source_at, num_ranks)
    by_bin = _by_class_then(classes, bin_at, num_ranks)
    return _deal(by_source, by_bin, source_at, bin_at, node[np.argsort(position)], classes)


@numba.njit(**_JIT)
def _by_class_then(classes, at, num_ranks):
    """Item ids by class, then by ``at`` (0..num_ranks-1), then by id: two counting passes (one where the ids are in
    ``at`` order already, as a batch's examples are by their loading rank)."""
    order = np.arange(at.size)
    for i in range(1, at.size):
        if at[i] < at[i - 1]:
            order = stably_by(at, order, num_ranks)
            break
    return stably_by(classes, order, classes.size)


@numba.njit(**_JIT)
def _deal(by_source, by_bin, source_at, bin_at, node_at, classes):
    """Per class (the same runs in both orders, each by (node, rank) position): the items whose source is a place's
    bin take it, then those on a place's node, then the rest, each time in order."""
    n = by_source.size
    source = source_at[by_source]  # in the orders
    place = bin_at[by_bin]
    source_node, place_node = node_at[source], node_at[place]
    cls = classes[by_source]
    dealt = np.full(n, -1, dtype=np.int64)  # by position in by_source: the position in by_bin it takes
    placed = np.zeros(n, dtype=np.bool_)  # by position in by_bin
    start = 0
    while start < n:
        end = start + 1
        while end < n and cls[end] == cls[start]:
            end += 1
        for keys, places in ((source, place), (source_node, place_node)):  # the same rank, then the same node
            i, j = start, start
            while i < end and j < end:
                if dealt[i] >= 0:
                    i += 1
                elif placed[j]:
                    j += 1
                elif keys[i] == places[j]:
                    dealt[i] = j
                    placed[j] = True
                    i += 1
                    j += 1
                elif keys[i] < places[j]:
                    i += 1
                else:
                    j += 1
        j = start
        for i in range(start, end):
            if dealt[i] >= 0:
                continue
            while placed[j]:
                j += 1
            dealt[i] = j
            placed[j] = True
        start = end
    taken = np.empty(n, dtype=np.int64)
    for i in range(n):
        taken[by_source[i]] = by_bin[dealt[i]]
    return taken
