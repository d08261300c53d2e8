"""The encoders on every pipeline stage, torch-free: which encoder-group rank encodes each item (balanced over
DP x PP, and over DP x PP x TP / encoder TP at an encoder TP of their own, every item once), the step's moves over
the encoder group (the outputs copied to every encoder replica of the backbone's TP group, the gradients back from
the first), the layouts refused, the config and its flags; the encoders on ranks of their own (MIMO's non-colocated
grids): each phase balanced over them, every item once, the outputs to every TP rank of their example's backbone DP
rank in the order the DP plan delivers them, the gradients back from its TP rank 0."""
import argparse
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from megatron_orch.balance.plan import Placement, Transfer
from megatron_orch.balance.step_model import ENCODER_RANKS
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import phase_items
from megatron_orch.megatron.orch_arguments import (CONFIG_FLAGS, add_orch_args, encoder_ranks_unsupported, flag_setting,
                                                   orch_config_from_args)
from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.config import ConfigError, EncoderRanks, OrchestratorConfig, config_setting
from megatron_orch.orchestrator.encoder_ranks import (CopiedStepMove, OwnEncoderRanks, PlannedStep,
                                                      decide_encoder_ranks, encode_on_own_ranks, group_moves,
                                                      group_traffic, own_ranks_moves, own_ranks_refusal,
                                                      read_step_message, spread_over_stages, stage_of_items,
                                                      step_message, unsupported_layout)
from megatron_orch.orchestrator.step_plan import plan_step, step_moves
from test_step_plan import sizes_of

TINY = load_model_config("tiny").phases()


@given(counts=st.lists(st.integers(0, 11), min_size=1, max_size=5), pipeline=st.integers(1, 4),
       rotation=st.integers(0, 3))
@settings(max_examples=60, deadline=None)
def test_stage_of_items_splits_each_rank_in_runs_of_consecutive_slots(counts, pipeline, rotation):
    encode = Placement.from_counts(counts)
    stage = stage_of_items(encode, pipeline, rotation)
    for rank, count in enumerate(counts):
        ids = encode.items_on(rank)
        stages = stage[ids]
        assert np.all(np.diff(stages) >= 0)  # consecutive slots per stage, stages in order
        sizes = np.bincount(stages, minlength=pipeline)
        assert sizes.max() - sizes.min() <= 1 and sizes.sum() == count
        longer = [(s - rotation) % pipeline < count % pipeline for s in range(pipeline)]
        assert [bool(size > count // pipeline) for size in sizes] == longer


def _sizes(num_ranks=2, seed=0, n=8):
    rng = np.random.default_rng(seed)
    return sizes_of(rng.integers(0, 6, n), rng.integers(0, 3, n), rng.integers(20, 120, n), num_ranks)


def _plan(num_ranks=2, seed=0, n=8, gpus_per_node=None):
    config = OrchestratorConfig(background=False, microbatching="equal_count")
    return plan_step(_sizes(num_ranks, seed, n), TINY, config,
                     Topology.uniform(num_ranks, gpus_per_node or num_ranks), 2, n // num_ranks // 2)


@pytest.mark.parametrize("pipeline", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spread_balances_each_phase_over_dp_x_pp(pipeline, seed):
    plan = _plan(seed=seed)
    spread = spread_over_stages(plan, pipeline)
    dp = plan.examples_home.num_ranks
    assert spread.num_ranks == dp * pipeline
    for phase, encoder in plan.encoders.items():
        placed = spread.encode[phase]
        counts = placed.counts()
        assert counts.sum() == encoder.example.size  # every item once
        assert counts.max(initial=0) == math.ceil(encoder.example.size / (dp * pipeline))  # the bound over the group
        # each item stays with its DP rank, in the DP plan's slot order
        assert np.array_equal(placed.rank % dp, encoder.encode.rank)
        for rank in range(spread.num_ranks):
            ids = placed.items_on(rank)
            assert np.all(np.diff(encoder.encode.slot[ids]) > 0)
        chunks = spread.chunks[phase]
        if chunks is not None:
            assert np.all(chunks.kept <= counts)


def test_group_moves_route_every_item_once_from_and_to_the_first_stage():
    plan = _plan(seed=3)
    spread = spread_over_stages(plan, 2)
    dp = plan.examples_home.num_ranks
    moves = group_moves(plan, spread)
    assert [move.name for move in moves] == [move.name for move in step_moves(plan)]
    for move in moves:
        if move.kind == "text":
            assert move.transfer.num_ranks == dp
            continue
        transfer = move.transfer
        assert transfer.num_ranks == 2 * dp and transfer.traffic_matrix().sum() == transfer.src.num_items
        encoder = plan.encoders[move.items_of]
        if move.kind == "inputs":  # from the first-stage rank that loaded the example
            assert np.array_equal(transfer.src.rank, encoder.home.rank)
            assert transfer.dst.same_as(spread.encode[move.items_of])
        else:  # to the first-stage rank that runs the example's first layers, gradients back
            assert move.with_gradients and transfer.src.same_as(spread.encode[move.items_of])
            assert np.array_equal(transfer.dst.rank, plan.examples_backbone.rank[encoder.example])
            assert move.gradients().dst.same_as(transfer.src)


@pytest.mark.parametrize("pipeline,replicas", [(1, 2), (2, 2), (2, 4)])
def test_spread_over_encoder_replicas_balances_over_the_group_and_copies_outputs_to_every_tp_replica(pipeline,
                                                                                                      replicas):
    plan = _plan(seed=4)
    spread = spread_over_stages(plan, pipeline, replicas)
    dp = plan.examples_home.num_ranks
    assert spread.num_ranks == dp * pipeline * replicas
    moves = group_moves(plan, spread)
    for phase, encoder in plan.encoders.items():
        placed = spread.encode[phase]
        counts = placed.counts()
        assert counts.sum() == encoder.example.size
        assert counts.max(initial=0) == math.ceil(encoder.example.size / spread.num_ranks)
        assert np.array_equal((placed.rank // replicas) % dp, encoder.encode.rank)  # ranks (stage * DP + dp) * R + j
    for move in moves:
        if move.kind == "text":
            continue
        encoder = plan.encoders[move.items_of]
        n = encoder.example.size
        if move.kind == "inputs":  # from replica 0 of the first-stage rank that loaded the example
            assert np.array_equal(move.transfer.src.rank, encoder.home.rank * replicas)
            continue
        assert isinstance(move, CopiedStepMove) and move.copies == replicas
        assert move.transfer.src.num_items == n * replicas
        backbone = plan.examples_backbone.rank[encoder.example]
        for c in range(replicas):  # copy c: from the item's encoder rank to replica c of its backbone rank
            copy = slice(c * n, (c + 1) * n)
            assert np.array_equal(move.transfer.src.rank[copy], spread.encode[move.items_of].rank)
            assert np.array_equal(move.transfer.dst.rank[copy], backbone * replicas + c)
        for rank in range(spread.num_ranks):  # what a sender holds: its rows, once per copy, in slot order
            held = spread.encode[move.items_of].items_on(rank)
            assert np.array_equal(move.transfer.src.items_on(rank) % n, np.tile(held, replicas))
        gradients = move.gradients()  # from replica 0 of the backbone rank alone, back to the encoder rank
        assert gradients.dst.same_as(spread.encode[move.items_of])
        assert np.array_equal(gradients.src.rank, backbone * replicas)


def test_copied_moves_deliver_every_replica_the_same_rows_as_one_replica_gets_without_copies():
    plan = _plan(seed=5)
    single, copied = (group_moves(plan, spread_over_stages(plan, 2, r)) for r in (1, 2))
    for one, two in zip(single, copied):
        if one.kind != "embeddings":
            continue
        n = one.transfer.src.num_items
        for c in range(2):  # replica c of backbone rank b receives, in slot order, what rank b does with R = 1
            for b in range(plan.examples_home.num_ranks):
                got = two.transfer.dst.items_on((b * 2 + c)) - c * n
                assert np.array_equal(got, one.transfer.dst.items_on(b))
        assert isinstance(two.gradients(), Transfer) and two.gradients().src.num_items == n


OWN_LAYOUTS = {"tp2_dp2_after_2_encoders": OwnEncoderRanks((0, 1), ((2, 3), (4, 5)), 6),
               "dp4_before_3_encoders": OwnEncoderRanks((4, 5, 6), ((0,), (1,), (2,), (3,)), 7)}


@pytest.mark.parametrize("name", OWN_LAYOUTS)
@pytest.mark.parametrize("seed", [0, 7])
def test_own_encoder_ranks_encode_each_phase_balanced_and_route_every_item_once(name, seed):
    layout = OWN_LAYOUTS[name]
    dp, tp = len(layout.backbone_ranks), layout.tensor_parallel_size
    plan = _plan(num_ranks=dp, seed=seed, n=4 * dp)
    encode = encode_on_own_ranks(plan, layout)
    encoders = list(layout.encoder_ranks)
    for k, (phase, encoder) in enumerate(plan.encoders.items()):
        placed = encode[phase]
        n = encoder.example.size
        counts = placed.counts()
        assert counts.sum() == n and not counts[np.setdiff1d(np.arange(layout.num_ranks), encoders)].any()
        assert counts.max(initial=0) == math.ceil(n / len(encoders))  # the bound over the encoder ranks
        longer = [(e - k) % len(encoders) < n % len(encoders) for e in range(len(encoders))]
        assert [bool(counts[r] > n // len(encoders)) for r in encoders] == longer  # the extra items rotate
        dp_order = np.lexsort((encoder.encode.slot, encoder.encode.rank))  # the DP plan's order, in runs
        assert np.array_equal(np.concatenate([placed.items_on(r) for r in encoders]), dp_order)
    moves = own_ranks_moves(plan, layout, encode)
    assert [move.name for move in moves] == [move.name for move in step_moves(plan)]
    backbone = np.asarray(layout.backbone_ranks)
    for move, listed in zip(moves, step_moves(plan)):
        if move.kind == "text":  # within the backbone's DP ranks, as the plan moves it
            assert move.transfer.src.same_as(listed.transfer.src) and move.transfer.dst.same_as(listed.transfer.dst)
            continue
        encoder = plan.encoders[move.items_of]
        n = encoder.example.size
        if move.kind == "inputs":  # from TP rank 0 of the DP rank that loaded the example
            assert np.array_equal(move.transfer.src.rank, backbone[encoder.home.rank, 0])
            assert move.transfer.dst.same_as(encode[move.items_of])
            continue
        assert move.with_gradients and move.transfer.src.num_items == n * tp
        assert isinstance(move, CopiedStepMove) == (tp > 1)
        for t in range(tp):  # TP rank t of backbone DP rank d receives, in slot order, what DP rank d does colocated
            for d in range(dp):
                got = move.transfer.dst.items_on(backbone[d, t]) - t * n
                assert np.array_equal(got, listed.transfer.dst.items_on(d)), (move.name, d, t)
        gradients = move.gradients()  # from TP rank 0 of the backbone DP rank alone, back to the encoder rank
        assert gradients.dst.same_as(encode[move.items_of])
        assert np.array_equal(gradients.src.rank, backbone[plan.examples_backbone.rank[encoder.example], 0])


@pytest.mark.parametrize("packed", [False, True])
def test_the_step_message_gives_the_encoder_ranks_the_backbone_ranks_plan(packed):
    """What the first backbone rank sends the encoder-only ranks each step reads back as the same sizes, micro-batches,
    nodes, packing and digest, and planning from it gives the backbone ranks' plan (its digest); the data's end is an
    empty message; a message of other phases or a cut one is refused, naming both lengths."""
    dp, n = 4, 16
    sizes = _sizes(dp, 3, n)
    topology = Topology.uniform(dp, 2)
    config = OrchestratorConfig(background=False, microbatching="packed" if packed else "equal_count")
    plan = plan_step(sizes, TINY, config, topology, 2, n // dp // 2)
    step = PlannedStep(sizes, n // dp // 2, topology, config.packed, plan.digest)
    message = step_message(step, TINY.encoder_names)
    got = read_step_message(message.copy(), TINY.encoder_names)
    assert (got.num_microbatches, got.packed, got.digest) == (step.num_microbatches, packed, plan.digest)
    assert np.array_equal(got.topology.node_of_rank, topology.node_of_rank)
    assert np.array_equal(got.sizes.counts, sizes.counts) and np.array_equal(got.sizes.num_tokens, sizes.num_tokens)
    assert got.sizes.items.keys() == sizes.items.keys()
    assert all(np.array_equal(got.sizes.items[p], sizes.items[p]) for p in sizes.items)
    microbatching = "packed" if got.packed else "equal_count"
    replanned = plan_step(got.sizes, TINY, OrchestratorConfig(background=False, microbatching=microbatching),
                          got.topology, 2, got.num_microbatches)
    assert replanned.digest == plan.digest
    assert step_message(None, TINY.encoder_names).size == 0
    assert read_step_message(np.zeros(0), TINY.encoder_names) is None
    with pytest.raises(ValueError, match=rf"step message of {message.size} numbers, expected {message.size - n} .*"
                                         rf"phases \['vision'\]"):
        read_step_message(message, TINY.encoder_names[:1])
    with pytest.raises(ValueError, match=rf"step message of {message.size - 1} numbers, expected {message.size}"):
        read_step_message(message[:-1], TINY.encoder_names)


def test_own_encoder_ranks_are_distinct_ranks_of_the_group():
    with pytest.raises(ValueError, match=r"must be distinct ranks of 0..5"):
        OwnEncoderRanks((0, 2), ((2, 3), (4, 5)), 6)
    with pytest.raises(ValueError, match=r"must be distinct ranks of 0..4"):
        OwnEncoderRanks((0, 1), ((2, 3), (4, 5)), 5)
    with pytest.raises(ValueError, match=r"backbone ranks \[DP\]\[TP\] of one TP size"):
        OwnEncoderRanks((0, 1), ((2, 3), (4,)), 6)
    with pytest.raises(ValueError, match=r"needs encoder ranks"):
        OwnEncoderRanks((), ((2, 3),), 6)


def test_group_traffic_counts_the_moves_that_run():
    """Over the DP ranks alone (one stage, one replica) it is the plan's own count; over DP x PP x R replicas each
    move's bytes are those of its items that change rank (an embeddings move's every copy forward, one back)."""
    plan = _plan(num_ranks=4, seed=6, n=16, gpus_per_node=2)
    items = phase_items(_sizes(4, 6, 16), TINY)
    dp_nodes = np.arange(4) // 2
    traffic, peers = group_traffic(plan, spread_over_stages(plan, 1), items, dp_nodes)
    for kind in ("intra_node", "inter_node"):
        assert sum(getattr(m, kind) for m in traffic.values()) == pytest.approx(
            sum(getattr(m, kind) for m in plan.traffic.values()))
    assert peers.busiest() == plan.peers.busiest()
    group = spread_over_stages(plan, 2, 2)
    nodes = np.arange(group.num_ranks) // 4
    traffic, _ = group_traffic(plan, group, items, nodes)
    for move in group_moves(plan, group):
        nbytes = move.bytes_of(items)
        copies = move.copies if isinstance(move, CopiedStepMove) else 1
        transfer = move.transfer
        if move.kind == "text":  # the first stage's replica 0: DP rank d at group rank d * R
            moved = nbytes[transfer.src.rank != transfer.dst.rank].sum()
        else:
            moved = np.tile(nbytes, copies)[transfer.src.rank != transfer.dst.rank].sum()
        assert traffic[move.name].off_gpu == pytest.approx(moved), move.name
        if move.with_gradients:
            back = move.gradients()
            moved_back = nbytes[back.src.rank != back.dst.rank].sum()
            assert traffic[f"{move.name} gradients"].off_gpu == pytest.approx(moved_back)
    assert any(traffic[name].off_gpu != plan.traffic[name].off_gpu / (2 if name.endswith("embeddings") else 1)
               for name in plan.traffic)  # not the first-stage layout's count


def test_group_traffic_node_wise_bounds_the_peers_and_keeps_the_bytes_across_nodes():
    """Node-wise over DP 4 x PP 2 x R 2 encoder ranks on 4 nodes of 4: each move's bytes across nodes are the flat
    move's (an item crosses nodes once), a rank's peers at most 3 on its node + 3 across, and the text counted as
    its DP group's hops run it (the same bytes as the plan's own node-wise count over the DP nodes)."""
    plan = _plan(num_ranks=4, seed=6, n=16, gpus_per_node=2)
    items = phase_items(_sizes(4, 6, 16), TINY)
    group = spread_over_stages(plan, 2, 2)
    nodes, dp_nodes = np.arange(group.num_ranks) // 4, np.arange(4) // 2
    flat, flat_peers = group_traffic(plan, group, items, nodes)
    wise, peers = group_traffic(plan, group, items, nodes, "node-wise", dp_nodes)
    assert wise.keys() == flat.keys()
    for name, moved in wise.items():
        assert moved.node_wise and moved.inter_node == pytest.approx(flat[name].inter_node), name
    assert peers.intra_node.max() <= 3 and peers.inter_node.max() <= 3 and flat_peers.total.max() > 6
    text = next(move for move in group_moves(plan, group) if move.kind == "text")
    own = text.transfer.moved_bytes(text.bytes_of(items), dp_nodes, "node-wise")
    assert (wise["text"].intra_node, wise["text"].inter_node) == pytest.approx((own.intra_node, own.inter_node))
    with pytest.raises(ValueError, match="needs its DP group's nodes"):
        group_traffic(plan, group, items, nodes, "node-wise")


def test_encoder_ranks_of_their_own_refuse_what_they_do_not_run():
    """Shadow mode, the checked first step and a node-wise all-to-all are refused by name (the backbone ranks'
    iterator and the encoder ranks' loop both ask this, before any collective)."""
    runs = OrchestratorConfig(verify_first_step=False)
    assert own_ranks_refusal(runs) is None
    for config, named in ((OrchestratorConfig(), "verify_first_step=False"),
                          (OrchestratorConfig(shadow=True), "shadow=False"),
                          (OrchestratorConfig(verify_first_step=False, all_to_all="node-wise"),
                           "run their moves flat, not node-wise")):
        assert named in own_ranks_refusal(config), config


def test_unsupported_layouts_are_named():
    """The planning layer names the config's fields; a command line passes its flags' naming."""
    fine = dict(sharded=None)
    assert unsupported_layout(**fine) is None
    assert unsupported_layout(**{**fine, "sharded": "--use-torch-fsdp2"}).startswith(
        "OrchestratorConfig.encoder_ranks=all with --use-torch-fsdp2 is not supported")
    assert unsupported_layout(**fine, tensor_parallel_size=4, encoder_tensor_parallel_size=2) is None
    odd = dict(fine, tensor_parallel_size=4, encoder_tensor_parallel_size=3)
    assert unsupported_layout(**odd).startswith(
        "OrchestratorConfig.encoder_tensor_parallel_size=3 does not divide the backbone's tensor-parallel size 4")
    assert unsupported_layout(**odd, naming=flag_setting).startswith(
        "--orch-encoder-tensor-parallel-size 3 does not divide the backbone's tensor-parallel size 4")


def test_a_command_line_names_its_flags_where_the_planning_layer_names_fields():
    """Every field a command line sets has its flag (the planning layer's messages name no flag of their own); a
    field without one keeps the config's name."""
    assert set(CONFIG_FLAGS) <= {field.name for field in dataclasses.fields(OrchestratorConfig)}
    assert flag_setting("encoder_ranks", "all") == "--orch-encoder-ranks all"
    assert flag_setting("context_parallel_size") == "--context-parallel-size"
    assert flag_setting("shadow", "True") == config_setting("shadow", "True") == "OrchestratorConfig.shadow=True"


def test_config_takes_the_layout_as_data():
    assert tuple(r.value for r in EncoderRanks if r is not EncoderRanks.AUTO) == ENCODER_RANKS  # the step model's
    assert OrchestratorConfig().encoder_ranks is EncoderRanks.AUTO and not OrchestratorConfig().encoders_on_every_stage
    assert OrchestratorConfig(encoder_ranks=EncoderRanks.ALL).verify_first_step  # the first step checked with it
    config = OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, verify_first_step=False)
    assert config.encoders_on_every_stage
    assert not OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, shadow=True).encoders_on_every_stage
    with pytest.raises(ConfigError, match=r"OrchestratorConfig.encoder_ranks must be an EncoderRanks"):
        OrchestratorConfig(encoder_ranks="all", verify_first_step=False)
    assert OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, verify_first_step=False,
                              all_to_all="node-wise").encoders_on_every_stage
    spread = OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, verify_first_step=False, encoder_tensor_parallel_size=1)
    assert spread.encoder_tp_replicas(4) == 4 and spread.spreads_encoders(4, 1) and not spread.spreads_encoders(1, 1)
    assert config.encoder_tp_replicas(4) == 1 and config.spreads_encoders(1, 2) and not config.spreads_encoders(4, 1)
    with pytest.raises(ConfigError, match="encoder_tensor_parallel_size 1 needs encoder_ranks ALL or AUTO"):
        OrchestratorConfig(encoder_ranks=EncoderRanks.FIRST_STAGE, encoder_tensor_parallel_size=1)
    assert OrchestratorConfig(encoder_tensor_parallel_size=1).with_encoder_ranks(
        EncoderRanks.FIRST_STAGE).encoder_tensor_parallel_size is None
    assert OrchestratorConfig(verify_first_step=False, encoder_tensor_parallel_size=1).with_encoder_ranks(
        EncoderRanks.ALL) == spread
    with pytest.raises(ConfigError, match=r"encoder_tensor_parallel_size must be an int >= 1, got 0"):
        OrchestratorConfig(encoder_ranks=EncoderRanks.ALL, verify_first_step=False, encoder_tensor_parallel_size=0)


def test_auto_decides_all_where_it_differs_runs_and_fits():
    """``decide_encoder_ranks``: ``AUTO`` is ``ALL`` where it differs from ``FIRST_STAGE`` (PP > 1, or the encoders'
    TP below the backbone's) and nothing speaks against it, else ``FIRST_STAGE`` naming the first reason (the
    memory model asked last, only then); a layout asked for is kept."""
    def decide(config=OrchestratorConfig(), pp=2, tp=1, **kwargs):
        return decide_encoder_ranks(config, pipeline_parallel_size=pp, tensor_parallel_size=tp, **kwargs)

    def never():
        raise AssertionError("the memory model asked where the layout decided already")

    everywhere = decide(memory="fits the GPU's 80.0 GB")
    assert (everywhere.ranks, everywhere.asked) == (EncoderRanks.ALL, EncoderRanks.AUTO)
    assert everywhere.line(flag_setting) == (
        "post-balancing: the encoders on every rank (--orch-encoder-ranks auto: all): each encoder phase over DP x 2 "
        "pipeline stages x 1 encoder replica per TP group instead of the first stage's DP ranks; fits the GPU's 80.0 GB")
    assert everywhere.line().startswith("post-balancing: the encoders on every rank "
                                        "(OrchestratorConfig.encoder_ranks=auto: all): each encoder phase")
    assert decide(OrchestratorConfig(encoder_tensor_parallel_size=1), pp=1, tp=4).ranks is EncoderRanks.ALL
    assert decide(OrchestratorConfig(all_to_all="node-wise")).ranks is EncoderRanks.ALL
    for config, pp, tp, kwargs, reason in [
            (OrchestratorConfig(), 1, 4, {}, "one pipeline stage"),
            (OrchestratorConfig(encoder_tensor_parallel_size=4), 1, 4, {}, "one pipeline stage"),
            (OrchestratorConfig(), 2, 1, {"unavailable": "why not"}, "why not"),
            (OrchestratorConfig(shadow=True), 2, 1, {}, "shadow mode")]:
        decision = decide(config, pp, tp, memory_refusal=never, **kwargs)
        assert decision.ranks is EncoderRanks.FIRST_STAGE and reason in decision.reason, decision
        assert decision.line(flag_setting).startswith("post-balancing: the encoders on the first pipeline stage "
                                                      "(--orch-encoder-ranks auto: first-stage): ")
    refused = decide(memory_refusal=lambda: "--orch-encoder-ranks all does not fit")
    assert refused.ranks is EncoderRanks.FIRST_STAGE and refused.reason == "--orch-encoder-ranks all does not fit"
    for asked in (EncoderRanks.ALL, EncoderRanks.FIRST_STAGE):
        kept = decide(OrchestratorConfig(encoder_ranks=asked), unavailable="why not", memory_refusal=never)
        assert (kept.ranks, kept.reason) == (asked, "as asked")
        assert kept.line(flag_setting).endswith(f"(--orch-encoder-ranks {asked.value}): as asked")


def _parser():
    parser = add_orch_args(argparse.ArgumentParser())
    parser.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    parser.add_argument("--overlap-grad-reduce", action="store_true")
    parser.add_argument("--use-distributed-optimizer", action="store_true")
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--use-torch-fsdp2", action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--sequence-parallel", action="store_true")
    return parser


def test_orch_encoder_ranks_flag():
    parse = _parser().parse_args
    assert orch_config_from_args(parse(["--orch-post-balancing"])).encoder_ranks is EncoderRanks.AUTO
    config = orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-ranks", "all",
                                          "--pipeline-model-parallel-size", "2"]), verify_by_default=True)
    assert config.encoder_ranks is EncoderRanks.ALL and config.verify_first_step
    assert orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-ranks", "all", "--orch-all-to-all",
                                        "node-wise", "--pipeline-model-parallel-size", "2"])).all_to_all == "node-wise"
    assert orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-ranks", "all",
                                        "--orch-verify-first-step"])).verify_first_step
    auto = parse(["--orch-post-balancing", "--orch-all-to-all", "node-wise", "--pipeline-model-parallel-size", "2",
                  "--use-torch-fsdp2"])  # auto is not refused what all would be: it decides later
    assert orch_config_from_args(auto).encoder_ranks is EncoderRanks.AUTO
    with pytest.raises(ValueError, match="--orch-encoder-ranks all with --use-torch-fsdp2 is not supported"):
        orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-ranks", "all",
                                     "--pipeline-model-parallel-size", "2", "--use-torch-fsdp2"]))
    # Megatron DDP's overlapped reduction (all-reduced or reduce-scattered), context parallelism: all runs them, and
    # auto picks it
    for layout in (["--overlap-grad-reduce"], ["--overlap-grad-reduce", "--use-distributed-optimizer"],
                   ["--context-parallel-size", "2"]):
        layout = ["--pipeline-model-parallel-size", "2", *layout]
        asked = orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-ranks", "all", *layout]))
        assert asked.encoder_ranks is EncoderRanks.ALL
        args = parse(["--orch-post-balancing", *layout])
        assert encoder_ranks_unsupported(args) is None
        decided = decide_encoder_ranks(orch_config_from_args(args), pipeline_parallel_size=2, tensor_parallel_size=1,
                                       unavailable=encoder_ranks_unsupported(args))
        assert (decided.asked, decided.ranks) == (EncoderRanks.AUTO, EncoderRanks.ALL), decided
    with pytest.raises(ValueError, match="--orch-encoder-ranks given without --orch-post-balancing"):
        orch_config_from_args(parse(["--orch-encoder-ranks", "all"]))


def test_orch_encoder_tensor_parallel_size_flag():
    parse = _parser().parse_args
    all_ranks = ["--orch-post-balancing", "--orch-encoder-ranks", "all", "--tensor-model-parallel-size", "4"]
    assert orch_config_from_args(parse(all_ranks + ["--orch-encoder-tensor-parallel-size", "2"])
                                 ).encoder_tensor_parallel_size == 2
    assert orch_config_from_args(parse(all_ranks)).encoder_tensor_parallel_size is None
    with pytest.raises(ValueError, match=r"^--orch-encoder-tensor-parallel-size 3 does not divide the backbone's "
                                         r"tensor-parallel size 4"):
        orch_config_from_args(parse(all_ranks + ["--orch-encoder-tensor-parallel-size", "3"]))
    assert orch_config_from_args(parse(all_ranks + ["--orch-encoder-tensor-parallel-size", "1", "--sequence-parallel"])
                                 ).encoder_tensor_parallel_size == 1
    with pytest.raises(ValueError, match=r"^--orch-encoder-tensor-parallel-size 1 needs encoder_ranks ALL or AUTO"):
        orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-ranks", "first-stage",
                                     "--orch-encoder-tensor-parallel-size", "1"]))
    assert orch_config_from_args(parse(["--orch-post-balancing", "--orch-encoder-tensor-parallel-size", "1"])
                                 ).encoder_tensor_parallel_size == 1
