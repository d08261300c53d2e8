"""``_kernels.swap_sweeps`` alone, one sweep at a time: every swap it makes narrows its pair of bins (both
new loads strictly between the old ones), so the maximum never rises, the loads' sum of squares falls
and every bin keeps its item count. The partitioners refine its result afterwards, which would hide a
sweep that made a pair worse; here nothing does."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swap_sweeps_reference import swap_sweeps_reference

from megatron_orch.balance import _kernels
from megatron_orch.balance.partition import _decreasing
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import MIXTURES, draw_sizes


def _one_sweep(costs, bins, num_bins, group_size=None):
    costs = np.asarray(costs, dtype=np.float64)
    order = np.argsort(-costs, kind="stable")
    after = np.asarray(bins, dtype=np.int64).copy()
    _kernels.swap_sweeps(costs, order, num_bins, after, 0.0, 1, group_size or num_bins)
    return after


def _loads(costs, bins, num_bins):
    return np.bincount(bins, weights=np.asarray(costs, dtype=np.float64), minlength=num_bins)


def test_a_swap_that_would_raise_the_heavier_bin_is_not_made():
    """Bin 0 holds 10 + 5, bin 1 holds 12: swapping 10 for 12 would bring bin 0 to 17; no swap of these
    items narrows the pair (a cost difference strictly between 0 and the gap of 3), so none is made."""
    costs, bins = [10.0, 5.0, 12.0], [0, 0, 1]
    assert list(_one_sweep(costs, bins, 2)) == bins


def test_a_swap_that_narrows_the_pair_is_made():
    costs, bins = [10.0, 5.0, 4.0], [0, 0, 1]  # 15 vs 4: swapping 10 for 4 gives 9 and 10
    after = _one_sweep(costs, bins, 2)
    assert sorted(_loads(costs, after, 2)) == [9.0, 10.0]


@given(st.integers(2, 6).flatmap(lambda num_bins: st.tuples(
    st.just(num_bins),
    st.lists(st.tuples(st.integers(1, 50), st.integers(0, num_bins - 1)), min_size=2, max_size=30),
    st.sampled_from([1, 2, num_bins]))))
def test_every_sweep_narrows_the_pairs_it_swaps(case):
    num_bins, items, group_size = case
    costs = [float(cost) for cost, _ in items]
    bins = [b for _, b in items]
    after = _one_sweep(costs, bins, num_bins, group_size)
    before_loads, after_loads = _loads(costs, bins, num_bins), _loads(costs, after, num_bins)
    assert np.array_equal(np.bincount(after, minlength=num_bins), np.bincount(bins, minlength=num_bins))
    assert after_loads.max() <= before_loads.max()
    changed = after_loads != before_loads
    if changed.any():
        assert (after_loads ** 2).sum() < (before_loads ** 2).sum()
        # a swapped bin stays within the span of its group's old loads, strictly inside it
        for b in np.flatnonzero(changed):
            group = slice(b // group_size * group_size, min(num_bins, (b // group_size + 1) * group_size))
            assert before_loads[group].min() < after_loads[b] < before_loads[group].max()


def _both(costs, bins, num_bins, stop_at, max_sweeps, group_size):
    """(bins, sweeps) of the compiled swap_sweeps and of its reference, from the same start."""
    order = _decreasing(costs)
    ours, theirs = bins.copy(), bins.copy()
    sweeps = _kernels.swap_sweeps(costs, order, num_bins, ours, stop_at, max_sweeps, group_size)
    expected = swap_sweeps_reference(costs, order, num_bins, theirs, stop_at, max_sweeps, group_size)
    return (ours, sweeps), (theirs, expected)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9), st.data())
def test_equals_the_sweeps_that_relist_every_bin(num_bins, data):
    """Every swap, sweep count and load decision as the reference (every bin's load and items listed again from
    all items at each sweep) makes them: ties of equal costs, bins of many items (sorted, not by insertion),
    groups, a stop above the minimum, sums that depend on their order (1e16 + 1 + 1)."""
    n = data.draw(st.integers(0, 120))
    value = st.one_of(st.integers(0, 9).map(float), st.floats(0, 1e3, allow_nan=False), st.sampled_from([0.1, 1e16]))
    costs = np.array(data.draw(st.lists(value, min_size=n, max_size=n)), dtype=np.float64)
    bins = np.array(data.draw(st.lists(st.integers(0, num_bins - 1), min_size=n, max_size=n)), dtype=np.int64)
    group_size = data.draw(st.sampled_from(sorted({1, 2, 3, num_bins})))
    stop_at = data.draw(st.sampled_from([0.0, float(costs.sum()) / num_bins]))
    (ours, sweeps), (theirs, expected) = _both(costs, bins, num_bins, stop_at, data.draw(st.integers(1, 16)),
                                               group_size)
    assert sweeps == expected and np.array_equal(ours, theirs)


@pytest.mark.parametrize("mixture", ["shipped", "heavy-tail-rare"])
def test_equals_the_reference_on_a_step_backbone(mixture):
    """A DP 512 batch's backbone (8,192 examples) from a round robin start: 16 sweeps of hundreds of swaps."""
    config, _, sizes = draw_sizes(list(MIXTURES[mixture]), 512, 16, "mllm_84b", 0)
    costs = phase_items(sizes, config.phases())["llm"].cost
    start = np.arange(costs.size, dtype=np.int64) % 512
    (ours, sweeps), (theirs, expected) = _both(costs, start, 512, 0.0, 16, 512)
    assert sweeps == expected > 1 and np.array_equal(ours, theirs) and not np.array_equal(ours, start)

