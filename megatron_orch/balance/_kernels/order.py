"""Items by decreasing cost, ties by increasing id: the order every construction takes them in."""
import numba
import numpy as np

from megatron_orch.balance._jit import _JIT

_DIGIT_BITS = 14  # a counting pass per 14 bits (16,384 counters): 4 cover the 56 a backbone's costs differ in


@numba.njit(**_JIT)
def decreasing(costs):
    """Item ids by decreasing cost, ties by increasing id (``np.argsort(-costs, kind="stable")``) for finite costs
    >= 0, whose bits order as the numbers do: a stable LSD radix sort of (largest bits - bits), one counting pass per
    14 bits in which the costs differ (4 at a step's backbone: ~2.5x less CPU than numpy's stable argsort)."""
    n = costs.size
    bits = (costs + 0.0).view(np.int64)  # (+ 0.0: -0.0 becomes 0.0)
    ids = np.arange(n)
    if n < 2:
        return ids
    top, bottom = bits.max(), bits.min()
    key = top - bits
    span = top - bottom
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
