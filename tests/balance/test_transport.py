"""The compiled exact placement against its oracle, OR-Tools (min-cost flow, linear sum assignment).

The numba solver must reach the same optimum (total inter-node bytes), prove it (dual gap 0), keep
node capacities, and be deterministic; the in-node assignment must keep as many bytes on their GPU
as OR-Tools' assignment given the same bins -> nodes.
"""
import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance import _transport
from megatron_orch.balance import placement as placement_module
from megatron_orch.balance.placement import (BinTraffic, PlacementConfig, exact_min_cost_flow, place_bins,
                                          placement_cost)
from megatron_orch.balance.topology import Topology

pytest.importorskip("ortools")


def _solve(traffic, topology):
    row_start, node, nbytes = _transport.merge_pairs(traffic.bin, topology.node_of_rank[traffic.rank],
                                                     traffic.nbytes, traffic.num_bins, topology.num_nodes)
    capacity = topology.ranks_per_node()
    node_of_bin, potential = _transport.transport(row_start, node, nbytes, capacity)
    gap = _transport.dual_gap(row_start, node, nbytes, capacity, node_of_bin, potential)
    return node_of_bin, gap


def _oracle_in_node_off_gpu(traffic, topology, node_of_bin):
    """Off-GPU bytes of OR-Tools' optimal bins -> GPUs assignment inside the given nodes."""
    problem = placement_module._Problem(traffic, topology)
    left, right = problem._same_node_pairs(node_of_bin)
    solver = placement_module.linear_sum_assignment.SimpleLinearSumAssignment()
    solver.add_arcs_with_cost(left, right, -problem._bytes_at(left, right))
    assert solver.solve() == solver.OPTIMAL
    rank_of_bin = np.array([solver.right_mate(b) for b in range(traffic.num_bins)])
    return placement_cost(traffic, topology, rank_of_bin).off_gpu_bytes


def _check_against_oracle(traffic, topology):
    node_of_bin, gap = _solve(traffic, topology)
    assert gap == 0, "the solver's optimum must carry its certificate"
    assert np.array_equal(np.bincount(node_of_bin, minlength=topology.num_nodes), topology.ranks_per_node())
    result = place_bins(traffic, topology, PlacementConfig(method="exact"))
    assert result.solver == "transport (certified optimal)"
    assert np.array_equal(topology.node_of_rank[result.rank_of_bin], node_of_bin)
    assert sorted(result.rank_of_bin.tolist()) == list(range(traffic.num_bins))
    oracle_ranks, oracle_solver = exact_min_cost_flow(traffic, topology)
    assert oracle_solver == "min-cost-flow (OR-Tools)"
    oracle = placement_cost(traffic, topology, oracle_ranks)
    assert result.inter_node_bytes == oracle.inter_node_bytes
    assert result.off_gpu_bytes == _oracle_in_node_off_gpu(traffic, topology, node_of_bin)
    again = place_bins(traffic, topology, PlacementConfig(method="exact"))
    assert again.rank_of_bin.tolist() == result.rank_of_bin.tolist()
    return result


@st.composite
def sparse_instances(draw):
    """Traffic of items drawn to bins from home ranks, on 1-6 nodes of uneven size; weights from
    tied small integers (degenerate) to wide ranges."""
    sizes = draw(st.lists(st.integers(1, 5), min_size=1, max_size=6))
    num = sum(sizes)
    node_of_rank = np.repeat(np.arange(len(sizes)), sizes)
    seed = draw(st.integers(0, 2**31 - 1))
    items = draw(st.integers(0, 6 * num))
    high = draw(st.sampled_from([2, 4, 1000, 10**9]))
    rng = np.random.default_rng(seed)
    traffic = BinTraffic.from_items(rng.integers(0, num, items), rng.integers(0, num, items),
                                    rng.integers(1, high, items), num, num)
    return traffic, Topology(node_of_rank)


@settings(max_examples=150, deadline=None)
@given(sparse_instances())
def test_transport_matches_ortools_on_random_instances(instance):
    _check_against_oracle(*instance)


@pytest.mark.parametrize("num_ranks, gpus_per_node, items_per_rank, high, seed", [
    (64, 8, 16, 10**6, 0), (128, 8, 40, 3, 1), (96, 4, 10, 10**9, 2), (64, 1, 8, 50, 3),
    (60, 16, 30, 2, 4), (200, 8, 5, 10**4, 5)])
def test_transport_matches_ortools_on_larger_instances(num_ranks, gpus_per_node, items_per_rank, high, seed):
    rng = np.random.default_rng(seed)
    home = np.repeat(np.arange(num_ranks), items_per_rank)
    bins = rng.integers(0, num_ranks, home.size)
    traffic = BinTraffic.from_items(bins, home, rng.integers(1, high, home.size), num_ranks, num_ranks)
    _check_against_oracle(traffic, Topology.uniform(num_ranks, gpus_per_node))


@pytest.mark.parametrize("algorithm, placements", [("auto", 1), ("lpt", 3)])
def test_transport_matches_ortools_on_trace_placements(algorithm, placements):
    """The placements the trainer solves on a step drawn from the traces: the backbone's, and with an
    explicit encoder partitioner (auto plans the model's equal encoder items without placement) the
    vision and audio phases' too."""
    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.orchestrator import step_plan
    from megatron_orch.orchestrator.config import OrchestratorConfig
    from megatron_orch.bench.planning import draw_step

    captured = []
    real = step_plan.place_items

    def capture(bins, ranks, nbytes, topology, config):
        rank_of_bin = real(bins, ranks, nbytes, topology, config)
        captured.append((BinTraffic.from_items(bins, ranks, nbytes, topology.num_ranks, topology.num_ranks),
                         topology, rank_of_bin))
        return rank_of_bin

    model, sizes = draw_step(list(DEFAULT_MIXTURE), dp=96, per_rank=4, model="mllm_84b", seed=7)
    topology = Topology.uniform(96, 8)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step_plan, "place_items", capture)
        step_plan.plan_step(sizes, model.phases(), OrchestratorConfig(algorithm=algorithm, background=False),
                            topology, micro_batch_size=1, num_microbatches=4)
    assert len(captured) == placements
    for traffic, topo, rank_of_bin in captured:
        result = _check_against_oracle(traffic, topo)
        assert rank_of_bin.tolist() == result.rank_of_bin.tolist()


@settings(max_examples=60, deadline=None)
@given(sparse_instances(), st.sampled_from(["identity", "greedy", "exact", "minmax"]))
def test_place_items_is_place_bins_of_the_merged_items(instance, method):
    traffic, topology = instance
    rng = np.random.default_rng(traffic.nbytes.size)
    # split every (bin, rank) entry into items, shuffled
    parts = rng.integers(1, 3, traffic.nbytes.size)
    bins, ranks = np.repeat(traffic.bin, parts), np.repeat(traffic.rank, parts)
    nbytes = np.concatenate([[b // p] * (p - 1) + [b - b // p * (p - 1)] for b, p in zip(traffic.nbytes, parts)]
                            ).astype(np.int64) if parts.size else np.zeros(0, np.int64)
    order = rng.permutation(bins.size)
    config = PlacementConfig(method=method, time_limit_s=5.0, deterministic=True)
    ranks_of_items = placement_module.place_items(bins[order], ranks[order], nbytes[order], topology, config)
    assert ranks_of_items.tolist() == place_bins(traffic, topology, config).rank_of_bin.tolist()


# Pair counts and shapes that take each path: dense (few cells per pair), grouped by row (many cells) with
# short rows (columns put in order by insertion) and long ones (sorted), input in any order, columns in order,
# already sorted.
@pytest.mark.parametrize("n, num_rows, num_cols, order", [
    (500, 9, 5, "random"), (40, 9, 50, "random"), (300, 900, 2000, "random"), (2000, 9, 5000, "random"),
    (40, 9, 50, "cols"), (40, 9, 50, "keys")])
def test_merge_pairs_sums_sorts_and_drops_zeros(n, num_rows, num_cols, order):
    rng = np.random.default_rng(n)
    rows, cols = rng.integers(0, num_rows - 2, n), rng.integers(0, num_cols, n)
    values = rng.integers(0, 3, n)
    if order != "random":
        sort = np.argsort(cols if order == "cols" else rows * num_cols + cols, kind="stable")
        rows, cols, values = rows[sort], cols[sort], values[sort]
    row_start, col, value = _transport.merge_pairs(rows, cols, values, num_rows, num_cols)
    dense = np.zeros((num_rows, num_cols), dtype=np.int64)
    np.add.at(dense, (rows, cols), values)
    keys = np.flatnonzero(dense)
    assert np.array_equal(np.repeat(np.arange(num_rows), np.diff(row_start)) * num_cols + col, keys)
    assert np.array_equal(value, dense.reshape(-1)[keys])
    empty = _transport.merge_pairs(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), 3, 2)
    assert empty[0].tolist() == [0, 0, 0, 0] and empty[1].size == 0


@pytest.mark.parametrize("longest_row", [1, 5, _transport._SHORT_ROW, _transport._SHORT_ROW + 1, 300])
def test_rows_sorted_by_decreasing_weight_ties_by_node(longest_row):
    """Short rows (insertion) and long ones (argsort) alike: each row by decreasing weight, equal weights by
    increasing node, as a stable sort of the row (given by increasing node) on minus the weight."""
    rng = np.random.default_rng(longest_row)
    lengths = np.append(rng.integers(0, longest_row + 1, 60), longest_row)
    row_start = np.concatenate(([0], np.cumsum(lengths)))
    node = np.concatenate([np.sort(rng.choice(400, k, replace=False)) for k in lengths]).astype(np.int64)
    weight = rng.integers(1, 6, node.size)  # many ties
    sorted_node, sorted_weight = _transport._sort_rows(row_start, node, weight)
    for lo, hi in zip(row_start[:-1], row_start[1:]):
        order = np.argsort(-weight[lo:hi], kind="stable")
        assert np.array_equal(sorted_node[lo:hi], node[lo:hi][order])
        assert np.array_equal(sorted_weight[lo:hi], weight[lo:hi][order])


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_in_node_assignment_matches_brute_force(size):
    rng = np.random.default_rng(size)
    for _ in range(20):
        weight = rng.integers(0, 5, (size, size)) * (rng.random((size, size)) < 0.6)
        out = np.empty(size, dtype=np.int64)
        _transport._hungarian_max(weight, size, out)
        assert sorted(out.tolist()) == list(range(size))
        best = max(sum(weight[i, p[i]] for i in range(size)) for p in itertools.permutations(range(size)))
        assert weight[np.arange(size), out].sum() == best


def test_uncertified_solution_falls_back_to_ortools(monkeypatch):
    rng = np.random.default_rng(1)
    traffic = BinTraffic.from_items(rng.integers(0, 16, 80), rng.integers(0, 16, 80), rng.integers(1, 99, 80), 16, 16)
    topology = Topology.uniform(16, 4)
    monkeypatch.setattr(_transport, "dual_gap", lambda *args: 1)
    result = place_bins(traffic, topology, PlacementConfig(method="exact"))
    assert result.solver == "min-cost-flow (OR-Tools) (transport solver not certified)"
    assert result.inter_node_bytes == placement_cost(traffic, topology, exact_min_cost_flow(traffic, topology)[0]).inter_node_bytes


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(-5, 0), min_size=1, max_size=40), st.data())
def test_the_potentials_tree_gives_the_top_two_as_a_scan_does(values, data):
    """The price rounds read the node of largest potential (ties: smaller id) and the largest of the others
    from a tournament tree kept as potentials drop: what a scan of every node gives, after each drop."""
    v = np.array(values, dtype=np.int64)
    tree = _transport._tree_of_nodes(v)
    for n, drop in data.draw(st.lists(st.tuples(st.integers(0, v.size - 1), st.integers(0, 3)), max_size=20)):
        v[n] -= drop
        _transport._tree_update(tree, v, n)
        first = int(np.argmax(v))
        others = np.delete(v, first)
        assert _transport._top_two(tree, v) == (first, others.max() if others.size else -(1 << 62))
