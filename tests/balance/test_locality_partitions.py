"""The partitioners whose bins are ranks on nodes: ``partition_uniform`` (items of one cost and one
size: the encoder phases) against brute force, ``partition_equal_count_locality`` (the backbone
under --orch-locality) against the plain equal-count plan with exact placement, and the locality
partitioners' fallback, placed; LPT near home (their start) against its plain Python definition."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance import _kernels
from megatron_orch.balance.partition import (Outcome, equal_count_lower_bound, partition, partition_equal_count,
                                             partition_equal_count_locality, partition_locality, partition_uniform)
from megatron_orch.balance.placement import (BinTraffic, PlacementConfig, exact_min_cost_flow, place_items,
                                             placement_cost)
from megatron_orch.balance.topology import Topology


def lpt_near_home_reference(costs, memory, memory_cap, home, order, num_bins, gpus_per_node, target):
    """``_kernels.lpt_near_home`` in plain Python, its definition: each item in ``order`` to its home rank if that
    stays within ``target`` and the memory cap, else to its node's least-loaded rank with memory room if that
    stays within ``target``, else to the least-loaded rank anywhere with room if less loaded (ties: the lower rank).
    Returns (-1 or the item no rank has room for, rank of every item placed)."""
    load, mem, out = [0.0] * num_bins, [0.0] * num_bins, [-1] * len(costs)
    for item in order:
        c, m, r = costs[item], memory[item], home[item]
        if load[r] + c > target or mem[r] + m > memory_cap:
            lo = r // gpus_per_node * gpus_per_node
            node = [b for b in range(lo, min(num_bins, lo + gpus_per_node)) if memory_cap - mem[b] >= m]
            r = min(node, key=lambda b: (load[b], b)) if node else -1
            if r < 0 or load[r] + c > target:
                anywhere = [b for b in range(num_bins) if memory_cap - mem[b] >= m]
                if not anywhere:
                    return item, out
                g = min(anywhere, key=lambda b: (load[b], b))
                if r < 0 or load[g] < load[r]:
                    r = g
        out[item] = r
        load[r] += c
        mem[r] += m
    return -1, out


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 13), st.integers(1, 5), st.integers(0, 60), st.sampled_from([1.0, 0.8, 1.3]),
       st.sampled_from([np.inf, 6.0, 2.5]), st.integers(0, 2**31 - 1))
def test_lpt_near_home_is_its_definition(num_bins, gpus_per_node, n, target_scale, memory_cap, seed):
    """Loads and costs with ties (few distinct costs), a target below and above the mean, memory caps that bind
    and one no rank can meet; nodes that need not fill the last one."""
    rng = np.random.default_rng(seed)
    costs = rng.integers(1, 5, n).astype(np.float64) * rng.choice([1.0, 0.1], n)
    memory = rng.integers(0, 3, n).astype(np.float64)
    home = rng.integers(0, num_bins, n)
    order = np.argsort(-costs, kind="stable")
    target = target_scale * costs.sum() / num_bins
    bins = np.full(n, -1, dtype=np.int64)
    failed = _kernels.lpt_near_home(costs, memory, memory_cap, home, order, num_bins, gpus_per_node, target, bins)
    expected_failed, expected = lpt_near_home_reference(costs.tolist(), memory.tolist(), memory_cap, home.tolist(),
                                                        order.tolist(), num_bins, gpus_per_node, target)
    assert failed == expected_failed
    if failed < 0:
        assert bins.tolist() == expected
    else:  # (the items placed before the one refused)
        placed = np.array(expected) >= 0
        assert bins[placed].tolist() == np.array(expected)[placed].tolist()


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


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_equal_count_locality_keeps_counts_and_the_capacity(data):
    gpus = data.draw(st.sampled_from([1, 2, 4]))
    num_bins = gpus * data.draw(st.integers(1, 4))
    per_bin = data.draw(st.integers(1, 6))
    n = num_bins * per_bin
    costs = np.array(data.draw(st.lists(st.floats(0.0, 100.0), min_size=n, max_size=n)))
    home = np.array(data.draw(st.permutations(np.repeat(np.arange(num_bins), per_bin).tolist())), dtype=np.int64)
    tolerance = data.draw(st.sampled_from([0.0, 0.01, 0.2]))
    part = partition_equal_count_locality(costs, home, num_bins, gpus, item_bytes=np.ones(n), tolerance=tolerance)
    reference = partition_equal_count(costs, num_bins, home=home)
    assert np.array_equal(part.counts(), np.full(num_bins, per_bin))
    home_max = np.bincount(home, weights=costs, minlength=num_bins).max()
    assert part.max_cost <= home_max + 1e-9
    if part.method.startswith("equal_locality_fallback"):  # the reference bins, on the ranks exact placement picks
        rank_of_bin = place_items(reference.bin_of_item, home, np.ones(n, dtype=np.int64),
                                  Topology.uniform(num_bins, gpus), PlacementConfig(method="exact"))
        assert np.array_equal(part.bin_of_item, rank_of_bin[reference.bin_of_item])
    else:
        assert part.max_cost <= (1 + tolerance) * reference.max_cost + 1e-9
    if part.method == "home":
        assert np.array_equal(part.bin_of_item, home)


def test_equal_count_locality_moves_far_fewer_items_across_nodes():
    rng = np.random.default_rng(3)
    num_bins, gpus, per_bin = 64, 8, 16
    costs = rng.lognormal(0.0, 1.0, num_bins * per_bin) * np.repeat(rng.uniform(0.5, 2.0, num_bins), per_bin)
    home = np.repeat(np.arange(num_bins), per_bin)
    ones = np.ones(costs.size, dtype=np.int64)
    part = partition_equal_count_locality(costs, home, num_bins, gpus, item_bytes=ones)
    assert part.method == "equal_locality"
    reference = partition_equal_count(costs, num_bins, home=home)
    placed = place_items(reference.bin_of_item, home, ones, Topology.uniform(num_bins, gpus),
                         PlacementConfig(method="exact"))[reference.bin_of_item]
    crossing = (part.bin_of_item // gpus != home // gpus).sum()
    crossing_placed = (placed // gpus != home // gpus).sum()
    assert part.max_cost <= 1.01 * reference.max_cost < np.bincount(home, weights=costs).max()
    assert part.max_cost <= 1.02 * equal_count_lower_bound(costs, num_bins)
    assert crossing < 0.25 * crossing_placed, (crossing, crossing_placed)
    assert part.inter_node_bytes == crossing


def test_equal_count_locality_refuses_a_partial_node():
    with pytest.raises(ValueError, match="multiple of gpus_per_node"):
        partition_equal_count_locality(np.ones(6), np.repeat(np.arange(3), 2), 3, 2, item_bytes=np.ones(6))


@pytest.mark.parametrize("equal_count", [True, False])
def test_a_locality_fallback_is_placed_exactly(equal_count):
    """With no tolerance the heuristics miss the reference's max: its bins then go to the ranks the
    exact placement gives them (OR-Tools' min-cost flow as the oracle), never to ranks 0..K-1 as built."""
    rng = np.random.default_rng(0)  # an instance both heuristics miss by a little
    num_bins, gpus, per_bin = 16, 4, 8
    costs = rng.lognormal(0.0, 1.2, num_bins * per_bin)
    home = np.repeat(np.arange(num_bins), per_bin)
    nbytes = np.rint(100 * costs).astype(np.int64)
    if equal_count:
        part = partition_equal_count_locality(costs, home, num_bins, gpus, item_bytes=nbytes, tolerance=0.0)
        reference = partition_equal_count(costs, num_bins, home=home).bin_of_item
    else:
        part = partition_locality(costs, home, num_bins, gpus, item_bytes=nbytes, tolerance=0.0)
        reference = partition(costs, num_bins, home=home).bin_of_item
    assert "fallback" in part.method and part.method.endswith("+exact"), part.method
    assert part.outcome is Outcome.FALLBACK  # what step_plan decides by
    same_bins = {tuple(np.flatnonzero(part.bin_of_item == b)) for b in range(num_bins)}
    assert same_bins == {tuple(np.flatnonzero(reference == b)) for b in range(num_bins)}
    topology = Topology.uniform(num_bins, gpus)
    traffic = BinTraffic.from_items(reference, home, nbytes, num_bins, num_bins)
    oracle = placement_cost(traffic, topology, exact_min_cost_flow(traffic, topology)[0])
    unplaced = nbytes[reference // gpus != home // gpus].sum()
    assert part.inter_node_bytes == oracle.inter_node_bytes < unplaced


@pytest.mark.parametrize("equal_count", [True, False])
def test_an_unplaced_fallback_is_the_reference_as_it_is(equal_count):
    """``place_fallback=False`` (the step planner places the plain plan itself): the same miss, the reference's
    bins unchanged, no placement named, no byte figures (bins are not ranks)."""
    rng = np.random.default_rng(0)  # the instance above, which both heuristics miss
    num_bins, gpus, per_bin = 16, 4, 8
    costs = rng.lognormal(0.0, 1.2, num_bins * per_bin)
    home = np.repeat(np.arange(num_bins), per_bin)
    nbytes = np.rint(100 * costs).astype(np.int64)
    locality = partition_equal_count_locality if equal_count else partition_locality
    reference = (partition_equal_count(costs, num_bins, home=home) if equal_count
                 else partition(costs, num_bins, home=home))
    part = locality(costs, home, num_bins, gpus, item_bytes=nbytes, reference=reference, place_fallback=False)
    assert part.outcome is Outcome.FALLBACK
    assert part.method == ("equal_locality" if equal_count else "locality") + "_fallback:" + reference.method
    assert np.array_equal(part.bin_of_item, reference.bin_of_item)
    assert part.bin_of_item is not reference.bin_of_item
    assert np.isnan(part.moved_bytes) and np.isnan(part.inter_node_bytes)
    placed = locality(costs, home, num_bins, gpus, item_bytes=nbytes, reference=reference)
    assert placed.outcome is Outcome.FALLBACK and placed.method == part.method + "+exact"
    assert part.max_cost == placed.max_cost == reference.max_cost



def _refine_bins(costs, bins, num_bins, node_size, stop_at, settle_at_stop):
    """``_kernels.refine`` as the locality partitioners call it (no memory cap): (bins after, steps taken)."""
    costs, bins = np.asarray(costs, dtype=float), np.array(bins, dtype=np.int64)
    order = np.argsort(-costs, kind="stable").astype(np.int64)
    steps = _kernels.refine(costs, np.zeros(costs.size), np.inf, num_bins, bins, True, stop_at, 8, node_size,
                            costs.size + num_bins, order, 1024, np.inf, settle_at_stop)
    return bins, steps


def test_settling_at_the_capacity_moves_the_cheapest_item_that_reaches_it():
    """Rank 0 holds 5 against a capacity of 4: evening it out with rank 1 moves the 2.5 item; settling moves the
    1.0 item, which is enough (fewer bytes, the same capacity met)."""
    plain, _ = _refine_bins([2.5, 1.5, 1.0], [0, 0, 0], 2, 2, 4.0, settle_at_stop=False)
    settled, steps = _refine_bins([2.5, 1.5, 1.0], [0, 0, 0], 2, 2, 4.0, settle_at_stop=True)
    assert plain.tolist() == [1, 0, 0]
    assert settled.tolist() == [0, 0, 1] and steps == 1


def test_settling_a_full_node_looks_at_other_nodes_first():
    """Node 0 (ranks 0-1) holds 6.5 against 2 x 3: no exchange inside it can fix that. Settling sends one item to
    node 1 at once; the plain refinement first evens out the node (a move inside it), then leaves it (a second
    step)."""
    costs, bins = [2.0, 1.0, 1.0, 1.0, 1.0, 0.5], [0, 0, 0, 1, 1, 1]
    plain, plain_steps = _refine_bins(costs, bins, 4, 2, 3.0, settle_at_stop=False)
    settled, steps = _refine_bins(costs, bins, 4, 2, 3.0, settle_at_stop=True)
    loads = np.bincount(settled, weights=costs, minlength=4)
    assert steps == 1 and loads.max() <= 3.0 and (settled != bins).sum() == 1 and settled[np.flatnonzero(
        settled != bins)[0]] >= 2
    assert plain_steps == 2 and np.bincount(plain, weights=costs, minlength=4).max() <= 3.0
