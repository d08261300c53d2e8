"""The refinement's shortcuts (``_kernels.local_search``) against plain Python: the per-bin cache of items by
cost is what a fresh sort gives after any exchange, the partner bound never skips an exchange that would beat
the best found, and the trade with the batch's cheapest items skips only items that cannot beat it (the reference
tries each). They keep ``refine``'s plans as they were; the plans' own tests judge their quality."""
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from cheapest_swap_reference import cheapest_swap_reference
from pair_swap_reference import pair_swap_reference
from refine_reference import refine_reference

from megatron_orch.balance._kernels import _segment_tree, local_search


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


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 1)), min_size=2 * 33, max_size=160))
def test_a_bin_gathered_by_cost_is_sorted_by_cost_then_id(items):
    """Two bins of 66 to 160 items with ties (one above ``_INSERTION_ITEMS``, sorted with Shell's gaps, the other
    maybe below, by insertion): (cost, id) order either way."""
    costs = np.array([float(c) for c, _ in items])
    bins = [b for _, b in items]
    head, nxt = _linked(bins, 2)
    out = np.empty(len(bins), dtype=np.int64)
    for b in range(2):
        m = local_search._gather_sorted(head, nxt, costs, b, out)
        assert out[:m].tolist() == _by_cost(costs, bins, b)


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


def _drawn_search(data, num_bins, largest, scale, memory_room, max_items):
    """A refinement step's inputs drawn by hypothesis: items (costs with ties at ``scale``, bins, memory), the memory
    cap, the bins' loads and memory, the most-loaded bin and its items by cost, the items by decreasing cost, and a
    ``best`` at or below the top load."""
    items = data.draw(st.lists(st.tuples(st.integers(1, largest), st.integers(0, num_bins - 1), st.integers(0, 3)),
                               min_size=2, max_size=max_items))
    costs = np.array([float(c) for c, _, _ in items]) * scale
    bins = np.array([b for _, b, _ in items], dtype=np.int64)
    memory = np.array([float(m) for _, _, m in items])
    memory_cap = memory_room * costs.size / num_bins + 2.0
    load = np.bincount(bins, weights=costs, minlength=num_bins)
    bin_mem = np.bincount(bins, weights=memory, minlength=num_bins)
    top = int(np.argmax(load))
    top_items = np.array(_by_cost(costs, bins.tolist(), top), dtype=np.int64)
    order = np.argsort(-costs, kind="stable")
    best = load[top] - data.draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])) * (load[top] - load.min())
    return costs, bins, memory, memory_cap, load, bin_mem, top, top_items, order, best


@settings(max_examples=400, deadline=None)
@given(st.data(), st.integers(2, 12), st.sampled_from([5, 12, 40, 200]), st.sampled_from([1.0, 1e15]),
       st.sampled_from([math.inf, 1.0, 3.0]))
def test_cheapest_swap_is_trying_every_cheapest_item_in_turn(data, num_bins, largest, scale, memory_room):
    """Costs with ties (the scan order and the choices among equal values matter) or fewer ties, at a step
    backbone's scale (1e15) or a small one (the skips' margins hold), any bin the most loaded, ``best`` at or below
    its load, a floor anywhere between the mean and the top (or none), memory that binds or not, the tree built from
    any position at or before the scan's start: the same swap as the reference's item-by-item scan."""
    costs, bins, memory, memory_cap, load, bin_mem, top, top_items, order, best = _drawn_search(
        data, num_bins, largest, scale, memory_room, max_items=100)
    floor_at = data.draw(st.sampled_from([None, 0.0, 0.5, 1.0]))
    floor = -math.inf if floor_at is None else floor_at * load[top] + (1.0 - floor_at) * load.mean()
    scan = data.draw(st.integers(1, costs.size + 2))
    expected = cheapest_swap_reference(costs, memory, memory_cap, load, bin_mem, bins, top, top_items.tolist(),
                                       order.tolist(), scan, best, floor)
    start = local_search._scan_start(costs, order, top_items, top_items.size, scan)
    slack_lo = max(0, start - data.draw(st.integers(0, 4)))
    slack, width, leaf = local_search._slack_tree(costs, load, bins, order, slack_lo)
    out, into = np.full(1, -1, dtype=np.int64), np.full(1, -1, dtype=np.int64)
    value, found = local_search._cheapest_swap(costs, memory, memory_cap, load, bin_mem, bins, top, top_items,
                                               top_items.size, order, start, slack, width, slack_lo, best, out, into,
                                               floor)
    assert (value, found) == expected[:2]
    if found >= 0:
        assert (out[0], into[0]) == expected[2:]


@settings(max_examples=300, deadline=None)
@given(st.data(), st.integers(2, 10), st.sampled_from([5, 40, 200]), st.sampled_from([1.0, 1e15]),
       st.sampled_from([math.inf, 1.0, 3.0]))
def test_marked_bins_hold_every_swap_and_move_that_beats_the_best(data, num_bins, largest, scale, memory_room):
    """The widest searches try only the bins ``_mark_takers`` marks (for swaps) and those ``_first_shed`` leaves room
    for (moves): every bin where the one-for-one exchanges (``_exchange_with``, kind 0) beat ``best`` is among them,
    whatever the cap on the swapped items' cost, the memory, the floor."""
    costs, bins, memory, memory_cap, load, bin_mem, top, top_items, order, best = _drawn_search(
        data, num_bins, largest, scale, memory_room, max_items=80)
    floor_at = data.draw(st.sampled_from([None, 0.5, 1.0]))
    floor = -math.inf if floor_at is None else floor_at * load[top] + (1.0 - floor_at) * load.mean()
    cap = data.draw(st.sampled_from([math.inf, 0.0, 3.0, 10.0])) * scale
    marks = np.zeros(num_bins, dtype=np.int64)
    local_search._mark_takers(costs, order, bins, top_items, top_items.size, load[top], best, cap,
                              local_search._slack_tree(costs, load, bins, order, 0), marks, 1)
    shed = local_search._first_shed(costs, top_items, top_items.size, load[top], best)
    scratch = [np.empty(costs.size, dtype=np.int64) for _ in range(3)]
    for b in range(num_bins):
        partner_items = np.array(_by_cost(costs, bins.tolist(), b), dtype=np.int64)
        if b == top or not partner_items.size:
            continue
        for allow_moves, swap_cap in ((False, cap), (True, -1.0)):  # swaps alone, then moves alone
            _, found, _ = local_search._exchange_with(costs, memory, memory_cap, load, bin_mem, top, b, top_items,
                                                      top_items.size, partner_items, partner_items.size, 0,
                                                      allow_moves, swap_cap, *scratch[:1], best, *scratch[1:], floor)
            if found >= 0 and allow_moves:
                assert shed < top_items.size and load[b] + costs[top_items[shed]] < best
            elif found >= 0:
                assert marks[b] == 1


@settings(max_examples=600, deadline=None)
@given(st.data(), st.sampled_from([5, 30]), st.sampled_from([1.0, 1e15]), st.sampled_from([math.inf, 1.0, 3.0]))
def test_pair_swap_is_searching_the_partner_pairs_afresh(data, largest, scale, memory_room):
    """Few or many pairs on either side (the partner's searched on from the last found: a bin of two items against
    one of 32), sums with ties, any gap (none too), memory that binds or not, a floor or none: the swap the
    reference's binary search for every top pair finds, with all the top bin's pairs or its distinct ones."""
    top_costs = data.draw(st.lists(st.integers(1, largest), min_size=2, max_size=12))
    partner_costs = data.draw(st.lists(st.integers(1, largest), min_size=2, max_size=32))
    costs = np.array([float(c) for c in top_costs + partner_costs]) * scale
    memory = np.array(data.draw(st.lists(st.integers(0, 3), min_size=costs.size, max_size=costs.size)), dtype=float)
    items = np.arange(costs.size, dtype=np.int64)
    pairs = []
    for members in (items[:len(top_costs)], items[len(top_costs):]):
        members = np.array(sorted(members.tolist(), key=lambda i: (costs[i], i)), dtype=np.int64)
        rows = members.size * (members.size - 1) // 2
        row = (np.empty(rows), np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64))
        pairs.append((row, local_search._pair_sums(costs, members, members.size, *row)))
    (top_pairs, num_top), (partner_pairs, num_partner) = pairs
    load = np.array([costs[:len(top_costs)].sum(), costs[len(top_costs):].sum()])
    load[0] += data.draw(st.integers(0, 40)) * scale
    bin_mem = np.array([memory[:len(top_costs)].sum(), memory[len(top_costs):].sum()])
    memory_cap = memory_room * (bin_mem.max() + 1.0)
    best = load[0] - data.draw(st.sampled_from([0.0, 0.0, 0.2])) * abs(load[0] - load[1])
    floor = data.draw(st.sampled_from([-math.inf, 0.5 * (load[0] + load[1])]))
    expected = pair_swap_reference(memory, memory_cap, load, bin_mem, 0, 1, best,
                                   list(zip(*(a[:num_top].tolist() for a in top_pairs))),
                                   list(zip(*(a[:num_partner].tolist() for a in partner_pairs))), floor)
    distinct = tuple(a.copy() for a in top_pairs)  # (the refinement's top pairs: a run of equal ones kept once)
    num_distinct = local_search._distinct_pairs(memory, *distinct, num_top)
    for pairs, count in ((top_pairs, num_top), (distinct, num_distinct)):
        out, into = np.full(2, -1, dtype=np.int64), np.full(2, -1, dtype=np.int64)
        value, found = local_search._pair_swap(costs, memory, memory_cap, load, bin_mem, 0, 1, best, out, into,
                                               pairs, count, partner_pairs, num_partner, floor)
        assert (value, found) == expected[:2]
        if found >= 0:
            assert (tuple(out), tuple(into)) == expected[2:]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=2, max_size=32), st.lists(st.integers(2, 60), max_size=8),
       st.integers(0, 12), st.sampled_from([1.0, 1e15, 0.1]))
def test_pair_within_is_whether_any_pair_differs_by_less_than_the_gap(partner_costs, top_sums, gap, scale):
    """Sums with ties (a difference of 0 does not count), a gap of 0 too, float scales: whether some pair of the
    partner's items sums to s with 0 < t - s < gap for a top sum t, as every pair tried in turn says."""
    costs = np.array(sorted(partner_costs), dtype=float) * scale
    items = np.arange(costs.size, dtype=np.int64)
    sums = np.array(sorted(set(top_sums)), dtype=float) * scale
    expected = any(0.0 < t - (costs[u] + costs[v]) < gap * scale for t in sums
                   for u in range(costs.size) for v in range(u + 1, costs.size))
    near = np.empty(costs.size)
    assert local_search._pair_within(costs, items, costs.size, sums, sums.size, gap * scale, near) == expected


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=40), st.data())
def test_tree_last_above_is_the_last_leaf_above_the_threshold(values, data):
    lo = data.draw(st.integers(0, len(values) - 1))
    hi = data.draw(st.integers(lo - 1, len(values) - 1))
    threshold = data.draw(st.integers(-6, 5)) + 0.5
    keys = np.array(values, dtype=np.float64)
    order = np.arange(keys.size)
    slack, width, leaf = local_search._slack_tree(keys, np.zeros(1), np.zeros(keys.size, dtype=np.int64), order, 0)
    assert leaf.tolist() == list(range(keys.size))
    expected = max((u for u in range(lo, hi + 1) if values[u] > threshold), default=-1)
    assert _segment_tree._tree_last_above(slack, width, lo, hi, threshold) == expected
    changed = data.draw(st.integers(0, keys.size - 1))  # a leaf set again: the path above it follows
    values[changed] = data.draw(st.integers(-5, 5))
    _segment_tree._tree_set_max(slack, width, changed, float(values[changed]))
    expected = max((u for u in range(lo, hi + 1) if values[u] > threshold), default=-1)
    assert _segment_tree._tree_last_above(slack, width, lo, hi, threshold) == expected


@settings(max_examples=150, deadline=None)
@given(st.data(), st.sampled_from([12, 16]), st.sampled_from([2, 4]), st.sampled_from([9, 40, 200]),
       st.integers(1, 60), st.booleans(), st.booleans())
def test_refine_keeps_its_trees_as_a_fresh_start_builds_them(data, num_bins, node_size, largest, scan, settle,
                                                             allow_moves):
    """Integer costs (every sum exact, so loads kept up to date equal loads summed afresh): refine run to its end
    makes the exchanges of refine restarted after every step, which builds its sorted bins and its tree of the
    cheapest items' slack anew each time. Swaps across nodes only with the cheapest items (``cross_swap_cap`` 0, as
    the locality refinement starts) and one partner, down to the mean: the trades with the cheapest items do much
    of the work."""
    items = data.draw(st.lists(st.tuples(st.integers(1, largest), st.integers(0, num_bins - 1)), min_size=20,
                               max_size=200))
    costs = np.array([float(c) for c, _ in items])
    bins = np.array([b for _, b in items], dtype=np.int64)
    stop_at = float(np.floor(costs.sum() / num_bins))
    order = np.argsort(-costs, kind="stable")
    memory = np.zeros(costs.size)
    args = (allow_moves, stop_at, 1, node_size)
    once = bins.copy()
    steps = local_search.refine(costs, memory, np.inf, num_bins, once, *args, 10 * costs.size, order, scan, 0.0,
                                settle)
    stepwise, restarted = bins.copy(), 0
    while local_search.refine(costs, memory, np.inf, num_bins, stepwise, *args, 1, order, scan, 0.0, settle):
        restarted += 1
    assert (steps, once.tolist()) == (restarted, stepwise.tolist())


@settings(max_examples=500, deadline=None)
@given(st.data(), st.sampled_from([16, 32]), st.sampled_from([0, 2, 4]), st.sampled_from([1, 4]),
       st.sampled_from([3, 9, 40]), st.sampled_from([0.0, 0.5, math.inf]), st.booleans(), st.booleans(),
       st.sampled_from([math.inf, 1.5]))
def test_refine_makes_the_exchanges_of_a_search_afresh_at_every_step(data, num_bins, node_size, partners, largest,
                                                                   swap_cap, settle, allow_moves, memory_room):
    """Integer costs with ties and integer memory (that binds or not), one or four partners at first (steps widen
    8 times, to every bin with a node's bins: marks from 9 partners on; the two-for-two rounds with fewer partners
    than the others), a node's bins or none, small items only across nodes or any, to the mean: refine (which skips,
    on a widened step, the partners and rounds it has tried on the same loads, and pairs or bins that cannot beat the
    best) takes the steps of the reference, which tries them all again."""
    items = data.draw(st.lists(st.tuples(st.integers(1, largest), st.integers(0, num_bins - 1), st.integers(0, 3)),
                               min_size=32, max_size=200))
    costs = np.array([float(c) for c, _, _ in items])
    bins = np.array([b for _, b, _ in items], dtype=np.int64)
    memory = np.array([float(m) for _, _, m in items])
    memory_cap = memory_room * (np.bincount(bins, weights=memory, minlength=num_bins).max() + 3.0)
    stop_at = float(np.floor(costs.sum() / num_bins))
    order = np.argsort(-costs, kind="stable")
    scan = data.draw(st.integers(1, costs.size))
    args = (memory, memory_cap, num_bins)
    rest = (allow_moves, stop_at, partners, node_size, 10 * costs.size, order, scan, swap_cap * costs.mean(), settle)
    expected = bins.copy()
    steps = refine_reference(costs, *args, expected, *rest)
    assert (local_search.refine(costs, *args, bins, *rest), bins.tolist()) == (steps, expected.tolist())


@settings(max_examples=200, deadline=None)
@given(st.data(), st.sampled_from([8, 16]), st.sampled_from([0, 2, 4]), st.booleans(), st.booleans(),
       st.lists(st.sampled_from([0.0, 0.3, 2.0, math.inf]), min_size=1, max_size=4))
def test_refine_caps_takes_the_steps_of_one_call_per_cap(data, num_bins, node_size, settle, allow_moves, caps):
    """Costs that are not integers (loads kept up to date then differ in their last bits from loads summed afresh,
    which a call of its own starts from) and memory that binds: refine_caps with caps in turn ends with the bins and
    steps of one refine call per cap, each made while the maximum is above the stop."""
    items = data.draw(st.lists(st.tuples(st.integers(1, 300), st.integers(0, num_bins - 1), st.integers(0, 3)),
                               min_size=16, max_size=160))
    costs = np.array([0.1 * c for c, _, _ in items])
    bins = np.array([b for _, b, _ in items], dtype=np.int64)
    memory = np.array([0.7 * m for _, _, m in items])
    memory_cap = np.bincount(bins, weights=memory, minlength=num_bins).max() + 1.1
    stop_at = 1.001 * costs.sum() / num_bins
    order = np.argsort(-costs, kind="stable")
    cross_swap_caps = np.array(caps) * costs.mean()
    args = (memory, memory_cap, num_bins)
    rest = (allow_moves, stop_at, 1, node_size, 10 * costs.size, order, 7)
    expected, steps = bins.copy(), 0
    for cap in cross_swap_caps:
        if np.bincount(expected, weights=costs, minlength=num_bins).max() > stop_at:
            steps += local_search.refine(costs, *args, expected, *rest, cap, settle)
    assert (local_search.refine_caps(costs, *args, bins, *rest, cross_swap_caps, settle), bins.tolist()) == \
        (steps, expected.tolist())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=2, max_size=24), st.sampled_from([0, 2, 8]), st.integers(1, 30))
def test_partners_are_the_least_loaded_bins_below_the_top(loads, node_size, partners):
    """Loads with ties: on the top bin's node (node_size > 0), its other bins below its load by (load, id); anywhere,
    the first bin of each load below the top's, up to ``partners`` of them."""
    load = np.array([float(x) for x in loads])
    rank = np.argsort(load, kind="stable")
    top = int(rank[-1])
    out = np.empty(max(load.size, node_size), dtype=np.int64)
    count = local_search._partners(load, rank, top, node_size, partners, out)
    if node_size:
        node = range(top // node_size * node_size, min(load.size, (top // node_size + 1) * node_size))
        expected = sorted((b for b in node if load[b] < load[top]), key=lambda b: (load[b], b))
    else:
        expected = [int(b) for p, b in enumerate(rank)
                    if load[b] < load[top] and (p == 0 or load[rank[p - 1]] != load[b])][:partners]
    assert out[:count].tolist() == expected
