"""partition_groups (every rank's packed micro-batches in one compiled call) against partition() run group by
group, the same bins, item for item; partition()'s ``auto`` (compiled) against the Python loop it replaced."""
import numpy as np
import pytest
from auto_reference import AUTO_ORDER, auto_reference
from hypothesis import given, settings, strategies as st

from megatron_orch.balance import _kernels
from megatron_orch.balance.partition import partition, partition_groups
from megatron_orch.balance.registry import PARTITIONERS
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import HEAVY_TAILED_MIXTURES
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import MIXTURES, PLAN_METHODS, draw_sizes
from megatron_orch.orchestrator.step_plan import plan_step

METHODS = ("auto",) + tuple(entry.name for entry in PARTITIONERS.builtins())


def test_the_compiled_methods_are_the_built_in_partitioners():
    """partition_groups compiles auto and every built-in partitioner (a registered one runs group by group)."""
    assert _kernels.METHOD_CODES == METHODS == ("auto", "lpt", "kk", "bs_ffd")
    assert _kernels.CONSTRUCTIONS == METHODS[1:]  # what auto tries, as the registry lists them
    assert tuple(_kernels.CONSTRUCTIONS[c] for c in _kernels.TRIED) == AUTO_ORDER  # and the order it tries them in


def per_group_in_python(costs, group, num_bins, method):
    out = np.empty(costs.size, dtype=np.int64)
    for g in np.unique(group):
        ids = np.flatnonzero(group == g)
        out[ids] = partition(costs[ids], num_bins, method=method).bin_of_item
    return out


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(METHODS), st.integers(1, 12), st.integers(1, 6), st.data())
def test_equals_partition_group_by_group(method, num_bins, num_groups, data):
    n = data.draw(st.integers(0, 90))
    value = st.one_of(st.floats(0, 1e6, allow_nan=False), st.sampled_from([0.0, 1.0, 7.0, 1e9]))
    costs = np.array(data.draw(st.lists(value, min_size=n, max_size=n)), dtype=np.float64)
    group = np.array(data.draw(st.lists(st.integers(0, num_groups - 1), min_size=n, max_size=n)), dtype=np.int64)
    expected = per_group_in_python(costs, group, num_bins, method)
    assert np.array_equal(partition_groups(costs, group, num_bins, method=method), expected)


@pytest.mark.parametrize("mixture", sorted(HEAVY_TAILED_MIXTURES))
def test_equals_partition_on_a_packed_step(mixture):
    """The packed backbone of a heavy-tailed DP 64 batch: 16 micro-batches per rank, every rank's examples."""
    config, _, sizes = draw_sizes(list(HEAVY_TAILED_MIXTURES[mixture]), 64, 16, "mllm_84b", 0)
    plan = plan_step(sizes, config.phases(), PLAN_METHODS["orch"], Topology.uniform(64, 8), 1, 16)
    costs, rank = phase_items(sizes, config.phases())["llm"].cost, plan.examples_backbone.rank
    expected = per_group_in_python(costs, rank, 16, "auto")
    assert np.array_equal(partition_groups(costs, rank, 16), expected)
    assert np.array_equal(plan.microbatch_of_example, expected)  # what plan_step planned


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="one integer group id per item"):
        partition_groups([1.0, 2.0], [0], 2)
    with pytest.raises(ValueError, match="must be >= 0"):
        partition_groups([1.0, 2.0], [0, -1], 2)
    with pytest.raises(ValueError, match="unknown partitioner 'best'"):
        partition_groups([1.0], [0], 2, method="best")


def _auto_or_refusal(costs, num_bins, memory, memory_cap, refine):
    try:
        part = partition(costs, num_bins, memory=memory, memory_cap=memory_cap, refine=refine)
    except ValueError as err:
        return str(err)
    return part.bin_of_item, part.method


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12), st.booleans(), st.booleans(), st.data())
def test_auto_is_the_python_loop_over_the_built_in_partitioners(num_bins, capped, refine, data):
    """partition()'s ``auto`` (compiled, balance/_kernels/auto.py) against the Python loop it replaced
    (auto_reference.py): the same bins and name, with and without a memory cap, or the same refusal."""
    n = data.draw(st.integers(0, 90))
    value = st.one_of(st.floats(0, 1e6, allow_nan=False), st.sampled_from([0.0, 1.0, 7.0, 1e9]))
    costs = np.array(data.draw(st.lists(value, min_size=n, max_size=n)), dtype=np.float64)
    memory = memory_cap = None
    if capped:
        memory = np.array(data.draw(st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0]), min_size=n, max_size=n)))
        memory_cap = data.draw(st.sampled_from([5.0, 6.0, 10.0, 40.0]))
    expected = auto_reference(costs, num_bins, memory, memory_cap, refine)
    got = _auto_or_refusal(costs, num_bins, memory, memory_cap, refine)
    if isinstance(expected, ValueError):
        assert got == str(expected)
    else:
        assert np.array_equal(got[0], expected[0]) and got[1] == expected[1], (got, expected)


@pytest.mark.parametrize("mixture", ["heavy-tail", "shipped", "heavy-tail-rare"])
def test_auto_is_the_python_loop_on_a_step_backbone(mixture):
    """A DP 512 batch's backbone (8,192 examples), as plan_step partitions it."""
    config, _, sizes = draw_sizes(list(MIXTURES[mixture]), 512, 16, "mllm_84b", 0)
    costs = phase_items(sizes, config.phases())["llm"].cost
    bins, method = auto_reference(costs, 512)
    part = partition(costs, 512)
    assert np.array_equal(part.bin_of_item, bins) and part.method == method


def test_auto_places_a_heavy_tail_at_its_bound_by_first_fit():
    """Where the longest items set the bound above the mean, auto tries first-fit decreasing at the bound first:
    on a DP 10240 heavy-tail-rare backbone it places every item there (an optimal plan, in one pass), where LPT
    refined stays ~0.7% above the bound."""
    config, _, sizes = draw_sizes(list(MIXTURES["heavy-tail-rare"]), 10240, 16, "mllm_84b", 0)
    costs = phase_items(sizes, config.phases())["llm"].cost
    bound = _kernels.pigeonhole_bound(costs, _kernels.decreasing(costs), 10240)
    assert bound > costs.sum() / 10240
    part = partition(costs, 10240)
    assert part.method == "auto:bs_ffd+refine" and part.max_cost == bound
    assert part.counts().min() >= 1  # (first-fit leaves the last bins empty: each takes one of the cheapest items)
    assert partition(costs, 10240, method="lpt", refine=True).max_cost > 1.005 * bound
