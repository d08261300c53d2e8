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

* compute of phase p on rank r: the sum of its items' costs, with a cost profile in seconds plus the
  profile's per-call overhead on every rank that has an item of an encoder phase; without a profile
  the items' training FLOPs at an assumed ``tflops`` per GPU; split evenly over the replica's GPUs
  (encoders over its first stage's tensor-parallel group);
* per-phase methods: the step model's schedule (encoders, then the pipelined backbone with its bubble,
  then the encoders' backward; each phase's embeddings travel while the next phase encodes, their
  gradients while earlier phases run their backward; the gradient reduction exposed as far as the
  backward cannot hide it; raw inputs and text during the previous step);
* ``none`` and ``backbone_only`` run each example's encoders inside its micro-batch on the first
  pipeline stage, so that stage paces the pipeline: ``(encoders + backbone / stages) * (1 + bubble)`` of
  the slowest rank, plus the same gradient reduction;
* planning: ``plan_step`` runs on a CPU thread during the previous step, so only the part of its wall
  time (measured here, on this machine) beyond the step's own time is exposed.

What the model leaves out: memory limits, padding inside backbone micro-batches (items are timed
alone), the difference in cost between micro-batches of a pipeline (the bubble uses their mean), and
the tensor- and pipeline-parallel communication inside a replica (the same for every method).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Dict, Optional, Sequence

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile, rank_seconds
from megatron_orch.balance.step_model import DEFAULT_TFLOPS, Busiest, LinkModel, StepModel
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes, phase_items
from megatron_orch.bench.balance import backbone_only_plan
from megatron_orch.bench.common import PLAN_METHODS, model_phases, plan_method
from megatron_orch.orchestrator.step_plan import StepPlan, step_transfers, warm_up

__all__ = ("SIM_METHODS", "END_TO_END", "DEFAULT_TFLOPS", "LinkModel", "StepModel", "phase_rank_seconds",
           "simulate_step", "topology_of", "warm_up_planner")

SIM_METHODS = ("none", "orch", "equal_count", "locality", "equal_locality", "backbone_only")
END_TO_END = ("none", "backbone_only")  # each example runs all its phases on one rank


def topology_of(dp: int, model: StepModel) -> Topology:
    """The DP group's nodes: a replica's first-stage TP group of ``tensor_parallel`` GPUs, as many per node as
    fit (one per node, or spread over nodes, when it fills one)."""
    return Topology.uniform(dp, max(1, model.link.gpus_per_node // model.tensor_parallel))


def phase_rank_seconds(plan: StepPlan, items: Dict[str, PhaseItems], profile: Optional[CostProfile],
                       tflops: float) -> Dict[str, np.ndarray]:
    """Modeled compute seconds of every phase on every rank under ``plan`` (on one GPU of the replica's
    work: :meth:`StepModel.compute_seconds` spreads it)."""
    dp = plan.examples_home.num_ranks
    out = {}
    for phase in items:
        rank = plan.encoders[phase].encode.rank if phase in plan.encoders else plan.examples_backbone.rank
        if profile is None:
            out[phase] = np.bincount(rank, weights=items[phase].cost, minlength=dp) / (tflops * 1e12)
        else:
            out[phase] = rank_seconds(profile.phases[phase], items[phase].cost, rank, dp)
    return out


def simulate_step(sizes: StepSizes, model, link: LinkModel, profile: Optional[CostProfile] = None,
                  tflops: float = DEFAULT_TFLOPS, nic_sweep: Sequence[float] = (),
                  step_model: Optional[StepModel] = None) -> dict:
    """Every method's modeled step on one global batch (see the module docstring). ``step_model``: the
    layout and overlap (default: DP only, transfers overlapped as the schedule overlaps them); its link and
    FLOP rate are ``link`` and ``tflops``."""
    cluster = dataclasses.replace(step_model or StepModel(), link=link, tflops=tflops)
    dp = int(np.asarray(sizes.counts).size)
    per_rank = int(np.asarray(sizes.counts)[0])
    topology = topology_of(dp, cluster)
    phases = model_phases(model, profile)
    items = phase_items(sizes, phases)
    backbone = phases.backbone.name
    plans, plan_seconds = {}, {}
    for method in SIM_METHODS:
        start = time.perf_counter()
        if method == "backbone_only":
            plans[method] = backbone_only_plan(sizes, plans["none"])
        else:
            plans[method] = plan_method(method, sizes, model, topology, profile, step_model=cluster)
        plan_seconds[method] = 0.0 if method == "none" else time.perf_counter() - start

    def figures(method: str, at: StepModel) -> dict:
        plan = plans[method]
        ranks = {p: v / cluster.tensor_parallel for p, v in phase_rank_seconds(plan, items, profile, tflops).items()}
        moves = {move.name: (move, Busiest.of(move.moved_bytes(topology.node_of_rank)))
                 for move in step_transfers(plan, items)}
        embeddings = {p: moves[f"{p} embeddings"][1] for p in plan.encoders}
        prefetched = [busiest for move, busiest in moves.values() if move.times == 1]
        replicas_per_node = max(1, at.link.gpus_per_node // at.tensor_parallel)
        if method in END_TO_END:  # encoders inside the micro-batches of the first stage, which paces the pipeline
            paced = sum((ranks[p] for p in plan.encoders), np.zeros(dp)) + ranks[backbone] / at.pipeline_stages
            bubble = (at.pipeline_stages - 1) / (at.virtual_stages * per_rank) if at.pipeline_stages > 1 else 0.0
            compute = float((paced * (1.0 + bubble)).max(initial=0.0))
            parts = at.step([], 0.0, per_rank, {}, prefetched, dp, replicas_per_node, other_compute=compute)
            parts.update(backbone=compute, pipeline_bubble=compute * bubble / (1.0 + bubble))
        else:
            encoders = [(p, float(ranks[p].max(initial=0.0))) for p in plan.encoders]
            parts = at.step(encoders, float(ranks[backbone].max(initial=0.0)), plan.num_microbatches, embeddings,
                            prefetched, dp, replicas_per_node)
        return {"parts": parts, "phase_seconds": {p: float(r.max(initial=0.0)) for p, r in ranks.items()},
                "phase_mean_seconds": {p: float(r.mean()) for p, r in ranks.items()},
                "comm": {name: {"seconds": b.seconds(at.link), "times": move.times, "nvlink_bytes": b.nvlink_bytes,
                                "nic_bytes": b.nic_bytes, "inter_node_bytes": move.moved_bytes(
                                    topology.node_of_rank).inter_node,
                                "intra_node_bytes": move.moved_bytes(topology.node_of_rank).intra_node}
                         for name, (move, b) in moves.items()}}

    result = {}
    for method in SIM_METHODS:
        f = figures(method, cluster)
        parts = f["parts"]
        exposed = max(0.0, plan_seconds[method] - parts["step"]) if method not in END_TO_END else 0.0
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
            "plan_seconds": plan_seconds[method],
            "exposed_plan_seconds": exposed,
            "step_seconds": parts["step"] + exposed,
        }
    upstream = result["none"]
    for figures_ in result.values():
        figures_["speedup"] = upstream["step_seconds"] / figures_["step_seconds"]
        figures_["phase_speedup"] = {p: upstream["phase_seconds"][p] / s if s > 0 else 1.0
                                     for p, s in figures_["phase_seconds"].items()}
    result["nic_sweep"] = {}
    for gbits in nic_sweep:
        slow = cluster.with_nic(gbits)
        result["nic_sweep"][str(gbits)] = {method: figures(method, slow)["parts"]["step"]
                                           + result[method]["exposed_plan_seconds"] for method in SIM_METHODS}
    return result


def warm_up_planner(model, announce=None) -> None:
    """Compile the planner's kernels first, so that planning times exclude JIT compilation (``announce``: told
    when numba compiles, see :func:`~megatron_orch.orchestrator.step_plan.warm_up`)."""
    for config in PLAN_METHODS.values():
        warm_up(model.phases(), config, announce)
