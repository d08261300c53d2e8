"""Exchanging alike items between bins (:mod:`megatron_orch.balance.exchange`): every item placed exactly once,
every bin holding the same items' worth of each class (so the same cost: balance identical by construction), no
fewer items at home and no more across nodes, per class; and the classes themselves."""
import numpy as np
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.exchange import classes_of, exchange_alike


@st.composite
def dealt(draw):
    num_ranks = draw(st.integers(1, 24))
    gpus = draw(st.integers(1, num_ranks))
    n = draw(st.integers(0, 120))
    ranks = st.integers(0, num_ranks - 1)
    bins = np.array(draw(st.lists(ranks, min_size=n, max_size=n)), dtype=np.int64)
    sources = np.array(draw(st.lists(ranks, min_size=n, max_size=n)), dtype=np.int64)
    costs = np.array(draw(st.lists(st.sampled_from([0.5, 1.0, 1.5, 7.25]), min_size=n, max_size=n)))
    nodes = np.array(draw(st.permutations(list(np.arange(num_ranks) // gpus))), dtype=np.int64)  # any node order
    return bins, sources, costs, nodes


@settings(max_examples=200, deadline=None)
@given(dealt())
def test_every_bin_keeps_its_cost_and_every_item_is_placed_once(case):
    bins, sources, costs, nodes = case
    classes = classes_of(costs)
    taken = exchange_alike(bins, sources, classes, nodes)
    assert np.array_equal(np.sort(taken), np.arange(bins.size))  # a permutation: each place taken once
    exchanged = bins[taken]
    num_ranks = nodes.size
    for c in np.unique(classes):
        mine = classes == c
        assert np.array_equal(classes[taken[mine]], classes[mine])  # within its class
        assert np.array_equal(np.bincount(exchanged[mine], minlength=num_ranks),
                              np.bincount(bins[mine], minlength=num_ranks))
        assert (exchanged[mine] == sources[mine]).sum() >= (bins[mine] == sources[mine]).sum()
        crossing = nodes[exchanged[mine]] != nodes[sources[mine]]
        assert crossing.sum() <= (nodes[bins[mine]] != nodes[sources[mine]]).sum()
    np.testing.assert_array_equal(np.bincount(exchanged, weights=costs, minlength=num_ranks),
                                  np.bincount(bins, weights=costs, minlength=num_ranks))


def test_a_sources_alike_items_go_to_few_bins():
    """Four sources of four alike items each, dealt round-robin over four other ranks (16 pairs): after the
    exchange each source sends to one rank (4 pairs), and an item whose source is a bin goes home."""
    sources = np.repeat(np.arange(4), 4)
    bins = np.tile(np.arange(4, 8), 4)
    nodes = np.zeros(8, dtype=np.int64)
    exchanged = bins[exchange_alike(bins, sources, np.zeros(16, dtype=np.int64), nodes)]
    assert len(set(zip(sources.tolist(), bins.tolist()))) == 16
    assert len(set(zip(sources.tolist(), exchanged.tolist()))) == 4
    home = exchange_alike(np.array([1, 0]), np.array([0, 1]), np.array([0, 0]), np.zeros(2, dtype=np.int64))
    assert np.array_equal(np.array([1, 0])[home], [0, 1])


def test_items_stay_on_their_node_before_the_rest_are_dealt():
    """Two items of rank 2 (node 1) placed on rank 3 (node 1), one of rank 0 (node 0) on rank 4 (node 2), alike:
    dealt in rank order alone, rank 0's item would take a node-1 place and push one of rank 2's onto node 2; the
    node pass keeps both on node 1 (one item crosses nodes, as planned)."""
    nodes = np.arange(6) // 2
    sources, bins = np.array([0, 2, 2]), np.array([4, 3, 3])
    exchanged = bins[exchange_alike(bins, sources, np.zeros(3, dtype=np.int64), nodes)]
    assert exchanged.tolist() == [4, 3, 3]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from([0.0, 1.5, 2.0, 1e-300])), max_size=60))
def test_classes_join_exactly_the_equal_items(rows):
    ints = np.array([r[0] for r in rows], dtype=np.int64)
    floats = np.array([r[1] for r in rows], dtype=np.float64)
    ids = classes_of(ints, floats)
    assert ids.size == len(rows) and (ids.size == 0 or ids.max() < len(rows))
    for i in range(len(rows)):
        for j in range(len(rows)):
            assert (ids[i] == ids[j]) == (rows[i] == rows[j])
    assert np.array_equal(classes_of(np.float32([1.5, 1.25, 1.5])), [0, 1, 0])  # not truncated to integers


def test_bad_input_is_refused_by_name():
    import pytest
    with pytest.raises(ValueError, match="a source outside 0..1"):
        exchange_alike(np.array([0]), np.array([2]), np.array([0]), np.zeros(2, dtype=np.int64))
    with pytest.raises(ValueError, match="1 bins, 2 sources"):
        exchange_alike(np.array([0]), np.array([0, 1]), np.array([0]), np.zeros(2, dtype=np.int64))
