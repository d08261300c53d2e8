"""The pipeline schedule model (balance/pipeline_schedule.py) against an event-by-event reference written here
from megatron-core's loops, its closed forms, its lower bound against random plans, and the pipeline-aware
local search against the plan it starts from."""
import heapq

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.pipeline_schedule import PipelineSchedule


def megatron_order(p, v, stage, m, group):
    """A stage's operations as megatron-core's schedule loops issue them: (is_forward, chunk, micro-batch)."""
    if v == 1:
        warmup = min(p - stage - 1, m)
        remaining = m - warmup
        ops = [(True, 0, i) for i in range(warmup)]
        for i in range(remaining):
            ops += [(True, 0, warmup + i), (False, 0, i)]
        return ops + [(False, 0, remaining + i) for i in range(warmup)]
    table = []  # get_schedule_table
    for start in range(0, m, group):
        stop = m if start + group >= m else start + group
        table += [(mb, c) for c in range(v) for mb in range(start, stop)]
    total = m * v
    warmup = min((p - stage - 1) * 2 + (v - 1) * group, total)
    forward = lambda k: (True, table[k][1], table[k][0])  # noqa: E731
    backward = lambda k: (False, v - 1 - table[k][1], table[k][0])  # noqa: E731
    ops = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        ops += [forward(k + warmup), backward(k)]
    return ops + [backward(k) for k in range(total - warmup, total)]


def event_reference(p, v, costs, group=None, forward_share=1 / 3):
    """Step time by discrete events: every stage runs its operations in order; an operation starts once its
    stage is free and the activation (or gradient) it needs has arrived from the neighbouring virtual stage."""
    m = len(costs)
    nv = p * v
    orders = [megatron_order(p, v, s, m, group or p) for s in range(p)]
    arrived = {}  # (is_forward, virtual stage, micro-batch) -> time its input is there
    nxt = [0] * p
    free = [0.0] * p
    events = [(0.0, s) for s in range(p)]  # (time, stage): the stage looks at its next operation
    heapq.heapify(events)
    finish = 0.0
    waiting = {}  # needed key -> stage blocked on it
    while events:
        now, s = heapq.heappop(events)
        if nxt[s] >= len(orders[s]) or free[s] > now:
            continue
        is_forward, chunk, mb = orders[s][nxt[s]]
        k = chunk * p + s
        if is_forward:
            needs = None if k == 0 else (True, k, mb)
        else:
            needs = (False, k, mb)
        if needs is not None and needs not in arrived:
            waiting[needs] = s
            continue
        start = max(now, arrived.get(needs, 0.0))
        duration = costs[mb] * (forward_share if is_forward else 1 - forward_share) / nv
        end = start + duration
        nxt[s] += 1
        free[s] = end
        finish = max(finish, end)
        if is_forward:
            produced = (True, k + 1, mb) if k < nv - 1 else (False, k, mb)  # the last stage's loss starts its backward
        else:
            produced = (False, k - 1, mb) if k > 0 else None
        if produced is not None:
            arrived[produced] = end
            owner = produced[1] % p
            if waiting.pop(produced, None) is not None:
                heapq.heappush(events, (max(end, free[owner]), owner))
        heapq.heappush(events, (end, s))
    assert all(nxt[s] == len(orders[s]) for s in range(p)), "the reference deadlocked"
    return finish


@st.composite
def layouts(draw):
    p = draw(st.integers(1, 5))
    v = 1 if p == 1 else draw(st.integers(1, 3))
    group = None
    if v > 1:
        group = draw(st.sampled_from([None, p, p + 1]))
        g = group or p
        m = draw(st.integers(g, 3 * g + 2).filter(lambda m: not 0 < m % g < p))
    else:
        m = draw(st.integers(1, 12))
    costs = draw(st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=m, max_size=m))
    return p, v, group, costs


@settings(max_examples=300)
@given(layouts())
def test_the_model_equals_an_event_by_event_replay_of_megatrons_loops(layout):
    p, v, group, costs = layout
    schedule = PipelineSchedule(p, v, group)
    for s in range(p):
        ours = [(kind == 0, chunk, mb) for kind, chunk, mb in schedule.stage_order(s, len(costs))]
        assert ours == megatron_order(p, v, s, len(costs), group or p)
    model = float(schedule.replica_seconds(np.array([costs]))[0])
    assert model == pytest.approx(event_reference(p, v, costs, group), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p, v, m", [(1, 1, 5), (4, 1, 4), (4, 1, 16), (2, 2, 4), (4, 2, 16), (4, 4, 8)])
def test_equal_microbatches_take_the_textbook_bubble(p, v, m):
    """Equal micro-batches of cost c: (m + (p - 1) / v) c / p (1F1B's bubble, divided by the chunks)."""
    assert PipelineSchedule(p, v).replica_seconds(np.full((1, m), 3.0))[0] == pytest.approx((m + (p - 1) / v) * 3 / p)


def test_one_long_microbatch_crosses_every_stage_alone():
    """A micro-batch as long as all the others together paces the replica: it takes its whole cost on its own
    (forward through the four stages, backward back) while the others wait behind or ahead of it."""
    costs = np.ones((1, 8))
    costs[0, 3] = 40.0
    assert PipelineSchedule(4).replica_seconds(costs)[0] >= 40.0
    assert PipelineSchedule(4).replica_seconds(np.full((1, 8), 47 / 8))[0] < 20.0


def test_encoders_inside_the_first_stages_microbatches_pace_the_pipeline():
    """Upstream runs each micro-batch's encoders on the first stage: added to its first forward and backward.
    With 1 + 1 s of encoders per micro-batch the first stage works 4 x (2 + 0.5) = 10 s, and the second stage's
    short operations fit its gaps: the step is the first stage's work, against 2.5 s without encoders."""
    schedule = PipelineSchedule(2)
    assert schedule.replica_seconds(np.ones((1, 4)))[0] == pytest.approx(2.5)
    paced = schedule.replica_seconds(np.ones((1, 4)), first_forward=np.ones((1, 4)), first_backward=np.ones((1, 4)))[0]
    assert paced == pytest.approx(10.0)


@st.composite
def random_plans(draw):
    p = draw(st.integers(2, 4))
    v = draw(st.sampled_from([1, 2]))
    m = p * draw(st.integers(1, 3))
    replicas = draw(st.integers(1, 4))
    n = draw(st.integers(replicas * m, replicas * m + 10))
    costs = np.array(draw(st.lists(st.floats(0.01, 50.0), min_size=n, max_size=n)))
    fill = draw(st.booleans())  # every micro-batch holds an example
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    if fill:
        cells = np.concatenate([np.arange(replicas * m), rng.integers(0, replicas * m, n - replicas * m)])
        rng.shuffle(cells)
    else:
        cells = rng.integers(0, replicas * m, n)
    return PipelineSchedule(p, v), costs, replicas, m, cells // m, cells % m, fill


@settings(max_examples=300)
@given(random_plans())
def test_no_plan_runs_below_the_lower_bound(case):
    schedule, costs, replicas, m, replica, microbatch, fill = case
    steps = schedule.plan_seconds(costs, replica, microbatch, replicas, m)
    assert steps.max() >= schedule.lower_bound(costs, replicas, every_microbatch_holds_one=fill) * (1 - 1e-12)
    for r in range(replicas):  # and no replica below its own bound
        mine = replica == r
        loads = np.bincount(microbatch[mine], weights=costs[mine], minlength=m)
        assert steps[r] >= schedule.bound(loads.sum(), loads.min()) * (1 - 1e-12)


@settings(max_examples=100)
@given(random_plans(), st.booleans())
def test_the_local_search_keeps_every_example_and_never_slows_the_slowest_replica(case, equal_count):
    schedule, costs, replicas, m, _, _, _ = case
    n = costs.size
    rows = None
    if equal_count:
        n = replicas * m
        costs, rows = costs[:n], 1
    start = np.arange(n) % replicas
    start_steps = schedule.plan(costs, start, replicas, m, rows=rows, max_rounds=0)[2]
    bins, microbatch, steps = schedule.plan(costs, start, replicas, m, rows=rows)
    assert bins.shape == (n,) and set(bins.tolist()) <= set(range(replicas))
    assert ((microbatch >= 0) & (microbatch < m)).all()
    if equal_count:  # counts kept, one example per micro-batch
        assert (np.bincount(bins, minlength=replicas) == np.bincount(start, minlength=replicas)).all()
        assert len(set(zip(bins.tolist(), microbatch.tolist()))) == n
    assert steps == pytest.approx(schedule.plan_seconds(costs, bins, microbatch, replicas, m), rel=1e-12)
    assert steps.max() <= start_steps.max() * (1 + 1e-12)


def test_the_local_search_gives_the_replica_of_a_long_example_less_other_work():
    """Two replicas, PP 4, four micro-batches: one 12-unit example and 24 of 1. Balanced by sums, each replica
    holds 18 units, and the long one's replica takes 12 2/3 (its six short examples queue beside the long
    micro-batch's trip through the stages). The pipeline-aware plan moves them away and reaches the bound: the
    long example's own trip, 12."""
    schedule = PipelineSchedule(4)
    costs = np.array([12.0] + [1.0] * 24)
    sums = np.array([0] * 7 + [1] * 18)
    before = schedule.plan(costs, sums, 2, 4, max_rounds=0)[2].max()
    bins, microbatch, steps = schedule.plan(costs, sums, 2, 4)
    assert before == pytest.approx(12 + 2 / 3)
    assert steps.max() == pytest.approx(schedule.lower_bound(costs, 2)) == 12.0
    assert (bins[1:] == bins[0]).sum() < 6


def test_bad_layouts_and_microbatch_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="virtual stages need stages > 1"):
        PipelineSchedule(1, 2)
    with pytest.raises(ValueError, match="stages must be an int >= 1"):
        PipelineSchedule(0)
    with pytest.raises(ValueError, match="cannot run 5 micro-batches"):
        PipelineSchedule(4, 2).ops(5)
    with pytest.raises(ValueError, match="finite, >= 0"):
        PipelineSchedule(2).replica_seconds(np.array([[1.0, -1.0]]))
