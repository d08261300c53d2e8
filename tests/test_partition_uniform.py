"""``partition_uniform`` (items of one cost and one size: the encoder phases) against brute force."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.partition import partition_uniform


def brute_force(home, node_of_bin):
    """Over every assignment with the optimal max count: (that max, fewest items off their bin,
    fewest items off their node)."""
    home = np.asarray(home)
    num_bins = len(node_of_bin)
    assign = np.array(list(itertools.product(range(num_bins), repeat=home.size)), dtype=np.int64)
    counts = (assign[:, :, None] == np.arange(num_bins)).sum(1)
    best = counts.max(1).min()
    keep = counts.max(1) == best
    moved = (assign != home).sum(1)[keep]
    node = np.asarray(node_of_bin)
    inter = (node[assign] != node[home]).sum(1)[keep]
    return int(best), int(moved.min()), int(inter.min())


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_optimal_max_and_fewest_moves_on_and_off_node(data):
    num_bins = data.draw(st.integers(1, 4))
    node_of_bin = data.draw(st.lists(st.integers(0, 1), min_size=num_bins, max_size=num_bins))
    home = np.array(data.draw(st.lists(st.integers(0, num_bins - 1), min_size=0, max_size=7)), dtype=np.int64)
    part = partition_uniform(np.full(home.size, 2.5), home, node_of_bin, item_bytes=np.full(home.size, 3))
    best, fewest_moved, fewest_inter = brute_force(home, node_of_bin)
    counts = np.bincount(part.bin_of_item, minlength=num_bins)
    assert counts.max(initial=0) == best
    assert np.isclose(part.max_cost, 2.5 * best)
    assert (part.bin_of_item != home).sum() == fewest_moved
    assert (np.asarray(node_of_bin)[part.bin_of_item] != np.asarray(node_of_bin)[home]).sum() == fewest_inter
    assert part.moved_bytes == 3 * fewest_moved and part.inter_node_bytes == 3 * fewest_inter
    assert part.method == ("home" if fewest_moved == 0 else "uniform")


def test_large_instance_keeps_node_traffic_to_node_surplus():
    rng = np.random.default_rng(0)
    num_bins, gpus = 512, 8
    node_of_bin = np.arange(num_bins) // gpus
    home = np.sort(rng.integers(0, num_bins, 40_000) ** 2 // num_bins)  # skewed: low ranks load most
    part = partition_uniform(np.ones(home.size), home, node_of_bin, item_bytes=np.ones(home.size))
    cap = -(-home.size // num_bins)
    have = np.bincount(home, minlength=num_bins)
    assert part.counts().max() == cap
    assert part.moved_bytes == np.maximum(have - cap, 0).sum()
    node_have = np.bincount(node_of_bin[home], minlength=num_bins // gpus)
    assert part.inter_node_bytes == np.maximum(node_have - gpus * cap, 0).sum()
    assert part.max_cost < part.baseline_max_cost


def test_refuses_unequal_items():
    with pytest.raises(ValueError, match="equal cost and equal bytes"):
        partition_uniform([1.0, 2.0], [0, 1], [0, 0], item_bytes=[1, 1])
    with pytest.raises(ValueError, match="equal cost and equal bytes"):
        partition_uniform([1.0, 1.0], [0, 1], [0, 0], item_bytes=[1, 2])
