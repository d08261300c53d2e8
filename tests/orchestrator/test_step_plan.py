"""The per-step plan: every item computed once per phase, outputs routed to their example's backbone
rank, equal micro-batch counts, determinism, and the edge cases of DESIGN.md section 4."""
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.step_model import StepModel
from megatron_orch.balance.topology import Topology
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.balance.workload import StepSizes, phase_items
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.step_plan import _microbatches, plan_step

TINY = load_model_config("tiny").phases()
CONFIGS = [OrchestratorConfig(background=False),
           OrchestratorConfig(microbatching="equal_count", background=False),
           OrchestratorConfig(locality=True, background=False),
           OrchestratorConfig(microbatching="equal_count", locality=True, background=False),
           OrchestratorConfig(placement="minmax", background=False),
           OrchestratorConfig(phases=("vision",), background=False),
           # the backbone judged by the pipeline schedule (the simulator's and bench.balance's planner with PP > 1)
           OrchestratorConfig(microbatching="equal_count", background=False, step_model=StepModel(pipeline_stages=4)),
           OrchestratorConfig(background=False, step_model=StepModel(tensor_parallel=2, pipeline_stages=2)),
           OrchestratorConfig(exchange_alike=True, background=False),
           OrchestratorConfig(microbatching="equal_count", locality=True, exchange_alike=True, background=False)]


def sizes_of(vision, audio, tokens, num_ranks):
    n = len(tokens)
    return StepSizes(counts=np.full(num_ranks, n // num_ranks), items={"vision": np.asarray(vision),
                     "audio": np.asarray(audio)}, num_tokens=np.asarray(tokens))


def check_plan(plan, sizes, config, mbs, num_mb):
    n = sizes.num_examples
    num_ranks = plan.examples_backbone.num_ranks
    # Every example on exactly one backbone rank (Placement validates slots), micro-batch in range.
    assert plan.examples_backbone.num_items == n
    assert plan.microbatch_of_example.min(initial=0) >= 0
    assert plan.microbatch_of_example.max(initial=0) < num_mb
    for r in range(num_ranks):
        mine = plan.examples_backbone.items_on(r)
        mb = plan.microbatch_of_example[mine]
        assert np.all(np.diff(mb) >= 0), "slot order must be micro-batch order"
        if config.microbatching == "equal_count":
            assert np.array_equal(np.bincount(mb, minlength=num_mb), np.full(num_mb, mbs))
    for phase, per_example in sizes.items.items():
        enc = plan.encoders[phase]
        assert np.array_equal(enc.example, np.repeat(np.arange(n), per_example))
        assert enc.home.same_as(plan.examples_home.expand(enc.example))  # the loader's placement, slots too
        out = plan.output_transfer(phase)
        assert np.array_equal(out.dst.rank, plan.examples_backbone.rank[enc.example])
        assert np.array_equal(out.src.rank, enc.encode.rank)
        if not config.balances(phase):
            assert np.array_equal(enc.encode.rank, enc.home.rank)
        # Outputs arrive in the order the backbone splices them: by example slot, then item.
        for r in range(num_ranks):
            arrived = out.dst.items_on(r)
            keys = [(plan.examples_backbone.slot[enc.example[i]], i) for i in arrived]
            assert keys == sorted(keys)
        stats = plan.stats[phase]
        assert stats.items == enc.example.size
        assert stats.max_after <= stats.max_before + 1e-6
    if config.step_model.pipeline_stages == 1:
        assert plan.stats["llm"].max_after <= plan.stats["llm"].max_before + 1e-6
    else:  # judged by the pipeline: its slowest replica no slower than the loader's plan through the schedule
        home_rank = plan.examples_home.rank
        loader = np.arange(n) % (mbs * num_mb) // mbs
        if config.packed:
            loader = _microbatches(home_rank, phase_items(sizes, TINY)["llm"].cost, sizes.num_tokens, num_ranks, mbs,
                                   num_mb, True, config.algorithm)
        assert slowest_replica(plan.examples_backbone.rank, plan.microbatch_of_example, sizes, config, num_mb) <= \
            slowest_replica(home_rank, loader, sizes, config, num_mb) * (1 + 1e-9)


def slowest_replica(rank, microbatch, sizes, config, num_mb):
    """The slowest replica's modeled pipelined backbone of a plan (every example's rank and micro-batch)."""
    cells = np.zeros((int(rank.max(initial=0)) + 1 if rank.size else 1, num_mb))
    np.add.at(cells, (rank, microbatch), config.step_model.compute_seconds(phase_items(sizes, TINY)["llm"].cost, False))
    return config.step_model.pipelined(cells).seconds


@st.composite
def steps(draw):
    num_ranks = draw(st.integers(1, 5))
    mbs, num_mb = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n = num_ranks * mbs * num_mb
    vision = draw(st.lists(st.integers(0, 9), min_size=n, max_size=n))
    audio = draw(st.lists(st.integers(0, 4), min_size=n, max_size=n))
    tokens = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    gpus = draw(st.sampled_from([1, 2, 4]))
    return sizes_of(vision, audio, tokens, num_ranks), mbs, num_mb, gpus


@settings(max_examples=40, deadline=None)
@given(steps(), st.sampled_from(CONFIGS))
def test_plan_routes_every_item_once(step, config):
    sizes, mbs, num_mb, gpus = step
    num_ranks = sizes.counts.size
    if config.locality and num_ranks % gpus:
        gpus = 1
    topology = Topology.uniform(num_ranks, gpus)
    plan = plan_step(sizes, TINY, config, topology, mbs, num_mb)
    check_plan(plan, sizes, config, mbs, num_mb)
    again = plan_step(sizes, TINY, config, topology, mbs, num_mb)
    assert again.digest == plan.digest


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.microbatching}-loc{c.locality}-{c.placement}-{c.phases}")
@pytest.mark.parametrize("case", ["no_images", "audio_on_some_ranks", "one_huge_example",
                                  "heavy_on_one_rank", "dp1"])
def test_edge_cases(case, config):
    rng = np.random.default_rng(7)
    num_ranks, mbs, num_mb = (1 if case == "dp1" else 4), 2, 2
    n = num_ranks * mbs * num_mb
    vision, audio, tokens = rng.integers(0, 6, n), rng.integers(0, 3, n), rng.integers(20, 120, n)
    if case == "no_images":
        vision[:] = 0
    elif case == "audio_on_some_ranks":
        audio[: n // 2] = 0
    elif case == "one_huge_example":
        vision[3], tokens[3] = 40, 2000
    elif case == "heavy_on_one_rank":
        vision[: mbs * num_mb], tokens[: mbs * num_mb] = 30, 1500
        vision[mbs * num_mb:], audio[mbs * num_mb:] = 0, 0
    sizes = sizes_of(vision, audio, tokens, num_ranks)
    plan = plan_step(sizes, TINY, config, Topology.uniform(num_ranks, 2 if num_ranks > 1 else 1), mbs, num_mb)
    check_plan(plan, sizes, config, mbs, num_mb)
    if case == "heavy_on_one_rank" and config.balances("vision"):
        assert plan.stats["vision"].imbalance_after < 1.1 < plan.stats["vision"].imbalance_before


def test_balances_a_realistic_batch():
    """DP 16 with 8 examples per rank drawn from the shipped traces: imbalance falls to the targets."""
    from megatron_orch.mllm.synthetic import SyntheticMultimodalDataset

    num_ranks, mbs, num_mb = 16, 2, 4
    n = num_ranks * mbs * num_mb
    dataset = SyntheticMultimodalDataset(load_model_config("tiny"), num_samples=n, seed=3, seq_length=1024)
    records = [dataset.example_sizes(i) for i in range(n)]
    sizes = sizes_of([r.num_items("vision") for r in records], [r.num_items("audio") for r in records],
                     [r.num_tokens for r in records], num_ranks)
    topology = Topology.uniform(num_ranks, 8)
    equal = plan_step(sizes, TINY, OrchestratorConfig(background=False), topology, mbs, num_mb)
    packed = plan_step(sizes, TINY, OrchestratorConfig(microbatching="packed", background=False), topology,
                       mbs, num_mb)
    for phase in ("vision", "audio"):
        assert equal.stats[phase].imbalance_before > 1.3
        assert equal.stats[phase].imbalance_after <= 1.05 * _granularity(equal.stats[phase], num_ranks)
    assert equal.stats["llm"].imbalance_after <= 1.15
    assert packed.stats["llm"].imbalance_after <= 1.05


def _granularity(stats, num_ranks):
    """Identical items cannot split: the best max/mean is ceil(items / K) / (items / K)."""
    return np.ceil(stats.items / num_ranks) / (stats.items / num_ranks) if stats.items else 1.0


def test_bad_sizes_are_rejected_before_planning():
    with pytest.raises(ValueError, match="DP rank 1 loaded 3 examples, expected"):
        plan_step(StepSizes(counts=np.array([4, 3]), items={"vision": np.zeros(7, int), "audio": np.zeros(7, int)},
                            num_tokens=np.ones(7, int)),
                  TINY, OrchestratorConfig(), Topology.uniform(2, 1), 2, 2)
    with pytest.raises(ValueError, match=r"items\['audio'\] has a negative entry at example 2"):
        StepSizes(counts=np.array([4]), items={"vision": np.zeros(4, int), "audio": np.array([0, 0, -1, 0])},
                  num_tokens=np.ones(4, int))
    with pytest.raises(ValueError, match="OrchestratorConfig.phases: the model has no phase 'text'; its phases are "
                                         "vision,audio,llm"):
        plan_step(sizes_of([0] * 4, [0] * 4, [5] * 4, 2), TINY, OrchestratorConfig(phases=("vision", "text")),
                  Topology.uniform(2, 1), 1, 2)
    with pytest.raises(ValueError, match="OrchestratorConfig.phases: repeated phases"):
        OrchestratorConfig(phases=("vision", "vision"))


def test_three_encoder_phases_are_planned_and_balanced():
    """tiny_video's vision, video and audio phases: each routed once to its example's backbone rank, each
    balanced; --orch-phases leaves the ones it does not name where they were loaded."""
    phases = load_model_config("tiny_video").phases()
    rng = np.random.default_rng(5)
    num_ranks, mbs, num_mb = 4, 2, 2
    n = num_ranks * mbs * num_mb
    items = {name: rng.integers(0, 5, n) for name in phases.encoder_names}
    items["video"][: mbs * num_mb] = 12  # every long video on rank 0
    sizes = StepSizes(counts=np.full(num_ranks, mbs * num_mb), items=items, num_tokens=rng.integers(40, 200, n))
    for config in (OrchestratorConfig(background=False), OrchestratorConfig(phases=("video", "llm"), background=False)):
        plan = plan_step(sizes, phases, config, Topology.uniform(num_ranks, 2), mbs, num_mb)
        check_plan(plan, sizes, config, mbs, num_mb)
        assert list(plan.stats) == ["vision", "video", "audio", "llm"]
        assert plan.stats["video"].imbalance_after < 1.1 < plan.stats["video"].imbalance_before


def test_the_backbone_is_planned_per_context_parallel_rank():
    """With CP 2 every example's backbone cost and memory are halved (lengths a multiple of 4): the same plan,
    half the per-rank figures; the encoder phases are untouched (encoders run whole on every CP rank)."""
    sizes = sizes_of([1, 0, 3, 2], [0, 2, 1, 0], [40, 12, 96, 20], 2)
    whole, split = (plan_step(sizes, TINY, OrchestratorConfig(background=False, context_parallel_size=cp),
                              Topology.uniform(2, 1), 1, 2) for cp in (1, 2))
    assert np.array_equal(whole.examples_backbone.rank, split.examples_backbone.rank)
    assert split.stats["llm"].mean == pytest.approx(whole.stats["llm"].mean / 2)
    assert split.memory.phase_peak["llm"] == pytest.approx(whole.memory.phase_peak["llm"] / 2)
    for phase in ("vision", "audio"):
        assert split.stats[phase].mean == pytest.approx(whole.stats[phase].mean)
    with pytest.raises(ValueError, match="OrchestratorConfig.context_parallel_size must be >= 1"):
        OrchestratorConfig(context_parallel_size=0)


def test_auto_micro_batching_packs_unless_the_backbone_cannot():
    auto = OrchestratorConfig()
    assert auto.microbatching == "auto" and auto.packed  # plan_step plans auto as packed
    assert auto.resolve_microbatching(None).microbatching == "packed"
    assert auto.resolve_microbatching("its forward takes no THD parameters").microbatching == "equal_count"
    equal = OrchestratorConfig(microbatching="equal_count")
    assert equal.resolve_microbatching(None) is equal and not equal.packed
    with pytest.raises(ValueError, match="OrchestratorConfig.microbatching packed: its forward takes no THD parameters"):
        OrchestratorConfig(microbatching="packed").resolve_microbatching("its forward takes no THD parameters")


def _slowdown_reference(candidate, reference, items, rank_of_item, home, topology, config, backbone_seconds):
    """``_SlowerThan`` written from the step model's definition, each move's bytes summed over the hops the
    configured all-to-all runs (``Transfer.hops``: the flat transfer, or the node-wise one's two)."""
    from megatron_orch.balance.plan import MovedBytes, Placement, Transfer, moved_bytes
    from megatron_orch.balance.step_model import Busiest, PipelinedBackbone

    node, num_ranks, model = topology.node_of_rank, topology.num_ranks, config.step_model

    def move(src, dst, nbytes):
        transfer = Transfer(Placement.from_ranks(src, num_ranks), Placement.from_ranks(dst, num_ranks))
        hops = [moved_bytes(h.src.rank, h.dst.rank, nbytes, node) for h in transfer.hops(config.all_to_all, node)]
        summed = [sum(getattr(h, name) for h in hops) for name in ("intra_node", "inter_node", "sent_intra",
                                                                   "received_intra", "sent_inter", "received_inter")]
        return Busiest.of(MovedBytes(hops[0].total, *summed, hops[0].connections,
                                     node_wise=config.all_to_all == "node-wise"))

    encoders = [(phase, model.compute_seconds(np.bincount(rank, weights=items[phase].cost,
                                                          minlength=num_ranks).max(), False))
                for phase, (_, rank, _) in rank_of_item.items()]
    inputs = [move(home[example], rank, items[phase].nbytes) for phase, (example, rank, _) in rank_of_item.items()]

    def figures(backbone_rank):
        embeddings = {phase: move(rank, backbone_rank[example], out) for phase, (example, rank, out)
                      in rank_of_item.items()}
        return (PipelinedBackbone(backbone_seconds(backbone_rank), 0.0), embeddings,
                inputs + [move(home, backbone_rank, items["llm"].nbytes)])

    ours, theirs = figures(candidate), figures(reference)
    moves = [*ours[1].values(), *theirs[1].values(), *ours[2], *theirs[2]]
    worst = -np.inf
    for nic in model.nic_breakpoints(moves, model.lowest_nic_gbits_per_s):
        at = model.with_nic(nic)
        worst = max(worst, at.step(encoders, *ours)["step"] / at.step(encoders, *theirs)["step"] - 1.0)
    return worst


def test_the_locality_decision_times_the_configured_all_to_all():
    """plan_step keeps a locality plan only where the step model finds it no slower than the plain one
    (``_SlowerThan``); it times every move as the configured all-to-all runs it, so under node-wise by its two
    hops (one after the other, a latency each), not by the flat exchange's single one."""
    from megatron_orch.balance.workload import phase_items
    from megatron_orch.orchestrator.step_plan import _SlowerThan

    rng = np.random.default_rng(3)
    num_ranks, per_rank = 16, 6
    n = num_ranks * per_rank
    sizes = sizes_of(rng.integers(0, 4, n), rng.integers(0, 3, n), rng.integers(16, 400, n), num_ranks)
    items = phase_items(sizes, TINY)
    topology = Topology.uniform(num_ranks, 4)
    home = np.repeat(np.arange(num_ranks), per_rank)
    rank_of_item = {phase: (items[phase].example, rng.integers(0, num_ranks, items[phase].example.size),
                            items[phase].output_nbytes) for phase in ("vision", "audio")}
    candidate, reference = rng.permutation(home), rng.permutation(home)

    def backbone_seconds(rank):
        return np.bincount(rank, weights=items["llm"].cost, minlength=num_ranks).max() / 400e12

    def pipelined(rank):
        from megatron_orch.balance.step_model import PipelinedBackbone
        return PipelinedBackbone(backbone_seconds(rank), 0.0)

    slowdowns = {}
    for all_to_all in ("flat", "node-wise"):
        config = OrchestratorConfig(background=False, all_to_all=all_to_all)
        slowdowns[all_to_all], _ = _SlowerThan(reference, items, rank_of_item, home, topology, pipelined,
                                               config)(candidate)
        expected = _slowdown_reference(candidate, reference, items, rank_of_item, home, topology, config,
                                       backbone_seconds)
        assert slowdowns[all_to_all] == pytest.approx(expected, rel=1e-9, abs=1e-12), all_to_all
    assert slowdowns["flat"] != pytest.approx(slowdowns["node-wise"], rel=1e-6)  # the exchanges time differently


def test_a_pipelined_backbone_plan_runs_no_slower_through_the_schedule_than_the_sum_balanced_one():
    """With PP 4 in the step model, a batch with one long example gets the pipeline-aware backbone plan, whose
    slowest replica's modeled pipelined step is shorter than the sum-balanced plan's."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(50, 400, 32)
    tokens[5] = 3000
    sizes = sizes_of(rng.integers(0, 3, 32), rng.integers(0, 2, 32), tokens, 4)
    summed = OrchestratorConfig(microbatching="equal_count", background=False, verify_first_step=False)
    pipelined = OrchestratorConfig(microbatching="equal_count", background=False, verify_first_step=False,
                                   step_model=StepModel(pipeline_stages=4))
    topology = Topology.uniform(4, 4)
    by_sums, by_pipeline = (plan_step(sizes, TINY, config, topology, 1, 8) for config in (summed, pipelined))
    assert by_pipeline.stats["llm"].method.endswith("+pipelined")
    assert not by_sums.stats["llm"].method.endswith("+pipelined")
    check_plan(by_pipeline, sizes, pipelined, 1, 8)
    assert slowest_replica(by_pipeline.examples_backbone.rank, by_pipeline.microbatch_of_example, sizes, pipelined, 8) \
        < slowest_replica(by_sums.examples_backbone.rank, by_sums.microbatch_of_example, sizes, pipelined, 8)


@pytest.mark.parametrize("plain", [OrchestratorConfig(background=False),
                                   OrchestratorConfig(microbatching="equal_count", background=False),
                                   OrchestratorConfig(locality=True, background=False),
                                   OrchestratorConfig(step_model=StepModel(pipeline_stages=2), background=False)],
                         ids=["packed", "equal_count", "locality", "pp2"])
def test_exchanging_alike_examples_keeps_the_balance_and_pulls_from_fewer_ranks(plain):
    """``exchange_alike``: every rank's backbone examples, micro-batch by micro-batch, cost what the plain plan's
    do (so the same balance, stats and step time), every example on one rank; and on a batch of few distinct
    lengths each rank's text comes from fewer ranks, with fewer bytes across nodes."""
    from megatron_orch.balance.plan import Connections
    from megatron_orch.balance.workload import phase_items
    from megatron_orch.orchestrator.step_plan import step_transfers

    rng = np.random.default_rng(3)
    num_ranks, mbs, num_mb = 32, 2, 4
    n = num_ranks * mbs * num_mb
    sizes = sizes_of(rng.integers(0, 3, n), rng.integers(0, 2, n), rng.choice([40, 80, 160, 320], n), num_ranks)
    topology = Topology.uniform(num_ranks, 4)
    plans = [plan_step(sizes, TINY, dataclasses.replace(plain, exchange_alike=on), topology, mbs, num_mb)
             for on in (False, True)]
    for plan in plans:
        check_plan(plan, sizes, plain, mbs, num_mb)
    costs = phase_items(sizes, TINY)["llm"].cost

    def cells(plan):  # each rank's micro-batch costs
        rank = plan.examples_backbone.rank
        per_cell = np.bincount(rank * num_mb + plan.microbatch_of_example, weights=costs,
                               minlength=num_ranks * num_mb).reshape(num_ranks, num_mb)
        return np.sort(per_cell, axis=1)

    np.testing.assert_allclose(cells(plans[1]), cells(plans[0]), rtol=1e-12)
    assert [s.max_after for s in plans[1].stats.values()] == [s.max_after for s in plans[0].stats.values()]
    assert plans[1].step_time == plans[0].step_time
    items = phase_items(sizes, TINY)
    text = [next(move for move in step_transfers(plan, items) if move.name == "text") for plan in plans]
    peers = [move.moved_bytes(topology.node_of_rank, "flat").connections.peers(topology.node_of_rank).total.sum()
             for move in text]
    inter = [plan.report()["inter-node MB"] for plan in plans]
    assert peers[1] < peers[0] and inter[1] <= inter[0], (peers, inter)
