"""Items by decreasing cost, ties by increasing id (the order every construction takes them in), and bins by
increasing load, ties by increasing id (the order the swap sweeps and the refinement pair them in)."""
import numba
import numpy as np

from megatron_orch.balance._jit import _INLINE, _JIT

_DIGIT_BITS = 14  # a counting pass per 14 bits (16,384 counters): 4 cover the 56 a backbone's costs differ in
_RADIX_FROM = 2048  # fewer values are sorted by numba's merge sort (a radix pass costs its 16,384 counters)
_INSERTION_UP_TO = 32  # and at most this many by insertion (~4x less CPU than the merge sort at 16: a step
# partitions every rank's examples into its micro-batches, thousands of sorts of ~16 values)


@numba.njit(**_JIT)
def _by_insertion(values, descending):
    """Ids by increasing value (``descending``: by decreasing value), ties by increasing id: a stable insertion
    sort, for a few values."""
    ids = np.arange(values.size)
    for u in range(1, values.size):
        x = values[u]
        v = u
        while v > 0 and (values[ids[v - 1]] < x if descending else values[ids[v - 1]] > x):
            ids[v] = ids[v - 1]
            v -= 1
        ids[v] = u
    return ids


@numba.njit(**_JIT)
def _radix_order(key, span):
    """Ids ``0..n-1`` by increasing ``key`` (int64, ``0 <= key <= span``), ties by increasing id: a stable LSD
    radix sort, one counting pass per 14 bits of the span."""
    n = key.size
    ids = np.arange(n)
    digits = 1 << _DIGIT_BITS
    mask = digits - 1
    other_key = np.empty(n, dtype=np.int64)
    other_ids = np.empty(n, dtype=np.int64)
    count = np.empty(digits + 1, dtype=np.int64)
    shift = 0
    while shift < 63 and span >> shift:  # (a shift of 64 or more is undefined: bits are 63 at most)
        count[:] = 0
        for t in range(n):
            count[((key[t] >> shift) & mask) + 1] += 1
        for d in range(digits):
            count[d + 1] += count[d]
        for t in range(n):
            d = (key[t] >> shift) & mask
            other_key[count[d]] = key[t]
            other_ids[count[d]] = ids[t]
            count[d] += 1
        key, other_key = other_key, key
        ids, other_ids = other_ids, ids
        shift += _DIGIT_BITS
    return ids


@numba.njit(**_INLINE)
def _sorted_ids(values, descending):
    """Ids by increasing value (``descending``: decreasing), ties by increasing id, for finite values >= 0, whose
    bits order as the numbers do: from :data:`_RADIX_FROM` values a radix sort of their bits' distance from the
    first value's, below by numba's merge sort or insertion."""
    if values.size <= _INSERTION_UP_TO:
        return _by_insertion(values, descending)
    if values.size < _RADIX_FROM:
        return np.argsort(-values if descending else values, kind="mergesort")
    bits = (values + 0.0).view(np.int64)  # (+ 0.0: -0.0 becomes 0.0)
    top, bottom = bits.max(), bits.min()
    return _radix_order(top - bits if descending else bits - bottom, top - bottom)


@numba.njit(**_JIT)
def decreasing(costs):
    """Item ids by decreasing cost, ties by increasing id (``np.argsort(-costs, kind="stable")``) for finite costs
    >= 0 (the radix sort: 4 counting passes at a step's backbone, ~2.5x less CPU than numpy's stable argsort)."""
    return _sorted_ids(costs, True)


@numba.njit(**_JIT)
def increasing(values):
    """Ids by increasing value, ties by increasing id (``np.argsort(values, kind="stable")``) for finite values
    >= 0 (bins' loads; the radix sort: ~2x less CPU than numba's merge sort at 10,240 bins, run at every swap
    sweep)."""
    return _sorted_ids(values, False)
