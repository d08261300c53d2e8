"""Binary min-heap over (key, id) pairs in numba: the least-loaded bin first for LPT and Karmarkar-Karp."""
import numba

from megatron_orch.balance._jit import _JIT


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
