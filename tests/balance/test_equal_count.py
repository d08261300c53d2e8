"""The equal-count partitioner (the default backbone plan) against CP-SAT's optimum on small heavy-tailed
batches and against its lower bound on large ones, the bound against brute force, and the greedy by room per free
slot against its plain Python definition."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from ortools.sat.python import cp_model

from megatron_orch.balance._kernels import decreasing, slot_lpt
from megatron_orch.balance.partition import equal_count_lower_bound, partition_equal_count
from megatron_orch.balance.traces import HEAVY_TAILED_MIXTURES
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import draw_sizes

from test_partition import brute_force_opt, check_assignment


def backbone_costs(mixture: str, dp: int, per_rank: int, seed: int) -> np.ndarray:
    """The backbone item costs (training FLOPs of mllm_84b) of a global batch drawn from a mixture."""
    config, _, sizes = draw_sizes(list(HEAVY_TAILED_MIXTURES[mixture]), dp, per_rank, "mllm_84b", seed)
    return phase_items(sizes, config.phases())["llm"].cost


def cp_sat_equal_count_optimum(costs: np.ndarray, num_bins: int) -> float:
    """The exact equal-count min-max (integer costs), proven optimal by CP-SAT (one worker: deterministic)."""
    n = costs.size
    model = cp_model.CpModel()
    x = [[model.new_bool_var("") for _ in range(num_bins)] for _ in range(n)]
    top = model.new_int_var(0, int(costs.sum()), "top")
    for i in range(n):
        model.add_exactly_one(x[i])
    for b in range(num_bins):
        model.add(sum(x[i][b] for i in range(n)) == n // num_bins)
        model.add(sum(int(costs[i]) * x[i][b] for i in range(n)) <= top)
    model.add(x[int(np.argmax(costs))][0] == 1)  # bins are interchangeable
    model.minimize(top)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 60
    assert solver.solve(model) == cp_model.OPTIMAL, "CP-SAT did not prove its optimum within 60 s"
    return solver.objective_value


def test_within_one_percent_of_cp_sat_on_small_heavy_tailed_batches():
    """3 ranks x 8 examples of the heavy-tailed mixture (costs rounded to integers for CP-SAT). The
    constructions alone miss the optimum by more than 1% on some of these: refinement closes it."""
    worst, worst_unrefined = 1.0, 1.0
    for seed in range(7):
        costs = backbone_costs("heavy-tail", 3, 8, seed)
        costs = np.round(costs / costs.max() * 1e5)
        opt = cp_sat_equal_count_optimum(costs, 3)
        part = partition_equal_count(costs, 3)
        check_assignment(part, costs, 3)
        assert (part.counts() == 8).all()
        assert part.lower_bound <= opt <= part.max_cost
        worst = max(worst, part.max_cost / opt)
        worst_unrefined = max(worst_unrefined, partition_equal_count(costs, 3, refine=False).max_cost / opt)
    assert worst <= 1.01, worst
    assert worst_unrefined > 1.01, worst_unrefined  # the test sees a partitioner that does not refine


@pytest.mark.parametrize("mixture", sorted(HEAVY_TAILED_MIXTURES))
def test_within_a_tenth_of_a_percent_of_the_bound_on_large_heavy_tailed_batches(mixture):
    """512 ranks x 16 examples: a few hundred long examples (documents, 1-10 minute clips, chats) among
    short ones. Count-capped LPT and equal-count KK with one-for-one refinement stayed 4-7% above the
    bound here."""
    unrefined = []
    for seed in (1, 2):
        costs = backbone_costs(mixture, 512, 16, seed)
        part = partition_equal_count(costs, 512)
        assert (part.counts() == 16).all()
        assert part.lower_bound == equal_count_lower_bound(costs, 512)
        assert part.max_over_lb <= 1.001, (seed, part.max_over_lb, part.method)
        unrefined.append(partition_equal_count(costs, 512, refine=False).max_over_lb)
    assert max(unrefined) > 1.002, unrefined  # the test sees a partitioner that does not refine


def test_lower_bound_counts_long_items_competing_for_short_ones():
    # 18 and 15 in different bins take the four smallest between them at best: (18 + 15 + 4 + 10) / 2;
    # together they would make 33. The largest item alone (18 + 4) and the mean (22.3) say less.
    costs = [18.0, 15.0, 10.0, 10.0, 10.0, 4.0]
    assert equal_count_lower_bound(costs, 3) == 23.5
    assert brute_force_opt(costs, 3, equal_count=True) == 25.0
    assert partition_equal_count(costs, 3).max_cost == 25.0


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.data())
def test_lower_bound_never_exceeds_the_brute_force_optimum(num_bins, per_bin, data):
    n = num_bins * per_bin
    costs = data.draw(st.lists(st.one_of(st.integers(0, 30), st.integers(100, 400)).map(float),
                               min_size=n, max_size=n))
    opt = brute_force_opt(costs, num_bins, equal_count=True)
    assert equal_count_lower_bound(costs, num_bins) <= opt * (1 + 1e-12)
    assert partition_equal_count(costs, num_bins).max_cost >= opt * (1 - 1e-12)


def slot_lpt_reference(costs, order, num_bins, per_bin, target):
    """slot_lpt's definition: each item in ``order`` to the bin with a free slot of the smallest (load - target)
    / free slots, ties by id."""
    load, free = [0.0] * num_bins, [per_bin] * num_bins
    bins = [0] * len(costs)
    for item in order:
        b = min((b for b in range(num_bins) if free[b]), key=lambda b: ((load[b] - target) / free[b], b))
        bins[item] = b
        load[b] += costs[item]
        free[b] -= 1
    return bins


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 12), st.integers(1, 6), st.floats(0.0, 200.0), st.data())
def test_slot_lpt_follows_its_definition(num_bins, per_bin, target, data):
    # small integer costs and zeros: equal keys across bins, ties broken by id; a target below the loads
    n = num_bins * per_bin
    costs = np.array(data.draw(st.lists(st.one_of(st.integers(0, 4), st.integers(0, 60)).map(float),
                                        min_size=n, max_size=n)))
    order = decreasing(costs)
    bins = np.zeros(n, dtype=np.int64)
    slot_lpt(costs, order, num_bins, per_bin, target, bins)
    assert bins.tolist() == slot_lpt_reference(costs.tolist(), order.tolist(), num_bins, per_bin, target)


def test_slot_lpt_breaks_ties_among_the_bins_that_took_an_item_by_id():
    # bins that took an item in one pass tie on their keys with each other and with a bin still waiting: only
    # the ids order them (a case where comparing keys alone among the bins that took an item goes wrong)
    costs = np.array([2.0, 3.0, 1.0, 1.0, 2.0, 2.0, 3.0, 0.0, 1.0, 0.0, 3.0, 2.0, 0.0, 0.0, 3.0])
    order = decreasing(costs)
    bins = np.zeros(costs.size, dtype=np.int64)
    slot_lpt(costs, order, 5, 3, 5.0, bins)
    assert bins.tolist() == slot_lpt_reference(costs.tolist(), order.tolist(), 5, 3, 5.0)
