"""What the benchmarks share: their command-line inputs, the global batch they draw, the methods' plans, the
warm-up, the output."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Callable, Dict, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile
from megatron_orch.balance.partition import partition, partition_equal_count, partition_locality
from megatron_orch.balance.comm_memory import CommunicatorMemory
from megatron_orch.balance.plan import ALL_TO_ALL, Connections, Placement
from megatron_orch.balance.step_model import StepModel
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.traces import (DERIVED_TRACES, HEAVY_TAILED_MIXTURES, SHIPPED_MIXTURE, Trace,
                                          TraceMixture, load_mixture, parse_trace_spec)
from megatron_orch.balance.workload import ModelPhases, PhaseItems, StepSizes, check_sequence_lengths, phase_items
from megatron_orch.mllm.config import DEFAULT_MODEL, MLLMConfig, load_model_config, sizes_from_trace, with_encoder_layers
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import EncoderPhasePlan, StepPlan, plan_step, step_transfers



def _reweighted(factors: Dict[str, float]) -> Tuple[Tuple[str, float], ...]:
    """The shipped mixture with the weight of every trace whose name contains a key multiplied."""
    return tuple((name, weight * next((f for key, f in factors.items() if key in name), 1.0))
                 for name, weight in SHIPPED_MIXTURE)


# The named mixtures of the benchmarks and the simulator (--mixture): the shipped one (every example trainable:
# SHIPPED_MIXTURE), re-weightings of it, and the heavy-tailed ones (balance/traces.py).
MIXTURES: Dict[str, Tuple[Tuple[str, float], ...]] = {
    "shipped": SHIPPED_MIXTURE,
    "audio-heavy": _reweighted({"asr": 4.0, "audio": 4.0, "music": 4.0}),
    "image-heavy": _reweighted({"omnibal": 4.0, "image": 4.0}),
    "video-heavy": _reweighted({"video": 4.0}),
    **HEAVY_TAILED_MIXTURES,
}

# The trainer's balancing methods as plan_step configurations (bench.balance, bench.emulate, megatron_orch.sim),
# beside upstream (``none``, :func:`upstream_plan`): the defaults (packed backbone micro-batches, the auto
# partitioner in every phase); equal-count backbone micro-batches; locality-aware in every phase, with packed and
# with equal-count backbone micro-batches.
DEFAULT_METHOD = "orch"
PLAN_METHODS = {
    "orch": OrchestratorConfig(background=False),
    "equal_count": OrchestratorConfig(microbatching="equal_count", background=False),
    "locality": OrchestratorConfig(locality=True, background=False),
    "equal_locality": OrchestratorConfig(microbatching="equal_count", locality=True, background=False),
}


def upstream_plan(sizes: StepSizes, backbone: str) -> StepPlan:
    """Upstream Megatron as a :class:`StepPlan` (placements only: no stats or traffic, digest 0): every item on the
    rank that loaded its example, the loader's micro-batches of one example."""
    home = Placement.from_counts(sizes.counts)
    encoders = {}
    for phase, per_example in sizes.items.items():
        example = np.repeat(np.arange(sizes.num_examples), np.asarray(per_example, dtype=np.int64))
        encoders[phase] = EncoderPhasePlan(example=example, home=home.expand(example), encode=home.expand(example))
    per_rank = int(np.asarray(sizes.counts).max(initial=1))
    return StepPlan(examples_home=home, examples_backbone=home, microbatch_of_example=home.slot,
                    num_microbatches=per_rank, encoders=encoders, backbone=backbone, stats={}, traffic={}, digest=0)


def model_phases(config: MLLMConfig, cost_profile: Optional[CostProfile] = None) -> ModelPhases:
    """The phases of ``config``, with the profile's measured costs if given."""
    phases = config.phases()
    return phases if cost_profile is None else cost_profile.apply(phases)


def plan_method(method: str, sizes: StepSizes, model: MLLMConfig, topology: Topology,
                cost_profile: Optional[CostProfile] = None, step_model: Optional[StepModel] = None) -> StepPlan:
    """The plan of ``none`` (upstream) or of a :data:`PLAN_METHODS` method, through ``plan_step`` with one
    example per micro-batch (``step_model``: the cluster its locality-aware plans are judged on)."""
    if method == "none":
        return upstream_plan(sizes, model.phases().backbone.name)
    config = dataclasses.replace(PLAN_METHODS[method], cost_profile=cost_profile,
                                 step_model=step_model or PLAN_METHODS[method].step_model)
    return plan_step(sizes, model.phases(), config, topology, micro_batch_size=1,
                     num_microbatches=int(np.asarray(sizes.counts)[0]))


def step_connections(plan: StepPlan, items: Dict[str, PhaseItems], node_of_rank, all_to_all: str) -> Connections:
    """The rank pairs every transfer of a step (``step_transfers``) connects, run ``all_to_all``."""
    connected = Connections.none(len(node_of_rank))
    for move in step_transfers(plan, items):
        connected = connected | move.moved_bytes(node_of_rank, all_to_all).connections
    return connected


def peer_check_args(description: str) -> argparse.Namespace:
    """The command line of the scripts that compare plans' peers on the shipped mixture's batches of seeds 0..
    (``scripts/check_placement_peers.py``, ``scripts/check_alike_exchange.py``)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--dp", default="512,2560", help="comma-separated DP sizes (default 512,2560)")
    parser.add_argument("--steps", type=int, default=10, help="batches of seeds 0.. (default 10)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="DP ranks per node (default 8)")
    return parser.parse_args()


@dataclasses.dataclass(frozen=True)
class FlatPeers:
    """What a run of plans gives the flat all-to-all: the first step's and the whole run's peers per rank, the bytes
    across nodes per step, and each plan's balance and modeled step time (``outcome``: equal for plans that move
    no load)."""
    step: np.ndarray
    run: np.ndarray
    inter_node_gb_per_step: float
    outcome: list

    def cells(self) -> Tuple[str, str, str]:
        """The table cells: step peers max / mean, run peers max / mean, inter-node GB per step."""
        return (f"{self.step.max()} / {self.step.mean():.1f}", f"{self.run.max()} / {self.run.mean():.1f}",
                f"{self.inter_node_gb_per_step:.1f}")


def flat_peers(plans: Sequence[StepPlan], batches: Sequence[StepSizes], phases: ModelPhases,
               topology: Topology) -> FlatPeers:
    """:class:`FlatPeers` of ``plans``, the plans of ``batches`` (one each, in order)."""
    run, first, inter = Connections.none(topology.num_ranks), None, 0.0
    for sizes, plan in zip(batches, plans, strict=True):
        connected = step_connections(plan, phase_items(sizes, phases), topology.node_of_rank, "flat")
        first = connected if first is None else first
        run = run | connected
        inter += plan.report()["inter-node MB"] / 1e3
    return FlatPeers(first.peers(topology.node_of_rank).total, run.peers(topology.node_of_rank).total,
                     inter / len(plans), [([s.max_after for s in plan.stats.values()], plan.step_time) for plan in plans])


def peers_over_steps(plan_of: Callable[[StepSizes], StepPlan], draw: Callable[[int], StepSizes], phases: ModelPhases,
                     topology: Topology, steps: int, memory: CommunicatorMemory = CommunicatorMemory()) -> dict:
    """The peers a method's plans (``plan_of``) give over ``steps`` steps, the batch of step k ``draw(k)`` (items of
    ``phases``): per all-to-all (``flat``,
    ``node-wise``), the busiest rank's peers ([all, on its node, across nodes]) in the first step (``step``) and over
    all of them (``run``, cumulative: what the communicator keeps connected), and the most modeled communicator
    MiB of any GPU after the first step and after the run (:class:`CommunicatorMemory`)."""
    if steps < 1:
        raise ValueError(f"peers are counted over >= 1 steps, got {steps}")
    node_of_rank = topology.node_of_rank
    first, run = {}, {mode: Connections.none(topology.num_ranks) for mode in ALL_TO_ALL}
    for k in range(steps):
        sizes = draw(k)
        plan, items = plan_of(sizes), phase_items(sizes, phases)
        for mode in ALL_TO_ALL:
            connected = step_connections(plan, items, node_of_rank, mode)
            first.setdefault(mode, connected)
            run[mode] = run[mode] | connected
    out = {"steps": steps}
    for mode in ALL_TO_ALL:
        step_peers, run_peers = first[mode].peers(node_of_rank), run[mode].peers(node_of_rank)
        out[mode] = {"step": list(step_peers.busiest()), "run": list(run_peers.busiest()),
                     "step_mib": float(memory.per_rank_mib(step_peers).max(initial=0.0)),
                     "run_mib": float(memory.per_rank_mib(run_peers).max(initial=0.0))}
    return out


def with_layers(config: MLLMConfig, layers: Optional[Tuple[int, ...]]) -> MLLMConfig:
    """``config`` with its stacks cut to ``layers``, one per phase (the encoders in order, then the backbone;
    the shipped configs: vision, audio, backbone), model and FLOPs alike."""
    if layers is None:
        return config
    if len(layers) != len(config.encoders) + 1:
        raise ValueError(f"--layers takes {len(config.encoders) + 1} numbers for model {config.name} (its phases "
                         f"{', '.join(config.phases().names)}), got {len(layers)}")
    for name, n in zip(config.encoders, layers):
        config = with_encoder_layers(config, name, n)
    backbone = config.backbone
    return dataclasses.replace(config, backbone=dataclasses.replace(
        backbone, transformer=dataclasses.replace(backbone.transformer, num_layers=layers[-1])))


def effective_layers(config: MLLMConfig) -> Tuple[int, ...]:
    """Layers of every phase's stack: the encoders in order, then the backbone."""
    return tuple(e.transformer.num_layers for e in config.encoders.values()) + (config.backbone.transformer.num_layers,)


def parse_layers(parser: argparse.ArgumentParser, text: Optional[str]) -> Optional[Tuple[int, ...]]:
    """``--layers`` as positive integers, one per phase (V,A,B for the shipped configs; checked against the
    model by :func:`with_layers`)."""
    if text is None:
        return None
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        layers = ()
    if not layers or min(layers) < 1:
        parser.error(f"--layers takes positive integers, one per phase (V,A,B for vision, audio, backbone), "
                     f"got {text!r}")
    return layers


def add_trace_args(parser: argparse.ArgumentParser) -> None:
    """``--mixture`` / ``--trace`` (what :func:`trace_specs` reads) and ``--traces-dir``."""
    parser.add_argument("--mixture", choices=list(MIXTURES), default="shipped",
                        help="a named mixture: shipped (" + ", ".join(f"{n}:{w}" for n, w in SHIPPED_MIXTURE)
                             + "; the default), a re-weighting of it (audio-, image-, video-heavy: x4) or a "
                             "heavy-tailed one (balance/traces.py HEAVY_TAILED_MIXTURES)")
    parser.add_argument("--trace", nargs="+", metavar="CSV[:WEIGHT]",
                        help="trace CSVs (names in the traces folder, or paths, or derived traces: "
                             + ", ".join(DERIVED_TRACES) + ") with optional weights, instead of --mixture")
    parser.add_argument("--traces-dir", default=None,
                        help="folder of the trace CSVs (default: $MEGATRON_ORCH_TRACES or the gzipped copies "
                             "in <repo>/data/traces)")
    add_seq_length_arg(parser)


def add_seq_length_arg(parser: argparse.ArgumentParser) -> None:
    """``--seq-length``: the longest example a drawn batch may hold (what :func:`batch_sizes` refuses)."""
    parser.add_argument("--seq-length", type=int, default=None,
                        help="backbone sequence length (default: the model's max_position_embeddings); a drawn "
                             "example longer than this is refused, as training refuses it")


def parser_with_batch_args(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the inputs that draw and map a global batch (traces, DP, model, seed, JSON)."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(parser)
    parser.add_argument("--dp", type=int, default=512, help="data-parallel size K (default 512)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples per DP rank M (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="DP ranks per node G (default 8)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model config name or YAML (default {DEFAULT_MODEL})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the result as JSON here")
    return parser


def trace_specs(args: argparse.Namespace) -> list:
    return [parse_trace_spec(s) for s in args.trace] if args.trace else list(MIXTURES[args.mixture])


def report(result: dict, format_tables: Callable[[dict], str], json_path: Optional[str],
           plot: Optional[Callable[[dict, str], None]] = None, plot_path: Optional[str] = None) -> dict:
    """Print the tables; write the JSON and draw the plot if asked."""
    print(format_tables(result))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {json_path}", file=sys.stderr)
    if plot_path:
        plot(result, plot_path)
        print(f"wrote {plot_path}", file=sys.stderr)
    return result


def draw_sizes(trace_specs: Sequence[tuple], dp: int, per_rank: int, model: str, seed: int,
               traces_dir: Optional[str] = None,
               seq_length: Optional[int] = None) -> Tuple[MLLMConfig, TraceMixture, StepSizes]:
    """The sizes of a random global batch of ``dp * per_rank`` examples, as the trainer gathers them (DP
    rank r loads the r-th consecutive block, as upstream Megatron does); an example longer than ``seq_length``
    (default: the model's positions) is refused (:func:`batch_sizes`)."""
    config = load_model_config(model)
    mixture = load_mixture(trace_specs, traces_dir)
    return config, mixture, batch_sizes(mixture.draw(dp * per_rank, seed), dp, per_rank, config, seq_length)


def batch_sizes(rows: Trace, dp: int, per_rank: int, config: MLLMConfig,
                seq_length: Optional[int] = None) -> StepSizes:
    """The sizes the trainer gathers for a global batch of trace rows, DP rank r holding rows ``[r * per_rank,
    (r + 1) * per_rank)``; an example of more than ``seq_length`` backbone tokens (default: the model's
    ``max_position_embeddings``) is refused with training's own check and message."""
    sizes = sizes_from_trace(rows, np.full(dp, per_rank, dtype=np.int64), config)
    limit = config.backbone.max_position_embeddings if seq_length is None else seq_length
    check_sequence_lengths(sizes.num_tokens, limit, lambda i: (
        f"{rows.name}: example {i} (DP rank {i // per_rank}, {rows['source'][i]} {rows['task'][i]})"))
    return sizes


def memory_caps(phases: Dict[str, PhaseItems], dp: int) -> Dict[str, float]:
    """Per-rank activation memory cap of each phase: what upstream's busiest rank already needs."""
    return {name: max(float(np.bincount(items.home, weights=items.memory, minlength=dp).max(initial=0.0)), 1.0)
            for name, items in phases.items()}


def warm_up_partitioners(gpus_per_node: int) -> None:
    """Compile the partitioners' kernels on a toy instance so that timings exclude JIT compilation."""
    rng = np.random.default_rng(0)
    costs, memory = rng.random(64), rng.random(64)
    home = np.repeat(np.arange(4), 16)
    for method in ("lpt", "kk", "bs_ffd", "auto"):
        partition(costs, 4, method=method, memory=memory if method != "kk" else None,
                  memory_cap=100.0 if method != "kk" else None, home=home)
    partition_equal_count(costs, 4, home=home)
    partition_locality(costs, home, 4, min(gpus_per_node, 4), item_bytes=costs, memory=memory, memory_cap=100.0)
