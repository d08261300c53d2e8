"""Simulated step time of every balancing method on a cluster of 8-GPU nodes.

For one global batch drawn from the traces (DP rank r loads the r-th block of ``per_rank`` examples)
each method assigns every item of every phase to a rank:

* ``none``: upstream Megatron, every example runs end to end on the rank that loaded it;
* ``orch``, ``equal_count``, ``locality``, ``equal_locality``: ``plan_step`` as the trainer runs it
  (:data:`megatron_orch.bench.common.PLAN_METHODS`): per-phase post-balancing with packed backbone
  micro-batches (the ``auto`` partitioner in every phase, exact placement); with the default flags
  (the backbone keeps ``per_rank`` examples per rank); with ``--orch-locality`` and packed
  micro-batches (bins are ranks, few bytes cross nodes); with ``--orch-locality`` and the default
  equal-count micro-batches;
* ``backbone_only``: verl-style single-phase balancing (``bench.balance.verl_equal_size_kk`` over the
  backbone lengths with verl's workload); whole examples move, every encoder item runs on its
  example's backbone rank.

Step time of a method, in seconds:

* compute of phase p on rank r: the sum of its items' costs, with a cost profile in seconds plus the
  profile's per-call overhead on every rank that has an item of an encoder phase; without a profile
  the items' training FLOPs at an assumed ``tflops`` per GPU. Per-phase methods synchronise between
  phases (an all-to-all), so their compute is the sum over phases of the slowest rank; ``none`` and
  ``backbone_only`` run each example end to end, so theirs is the slowest rank's sum over phases.
* communication: every transfer of the plan (``StepPlan.input_transfer`` of each encoder phase with
  the items' raw-input bytes, ``text_transfer`` with token ids, labels and loss mask, and
  ``output_transfer`` of each encoder phase with the projected embeddings, counted twice: embeddings
  forward, their gradients back), each an all-to-all timed by :class:`LinkModel`, all exposed (none
  is assumed hidden behind compute, although raw inputs could be dispatched during the previous step).
* planning: ``plan_step`` runs on a CPU thread during the previous step, so only the part of its wall
  time (measured here, on this machine) beyond the step's own time is exposed.

What the model leaves out: compute and communication overlap, pipeline bubbles, the gradient
all-reduce (the same for every method), memory limits, and the backbone's padding inside a
micro-batch (items are timed alone).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile, rank_seconds
from megatron_orch.balance.plan import MovedBytes
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes, phase_items
from megatron_orch.bench.balance import backbone_only_plan
from megatron_orch.bench.common import PLAN_METHODS, model_phases, plan_method
from megatron_orch.orchestrator.step_plan import StepPlan, step_transfers, warm_up

METHODS = ("none", "orch", "equal_count", "locality", "equal_locality", "backbone_only")
END_TO_END = ("none", "backbone_only")  # each example runs all its phases on one rank
DEFAULT_TFLOPS = 400.0  # assumed achieved bf16 TFLOP/s per GPU when there is no profile


@dataclass(frozen=True)
class LinkModel:
    """All-to-all time from per-rank bytes: a rank's messages to all its peers are pipelined, NVLink and
    the NIC carry their shares at the same time, so an all-to-all takes its busiest rank's
    ``max(NVLink bytes / nvlink bandwidth, NIC bytes / NIC bandwidth)`` (a rank's bytes on a link: the
    larger of what it sends and what it receives there) plus one latency per all-to-all (the NIC's if
    anything crosses nodes, else NVLink's). Defaults: 8-GPU H100/H200 nodes, NVLink 4 (450 GB/s per
    GPU and direction), one 400 Gb/s NIC per GPU."""

    gpus_per_node: int = 8
    nvlink_gbytes_per_s: float = 450.0
    nic_gbits_per_s: float = 400.0
    nvlink_latency_us: float = 5.0
    nic_latency_us: float = 20.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"link model: {f.name} must be > 0, got {getattr(self, f.name)}")

    def alltoall_seconds(self, moved: MovedBytes) -> float:
        """Time of one all-to-all that sends ``moved`` (``Transfer.moved_bytes`` over nodes of ``gpus_per_node``)."""
        nvlink = np.maximum(moved.sent_intra, moved.received_intra) / (self.nvlink_gbytes_per_s * 1e9)
        nic = np.maximum(moved.sent_inter, moved.received_inter) / (self.nic_gbits_per_s * 1e9 / 8)
        latency = self.nic_latency_us if moved.inter_node else (self.nvlink_latency_us if moved.intra_node else 0.0)
        return float(np.maximum(nvlink, nic).max(initial=0.0)) + latency * 1e-6


def phase_rank_seconds(plan: StepPlan, items: Dict[str, PhaseItems], profile: Optional[CostProfile],
                       tflops: float) -> Dict[str, np.ndarray]:
    """Modeled compute seconds of every phase on every rank under ``plan``."""
    dp = plan.examples_home.num_ranks
    out = {}
    for phase in items:
        rank = plan.encoders[phase].encode.rank if phase in plan.encoders else plan.examples_llm.rank
        if profile is None:
            out[phase] = np.bincount(rank, weights=items[phase].cost, minlength=dp) / (tflops * 1e12)
        else:
            out[phase] = rank_seconds(profile.phases[phase], items[phase].cost, rank, dp)
    return out


def simulate_step(sizes: StepSizes, model, link: LinkModel, profile: Optional[CostProfile] = None,
                  tflops: float = DEFAULT_TFLOPS, nic_sweep: Sequence[float] = ()) -> dict:
    """Every method's modeled step on one global batch (see the module docstring)."""
    dp = int(np.asarray(sizes.counts).size)
    topology = Topology.uniform(dp, link.gpus_per_node)
    phases = model_phases(model, profile)
    items = phase_items(sizes, phases)
    plans, plan_seconds = {}, {}
    for method in METHODS:
        start = time.perf_counter()
        if method == "backbone_only":
            plans[method] = backbone_only_plan(sizes, plans["none"])
        else:
            plans[method] = plan_method(method, sizes, model, topology, profile)
        plan_seconds[method] = 0.0 if method == "none" else time.perf_counter() - start

    result = {}
    for method, plan in plans.items():
        ranks = phase_rank_seconds(plan, items, profile, tflops)
        if method in END_TO_END:
            compute = float(sum(ranks.values()).max())
        else:
            compute = float(sum(r.max(initial=0.0) for r in ranks.values()))
        comm, moves = 0.0, {}
        for move in step_transfers(plan, items):
            moved = move.moved_bytes(topology.node_of_rank)
            seconds = link.alltoall_seconds(moved)
            comm += move.times * seconds
            moves[move.name] = {"seconds": seconds, "times": move.times, "inter_node_bytes": moved.inter_node,
                                "intra_node_bytes": moved.intra_node}
        step_before_planning = compute + comm
        exposed = max(0.0, plan_seconds[method] - step_before_planning)
        result[method] = {
            "phase_seconds": {p: float(r.max(initial=0.0)) for p, r in ranks.items()},
            "phase_mean_seconds": {p: float(r.mean()) for p, r in ranks.items()},
            "compute_seconds": compute,
            "comm_seconds": comm,
            "comm": moves,  # per all-to-all; a step runs each ``times`` times
            "inter_node_bytes": sum(m["times"] * m["inter_node_bytes"] for m in moves.values()),
            "intra_node_bytes": sum(m["times"] * m["intra_node_bytes"] for m in moves.values()),
            "plan_seconds": plan_seconds[method],
            "exposed_plan_seconds": exposed,
            "step_seconds": step_before_planning + exposed,
        }
    upstream = result["none"]
    for figures in result.values():
        figures["speedup"] = upstream["step_seconds"] / figures["step_seconds"]
        figures["phase_speedup"] = {p: upstream["phase_seconds"][p] / s if s > 0 else 1.0
                                    for p, s in figures["phase_seconds"].items()}
    result["nic_sweep"] = {}
    for gbits in nic_sweep:
        slow = dataclasses.replace(link, nic_gbits_per_s=gbits)
        result["nic_sweep"][str(gbits)] = {
            method: result[method]["compute_seconds"] + result[method]["exposed_plan_seconds"] + sum(
                move.times * slow.alltoall_seconds(move.moved_bytes(topology.node_of_rank))
                for move in step_transfers(plans[method], items))
            for method in METHODS if method not in END_TO_END}
    return result


def warm_up_planner(model) -> None:
    """Compile the planner's kernels first, so that planning times exclude JIT compilation."""
    for config in PLAN_METHODS.values():
        warm_up(model.phases(), config)
