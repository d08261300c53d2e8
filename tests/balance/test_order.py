"""``_kernels.decreasing`` and ``_kernels.increasing`` (radix sorts of the values' bits) against numpy's stable
argsort: items by decreasing cost, ties by increasing id, the order every construction takes; bins by increasing
load, ties by increasing id, the order the swap sweeps and the refinement pair them in."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_orch.balance import _kernels
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import MIXTURES, draw_sizes


def _numpy_order(costs):
    return np.argsort(-np.asarray(costs, dtype=np.float64), kind="stable")


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(st.floats(0, 1e300, allow_nan=False), st.sampled_from([0.0, -0.0, 1.0, 5e-324, 7.0])),
                max_size=200))
def test_equals_numpys_stable_argsort(values):
    """Ties (equal costs, 0.0 and -0.0), costs spanning every exponent (every digit pass), subnormals."""
    costs = np.array(values, dtype=np.float64)
    assert np.array_equal(_kernels.decreasing(costs), _numpy_order(costs))


@pytest.mark.parametrize("mixture", ["shipped", "heavy-tail-rare"])
def test_equals_numpys_stable_argsort_on_a_step_backbone(mixture):
    config, _, sizes = draw_sizes(list(MIXTURES[mixture]), 512, 16, "mllm_84b", 0)
    costs = phase_items(sizes, config.phases())["llm"].cost
    assert np.array_equal(_kernels.decreasing(costs), _numpy_order(costs))


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 3000), st.sampled_from([3, 1e3, 1e300]), st.integers(0, 2**31 - 1))
def test_increasing_equals_numpys_stable_argsort(size, spread, seed):
    """Bins by increasing load, ties by id, below and above the radix sort's threshold: loads of a few values
    (many ties, 0.0 and -0.0 among them), of every exponent (every digit pass), near one another (a balanced plan's
    loads differ in their last bits)."""
    rng = np.random.default_rng(seed)
    loads = {3: rng.choice([0.0, -0.0, 1.0, 2.0], size),
             1e3: 1e16 + rng.integers(0, 1000, size).astype(np.float64),
             1e300: rng.random(size) ** 50 * 1e300}[spread]
    assert np.array_equal(_kernels.increasing(loads), np.argsort(loads, kind="stable"))
