"""The refinement's shortcuts (``_kernels.local_search``) against plain Python: the per-bin cache of items by
cost is what a fresh sort gives after any exchange, and the partner bound never skips an exchange that would beat
the best found. Both keep ``refine``'s plans as they were; the plans' own tests judge their quality."""
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_orch.balance._kernels import local_search


def _linked(bins, num_bins):
    """refine's per-bin lists: ``head[b]`` the last item placed in b, ``nxt`` the one before it."""
    head = np.full(num_bins, -1, dtype=np.int64)
    nxt = np.full(len(bins), -1, dtype=np.int64)
    for i, b in enumerate(bins):
        nxt[i] = head[b]
        head[b] = i
    return head, nxt


def _by_cost(costs, bins, b):
    return sorted((i for i, x in enumerate(bins) if x == b), key=lambda i: (costs[i], i))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 39), st.integers(0, 3)), max_size=8), st.integers(2, 12))
def test_cached_items_by_cost_are_a_fresh_sort_after_every_move(items, moves, width):
    """Costs with ties (the cache must keep (cost, id) order); bins holding more than ``width`` items are gathered
    every time, never cached; a moved item's two bins are gathered again, every other bin read from the cache."""
    costs = np.array([float(c) for c, _ in items])
    bins = [b for _, b in items]
    num_bins = 4
    cache = np.empty(num_bins * width, dtype=np.int64)
    cached = np.full(num_bins, -1, dtype=np.int64)
    out = np.empty(len(bins), dtype=np.int64)
    for item, to in [(None, None)] + moves:
        if item is not None and item < len(bins):
            cached[bins[item]] = cached[to] = -1  # what refine does for the two bins of an exchange
            bins[item] = to
        head, nxt = _linked(bins, num_bins)
        for _ in range(2):  # filled, then read back
            for b in range(num_bins):
                m = local_search._sorted_items(head, nxt, costs, b, out, cache, cached, width)
                assert out[:m].tolist() == _by_cost(costs, bins, b)
                assert cached[b] == (m if m <= width else -1)


@settings(max_examples=300, deadline=None)
@given(st.floats(1.0, 1e17), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_the_partner_bound_skips_no_exchange_that_beats_the_best(top_load, partner_share, share_moved):
    """Any net cost d moved from the top bin to a lighter one gives max(L - d, Lb + d) (as the kernels compute it,
    in floats); a best just above that value must not be declared out of reach."""
    partner_load = top_load * partner_share
    d = (top_load - partner_load) * share_moved
    value = max(top_load - d, partner_load + d)
    assert not local_search._cannot_beat(top_load, partner_load, math.nextafter(value, math.inf))
    assert local_search._cannot_beat(top_load, partner_load, 0.5 * (top_load + partner_load) * (1 - 1e-9))


def _fresh_pairs(costs, items):
    """Every pair of ``items`` (by cost) by increasing sum, ties in the order found."""
    pairs = [(costs[a] + costs[b], a, b) for u, a in enumerate(items) for b in items[u + 1:]]
    return [p for _, p in sorted(enumerate(pairs), key=lambda t: (t[1][0], t[0]))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 39), st.integers(0, 3)), max_size=8))
def test_cached_pair_sums_are_a_fresh_sort_after_every_move(items, moves):
    """The locality refinements' per-bin pairs by sum (ties: the pair found first) read back after any exchange
    are those of the bin's items then; a moved item's two bins are built again, every other bin read back."""
    costs = np.array([float(c) for c, _ in items])
    bins = [b for _, b in items]
    num_bins, width = 4, 40
    rows = width * (width - 1) // 2
    pair_cache = (np.empty((num_bins, rows)), np.empty((num_bins, rows), dtype=np.int64),
                  np.empty((num_bins, rows), dtype=np.int64))
    pair_cached = np.full(num_bins, -1, dtype=np.int64)
    for item, to in [(None, None)] + moves:
        if item is not None and item < len(bins):
            pair_cached[bins[item]] = pair_cached[to] = -1  # what refine does for the two bins of an exchange
            bins[item] = to
        for _ in range(2):  # built, then read back
            for b in range(num_bins):
                members = np.array(_by_cost(costs, bins, b), dtype=np.int64)
                (sums, first, second), m = local_search._cached_pair_sums(costs, members, members.size, b,
                                                                          pair_cache, pair_cached)
                assert list(zip(sums[:m].tolist(), first[:m].tolist(), second[:m].tolist())) == \
                    _fresh_pairs(costs, members.tolist())
                assert pair_cached[b] == m
