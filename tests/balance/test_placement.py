"""Topology-aware bin placement against brute force over every bin -> rank permutation."""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance import placement as placement_module
from megatron_orch.balance.placement import BinTraffic, PlacementConfig, place_bins, placement_cost
from megatron_orch.balance.registry import PLACEMENTS
from megatron_orch.balance.topology import Topology

METHODS = tuple(entry.name for entry in PLACEMENTS.builtins())  # identity, greedy, exact, minmax


@st.composite
def instances(draw, max_bins=6):
    """A dense [bin, rank] byte matrix (many zeros) and a topology of 1-3 nodes, possibly uneven."""
    num = draw(st.integers(2, max_bins))
    nodes = sorted(draw(st.lists(st.integers(0, 2), min_size=num, max_size=num)))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    matrix = rng.integers(0, 1000, (num, num)) * (rng.random((num, num)) < 0.5)
    return BinTraffic.from_matrix(matrix), Topology(np.asarray(nodes))


def _all_costs(traffic, topology):
    perms = list(itertools.permutations(range(traffic.num_bins)))
    return perms, [placement_cost(traffic, topology, p) for p in perms]


def _check_result(result, traffic, topology):
    assert sorted(result.rank_of_bin.tolist()) == list(range(traffic.num_bins))
    cost = placement_cost(traffic, topology, result.rank_of_bin)
    assert (cost.inter_node_bytes, cost.max_node_inter_bytes, cost.off_gpu_bytes) == (
        result.inter_node_bytes, result.max_node_inter_bytes, result.off_gpu_bytes)
    assert result.solve_ms >= 0


@settings(max_examples=40, deadline=None)
@given(instances())
def test_exact_and_minmax_match_brute_force(instance):
    traffic, topology = instance
    perms, costs = _all_costs(traffic, topology)
    results = {m: place_bins(traffic, topology, PlacementConfig(method=m, time_limit_s=20)) for m in METHODS}
    for result in results.values():
        _check_result(result, traffic, topology)
    identity, greedy, exact, minmax = (results[m] for m in METHODS)
    assert identity.rank_of_bin.tolist() == list(range(traffic.num_bins))

    # exact: the fewest inter-node bytes; off-GPU bytes optimal among placements with its bins -> nodes.
    assert exact.solver == "transport (certified optimal)"
    assert exact.inter_node_bytes == min(c.inter_node_bytes for c in costs)
    node = topology.node_of_rank
    same_nodes = [c.off_gpu_bytes for p, c in zip(perms, costs)
                  if np.array_equal(node[list(p)], node[exact.rank_of_bin])]
    assert exact.off_gpu_bytes == min(same_nodes)

    # minmax: the least loaded busiest node, then the fewest inter-node bytes at that load.
    assert minmax.solver == "cp-sat optimal"
    best_max = min(c.max_node_inter_bytes for c in costs)
    assert minmax.max_node_inter_bytes == best_max <= exact.max_node_inter_bytes
    assert minmax.inter_node_bytes == min(c.inter_node_bytes for c in costs
                                          if c.max_node_inter_bytes == best_max)

    # greedy: never worse than identity.
    assert greedy.inter_node_bytes <= identity.inter_node_bytes
    assert exact.inter_node_bytes <= greedy.inter_node_bytes


def test_placement_cost_by_hand():
    # Ranks 0,1 on node 0 and rank 2 on node 1. Bin 0 pulls 5 from rank 0 and 7 from rank 2,
    # bin 1 pulls 3 from rank 1, bin 2 pulls 11 from rank 2.
    traffic = BinTraffic.from_matrix(np.array([[5, 0, 7], [0, 3, 0], [0, 0, 11]]))
    topology = Topology(np.array([0, 0, 1]))
    cost = placement_cost(traffic, topology, [0, 1, 2])
    # Bin 0 on rank 0: 7 bytes cross into node 0 (node 1 sends 7); nothing else moves.
    assert (cost.inter_node_bytes, cost.max_node_inter_bytes, cost.off_gpu_bytes) == (7, 7, 7)
    cost = placement_cost(traffic, topology, [2, 0, 1])
    # Bin 0 on rank 2 pulls 5 from node 0; bin 1 on rank 0 pulls 3 over NVLink; bin 2 on rank 1 pulls
    # 11 from node 1. Node 0 receives 11 and sends 5; node 1 receives 5 and sends 11.
    assert (cost.inter_node_bytes, cost.max_node_inter_bytes, cost.off_gpu_bytes) == (16, 11, 19)


def test_traffic_from_items_sums_bytes_per_bin_and_source():
    traffic = BinTraffic.from_items(bin_of_item=[0, 0, 1, 2, 0], home_rank=[1, 1, 0, 2, 2],
                                    item_bytes=[3, 4, 5, 0, 6], num_bins=3, num_ranks=3)
    assert traffic.matrix().tolist() == [[0, 7, 6], [5, 0, 0], [0, 0, 0]]
    assert traffic.bin_totals().tolist() == [13, 5, 0]
    assert BinTraffic.from_matrix(traffic.matrix()).matrix().tolist() == traffic.matrix().tolist()


@pytest.mark.parametrize("kwargs, match", [
    (dict(bin_of_item=[0, 3], home_rank=[0, 1], item_bytes=[1, 1]), r"bin_of_item\[1\] = 3"),
    (dict(bin_of_item=[0, 1], home_rank=[0, -1], item_bytes=[1, 1]), r"home_rank\[1\] = -1"),
    (dict(bin_of_item=[0, 1], home_rank=[0, 1], item_bytes=[1, -2]), "negative bytes"),
    (dict(bin_of_item=[0, 1], home_rank=[0], item_bytes=[1, 1]), "differ in length"),
    (dict(bin_of_item=[0.5, 1], home_rank=[0, 1], item_bytes=[1, 1]), "integers"),
])
def test_bad_items_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BinTraffic.from_items(num_bins=3, num_ranks=3, **kwargs)


def test_bins_and_ranks_must_match():
    traffic = BinTraffic.from_matrix(np.ones((3, 3), dtype=np.int64))
    with pytest.raises(ValueError, match="one bin per rank"):
        place_bins(traffic, Topology.uniform(4, 2))
    with pytest.raises(ValueError, match="unknown placement method"):
        PlacementConfig(method="best")


def _random_traffic(num_ranks, items_per_rank, seed):
    rng = np.random.default_rng(seed)
    home = np.repeat(np.arange(num_ranks), items_per_rank)
    bins = rng.integers(0, num_ranks, home.size)
    nbytes = rng.integers(1, 10**6, home.size)
    return BinTraffic.from_items(bins, home, nbytes, num_ranks, num_ranks)


def test_minmax_time_limit_falls_back_and_says_so():
    traffic, topology = _random_traffic(32, 6, seed=1), Topology.uniform(32, 4)
    exact = place_bins(traffic, topology, PlacementConfig(method="exact"))
    result = place_bins(traffic, topology, PlacementConfig(method="minmax", time_limit_s=0.0))
    _check_result(result, traffic, topology)
    assert "time limit reached before CP-SAT" in result.solver
    assert result.max_node_inter_bytes <= exact.max_node_inter_bytes


def test_minmax_restricted_to_candidate_nodes_is_never_worse_than_its_hint():
    traffic, topology = _random_traffic(48, 4, seed=2), Topology.uniform(48, 4)
    exact = place_bins(traffic, topology, PlacementConfig(method="exact"))
    config = PlacementConfig(method="minmax", time_limit_s=5.0, candidate_nodes=2, max_full_model=0,
                             deterministic=True)
    result = place_bins(traffic, topology, config)
    _check_result(result, traffic, topology)
    assert "2 candidate nodes per bin" in result.solver
    assert result.max_node_inter_bytes <= exact.max_node_inter_bytes
    # Deterministic mode: the same plan every time (every rank of a group computes it alike).
    again = place_bins(traffic, topology, config)
    assert again.rank_of_bin.tolist() == result.rank_of_bin.tolist()


def test_without_ortools_exact_still_solves_and_minmax_falls_back_to_it(monkeypatch):
    traffic, topology = _random_traffic(16, 5, seed=3), Topology.uniform(16, 4)
    exact = place_bins(traffic, topology, PlacementConfig(method="exact"))
    for name in ("min_cost_flow", "linear_sum_assignment", "cp_model"):
        monkeypatch.setattr(placement_module, name, None)
    for method in ("exact", "minmax"):
        result = place_bins(traffic, topology, PlacementConfig(method=method))
        _check_result(result, traffic, topology)
        assert result.rank_of_bin.tolist() == exact.rank_of_bin.tolist()
        assert result.solver == "transport (certified optimal)" + (" (OR-Tools not installed: no min-max)" if method == "minmax" else "")


def test_no_traffic_keeps_identity_costs_at_zero():
    traffic = BinTraffic.from_matrix(np.zeros((4, 4), dtype=np.int64))
    for method in METHODS:
        result = place_bins(traffic, Topology.uniform(4, 2), PlacementConfig(method=method))
        assert (result.inter_node_bytes, result.max_node_inter_bytes, result.off_gpu_bytes) == (0, 0, 0)


def test_placement_benchmark_orders_methods_as_their_guarantees_say():
    import json

    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.bench.placement import COMPARED_PLACEMENTS as BENCH_METHODS, FIELDS, run

    result = run(list(DEFAULT_MIXTURE), dp=16, per_rank=2, gpus_per_node=4, model="mllm_84b", seed=0,
                 minmax_time_limit_s=0.5)
    json.dumps(result)
    for phase in ("vision", "audio", "llm"):
        figures = result[phase]
        assert set(figures) == set(BENCH_METHODS)
        assert all(set(figures[m]) == set(FIELDS) for m in BENCH_METHODS)
        inter = {m: figures[m]["inter_node_bytes"] for m in BENCH_METHODS}
        assert inter["exact"] <= inter["greedy"] <= inter["identity"]
        assert figures["minmax"]["max_node_inter_bytes"] <= figures["exact"]["max_node_inter_bytes"]
        assert figures["exact"]["solver"] == "transport (certified optimal)"
        if phase != "llm":  # equal items: the trainer's uniform plan is as balanced, with fewest node crossings
            assert inter["trainer"] <= inter["exact"]
            assert figures["trainer"]["solver"] in ("plan_step defaults (uniform)", "plan_step defaults (home)")
    assert result["params"]["dp"] == 16 and result["params"]["num_nodes"] == 4
