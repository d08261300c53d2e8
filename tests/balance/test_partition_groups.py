"""partition_groups (every rank's packed micro-batches in one compiled call) against partition() run group by
group in Python, the implementation it replaces: the same bins, item for item."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance import _kernels
from megatron_orch.balance.partition import partition, partition_groups
from megatron_orch.balance.registry import PARTITIONERS
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import HEAVY_TAILED_MIXTURES
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import PLAN_METHODS, draw_sizes
from megatron_orch.orchestrator.step_plan import plan_step

METHODS = ("auto",) + tuple(entry.name for entry in PARTITIONERS.builtins())


def test_the_compiled_methods_are_the_built_in_partitioners():
    """partition_groups compiles auto and every built-in partitioner (a registered one runs group by group)."""
    assert _kernels.METHOD_CODES == METHODS == ("auto", "lpt", "kk", "bs_ffd")


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
