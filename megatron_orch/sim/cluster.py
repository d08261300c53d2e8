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
from typing import Dict, List, Optional, Sequence

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile, rank_seconds
from megatron_orch.balance.plan import Placement, Transfer
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes, phase_items
from megatron_orch.bench.balance import verl_equal_size_kk, verl_workload
from megatron_orch.bench.common import PLAN_METHODS, model_phases, plan_method
from megatron_orch.orchestrator.step_plan import EncoderPhasePlan, StepPlan, warm_up

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

    def alltoall_seconds(self, transfer: Transfer, item_bytes) -> Dict[str, float]:
        """Time of one all-to-all moving every item of ``transfer`` (``item_bytes`` each), and its bytes."""
        src, dst = transfer.src.rank, transfer.dst.rank
        nbytes = np.asarray(item_bytes, dtype=np.float64)
        num_ranks = transfer.num_ranks
        cross = src // self.gpus_per_node != dst // self.gpus_per_node
        local = ~cross & (src != dst)

        def busiest(mask) -> float:
            sent = np.bincount(src[mask], weights=nbytes[mask], minlength=num_ranks)
            received = np.bincount(dst[mask], weights=nbytes[mask], minlength=num_ranks)
            return np.maximum(sent, received)

        seconds = np.maximum(busiest(local) / (self.nvlink_gbytes_per_s * 1e9),
                             busiest(cross) / (self.nic_gbits_per_s * 1e9 / 8)).max(initial=0.0)
        inter, intra = float(nbytes[cross].sum()), float(nbytes[local].sum())
        latency = self.nic_latency_us if inter else (self.nvlink_latency_us if intra else 0.0)
        return {"seconds": float(seconds) + latency * 1e-6, "inter_node_bytes": inter, "intra_node_bytes": intra}


def backbone_only_plan(sizes: StepSizes, upstream: StepPlan) -> StepPlan:
    """verl-style assignment as a :class:`StepPlan` (no micro-batches, stats or digest: only its
    placements and transfers are used): examples balanced on backbone length alone, every encoder item on
    its example's rank."""
    dp = int(np.asarray(sizes.counts).size)
    examples = Placement.from_ranks(verl_equal_size_kk(verl_workload(sizes.num_tokens), dp), dp)
    encoders = {phase: EncoderPhasePlan(example=enc.example, home=enc.home, encode=examples.expand(enc.example))
                for phase, enc in upstream.encoders.items()}
    return StepPlan(examples_home=upstream.examples_home, examples_llm=examples,
                    microbatch_of_example=np.zeros(sizes.num_examples, dtype=np.int64), num_microbatches=1,
                    encoders=encoders, stats={}, digest=0)


def transfers(plan: StepPlan, items: Dict[str, PhaseItems], backbone: str) -> List[tuple]:
    """(name, transfer, item bytes, times per step) of every all-to-all the plan makes."""
    out = [(f"{phase} inputs", plan.input_transfer(phase), items[phase].nbytes, 1) for phase in plan.encoders]
    out.append(("text", plan.text_transfer(), items[backbone].nbytes, 1))
    out += [(f"{phase} embeddings", plan.output_transfer(phase), items[phase].output_nbytes, 2)
            for phase in plan.encoders]  # forward, and the gradients back
    return out


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
        moves = [(name, link.alltoall_seconds(t, b), times)
                 for name, t, b, times in transfers(plan, items, phases.backbone.name)]
        comm = sum(times * m["seconds"] for _, m, times in moves)
        step_before_planning = compute + comm
        exposed = max(0.0, plan_seconds[method] - step_before_planning)
        result[method] = {
            "phase_seconds": {p: float(r.max(initial=0.0)) for p, r in ranks.items()},
            "phase_mean_seconds": {p: float(r.mean()) for p, r in ranks.items()},
            "compute_seconds": compute,
            "comm_seconds": comm,
            "comm": {name: {**m, "times": times} for name, m, times in moves},
            "inter_node_bytes": sum(times * m["inter_node_bytes"] for _, m, times in moves),
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
                times * slow.alltoall_seconds(t, b)["seconds"]
                for _, t, b, times in transfers(plans[method], items, phases.backbone.name))
            for method in METHODS if method not in END_TO_END}
    return result


def warm_up_planner(model) -> None:
    """Compile the planner's kernels first, so that planning times exclude JIT compilation."""
    for config in PLAN_METHODS.values():
        warm_up(model.phases(), config)
