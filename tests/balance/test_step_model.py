"""The step model (the simulator's, and what locality-aware planning compares plans by): its schedule by hand,
and the property that a locality-aware plan's modeled step is never above the plain plan's, at any NIC
bandwidth, judged from the plans' own transfers (not from the planner's figures)."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.step_model import Busiest, LinkModel, StepModel
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import StepSizes, phase_items
from megatron_orch.bench.common import MIXTURES, PLAN_METHODS, draw_sizes
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import plan_step, step_transfers

TINY = load_model_config("tiny")
GB = 1e9


def test_the_schedule_by_hand():
    link = LinkModel(nvlink_gbytes_per_s=100.0, nic_gbits_per_s=80.0, nvlink_latency_us=0.0, nic_latency_us=0.0)
    model = StepModel(link=link, pipeline_stages=2, virtual_stages=2)
    vision, audio = Busiest(0.0, 20 * GB, False, True), Busiest(0.0, 5 * GB, False, True)  # 2 s and 0.5 s
    parts = model.step([("vision", 6.0), ("audio", 3.0)], model.pipelined_even(8.0, 4),
                       embeddings={"vision": vision, "audio": audio})
    # forward: vision 2 s, its move 2 s while audio encodes 1 s, audio's 0.5 s after: 2 + 2 + 0.5
    assert parts["encoders_forward"] == pytest.approx(4.5)
    # backbone: 8 s over 2 stages, bubble (2 - 1) / (2 x 4)
    assert parts["backbone"] == pytest.approx(4.0 * (1 + 1 / 8)) and parts["pipeline_bubble"] == pytest.approx(0.5)
    # backward: vision's gradients in after 2 s, its backward 4 s, audio's in long before: 2 + 4 + 2
    assert parts["encoders_backward"] == pytest.approx(8.0)
    assert parts["exposed_moves"] == pytest.approx(4.5 + 8.0 - 9.0)
    assert parts["step"] == pytest.approx(4.5 + 4.5 + 8.0)
    serial = dataclasses.replace(model, overlap=False).step([("vision", 6.0), ("audio", 3.0)],
                                                             model.pipelined_even(8.0, 4),
                                                             {"vision": vision, "audio": audio})
    assert serial["step"] == pytest.approx(9.0 + 4.5 + 2 * 2.5)


def test_the_gradient_reduction_by_hand():
    link = LinkModel(nic_gbits_per_s=80.0, nic_latency_us=0.0)  # 10 GB/s
    model = StepModel(link=link, grad_bytes=10 * GB, encoder_grad_bytes=1 * GB, bucket_bytes=1 * GB)
    ring = 2 * 3 / 4  # 4 ranks, one per node: 2 (n - 1) / n of the bytes through the NIC
    one_second = model.pipelined_even(1.0, 1)
    assert model.step([], one_second, {}, dp=4)["grad_reduce"] == pytest.approx(ring * 2 * GB / (10 * GB))
    assert dataclasses.replace(model, overlap=False).step([], one_second, {}, dp=4)["grad_reduce"] == pytest.approx(
        ring * 10 * GB / (10 * GB))
    fsdp = dataclasses.replace(model, fsdp=True).step([], one_second, {}, dp=4)["grad_reduce"]
    assert fsdp == pytest.approx(1.5 * ring - 1.0 + ring * 0.1 / 2)  # beyond the compute, and the first bucket
    assert model.step([], one_second, {}, dp=1)["grad_reduce"] == 0.0


def modeled_step(plan, items, model: StepModel, topology: Topology) -> float:
    """The simulator's step of ``plan`` (DP only), from its transfers and its phases' loads."""
    node = topology.node_of_rank
    moves = {m.name: Busiest.of(m.moved_bytes(node)) for m in step_transfers(plan, items)}
    encoders = [(p, model.compute_seconds(plan.stats[p].max_after, False)) for p in plan.encoders]
    backbone = model.pipelined_even(model.compute_seconds(plan.stats[plan.backbone].max_after, False),
                                    plan.num_microbatches)
    return model.step(encoders, backbone, {p: moves[f"{p} embeddings"] for p in plan.encoders},
                      [moves[f"{p} inputs"] for p in plan.encoders] + [moves["text"]])["step"]


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_the_locality_plan_is_never_slower_than_the_plain_plan(data):
    gpus, nodes = data.draw(st.sampled_from([2, 4])), data.draw(st.integers(2, 4))
    per_rank = data.draw(st.integers(1, 6))
    dp, n = gpus * nodes, gpus * nodes * per_rank
    sizes = StepSizes(counts=np.full(dp, per_rank), num_tokens=np.array(data.draw(st.lists(
        st.integers(1, 900), min_size=n, max_size=n))), items={
        phase: np.array(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
        for phase in ("vision", "audio")})
    sizes = StepSizes(sizes.counts, sizes.items, sizes.num_tokens + sum(
        sizes.items[p] * TINY.phases().encoder(p).output_rows for p in sizes.items))
    # a slow network makes bytes matter: a slower locality plan would show
    step_model = StepModel(link=LinkModel(nic_gbits_per_s=data.draw(st.sampled_from([1.0, 25.0, 400.0]))),
                           tflops=data.draw(st.sampled_from([1e-6, 1e-3, 1.0])))
    microbatching = data.draw(st.sampled_from(["packed", "equal_count"]))
    topology = Topology.uniform(dp, gpus)
    plans = {locality: plan_step(sizes, TINY.phases(), dataclasses.replace(
        PLAN_METHODS["orch"], microbatching=microbatching, locality=locality, step_model=step_model),
        topology, 1, per_rank) for locality in (False, True)}
    items = phase_items(sizes, TINY.phases())
    for nic in np.geomspace(1.0, step_model.link.nic_gbits_per_s, 5):
        at = step_model.with_nic(float(nic))
        assert modeled_step(plans[True], items, at, topology) <= modeled_step(plans[False], items, at, topology) * (
            1 + 1e-9), (nic, plans[True].stats["llm"].method)


def test_a_realistic_locality_plan_is_kept_and_moves_few_bytes_across_nodes():
    """A heavy-tailed DP 64 batch of the 84B model: the locality plan is kept (as balanced, no slower at any
    bandwidth) and sends a small share of the plain plan's bytes across nodes."""
    config, _, sizes = draw_sizes(list(MIXTURES["heavy-tail"]), 64, 16, "mllm_84b", 1)
    topology = Topology.uniform(64, 8)
    near = plan_step(sizes, config.phases(), PLAN_METHODS["locality"], topology, 1, 16)
    plain = plan_step(sizes, config.phases(), PLAN_METHODS["orch"], topology, 1, 16)
    assert near.stats["llm"].method.startswith("locality"), near.stats["llm"].method
    assert near.stats["llm"].max_after <= plain.stats["llm"].max_after
    share = {name: sum(m.inter_node for m in plan.traffic.values()) / sum(m.total for m in plan.traffic.values())
             for name, plan in (("near", near), ("plain", plain))}
    assert share["near"] < 0.25 < share["plain"], share


@pytest.mark.parametrize("dp,replicas_per_node,crosses", [(8, 8, False), (4, 8, False), (9, 8, True), (16, 8, True)])
def test_the_gradient_ring_crosses_nodes_only_when_the_dp_group_outgrows_one(dp, replicas_per_node, crosses):
    """A DP group that exactly fills a node reduces over NVLink; one more replica sends it through the NIC."""
    link = LinkModel(nvlink_gbytes_per_s=100.0, nic_gbits_per_s=80.0, nvlink_latency_us=0.0, nic_latency_us=0.0)
    model = StepModel(link=link, grad_bytes=10 * GB, encoder_grad_bytes=1 * GB, bucket_bytes=1 * GB)
    ring = 2 * (dp - 1) / dp * 2 * GB  # the encoders' gradients and the last bucket, behind nothing
    expected = ring / (10 * GB) if crosses else ring / (100 * GB)
    assert model.step([], model.pipelined_even(1.0, 1), {}, dp=dp, replicas_per_node=replicas_per_node)[
        "grad_reduce"] == pytest.approx(expected)
