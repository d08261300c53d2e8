"""Placement benchmark: which rank gets which balanced bin, and the bytes each choice moves.

    python -m megatron_orch.bench.placement --dp 512 --per-rank 16 --json out.json

Same inputs as ``megatron_orch.bench.balance``: a global batch of ``dp * per_rank`` examples drawn
from trace CSVs, DP rank r loading the consecutive block r, mapped to the items of every phase
under a model config. Every phase is balanced once with ``partition(method="auto")`` (memory cap:
upstream's busiest rank), then its interchangeable bins are placed on ranks (``--gpus-per-node``
consecutive ranks per node) by each method:

* ``identity``: bin b on rank b.
* ``greedy``: heaviest same-node, then same-GPU byte counts first; never worse than identity.
* ``exact``: fewest inter-node bytes (min-cost flow), then fewest off-GPU bytes inside nodes.
* ``minmax``: least loaded busiest node (CP-SAT, ``--minmax-time-limit`` seconds, warm-started).
* ``locality``: not a placement: ``partition_locality`` balances with bins that are ranks (as balanced
  as the ``auto`` plan), keeping items near home; its ``solve_ms`` is that partition's time.
* ``trainer``: what the trainer runs with its defaults, ``plan_step`` (encoder phases of equal items
  by ``partition_uniform``, whose bins are ranks; the backbone packed, ``auto``, then ``exact``
  placement); its ``solve_ms`` is the whole ``plan_step`` (all phases), shown on every phase.

Traffic of a phase: an encoder item's raw input moves from its home rank to its bin's rank; an
example of the LLM phase pulls its text bytes from its home rank and its projected embeddings from
the ranks that encoded its items (placed by ``exact`` for the four placements, so that they place
the same LLM traffic; ``locality``'s and ``trainer``'s own encoder ranks for those two). Fields per phase and method:
``inter_node_bytes`` (bytes crossing nodes), ``max_node_inter_bytes`` (the busiest node's larger
of received and sent inter-node bytes), ``off_gpu_bytes`` (bytes leaving their GPU), ``solve_ms``,
``solver``.
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import numpy as np

from megatron_orch.balance.partition import partition, partition_locality
from megatron_orch.balance.placement import BinTraffic, PlacementConfig, place_bins, placement_cost
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, phase_items
from megatron_orch.bench.common import (draw_sizes, memory_caps, parser_with_batch_args, plan_method, report,
                                        trace_specs, warm_up_partitioners)
from megatron_orch.orchestrator.step_plan import step_transfers

COMPARED_PLACEMENTS = ("identity", "greedy", "exact", "minmax", "locality", "trainer")
PLACEMENTS = ("identity", "greedy", "exact", "minmax")
LOCALITY_TOLERANCE = 0.01
FIELDS = ("inter_node_bytes", "max_node_inter_bytes", "off_gpu_bytes", "solve_ms", "solver")


def _sources(phases: Dict[str, PhaseItems], name: str, encoder_ranks: Dict[str, np.ndarray], backbone: str):
    """(item of this phase each flow belongs to, source rank, bytes) of everything the phase pulls."""
    items = phases[name]
    if name != backbone:
        return [(np.arange(len(items)), items.home, items.nbytes)]
    flows = [(phases[enc].example, ranks, phases[enc].output_nbytes) for enc, ranks in encoder_ranks.items()]
    return [(np.arange(len(items)), items.home, items.nbytes)] + flows


def _traffic(sources, bin_of_item: np.ndarray, dp: int) -> BinTraffic:
    item = np.concatenate([s[0] for s in sources])
    ranks = np.concatenate([s[1] for s in sources])
    nbytes = np.rint(np.concatenate([s[2] for s in sources])).astype(np.int64)
    return BinTraffic.from_items(bin_of_item[item], ranks, nbytes, dp, dp)


def _balanced_bins(items: PhaseItems, dp: int, cap: float):
    if not len(items):
        return np.zeros(0, dtype=np.int64), "empty"
    part = partition(items.cost, dp, method="auto", memory=items.memory, memory_cap=cap, home=items.home)
    return part.bin_of_item, part.method


def _locality_bins(items: PhaseItems, dp: int, gpus_per_node: int, cap: float):
    if not len(items):
        return np.zeros(0, dtype=np.int64)
    return partition_locality(items.cost, items.home, dp, gpus_per_node, item_bytes=items.nbytes,
                              memory=items.memory, memory_cap=cap,
                              tolerance=LOCALITY_TOLERANCE).bin_of_item


def run(trace_specs: Sequence[tuple], dp: int, per_rank: int, gpus_per_node: int, model: str, seed: int,
        minmax_time_limit_s: float = 1.0, traces_dir: Optional[str] = None, seq_length: Optional[int] = None) -> dict:
    """Run the benchmark and return its JSON-ready result ``{phase: {method: {field: value}}, params}``."""
    if dp < 1 or per_rank < 1 or gpus_per_node < 1 or minmax_time_limit_s < 0:
        raise ValueError(f"--dp, --per-rank, --gpus-per-node must be >= 1 and --minmax-time-limit >= 0, "
                         f"got {dp}, {per_rank}, {gpus_per_node}, {minmax_time_limit_s}")
    config, mixture, sizes = draw_sizes(trace_specs, dp, per_rank, model, seed, traces_dir, seq_length)
    model_phases = config.phases()
    backbone = model_phases.backbone.name
    phases = phase_items(sizes, model_phases)
    topology = Topology.uniform(dp, gpus_per_node)
    caps = memory_caps(phases, dp)
    _warm_up(gpus_per_node)
    plan_method("orch", sizes, config, topology)  # untimed: loads kernels, touches memory
    start = time.perf_counter()
    trainer_plan = plan_method("orch", sizes, config, topology)
    trainer_ms = 1e3 * (time.perf_counter() - start)
    trainer_ranks = {name: trainer_plan.encoders[name].encode.rank for name in model_phases.encoder_names}
    trainer_ranks[backbone] = trainer_plan.examples_backbone.rank

    result: dict = {}
    partitions = {}
    # Encoder ranks the LLM phase pulls embeddings from: the exact placement's for every placement
    # method (so they all place the same LLM traffic), locality's own for locality.
    encoder_ranks: Dict[str, Dict[str, np.ndarray]] = {"exact": {}, "locality": {}}
    for name in phases:  # encoders first
        items = phases[name]
        bins, partitions[name] = _balanced_bins(items, dp, caps[name])
        traffic = _traffic(_sources(phases, name, encoder_ranks["exact"], backbone), bins, dp)
        result[name] = {}
        for method in PLACEMENTS:
            placed = place_bins(traffic, topology, PlacementConfig(method=method,
                                                                   time_limit_s=minmax_time_limit_s))
            result[name][method] = {field: getattr(placed, field) for field in FIELDS}
            if method == "exact":
                encoder_ranks["exact"][name] = placed.rank_of_bin[bins]
        start = time.perf_counter()
        ranks = _locality_bins(items, dp, gpus_per_node, caps[name])
        solve_ms = 1e3 * (time.perf_counter() - start)
        traffic = _traffic(_sources(phases, name, encoder_ranks["locality"], backbone), ranks, dp)
        cost = placement_cost(traffic, topology, np.arange(dp))
        result[name]["locality"] = {"inter_node_bytes": cost.inter_node_bytes,
                                    "max_node_inter_bytes": cost.max_node_inter_bytes,
                                    "off_gpu_bytes": cost.off_gpu_bytes, "solve_ms": solve_ms,
                                    "solver": "partition_locality (bins are ranks)"}
        encoder_ranks["locality"][name] = ranks
        encoders_of_trainer = {enc: trainer_ranks[enc] for enc in encoder_ranks["exact"]}
        traffic = _traffic(_sources(phases, name, encoders_of_trainer, backbone), trainer_ranks[name], dp)
        cost = placement_cost(traffic, topology, np.arange(dp))
        result[name]["trainer"] = {"inter_node_bytes": cost.inter_node_bytes,
                                   "max_node_inter_bytes": cost.max_node_inter_bytes,
                                   "off_gpu_bytes": cost.off_gpu_bytes, "solve_ms": trainer_ms,
                                   "solver": f"plan_step defaults ({trainer_plan.stats[name].method})"}

    result["params"] = {
        "traces": [{"trace": t.name, "weight": w} for t, w in zip(mixture.traces, mixture.weights)],
        "dp": dp, "per_rank": per_rank, "num_examples": dp * per_rank, "gpus_per_node": gpus_per_node,
        "num_nodes": topology.num_nodes, "model": config.name, "seed": seed,
        "minmax_time_limit_s": minmax_time_limit_s,
        "items": {name: len(phases[name]) for name in phases},
        "balanced_partition": partitions,
        "total_bytes": {phase: sum(move.moved_bytes(topology.node_of_rank).total  # one way: what is placed
                                   for move in step_transfers(trainer_plan, phases) if move.phase == phase)
                        for phase in model_phases.names},
        "notes": {
            "bins": "identity/greedy/exact/minmax place the bins of one partition(method='auto') per phase",
            "locality": "partition_locality with 1% balance tolerance; solve_ms is that partition's time",
            "trainer": "plan_step with the default flags; solve_ms is the whole plan_step (all phases)",
            "max_node_inter_bytes": "busiest node's max(received, sent) bytes across nodes",
            backbone: "text bytes from the home rank; embeddings from the encoder ranks of the exact "
                   "placement (identity/greedy/exact/minmax), of locality (locality) or of plan_step (trainer)",
        },
    }
    return result


def _warm_up(gpus_per_node: int) -> None:
    """JIT-compile the partitioners and load OR-Tools on a toy instance, so timings exclude that."""
    warm_up_partitioners(gpus_per_node)
    rng = np.random.default_rng(0)
    traffic = BinTraffic.from_items(rng.integers(0, 4, 64), np.repeat(np.arange(4), 16), rng.integers(1, 100, 64), 4, 4)
    for method in PLACEMENTS:
        place_bins(traffic, Topology.uniform(4, 2), PlacementConfig(method=method, time_limit_s=0.5))


def format_tables(result: dict) -> str:
    """One markdown table per phase (bytes in GiB)."""
    p = result["params"]
    lines = [f"DP {p['dp']} x {p['per_rank']} examples/rank, {p['gpus_per_node']} GPUs/node "
             f"({p['num_nodes']} nodes), model {p['model']}, seed {p['seed']}, "
             f"min-max time limit {p['minmax_time_limit_s']} s", ""]
    gib = 2.0 ** 30
    for name in p["items"]:
        lines += [f"phase `{name}`: {p['items'][name]} items, {p['total_bytes'][name] / gib:.2f} GiB, "
                  f"balanced by `{p['balanced_partition'][name]}`", "",
                  "| method | inter-node GiB | busiest node GiB | off-GPU GiB | solve ms | solver |",
                  "|---|---:|---:|---:|---:|---|"]
        for m in COMPARED_PLACEMENTS:
            f = result[name][m]
            lines.append(f"| {m} | {f['inter_node_bytes'] / gib:.3f} | {f['max_node_inter_bytes'] / gib:.3f} | "
                         f"{f['off_gpu_bytes'] / gib:.3f} | {f['solve_ms']:.1f} | {f['solver']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> dict:
    parser = parser_with_batch_args("python -m megatron_orch.bench.placement", __doc__.split("\n\n")[0])
    parser.add_argument("--minmax-time-limit", type=float, default=1.0, help="seconds for min-max (default 1)")
    args = parser.parse_args(argv)
    specs = trace_specs(args)
    try:
        result = run(specs, args.dp, args.per_rank, args.gpus_per_node, args.model, args.seed,
                     args.minmax_time_limit, args.traces_dir, args.seq_length)
    except ValueError as err:  # e.g. an example longer than --seq-length: refused, as training refuses it
        parser.error(str(err))
    return report(result, format_tables, args.json)


if __name__ == "__main__":
    main()
