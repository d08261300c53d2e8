"""Balancing benchmark: per-phase post-balancing of a random global batch against upstream and a peer.

    python -m megatron_orch.bench.balance --dp 512 --per-rank 16 --json out.json

Draws a global batch of ``dp * per_rank`` examples from trace CSVs (``--mixture``: the shipped one, or a
heavy-tailed one of balance/traces.py; or ``--trace``),
DP rank r loading the consecutive block r (upstream Megatron), maps it to the items of every phase
under a model config (default: the 84B config) and plans each phase with every method:

* ``none``: upstream; every item stays on the rank that loaded its example.
* ``lpt``, ``kk``, ``bs_ffd``: the constructive partitioners alone on each phase (no refinement, no
  home fallback, bins not placed on ranks).
* ``orch``, ``orch_equal_count``, ``orch_locality``: what the trainer runs, ``plan_step`` with the
  flags of :data:`~megatron_orch.bench.common.PLAN_METHODS` (``orch``: the defaults, packed backbone
  micro-batches; ``orch_equal_count``: ``--orch-microbatching equal_count``, ``per_rank`` examples per
  rank in the backbone; ``orch_locality``: ``--orch-locality`` with packed micro-batches;
  ``orch_equal_locality``: ``--orch-locality`` with equal-count micro-batches), placement included, over
  ``--gpus-per-node`` ranks per node. Encoder phases of equal items (the model's tiles, frames and
  windows) are planned exactly by ``partition_uniform`` in all three. Plan time is the whole
  ``plan_step`` (all phases), shown on every phase.
* ``verl_kk``: a re-implementation, from its published description, of verl's DP batch balancing:
  equal-size Karmarkar-Karp over the backbone sequence lengths only, with verl's workload
  ``24576*s + s^2``; partition p goes to rank p. It plans the LLM phase; on the encoder phases its
  figures are those of the same plan, every encoder item following its example (single-phase
  balancing moves whole examples).

Every method's bin costs are recomputed here from its assignment under the model's cost model
(training FLOPs). ``max_over_mean`` is the slowest rank over the mean; ``max_over_lb`` uses the same
bound for every method, max(total / dp, largest item); ``bound_over_mean`` and ``max_over_bound``
use the method's own bound (:func:`own_bound`): for a phase of equal items (the model's tiles,
frames and windows) the whole-item floor ceil(n/K) items, for the backbone of an equal-count method
(``orch_equal_count``, ``orch_equal_locality``, ``verl_kk``) ``equal_count_lower_bound``.
``inter_node_bytes_frac`` (methods whose bins are ranks: all but lpt, kk, bs_ffd) is the share of
the phase's bytes that cross nodes, ``moved_bytes_frac`` the share that leaves its GPU, counted
by the step's own transfers (``step_transfers``, ``Transfer.moved_bytes``: what the trainer's log
and the simulator count): an encoder phase's raw inputs; for the LLM phase, the text from its home
rank and the projected embeddings from the ranks that encoded them, twice (forward, and their
gradients back).

Modeled step time, in training FLOPs of the slowest replica (``--pipeline-stages``, ``--virtual-stages``: a
DP rank's pipeline; every replica's micro-batches through Megatron's schedule,
:class:`~megatron_orch.balance.pipeline_schedule.PipelineSchedule`, which is their sum on one stage): a
per-phase plan synchronises between phases (an all-to-all), so its step is the sum over the encoder phases of
the slowest rank, then the backbone's slowest replica; with ``none`` and ``verl_kk`` every rank runs its own
examples end to end, each example's encoders inside its micro-batch on the first stage (on one stage: the
slowest rank's sum over phases, which favours them). ``speedup`` is relative to ``none``; ``step_over_lb``
against each encoder phase's bound plus the schedule's lower bound of the backbone. ``default`` sets the defaults' speedup
(``params.default``) beside the best method's; ``step.<method>.backbone_method`` says how each trainer row
planned the backbone (a locality-aware plan not kept: ``...+placed (... not faster)``).
"""
from __future__ import annotations

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from megatron_orch.balance.partition import equal_count_lower_bound, partition
from megatron_orch.balance.pipeline_schedule import PipelineSchedule
from megatron_orch.balance.comm_memory import CommunicatorMemory
from megatron_orch.balance.plan import ALL_TO_ALL, Placement
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes, phase_items
from megatron_orch.bench.common import (PLAN_METHODS, draw_sizes, memory_caps, parser_with_batch_args,
                                        peers_over_steps, report, trace_specs, upstream_plan, warm_up_partitioners)
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import EncoderPhasePlan, StepPlan, plan_step, step_transfers

COMPARED_METHODS = ("none", "lpt", "kk", "bs_ffd", "orch", "orch_equal_count", "orch_locality", "orch_equal_locality",
           "verl_kk")
RANK_METHODS = ("none", "orch", "orch_equal_count", "orch_locality", "orch_equal_locality", "verl_kk")  # bins are ranks
EQUAL_COUNT_METHODS = ("orch_equal_count", "orch_equal_locality", "verl_kk")  # per_rank backbone examples per rank
TRAINER_METHODS = {  # the trainer's flags for each orch row
    "orch": PLAN_METHODS["orch"], "orch_equal_count": PLAN_METHODS["equal_count"],
    "orch_locality": PLAN_METHODS["locality"], "orch_equal_locality": PLAN_METHODS["equal_locality"]}
DEFAULT = "orch"  # the trainer's defaults (bench.common.DEFAULT_METHOD)
VERL_LINEAR_COEFF = 24576  # verl's calculate_workload: 24576 * s + s^2 (a 7B model, hidden 4096)


def verl_workload(seq_len) -> np.ndarray:
    s = np.asarray(seq_len, dtype=np.float64)
    return VERL_LINEAR_COEFF * s + s * s


def verl_equal_size_kk(workloads, num_bins: int) -> np.ndarray:
    """Equal-size K-way Karmarkar-Karp (largest differencing), as verl's DP balancer describes it.

    The items, sorted ascending, form n/K states of K consecutive items (one per partition). While
    more than one state is left, the two with the largest spread (max - min partition sum; ties: the
    larger top partition) are merged: the first state's heaviest partition takes the second's
    lightest, and so on. Every partition therefore gets n/K items. Returns the partition of each item.
    """
    w = np.asarray(workloads, dtype=np.float64)
    n = w.size
    if n % num_bins:
        raise ValueError(f"verl's equal-size KK needs the number of items ({n}) to be a multiple of {num_bins}")
    order = np.lexsort((np.arange(n), w))
    heap = []
    for counter, group in enumerate(order.reshape(-1, num_bins)):
        sums = w[group][::-1].copy()  # partitions by decreasing sum
        members = group[::-1].reshape(num_bins, 1)
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], counter, sums, members))
    counter = len(heap)
    while len(heap) > 1:
        *_, sums0, members0 = heapq.heappop(heap)
        *_, sums1, members1 = heapq.heappop(heap)
        sums = sums0 + sums1[::-1]
        members = np.hstack((members0, members1[::-1]))
        by_sum = np.argsort(-sums, kind="stable")
        sums, members = sums[by_sum], members[by_sum]
        heapq.heappush(heap, (-(sums[0] - sums[-1]), -sums[0], counter, sums, members))
        counter += 1
    bins = np.empty(n, dtype=np.int64)
    if heap:
        members = heap[0][-1]
        bins[members] = np.arange(num_bins)[:, None]
    return bins


def backbone_only_plan(sizes: StepSizes, upstream: StepPlan) -> StepPlan:
    """verl-style assignment as a :class:`StepPlan` (no stats, traffic or digest: only its placements,
    micro-batches and transfers are used): examples balanced on backbone length alone (equal counts), every
    encoder item on its example's rank, one example per micro-batch as upstream's."""
    dp = int(np.asarray(sizes.counts).size)
    examples = Placement.from_ranks(verl_equal_size_kk(verl_workload(sizes.num_tokens), dp), dp)
    encoders = {phase: EncoderPhasePlan(example=enc.example, home=enc.home, encode=examples.expand(enc.example))
                for phase, enc in upstream.encoders.items()}
    return StepPlan(examples_home=upstream.examples_home, examples_backbone=examples,
                    microbatch_of_example=examples.slot, num_microbatches=upstream.num_microbatches,
                    encoders=encoders, backbone=upstream.backbone, stats={}, traffic={}, digest=0)


@dataclass(frozen=True)
class Plan:
    bins: np.ndarray  # bin (rank) of every item of the phase
    plan_ms: float


def _timed(fn: Callable[[], np.ndarray], repeats: int) -> Plan:
    best, bins = math.inf, None
    for _ in range(repeats):
        start = time.perf_counter()
        bins = fn()
        best = min(best, time.perf_counter() - start)
    return Plan(np.asarray(bins, dtype=np.int64), 1e3 * best)


def _trainer_configs(pipeline: PipelineSchedule) -> Dict[str, OrchestratorConfig]:
    """The trainer's rows' configs, their step model that of replicas of ``pipeline``'s stages."""
    return {method: dataclasses.replace(config, step_model=dataclasses.replace(
        config.step_model, pipeline_stages=pipeline.stages, virtual_stages=pipeline.virtual_stages))
        for method, config in TRAINER_METHODS.items()}


def plan_phases(sizes: StepSizes, model, phases: Dict[str, PhaseItems], dp: int, gpus_per_node: int,
                repeats: int, memory_cap: Dict[str, float], pipeline: PipelineSchedule = PipelineSchedule()):
    """Every method's plan for every phase (``verl_kk`` is planned on the LLM phase, then inherited), and
    the :class:`StepPlan` of each method whose bins are ranks (what its transfers move); the trainer's rows
    planned for replicas of ``pipeline``'s stages (pipeline-aware backbone plans where it has several)."""
    model_phases = model.phases()
    backbone = model_phases.backbone.name
    llm = phases[backbone]
    verl = _timed(lambda: verl_equal_size_kk(verl_workload(llm.tokens), dp), repeats)
    topology = Topology.uniform(dp, gpus_per_node)
    steps = {"none": upstream_plan(sizes, backbone)}
    steps["verl_kk"] = backbone_only_plan(sizes, steps["none"])
    trainer = {}
    per_rank = int(np.asarray(sizes.counts)[0])
    for method, config in _trainer_configs(pipeline).items():
        step_plan = [None]

        def run():
            step_plan[0] = plan_step(sizes, model_phases, config, topology, micro_batch_size=1,
                                     num_microbatches=per_rank)
            return step_plan[0].examples_backbone.rank

        run()  # untimed: the first call at this size loads kernels and touches fresh memory
        timed = _timed(run, repeats)
        steps[method] = step_plan[0]
        trainer[method] = {name: Plan(step_plan[0].encoders[name].encode.rank if name in step_plan[0].encoders
                                      else timed.bins, timed.plan_ms) for name in phases}
    plans: Dict[str, Dict[str, Plan]] = {}
    for name, items in phases.items():
        c, mem, cap, home = items.cost, items.memory, memory_cap[name], items.home
        runs = {
            "none": lambda: home,
            "lpt": lambda: partition(c, dp, method="lpt", memory=mem, memory_cap=cap, refine=False).bin_of_item,
            "kk": lambda: partition(c, dp, method="kk", refine=False).bin_of_item,
            "bs_ffd": lambda: partition(c, dp, method="bs_ffd", memory=mem, memory_cap=cap,
                                        refine=False).bin_of_item,
        }
        phase_plans = {m: _timed(run, 1 if m == "none" else repeats) for m, run in runs.items()}
        phase_plans.update({method: trainer[method][name] for method in TRAINER_METHODS})
        phase_plans["verl_kk"] = verl if name == backbone else Plan(steps["verl_kk"].encoders[name].encode.rank, 0.0)
        plans[name] = {m: phase_plans[m] for m in COMPARED_METHODS}
    return plans, steps


def own_bound(items: PhaseItems, method: str, dp: int, backbone: str) -> float:
    """The lower bound on the max rank cost that ``method`` can reach on this phase: for items of one cost
    (the model's tiles, frames and windows), ceil(n/K) of them; for the backbone of an equal-count method,
    :func:`equal_count_lower_bound`; else max(mean, largest item)."""
    costs = items.cost
    if not len(items):
        return 0.0
    if costs.min() == costs.max():
        return -(-len(items) // dp) * float(costs[0])
    if items.name == backbone and method in EQUAL_COUNT_METHODS:
        return equal_count_lower_bound(costs, dp)
    return max(float(costs.sum()) / dp, float(costs.max()))


def _phase_figures(phases: Dict[str, PhaseItems], plans, steps: Dict[str, StepPlan], name: str, method: str,
                   dp: int, gpus_per_node: int, backbone: str) -> dict:
    items, plan = phases[name], plans[name][method]
    loads = np.bincount(plan.bins, weights=items.cost, minlength=dp) if len(items) else np.zeros(dp)
    total = float(items.cost.sum())
    lower_bound = max(total / dp, float(items.cost.max())) if len(items) else 0.0
    bound = own_bound(items, method, dp, backbone)
    out = {
        "max_over_lb": float(loads.max() / lower_bound) if lower_bound > 0 else 1.0,
        "max_over_mean": float(loads.max() / (total / dp)) if total > 0 else 1.0,
        "bound_over_mean": bound / (total / dp) if total > 0 else 1.0,
        "max_over_bound": float(loads.max() / bound) if bound > 0 else 1.0,
        "plan_ms": plan.plan_ms,
        "max_flops": float(loads.max()),
    }
    if method in RANK_METHODS:  # what the phase's transfers move into place, per step (Transfer.moved_bytes)
        node_of_rank = Topology.uniform(dp, gpus_per_node).node_of_rank
        moved = [move.moved_bytes(node_of_rank).times(move.times) for move in step_transfers(steps[method], phases)
                 if move.phase == name]
        out["bytes"] = sum(m.total for m in moved)
        out["inter_node_bytes"] = sum(m.inter_node for m in moved)
        out["moved_bytes"] = sum(m.off_gpu for m in moved)
        out["inter_node_bytes_frac"] = out["inter_node_bytes"] / out["bytes"] if out["bytes"] else 0.0
        out["moved_bytes_frac"] = out["moved_bytes"] / out["bytes"] if out["bytes"] else 0.0
    return out


def run(trace_specs: Sequence[tuple], dp: int, per_rank: int, gpus_per_node: int, model: str, seed: int,
        repeats: int = 3, traces_dir: Optional[str] = None, seq_length: Optional[int] = None,
        pipeline: PipelineSchedule = PipelineSchedule(), peer_steps: int = 100) -> dict:
    """Run the benchmark and return its JSON-ready result (``pipeline``: each DP rank a replica of its stages;
    ``peer_steps``: the steps the trainer's methods' peers are counted over, batches of seeds ``seed``,
    ``seed + 1``, ...)."""
    if dp < 1 or per_rank < 1 or gpus_per_node < 1 or repeats < 1 or peer_steps < 1:
        raise ValueError(f"--dp, --per-rank, --gpus-per-node, --repeats and --peer-steps must be >= 1, got "
                         f"{dp}, {per_rank}, {gpus_per_node}, {repeats}, {peer_steps}")
    config, mixture, sizes = draw_sizes(trace_specs, dp, per_rank, model, seed, traces_dir, seq_length)
    model_phases = config.phases()
    backbone = model_phases.backbone.name
    phases = phase_items(sizes, model_phases)
    caps = memory_caps(phases, dp)
    warm_up_partitioners(gpus_per_node)
    plans, steps = plan_phases(sizes, config, phases, dp, gpus_per_node, repeats, caps, pipeline)

    result: dict = {name: {m: _phase_figures(phases, plans, steps, name, m, dp, gpus_per_node, backbone)
                           for m in COMPARED_METHODS} for name in phases}
    result["step"] = _step_model(phases, plans, steps, dp, result, backbone, pipeline)
    topology = Topology.uniform(dp, gpus_per_node)
    result["peers"] = {method: peers_over_steps(
        lambda step_sizes, c=trainer_config: plan_step(step_sizes, model_phases, c, topology, 1, per_rank),
        lambda k: sizes if k == 0 else draw_sizes(trace_specs, dp, per_rank, model, seed + k, traces_dir,
                                                  seq_length)[2], model_phases, topology, peer_steps)
        for method, trainer_config in _trainer_configs(pipeline).items()}
    for method in TRAINER_METHODS:  # how the trainer's plan balanced the backbone (a locality plan: kept or not)
        result["step"][method]["backbone_method"] = steps[method].stats[backbone].method
    best = max(COMPARED_METHODS, key=lambda m: result["step"][m]["speedup"])
    result["default"] = {"method": DEFAULT, "best": best, "speedup": result["step"][DEFAULT]["speedup"],
                         "best_speedup": result["step"][best]["speedup"],
                         "within": result["step"][DEFAULT]["speedup"] / result["step"][best]["speedup"]}
    result["params"] = {
        "traces": [{"trace": t.name, "weight": w} for t, w in zip(mixture.traces, mixture.weights)],
        "dp": dp, "per_rank": per_rank, "num_examples": dp * per_rank, "gpus_per_node": gpus_per_node,
        "peer_steps": peer_steps, "communicator_memory": dataclasses.asdict(CommunicatorMemory()),
        "pipeline_stages": pipeline.stages, "virtual_stages": pipeline.virtual_stages,
        "model": config.name, "model_shaped_after": config.shaped_after,
        "model_parameters": config.num_parameters()["total"], "seed": seed, "repeats": repeats,
        "default": DEFAULT,
        "items": {name: len(phases[name]) for name in phases},
        "total_flops": {name: float(phases[name].cost.sum()) for name in phases},
        "largest_over_mean": {name: float(phases[name].cost.max(initial=0.0) / (phases[name].cost.sum() / dp))
                              if len(phases[name]) else 0.0 for name in phases},
        "total_bytes": {name: result[name]["none"]["bytes"] for name in phases},
        "memory_cap_bytes": caps,
        "cost_unit": "training FLOPs (3x forward) from the model's shape",
        "notes": {
            "orch*": "the trainer's plan_step (placement included; plan_ms: all phases); orch (the defaults) and "
                     "orch_locality with packed backbone micro-batches, orch_equal_count and orch_equal_locality "
                     "with equal-count ones",
            "verl_kk": "planned on llm tokens with 24576*s+s^2; encoder items follow their example",
            "memory_cap": "per phase, upstream's peak per-rank activation memory (lpt, bs_ffd honour it; kk "
                          "ignores memory; the trainer's plan_step plans without a memory cap)",
            "step": "per-phase methods: the encoder phases' slowest ranks, then the backbone's slowest replica "
                    "through the pipeline schedule (one stage: its sum); none and verl_kk: every replica's "
                    "examples end to end, encoders inside their micro-batches on the first stage, through the "
                    "same schedule; lpt, kk, bs_ffd: one example per micro-batch, in id order",
            "max_over_lb": "lower bound max(total/dp, largest item) for every method",
            "step_over_lb": "the step's lower bound: each encoder phase's max(total/dp, largest item), then "
                            "PipelineSchedule.lower_bound of the backbone",
            "max_over_bound": "each method's own bound: ceil(n/K) items for a phase of equal items, "
                              "equal_count_lower_bound for the backbone of an equal-count method",
            "bytes": "per step, every transfer (Transfer.moved_bytes): raw inputs, text, embeddings forward "
                     "and their gradients back",
            "peers": "the trainer's rows: the busiest rank's distinct peers [all, on its node, across nodes] over a "
                     "step's transfers (this batch) and over peer_steps batches (seeds seed, seed + 1, ...), run "
                     "flat or node-wise (Transfer.node_wise), and the modeled communicator MiB of the busiest GPU "
                     "(CommunicatorMemory's assumptions)",
        },
    }
    return result


def _microbatch_loads(bins: np.ndarray, microbatch: np.ndarray, costs: np.ndarray, dp: int) -> np.ndarray:
    """``(dp, M)`` loads of every rank's micro-batches (M: the most any rank runs; the others run empty ones)."""
    m = int(microbatch.max(initial=0)) + 1
    return np.bincount(bins * m + microbatch, weights=costs, minlength=dp * m).reshape(dp, m)


def _step_model(phases: Dict[str, PhaseItems], plans, steps: Dict[str, StepPlan], dp: int, figures: dict,
                backbone: str, pipeline: PipelineSchedule) -> dict:
    """Every method's modeled step in training FLOPs of the slowest replica (``params.notes.step``)."""
    step = {}
    llm = phases[backbone]
    encoders = [name for name in phases if name != backbone]
    for m in COMPARED_METHODS:
        bins = plans[backbone][m].bins
        if m in steps:  # the plan's own micro-batches
            microbatch = steps[m].microbatch_of_example
        else:  # one example per micro-batch, in id order on its rank
            microbatch = np.zeros(bins.size, dtype=np.int64)
            for rank in range(dp):
                mine = np.flatnonzero(bins == rank)
                microbatch[mine] = np.arange(mine.size)
        loads = _microbatch_loads(bins, microbatch, llm.cost, dp)
        if m in ("none", "verl_kk"):  # every example end to end: its encoders inside its micro-batch
            inside = sum((_microbatch_loads(bins[phases[n].example], microbatch[phases[n].example], phases[n].cost, dp)
                          for n in encoders), np.zeros_like(loads))
            flops = float(pipeline.replica_seconds(loads, inside / 3.0, 2.0 * inside / 3.0).max(initial=0.0))
        else:
            flops = sum(float(np.bincount(plans[n][m].bins, weights=phases[n].cost, minlength=dp).max())
                        for n in encoders) + float(pipeline.replica_seconds(loads).max(initial=0.0))
        plan_ms = (plans[backbone][m].plan_ms if m in TRAINER_METHODS  # one plan_step for all phases
                   else sum(plans[name][m].plan_ms for name in phases))
        step[m] = {"flops": flops, "plan_ms": float(plan_ms)}
    lower = sum(max(float(phases[n].cost.sum()) / dp, float(phases[n].cost.max(initial=0.0))) for n in encoders)
    lower += pipeline.lower_bound(llm.cost, dp)
    for m in COMPARED_METHODS:
        step[m]["speedup"] = step["none"]["flops"] / step[m]["flops"]
        step[m]["over_lb"] = step[m]["flops"] / lower
        if m in RANK_METHODS:  # over the whole batch: every phase's bytes
            all_bytes = sum(figures[name][m]["bytes"] for name in phases)
            for field in ("inter_node_bytes", "moved_bytes"):
                moved = sum(figures[name][m][field] for name in phases)
                step[m][field + "_frac"] = moved / all_bytes if all_bytes else 0.0
    return step


def format_tables(result: dict) -> str:
    """Markdown tables: one per phase, then the modeled step."""
    p = result["params"]
    lines = [f"DP {p['dp']} x {p['per_rank']} examples/rank ({p['num_examples']} examples), a DP rank "
             f"{p['pipeline_stages']} pipeline stage(s) x {p['virtual_stages']} chunk(s), "
             f"{p['gpus_per_node']} GPUs/node, model {p['model']} ({p['model_parameters'] / 1e9:.1f}B), "
             f"seed {p['seed']}", ""]
    for name in p["items"]:
        lines += [f"phase `{name}`: {p['items'][name]} items, {p['total_flops'][name]:.3g} FLOPs, "
                  f"{p['total_bytes'][name] / 2**30:.2f} GiB per step", "",
                  "| method | max/mean | own bound/mean | max/own bound | max/LB | plan ms | inter-node bytes "
                  "| moved bytes |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for m in COMPARED_METHODS:
            f = result[name][m]
            inter = f"{100 * f['inter_node_bytes_frac']:.1f}%" if "inter_node_bytes_frac" in f else ""
            moved = f"{100 * f['moved_bytes_frac']:.1f}%" if "moved_bytes_frac" in f else ""
            lines.append(f"| {m} | {f['max_over_mean']:.4f} | {f['bound_over_mean']:.4f} | {f['max_over_bound']:.4f} "
                         f"| {f['max_over_lb']:.4f} | {f['plan_ms']:.2f} | {inter} | {moved} |")
        lines.append("")
    lines += ["modeled step (training FLOPs of the slowest rank)", "",
              "| method | step PFLOP | step/LB | speedup vs none | plan ms (all phases) | inter-node bytes "
              "| moved bytes |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for m in COMPARED_METHODS:
        s = result["step"][m]
        inter = f"{100 * s['inter_node_bytes_frac']:.1f}%" if "inter_node_bytes_frac" in s else ""
        moved = f"{100 * s['moved_bytes_frac']:.1f}%" if "moved_bytes_frac" in s else ""
        lines.append(f"| {m} | {s['flops'] / 1e15:.1f} | {s['over_lb']:.4f} | {s['speedup']:.3f} | "
                     f"{s['plan_ms']:.2f} | {inter} | {moved} |")
    lines += ["", *peer_table(result["peers"], "method")]
    d = result["default"]
    lines += ["", f"the default ({d['method']}) step speedup {d['speedup']:.4f}, the best method's ({d['best']}) "
              f"{d['best_speedup']:.4f}: {100 * (1 - d['within']):.2f}% below it",
              "backbone plans: " + ", ".join(f"{m} {result['step'][m]['backbone_method']}" for m in TRAINER_METHODS)]
    return "\n".join(lines)


def peer_table(peers: Dict[str, dict], row: str) -> List[str]:
    """A markdown table of :func:`~megatron_orch.bench.common.peers_over_steps` figures, one row per key of
    ``peers`` (named ``row``): the busiest rank's peers and the modeled communicator MiB per GPU, in one step and
    over the run, flat and node-wise."""
    steps = next(iter(peers.values()))["steps"]
    lines = [f"peers per rank (the busiest rank's, all = on its node + across nodes; cumulative over {steps} steps: "
             "what the communicator keeps connected) and modeled communicator MiB per GPU (CommunicatorMemory)", "",
             f"| {row} | all-to-all | step peers (node+net) | run peers (node+net) | step MiB | run MiB |",
             "|---|---|---:|---:|---:|---:|"]
    for name, figures in peers.items():
        for mode in ALL_TO_ALL:
            f = figures[mode]
            lines.append(f"| {name} | {mode} | {f['step'][0]} ({f['step'][1]}+{f['step'][2]}) | {f['run'][0]} "
                         f"({f['run'][1]}+{f['run'][2]}) | {f['step_mib']:.0f} | {f['run_mib']:.0f} |")
    return lines


def main(argv: Optional[List[str]] = None) -> dict:
    parser = parser_with_batch_args("python -m megatron_orch.bench.balance", __doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per plan; the fastest counts")
    parser.add_argument("--pipeline-stages", type=int, default=1,
                        help="pipeline stages of a DP rank's replica: the step through Megatron's 1F1B schedule "
                             "(default 1)")
    parser.add_argument("--virtual-stages", type=int, default=1,
                        help="model chunks per stage (the interleaved schedule; default 1)")
    parser.add_argument("--peer-steps", type=int, default=100,
                        help="steps the trainer's methods' peers are counted over (cumulative: what the communicator "
                             "keeps connected), batches of seeds --seed, --seed + 1, ... (default 100)")
    args = parser.parse_args(argv)
    specs = trace_specs(args)
    try:
        pipeline = PipelineSchedule(args.pipeline_stages, args.virtual_stages)
        result = run(specs, args.dp, args.per_rank, args.gpus_per_node, args.model, args.seed, args.repeats,
                     args.traces_dir, args.seq_length, pipeline, args.peer_steps)
    except ValueError as err:  # e.g. an example longer than --seq-length: refused, as training refuses it
        parser.error(str(err))
    return report(result, format_tables, args.json)


if __name__ == "__main__":
    main()
