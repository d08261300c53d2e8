"""Simulated step time of every balancing method on a cluster of multi-GPU nodes.

For one global batch drawn from the traces (DP rank r loads the r-th block of ``per_rank`` examples)
each method assigns every item of every phase to a DP rank (one model replica of ``tensor_parallel x
pipeline_stages`` GPUs):

* ``none``: upstream Megatron, every example runs end to end on the rank that loaded it;
* ``orch`` (the defaults: packed backbone micro-batches), ``equal_count``, ``locality``,
  ``equal_locality``: ``plan_step`` as the trainer runs it (:data:`megatron_orch.bench.common.PLAN_METHODS`),
  its step model set to the simulated cluster (:class:`~megatron_orch.balance.step_model.StepModel`, so a
  locality-aware plan is kept exactly where this simulator finds it no slower);
* ``backbone_only``: verl-style single-phase balancing (``bench.balance.verl_equal_size_kk`` over the
  backbone lengths with verl's workload); whole examples move, every encoder item runs on its
  example's backbone rank.

Step time of a method, in seconds (:mod:`megatron_orch.balance.step_model` for the per-phase methods):

* compute of phase p in every (rank, backbone micro-batch) cell: the sum of its items' costs (an encoder
  item in its example's micro-batch), with a cost profile in seconds plus the profile's per-call overhead
  on every cell that has an item; without a profile the items' training FLOPs at an assumed ``tflops``
  per GPU; split evenly over the replica's GPUs (encoders over its first stage's tensor-parallel group);
* per-phase methods: the step model's schedule (encoders, then the backbone: every replica's own
  micro-batches through Megatron's 1F1B or interleaved schedule, one by one
  (:mod:`megatron_orch.balance.pipeline_schedule`), the slowest replica counting; then the encoders'
  backward; each phase's embeddings travel while the next phase encodes, their gradients while earlier
  phases run their backward; the gradient reduction exposed as far as the backward cannot hide it; raw
  inputs and text during the previous step);
* ``--encoder-ranks all`` (the per-phase methods; upstream keeps Megatron's layout): every encoder phase on
  every GPU of the job at the encoders' TP size, its items balanced over all of them
  (:func:`spread_encoders`), their embeddings and raw inputs crossing nodes;
* ``--encoder-gpus N`` (the per-phase methods): the encoders on N GPUs of their own beside the replicas'
  (non-colocated, at the encoders' TP size), every encoder phase's items balanced over their groups, encoding
  the next batch while the replicas train this one: the step is the slower side plus the embeddings' and their
  gradients' all-to-alls (:meth:`StepModel.own_encoder_step`; its assumptions there); MFU counts the encoder
  GPUs too; ``auto`` takes the count of whole nodes of the defaults' highest modeled MFU
  (:func:`choose_encoder_gpus`);
* ``none`` and ``backbone_only`` run each example's encoders inside its micro-batch on the first
  pipeline stage: the same schedule with each micro-batch's encoders added to its first-stage forward and
  backward, plus the same gradient reduction;
* a node-wise all-to-all (``--orch-all-to-all node-wise``, :meth:`~megatron_orch.balance.plan.Transfer.node_wise`):
  every transfer's NVLink hop, then its NIC hop (``node_wise_step_seconds``); ``peers``: the busiest rank's
  distinct peers over the step's transfers, flat and node-wise;
* planning: ``plan_step`` runs on a CPU thread during the previous step; its time is not in the step
  (``bench.planning`` measures it), so every figure is a function of the batch and the flags alone: the
  same command gives the same JSON on any machine, under any load;
* modeled MFU: the batch's training FLOPs (the cost models') over step seconds x GPUs (the replicas', and the
  encoder GPUs' where a method runs on them) x ``peak_tflops`` (989: dense bf16 of one H100 or H200).

What the model leaves out: memory limits, padding inside backbone micro-batches (items are timed
alone), the tensor- and pipeline-parallel communication inside a replica (the same for every method),
and stage-to-stage transfer time.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Sequence

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile, rank_seconds
from megatron_orch.balance.partition import partition
from megatron_orch.balance.plan import ALL_TO_ALL
from megatron_orch.balance.step_model import DEFAULT_TFLOPS, Busiest, LinkModel, PipelinedBackbone, StepModel
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes, phase_items
from megatron_orch.bench.balance import backbone_only_plan
from megatron_orch.bench.common import DEFAULT_METHOD, PLAN_METHODS, model_phases, plan_method, step_connections
from megatron_orch.orchestrator.gpu_memory import (GRADIENT_BYTES, OPTIMIZER_BYTES, PARAMETER_BYTES, ParallelLayout,
                                                   stage_memory)
from megatron_orch.orchestrator.step_plan import StepPlan, step_transfers, warm_up

__all__ = ("SIM_METHODS", "END_TO_END", "DEFAULT_TFLOPS", "PEAK_TFLOPS", "LinkModel", "StepModel",
           "choose_encoder_gpus", "phase_cell_seconds", "model_flops", "model_state_bytes", "simulate_step",
           "spread_encoders", "step_lower_bound", "topology_of", "warm_up_planner")

SIM_METHODS = ("none", "orch", "equal_count", "locality", "equal_locality", "backbone_only")
END_TO_END = ("none", "backbone_only")  # each example runs all its phases on one rank
SUM_BALANCED = "orch_sum_balanced"  # (pipelined layouts) the defaults' plan by sums, judged by the same schedule
PEAK_TFLOPS = 989.0  # dense bf16 TFLOP/s of one H100 / H200 (spec sheet): modeled MFU's denominator


def topology_of(dp: int, model: StepModel) -> Topology:
    """The DP group's nodes: a replica's first-stage TP group of ``tensor_parallel`` GPUs, as many per node as
    fit (one per node, or spread over nodes, when it fills one)."""
    return Topology.uniform(dp, max(1, model.link.gpus_per_node // model.tensor_parallel))


def phase_cell_seconds(plan: StepPlan, items: Dict[str, PhaseItems], profile: Optional[CostProfile],
                       tflops: float) -> Dict[str, np.ndarray]:
    """Modeled compute seconds of every phase in every (rank, backbone micro-batch) cell under ``plan``,
    ``(dp, num_microbatches)`` (on one GPU of the replica's work: :meth:`StepModel.compute_seconds` spreads it).
    An encoder item counts in the cell of the rank that encodes it and its example's micro-batch; with a cost
    profile every cell with an item pays the phase's call overhead."""
    dp, m = plan.examples_home.num_ranks, plan.num_microbatches
    out = {}
    for phase in items:
        example = items[phase].example if phase in plan.encoders else np.arange(plan.examples_home.rank.size)
        rank = plan.encoders[phase].encode.rank if phase in plan.encoders else plan.examples_backbone.rank
        cell = rank * m + plan.microbatch_of_example[example]
        if profile is None:
            seconds = np.bincount(cell, weights=items[phase].cost, minlength=dp * m) / (tflops * 1e12)
        else:
            seconds = rank_seconds(profile.phases[phase], items[phase].cost, cell, dp * m)
        out[phase] = seconds.reshape(dp, m)
    return out


def spread_encoders(plan: StepPlan, items: Dict[str, PhaseItems], at: StepModel, profile: Optional[CostProfile],
                    tflops: float):
    """The encoder phases under ``encoder_ranks="all"`` or on encoder GPUs of their own: each phase's items
    balanced over every encoder group (:meth:`StepModel.encoder_groups`, of the encoders' TP size; items of one
    cost: ceil(n / groups) per group, exactly; else ``partition``), as (phase, seconds of the busiest group) in
    order, each phase's embedding all-to-all and its raw-input one. Every item is assumed to cross nodes (at
    this scale an item's encoder group is almost never on its replica's node; the encoder GPUs' nodes are their
    own): the busiest GPU's NIC bytes are the larger of the busiest group's sends and the busiest first-stage
    group's receives."""
    dp = plan.examples_home.num_ranks
    groups = at.encoder_groups(dp)
    etp = at.encoder_tensor_parallel or at.tensor_parallel
    encoders, embeddings, inputs = [], {}, []
    for phase in plan.encoders:
        it = items[phase]
        if not len(it):
            encoders.append((phase, 0.0))
            embeddings[phase] = Busiest(0.0, 0.0, False, False)
            continue
        if it.cost.min() == it.cost.max():
            per_group = -(-len(it) // groups)
            load = per_group * float(it.cost[0])
        else:
            bins = partition(it.cost, groups).bin_of_item
            per_group = int(np.bincount(bins, minlength=groups).max())
            load = float(np.bincount(bins, weights=it.cost, minlength=groups).max())
        seconds = load / (tflops * 1e12) if profile is None else load + profile.phases[phase].call_overhead
        encoders.append((phase, seconds / etp))
        received = np.bincount(plan.examples_backbone.rank[it.example], weights=it.output_nbytes, minlength=dp).max()
        embeddings[phase] = Busiest(0.0, float(max(received, per_group * it.output_nbytes.max())), False, True)
        loaded = np.bincount(it.home, weights=it.nbytes, minlength=dp).max()
        inputs.append(Busiest(0.0, float(max(loaded, per_group * it.nbytes.max())), False, True))
    return encoders, embeddings, inputs


def step_lower_bound(items: Dict[str, PhaseItems], backbone: str, at: StepModel, dp: int,
                     profile: Optional[CostProfile], tflops: float) -> float:
    """Seconds no per-phase plan's step goes below under ``at``'s layout, communication aside: each encoder
    phase's max(mean, largest item) over its groups (the replicas' first stages, or every encoder group of the
    job), forward and backward, then the backbone's :meth:`PipelineSchedule.lower_bound` over the replicas."""
    groups = at.encoder_groups(dp)
    spread = at.encoder_ranks == "all" or at.encoder_gpus
    etp = at.encoder_tensor_parallel or at.tensor_parallel if spread else at.tensor_parallel

    def seconds(phase: str) -> np.ndarray:
        cost = items[phase].cost
        return cost / (tflops * 1e12) if profile is None else cost

    encoders = sum(max(float(seconds(p).sum()) / groups, float(seconds(p).max(initial=0.0))) / etp
                   for p in items if p != backbone)
    llm = at.schedule.lower_bound(seconds(backbone) / at.tensor_parallel, dp)
    return max(encoders, llm) if at.encoder_gpus else encoders + llm


def model_state_bytes(model, at: StepModel, dp: int) -> dict:
    """Modeled model-state bytes per GPU (bf16 parameters, fp32 gradients, distributed-Adam shard) under ``at``'s
    layout, by :func:`~megatron_orch.orchestrator.gpu_memory.stage_memory` (each stage's encoders' optimizer
    sharded over DP, as the trainer shards it); with encoder GPUs of their own, those hold the encoders over
    their TP (their optimizer sharded over their own groups) and the replicas the backbone alone. Activations
    are not counted (``bench.memory`` gives them).

    Returns:
        ``{"first_stage": bytes, "other_stages": bytes}``, the first stage's GPUs and the others' (and
        ``"encoder_gpus"`` with encoder GPUs of their own).
    """
    params = model.num_parameters()
    phases = model.phases()
    layout = ParallelLayout(dp, at.tensor_parallel, at.pipeline_stages, at.encoder_ranks,
                            None if at.encoder_gpus else at.encoder_tensor_parallel)
    if at.encoder_gpus:  # the replicas hold no encoder
        params = {name: (count if name == phases.backbone.name else 0) for name, count in params.items()}
    stages = stage_memory(layout, params, phases, [0.0] * at.pipeline_stages)
    out = {"first_stage": stages[0].model_state, "other_stages": max((m.model_state for m in stages[1:]),
                                                                      default=stages[0].model_state)}
    if at.encoder_gpus:
        etp = at.encoder_tensor_parallel or at.tensor_parallel
        held = sum(model.num_parameters()[name] for name in model.encoders) / etp
        out["encoder_gpus"] = held * (PARAMETER_BYTES + GRADIENT_BYTES + OPTIMIZER_BYTES / at.encoder_groups(dp))
    return out


def model_flops(sizes: StepSizes, model) -> float:
    """Training FLOPs of a global batch under the model's cost models (every phase): what MFU counts."""
    return float(sum(float(p.cost.sum()) for p in phase_items(sizes, model.phases()).values()))


def simulate_step(sizes: StepSizes, model, link: LinkModel, profile: Optional[CostProfile] = None,
                  tflops: float = DEFAULT_TFLOPS, nic_sweep: Sequence[float] = (),
                  step_model: Optional[StepModel] = None, peak_tflops: float = PEAK_TFLOPS,
                  encoder_gpu_choices: Sequence[int] = ()) -> dict:
    """Every method's modeled step on one global batch (see the module docstring). ``step_model``: the
    layout and overlap (default: DP only, transfers overlapped as the schedule overlaps them); its link and
    FLOP rate are ``link`` and ``tflops``. ``encoder_gpu_choices``: encoder-GPU counts of their own to choose
    from, the one of the highest modeled MFU of the defaults (:func:`choose_encoder_gpus`; the result's
    ``encoder_gpus``). Deterministic: nothing measured on this machine enters a figure (planning runs on a CPU
    thread during the previous step; ``bench.planning`` measures its time)."""
    cluster = dataclasses.replace(step_model or StepModel(), link=link, tflops=tflops)
    dp = int(np.asarray(sizes.counts).size)
    topology = topology_of(dp, cluster)
    phases = model_phases(model, profile)
    items = phase_items(sizes, phases)
    backbone = phases.backbone.name
    flops = model_flops(sizes, model)
    gpus = dp * cluster.tensor_parallel * cluster.pipeline_stages
    # the planner balances over DP as the trainer does, whatever GPUs run the encoders
    planner = (dataclasses.replace(cluster, encoder_gpus=0, encoder_tensor_parallel=None) if cluster.encoder_gpus
               else cluster)
    plans = {}
    for method in SIM_METHODS:
        if method == "backbone_only":
            plans[method] = backbone_only_plan(sizes, plans["none"])
        else:
            plans[method] = plan_method(method, sizes, model, topology, profile, step_model=planner)
    if cluster.pipeline_stages > 1:  # the defaults planned by sums, as without a pipeline: what pipeline-aware beats
        plans[SUM_BALANCED] = plan_method("orch", sizes, model, topology, profile, step_model=dataclasses.replace(
            planner, pipeline_stages=1, virtual_stages=1))
    chosen = None
    if encoder_gpu_choices:
        chosen = choose_encoder_gpus(plans[DEFAULT_METHOD], items, cluster, encoder_gpu_choices, flops, gpus, profile,
                                     tflops, peak_tflops)
        cluster = dataclasses.replace(cluster, encoder_gpus=chosen["encoder_gpus"])

    def figures(method: str, at: StepModel, all_to_all: str = "flat") -> dict:
        plan = plans[method]
        cells = {p: v / cluster.tensor_parallel for p, v in phase_cell_seconds(plan, items, profile, tflops).items()}
        ranks = {p: v.sum(axis=1) for p, v in cells.items()}
        phase_max = {p: float(r.max(initial=0.0)) for p, r in ranks.items()}
        phase_mean = {p: float(r.mean()) for p, r in ranks.items()}
        moves = {move.name: (move, Busiest.of(move.moved_bytes(topology.node_of_rank, all_to_all)))
                 for move in step_transfers(plan, items)}
        embeddings = {p: moves[f"{p} embeddings"][1] for p in plan.encoders}
        prefetched = [busiest for move, busiest in moves.values() if move.times == 1]
        replicas_per_node = max(1, at.link.gpus_per_node // at.tensor_parallel)
        if method in END_TO_END:  # encoders inside the micro-batches of the first stage, which paces the pipeline
            inside = sum((cells[p] for p in plan.encoders), np.zeros((dp, plan.num_microbatches)))
            pipelined = at.pipelined(cells[backbone], first_forward=inside / 3.0, first_backward=2.0 * inside / 3.0)
            parts = at.step([], PipelinedBackbone(0.0, 0.0), {}, prefetched, dp, replicas_per_node,
                            other_compute=pipelined.seconds)
            parts.update(backbone=pipelined.seconds, pipeline_bubble=pipelined.bubble)
        elif at.encoder_ranks == "all" or at.encoder_gpus:
            encoders, embeddings, inputs = spread_encoders(plan, items, at, profile, tflops)
            run = at.own_encoder_step if at.encoder_gpus else at.step
            parts = run(encoders, at.pipelined(cells[backbone]), embeddings, inputs + [moves["text"][1]], dp,
                        replicas_per_node)
            groups = at.encoder_groups(dp)  # the mean: every item's seconds over the groups' GPUs
            etp = at.encoder_tensor_parallel or at.tensor_parallel
            phase_max.update(encoders)
            phase_mean.update({p: float(ranks[p].sum()) * at.tensor_parallel / etp / groups for p, _ in encoders})
        else:
            encoders = [(p, float(ranks[p].max(initial=0.0))) for p in plan.encoders]
            parts = at.step(encoders, at.pipelined(cells[backbone]), embeddings, prefetched, dp, replicas_per_node)
        return {"parts": parts, "phase_seconds": phase_max, "phase_mean_seconds": phase_mean,
                "comm": {name: {"seconds": b.seconds(at.link), "times": move.times, "nvlink_bytes": b.nvlink_bytes,
                                "nic_bytes": b.nic_bytes, "inter_node_bytes": move.moved_bytes(
                                    topology.node_of_rank).inter_node,
                                "intra_node_bytes": move.moved_bytes(topology.node_of_rank).intra_node}
                         for name, (move, b) in moves.items()}}

    result = {}
    for method in SIM_METHODS:
        f = figures(method, cluster)
        parts = f["parts"]
        comm = f["comm"]
        result[method] = {
            "phase_seconds": f["phase_seconds"], "phase_mean_seconds": f["phase_mean_seconds"],
            "compute_seconds": parts["compute"],
            "comm_seconds": sum(m["times"] * m["seconds"] for m in comm.values()),
            "exposed_comm_seconds": parts["exposed_moves"],
            "pipeline_bubble_seconds": parts["pipeline_bubble"],
            "grad_reduce_seconds": parts["grad_reduce"],
            "parts": parts,
            "comm": comm,  # per all-to-all; a step runs each ``times`` times
            "inter_node_bytes": sum(m["times"] * m["inter_node_bytes"] for m in comm.values()),
            "intra_node_bytes": sum(m["times"] * m["intra_node_bytes"] for m in comm.values()),
            "backbone_method": plans[method].stats[backbone].method if plans[method].stats else method,
            "step_seconds": parts["step"],
            "gpus": gpus + (0 if method in END_TO_END else cluster.encoder_gpus),
            "mfu": (flops / (parts["step"] * (gpus + (0 if method in END_TO_END else cluster.encoder_gpus))
                             * peak_tflops * 1e12) if parts["step"] > 0 else 0.0),
            "node_wise_step_seconds": figures(method, cluster, "node-wise")["parts"]["step"],
            "peers": {mode: dict(zip(("all", "node", "net"), step_connections(
                plans[method], items, topology.node_of_rank, mode).peers(topology.node_of_rank).busiest()))
                for mode in ALL_TO_ALL},
        }
    bound = step_lower_bound(items, backbone, cluster, dp, profile, tflops)
    for method in SIM_METHODS:
        if method not in END_TO_END:
            result[method]["step_over_bound"] = result[method]["step_seconds"] / bound
    result["none"]["speedup_bound"] = result["none"]["step_seconds"] / bound  # what no per-phase plan exceeds
    if SUM_BALANCED in plans:
        result["orch"]["sum_balanced_step_seconds"] = figures(SUM_BALANCED, cluster)["parts"]["step"]
    upstream = result["none"]
    for figures_ in result.values():
        figures_["speedup"] = upstream["step_seconds"] / figures_["step_seconds"]
        figures_["phase_speedup"] = {p: upstream["phase_seconds"][p] / s if s > 0 else 1.0
                                     for p, s in figures_["phase_seconds"].items()}
    if cluster.encoder_gpus:
        result["encoder_gpus"] = cluster.encoder_gpus
    if chosen is not None:
        result["encoder_gpu_choice"] = chosen
    result["nic_sweep"] = {}
    for gbits in nic_sweep:
        slow = cluster.with_nic(gbits)
        result["nic_sweep"][str(gbits)] = {method: figures(method, slow)["parts"]["step"] for method in SIM_METHODS}
    return result


def choose_encoder_gpus(plan: StepPlan, items: Dict[str, PhaseItems], at: StepModel, choices: Sequence[int],
                        flops: float, gpus: int, profile: Optional[CostProfile], tflops: float,
                        peak_tflops: float) -> dict:
    """The encoder-GPU count of ``choices`` at which ``plan``'s step has the highest modeled MFU (training FLOPs
    over step x all GPUs, the encoder GPUs with the replicas' ``gpus``; the fewest GPUs on a tie): the count
    where adding encoder GPUs stops shortening the step more than it adds GPUs. Returns the count, with every
    choice's step seconds and MFU."""
    dp = plan.examples_home.num_ranks
    backbone = plan.backbone
    cells = phase_cell_seconds(plan, {backbone: items[backbone]}, profile, tflops)[backbone] / at.tensor_parallel
    pipelined = at.pipelined(cells)
    text = Busiest.of(next(m for m in step_transfers(plan, items) if m.kind == "text").moved_bytes(
        topology_of(dp, at).node_of_rank))
    replicas_per_node = max(1, at.link.gpus_per_node // at.tensor_parallel)
    steps, mfu = {}, {}
    for count in sorted(set(int(c) for c in choices)):
        own = dataclasses.replace(at, encoder_gpus=count)
        encoders, embeddings, inputs = spread_encoders(plan, items, own, profile, tflops)
        steps[count] = own.own_encoder_step(encoders, pipelined, embeddings, inputs + [text], dp,
                                            replicas_per_node)["step"]
        mfu[count] = flops / (steps[count] * (gpus + count) * peak_tflops * 1e12)
    best = max(mfu, key=lambda c: (mfu[c], -c))
    return {"encoder_gpus": best, "step_seconds": {str(c): s for c, s in steps.items()},
            "mfu": {str(c): m for c, m in mfu.items()}}


def warm_up_planner(model, announce=None) -> None:
    """Compile (or load) the planner's kernels before the first batch (``announce``: told when numba compiles,
    see :func:`~megatron_orch.orchestrator.step_plan.warm_up`), so a first run says why it waits."""
    for config in PLAN_METHODS.values():
        warm_up(model.phases(), config, announce)
