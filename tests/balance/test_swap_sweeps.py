"""``_kernels.swap_sweeps`` alone, one sweep at a time: every swap it makes narrows its pair of bins (both
new loads strictly between the old ones), so the maximum never rises, the loads' sum of squares falls
and every bin keeps its item count. The partitioners refine its result afterwards, which would hide a
sweep that made a pair worse; here nothing does."""
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from megatron_orch.balance import _kernels


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
