"""The plan of one training step: where every encoder item and every example is computed, and the
transfers that move raw inputs, text and encoder outputs there.

Every rank of a DP group calls :func:`plan_step` with the same gathered sizes and gets the same plan
(the partitioners and the placement solvers are deterministic); :attr:`StepPlan.digest` lets the
caller check that cheaply.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance import _plan_kernels
from megatron_orch.balance._jit import announcing_compilation
from megatron_orch.balance.cost import ContextParallelCost
from megatron_orch.balance.exchange import classes_of, exchange_alike
from megatron_orch.balance.partition import (Outcome, partition, partition_equal_count,
                                              partition_equal_count_locality, partition_groups, partition_locality,
                                              uniform_bins)
from megatron_orch.balance.placement import PlacementConfig, place_items
from megatron_orch.balance.repair import localize, repair_locality
from megatron_orch.balance.plan import Connections, MovedBytes, Peers, Placement, Transfer, checksum, exchanged_bytes
from megatron_orch.balance.step_model import Busiest
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import ModelPhases, PhaseItems, StepSizes, phase_items
from megatron_orch.orchestrator.config import OrchestratorConfig


@dataclass(frozen=True)
class PhaseStats:
    """Load of one phase across DP ranks before (loader) and after (plan) balancing."""

    method: str
    items: int
    max_before: float
    mean: float
    max_after: float

    @property
    def imbalance_before(self) -> float:
        return self.max_before / self.mean if self.mean > 0 else 1.0

    @property
    def imbalance_after(self) -> float:
        return self.max_after / self.mean if self.mean > 0 else 1.0


@dataclass(frozen=True, eq=False)
class EncoderChunks:
    """How every rank runs its items of one encoder phase: in chunks of ``items`` consecutive items (slot
    order); on rank r the first ``kept[r]`` items (whole chunks, or all of them) keep their activations
    through the backbone, the others run without and are recomputed, chunk by chunk, for their backward."""

    items: int
    kept: np.ndarray  # per rank


@dataclass(frozen=True, eq=False)
class EncoderPhasePlan:
    """Items of one encoder phase: their example, where they are loaded and where they are encoded, and
    in which chunks (None: each rank's items in one chunk, kept)."""

    example: np.ndarray
    home: Placement
    encode: Placement
    chunks: Optional[EncoderChunks] = None


@dataclass(frozen=True, eq=False)
class StepMemory:
    """Modeled activation bytes of a step on every DP rank (the phases' cost models, ``PhaseItems.memory``):
    each phase's own peak and the step's peak (what is alive at once), under the plan and upstream (the
    loader's micro-batches, each encoding its own items), and the cap the plan kept the encoders under.

    Upstream, micro-batch m holds its encoders' activations and its backbone's at once. Under the plan,
    a rank holds its kept encoder chunks through all its backbone micro-batches, then one recomputed chunk
    at a time. Backbone micro-batches of rows padded to their longest example count that length for every
    row (packed ones: their examples). No pipelining: a first pipeline stage with several micro-batches
    in flight holds more, upstream as balanced."""

    phase_peak: Dict[str, np.ndarray]
    peak: np.ndarray
    upstream_phase_peak: Dict[str, np.ndarray]
    upstream_peak: np.ndarray
    encoder_cap: float


@dataclass(frozen=True, eq=False)
class StepPlan:
    examples_home: Placement
    examples_backbone: Placement           # slot order = micro-batch order on every rank
    microbatch_of_example: np.ndarray
    num_microbatches: int
    encoders: Dict[str, EncoderPhasePlan]  # the encoder phases
    backbone: str                          # the backbone phase's name
    stats: Dict[str, PhaseStats]           # every phase
    traffic: Dict[str, MovedBytes]         # per step, of every transfer (:func:`step_transfers`; {}: not planned)
    digest: int
    memory: Optional[StepMemory] = None    # modeled activation bytes (None: not planned)
    step_time: Tuple[float, float] = (0.0, 0.0)  # modeled, as loaded and as planned (:func:`_step_time`)
    peers: Optional[Peers] = None          # each rank's distinct peers over the step's transfers (None: not planned)
    connections: Optional[Connections] = None  # the rank pairs the step's transfers connect (None: not planned)

    def report(self) -> Dict[str, float]:
        """The plan's figures by name, as the log shows them: each phase's modeled cost max/mean over DP
        before (as loaded) and after (as planned), the MB the step's transfers move within and across
        nodes (all of them: raw inputs, text, embeddings forward and their gradients back), the most distinct
        peers a rank exchanges with over them, on its node and across nodes, and the share of
        the modeled step time the plan saves (``step_time``)."""
        out = {}
        for phase, stats in self.stats.items():
            out[f"{phase} before"], out[f"{phase} after"] = stats.imbalance_before, stats.imbalance_after
        out["intra-node MB"] = sum(moved.intra_node for moved in self.traffic.values()) / 1e6
        out["inter-node MB"] = sum(moved.inter_node for moved in self.traffic.values()) / 1e6
        _, out["peers intra-node"], out["peers inter-node"] = self.peers.busiest() if self.peers else (0, 0, 0)
        before, after = self.step_time
        out["step saved %"] = 100.0 * (1.0 - after / before) if before > 0 else 0.0
        return out

    def text_transfer(self) -> Transfer:
        """Token ids / labels / loss masks: home rank -> backbone rank."""
        return Transfer(self.examples_home, self.examples_backbone)

    def input_transfer(self, phase: str) -> Transfer:
        """Raw encoder inputs: home rank -> encoder rank."""
        enc = self.encoders[phase]
        return Transfer(enc.home, enc.encode)

    def output_transfer(self, phase: str) -> Transfer:
        """Encoder outputs: encoder rank -> backbone rank of their example, in one move."""
        enc = self.encoders[phase]
        return Transfer(enc.encode, self.examples_backbone.expand(enc.example))


MOVE_KINDS = ("inputs", "text", "embeddings")  # what a step's move carries (:attr:`StepMove.kind`)


@dataclass(frozen=True, eq=False)
class StepMove:
    """One all-to-all of a step (:func:`step_moves`): its name; what it carries (``kind``: an encoder phase's
    raw ``inputs``, the backbone's ``text``, i.e. token ids, labels and loss masks, or an encoder phase's
    ``embeddings``); the phase whose items travel (``items_of``) and the phase whose placement it fills
    (``phase``); what moves where (``transfer``); and whether the items' gradients come back by the inverse
    all-to-all in the backward pass (``with_gradients``: the embeddings)."""

    name: str
    kind: str
    items_of: str
    phase: str
    transfer: Transfer
    with_gradients: bool = False

    def __post_init__(self):
        if self.kind not in MOVE_KINDS:
            raise ValueError(f"StepMove.kind must be one of {MOVE_KINDS}, got {self.kind!r}")

    @property
    def times(self) -> int:
        """How many times a step runs it: twice when the gradients come back (forward, then backward)."""
        return 2 if self.with_gradients else 1

    def gradients(self) -> Transfer:
        """The all-to-all that sends the items' gradients back: the inverse of ``transfer``."""
        if not self.with_gradients:
            raise ValueError(f"{self.name}: no gradients come back")
        return self.transfer.inverse()

    def bytes_of(self, items: Dict[str, PhaseItems]) -> np.ndarray:
        """Each item's bytes on the wire, of ``items`` (``phase_items``): an encoder item's outputs for the
        embeddings, else what the loader read (raw inputs, text)."""
        of = items[self.items_of]
        return of.output_nbytes if self.kind == "embeddings" else of.nbytes


def step_moves(plan: StepPlan) -> List[StepMove]:
    """Every all-to-all of a step under ``plan``, the one list of them: each encoder phase's raw inputs
    (home rank -> encoder rank), the text (home rank -> backbone rank) and each encoder phase's
    embeddings (encoder rank -> backbone rank of their example; their gradients back by the inverse
    all-to-all). :func:`step_transfers` counts these (the trainer's log, the benchmarks, the simulator) and
    post-balancing's ``prepare_moves`` builds the routes of these, so what is counted is what runs."""
    backbone = plan.backbone
    out = [StepMove(f"{phase} inputs", "inputs", phase, phase, plan.input_transfer(phase)) for phase in plan.encoders]
    out.append(StepMove("text", "text", backbone, backbone, plan.text_transfer()))
    out += [StepMove(f"{phase} embeddings", "embeddings", phase, backbone, plan.output_transfer(phase),
                     with_gradients=True) for phase in plan.encoders]
    return out


@dataclass(frozen=True, eq=False, kw_only=True)
class StepTransfer(StepMove):
    """One all-to-all of a step (a :class:`StepMove`) with each item's bytes: what the byte count counts."""

    item_bytes: np.ndarray

    def moved_bytes(self, node_of_rank, all_to_all: str = "flat") -> MovedBytes:
        """What one all-to-all sends (:meth:`Transfer.moved_bytes`)."""
        return self.transfer.moved_bytes(self.item_bytes, node_of_rank, all_to_all)


def step_transfers(plan: StepPlan, items: Dict[str, PhaseItems]) -> List[StepTransfer]:
    """Every all-to-all of a step under ``plan`` (:func:`step_moves`), with the bytes of ``items``
    (``phase_items``); the embeddings run twice: forward, and their gradients back by the inverse
    all-to-all. The trainer's log, the benchmarks and the simulator all count these."""
    return [StepTransfer(**{f.name: getattr(move, f.name) for f in dataclasses.fields(StepMove)},
                         item_bytes=move.bytes_of(items))
            for move in step_moves(plan)]


def _place(bin_of_item, sources, num_ranks, topology, config: OrchestratorConfig):
    """Rank of every bin (``sources``: (bin, source rank, int64 bytes) arrays of what each bin pulls)."""
    bins, ranks, nbytes = (np.concatenate(arrays) for arrays in zip(*sources)) if len(sources) > 1 else sources[0]
    rank_of_bin = place_items(bins, ranks, nbytes, topology, PlacementConfig(
        method=config.placement, time_limit_s=config.placement_time_limit_s, deterministic=True))
    return rank_of_bin[bin_of_item]


def _balance_encoder(costs, home_rank, item_bytes, num_ranks, topology, config, balanced: bool):
    """Encoder rank of every item of one phase, and the method name."""
    if not balanced or costs.size == 0:
        return home_rank, "none"
    if config.algorithm == "auto" and _plan_kernels.all_equal(costs) and _plan_kernels.all_equal(item_bytes):
        return uniform_bins(np.ascontiguousarray(home_rank, dtype=np.int64), topology.node_of_rank)
    if config.locality:
        part = partition_locality(costs, home_rank, num_ranks, _gpus_per_node(topology),
                                  item_bytes=item_bytes)
        return part.bin_of_item, part.method
    part = partition(costs, num_ranks, method=config.algorithm, home=home_rank)
    if part.outcome is Outcome.HOME:
        return home_rank, part.method
    return _place(part.bin_of_item, [(part.bin_of_item, home_rank, item_bytes)], num_ranks,
                  topology, config), part.method


def _example_sources(home: np.ndarray, text_bytes: np.ndarray, rank_of_item):
    """What every example pulls to its backbone rank, as (example, source rank, int64 bytes) arrays: its text
    and the embeddings of its items encoded on its home rank in one triple per example, each item encoded
    elsewhere in its own (``rank_of_item``: each encoder phase's (example, encoder rank, output bytes))."""
    at_home = np.array(text_bytes, dtype=np.int64)
    examples, sources, nbytes = [np.arange(home.size, dtype=np.int64)], [home], [at_home]
    for example, enc_rank, out_bytes in rank_of_item.values():
        away = _plan_kernels.sources_by_example(home, at_home, example, enc_rank, out_bytes)
        for out, values in zip((examples, sources, nbytes), away):
            out.append(values)
    return np.concatenate(examples), np.concatenate(sources), np.concatenate(nbytes)


def _pull_rank(home: np.ndarray, sources, num_ranks: int) -> np.ndarray:
    """For every example, the rank that holds most of the bytes it pulls to its backbone rank (``sources``:
    :func:`_example_sources`; its text on its home rank, its embeddings where its items were encoded; ties: home,
    then the lower rank)."""
    return _plan_kernels.pull_ranks(home, *sources, num_ranks)


class _SlowerThan:
    """How much slower backbone ranks make a step than ``reference`` at worst, as
    :attr:`OrchestratorConfig.step_model` models it over the NIC bandwidths from its lowest to its link's: calling
    it with a candidate gives (relative slowdown, at which Gb/s); 0 or less: never slower. (The encoder plans are
    the same for both: only the backbone's compute, its text and the embeddings it pulls differ; the reference's
    figures and the encoders' are counted once, for every candidate judged against it.) Every move is timed as
    the configured all-to-all runs it (``config.all_to_all``: flat, or node-wise's two hops).
    ``pipelined(ranks)``: the modeled backbone of backbone ranks ``ranks`` (:class:`PipelinedBackbone`)."""

    def __init__(self, reference: np.ndarray, items: Dict[str, PhaseItems], rank_of_item, home: np.ndarray,
                 topology: Topology, pipelined, config: OrchestratorConfig):
        self.items, self.home, self.pipelined, self.config = items, home, pipelined, config
        self.node = topology.node_of_rank
        num_ranks = topology.num_ranks
        self.backbone = [name for name in items if name not in rank_of_item][0]
        model = config.step_model
        in_seconds = config.cost_profile is not None
        self.encoders = [(phase, model.compute_seconds(_plan_kernels.rank_loads_max(rank, items[phase].cost,
                                                                                    num_ranks), in_seconds))
                         for phase, (_, rank, _) in rank_of_item.items()]
        self.inputs = [self._move(home[example], rank, items[phase].nbytes)
                       for phase, (example, rank, _) in rank_of_item.items()]
        # each phase's embeddings as runs of one example's items on one encoder rank: what its items send, counted
        # in a fraction of the entries for every candidate (~800k items, ~100k runs at DP 10240)
        self.embeddings = {phase: _plan_kernels.runs(example, rank, np.ascontiguousarray(out_bytes, dtype=np.int64))[:3]
                           for phase, (example, rank, out_bytes) in rank_of_item.items()}
        self.theirs = self._figures(reference)

    def _move(self, src_rank, dst_rank, item_bytes) -> Busiest:
        return Busiest.of(exchanged_bytes(src_rank, dst_rank, item_bytes, self.node, self.config.all_to_all,
                                          connections=False))

    def _figures(self, backbone_rank):
        compute = self.pipelined(backbone_rank)
        embeddings = {phase: self._move(rank, backbone_rank[example], out_bytes)
                      for phase, (example, rank, out_bytes) in self.embeddings.items()}
        text = self._move(self.home, backbone_rank, self.items[self.backbone].nbytes)
        return compute, embeddings, self.inputs + [text]

    def __call__(self, candidate: np.ndarray):
        model = self.config.step_model
        ours, theirs = self._figures(candidate), self.theirs
        moves = [*ours[1].values(), *theirs[1].values(), *ours[2], *theirs[2]]
        worst = (-np.inf, model.link.nic_gbits_per_s)
        for nic in model.nic_breakpoints(moves, model.lowest_nic_gbits_per_s):
            at = model.with_nic(nic)
            mine = at.step(self.encoders, ours[0], ours[1], ours[2])["step"]
            other = at.step(self.encoders, theirs[0], theirs[1], theirs[2])["step"]
            excess = mine / other - 1.0 if other > 0 else 0.0
            if excess > worst[0]:
                worst = (excess if excess > 1e-12 else min(excess, 0.0), float(nic))
        return worst


def _repaired(bins, method, slower, reference, costs, home, text_bytes, rank_of_item, topology,
              slower_than: _SlowerThan, config: OrchestratorConfig, swaps_only: bool):
    """The locality plan ``bins`` after :func:`repair_locality` against the plain plan ``reference``, if that
    makes it no slower: (bins, method, slowdown as ``slower_than`` gives it)."""
    link = config.step_model.link
    sources = [(np.arange(home.size, dtype=np.int64), home, text_bytes), *rank_of_item.values()]
    repaired, actions = repair_locality(bins, reference, costs, sources, topology.node_of_rank,
                                        link.nvlink_gbytes_per_s * 8 / link.nic_gbits_per_s, swaps_only=swaps_only)
    if not actions:
        return bins, method, slower
    again = slower_than(repaired)
    return (repaired, f"{method}+repair", again) if again[0] < slower[0] else (bins, method, slower)


def _localized(reference, method, costs, home, text_bytes, example_bytes, pull, rank_of_item, topology,
               slower_than: _SlowerThan, config: OrchestratorConfig, swaps_only: bool):
    """The plain plan ``reference`` with its examples brought to the node holding most of their bytes (``pull``:
    the rank holding most of each example's bytes, :func:`_pull_rank`; ``example_bytes``: what it pulls) by
    :func:`localize` (within its balance), repaired if the step model finds it slower: (bins, method, slowdown
    as ``slower_than`` gives it)."""
    want = topology.node_of_rank[pull]
    bins, _ = localize(reference, costs, want, topology.node_of_rank, swaps_only=swaps_only,
                       item_bytes=example_bytes)
    name = f"{method}+localized"
    slower = slower_than(bins)
    if slower[0] > 0:
        bins, name, slower = _repaired(bins, name, slower, reference, costs, home, text_bytes, rank_of_item,
                                       topology, slower_than, config, swaps_only)
    return bins, name, slower


def _gpus_per_node(topology: Topology) -> int:
    per_node = topology.ranks_per_node()
    if per_node.min() != per_node.max():
        raise ValueError(f"locality balancing needs the same number of ranks per node, got {per_node.tolist()}")
    if not np.array_equal(topology.node_of_rank, np.arange(topology.num_ranks) // per_node[0]):
        raise ValueError("locality balancing needs DP ranks numbered node by node")
    return int(per_node[0])


def _microbatches(backbone_rank, costs, num_tokens, num_ranks, micro_batch_size, num_microbatches,
                  packed: bool, algorithm: str):
    """Micro-batch of every example on its backbone rank."""
    backbone_rank = np.ascontiguousarray(backbone_rank, dtype=np.int64)
    if not packed:
        # Longest first (ties by id), so the rows of a micro-batch have similar lengths (little padding).
        return _plan_kernels.longest_first_microbatches(backbone_rank, np.ascontiguousarray(num_tokens, dtype=np.int64),
                                                        num_ranks, micro_batch_size)
    # every rank's examples into its micro-batches, as partition(costs of the rank, num_microbatches) would
    return partition_groups(costs, backbone_rank, num_microbatches, method=algorithm)


def _pipelined(bins, method: str, costs, num_tokens, home, num_ranks: int, micro_batch_size: int,
               num_microbatches: int, config: OrchestratorConfig):
    """The backbone plan judged by the pipeline schedule (``config.step_model``'s stages > 1): the sum-balanced
    ``bins`` with their own micro-batches, the pipeline-aware local search from them
    (:meth:`PipelineSchedule.plan`) and the loader's plan (``home``, its own micro-batches); the one whose slowest
    replica's modeled step is shortest (ties: the loader's, then the sum-balanced), as (bins, micro-batch of every
    example, method). The loader's comes back as ``home`` itself."""
    schedule = config.step_model.schedule

    def own_microbatches(ranks):
        return _microbatches(ranks, costs, num_tokens, num_ranks, micro_batch_size, num_microbatches, config.packed,
                             config.algorithm)

    def slowest(ranks, microbatch):
        return schedule.plan_seconds(costs, ranks, microbatch, num_ranks, num_microbatches).max(initial=0.0)

    loader = (own_microbatches(home) if config.packed
              else np.arange(home.size) % (micro_batch_size * num_microbatches) // micro_batch_size)
    own = own_microbatches(bins)
    searched, microbatch, seconds = schedule.plan(costs, bins, num_ranks, num_microbatches,
                                                  rows=None if config.packed else micro_batch_size)
    candidates = [(slowest(home, loader), home, loader, "home+pipelined"), (slowest(bins, own), bins, own, method),
                  (seconds.max(initial=0.0), searched, microbatch, f"{method}+pipelined")]
    best = min(c[0] for c in candidates)
    return next((ranks, mb, name) for time, ranks, mb, name in candidates if time <= best * (1 + 1e-9))


def plan_step(sizes: StepSizes, phases: ModelPhases, config: OrchestratorConfig,
              topology: Topology, micro_batch_size: int, num_microbatches: int) -> StepPlan:
    """Plan every phase of one global batch (deterministic: same inputs, same plan on every rank); the
    costs are the phases' cost models, or the config's cost profile."""
    counts = np.asarray(sizes.counts, dtype=np.int64)
    num_ranks = int(counts.size)
    if topology.num_ranks != num_ranks:
        raise ValueError(f"topology spans {topology.num_ranks} ranks but sizes come from {num_ranks}")
    expected = micro_batch_size * num_microbatches
    if (counts != expected).any():
        r = int(np.flatnonzero(counts != expected)[0])
        raise ValueError(f"DP rank {r} loaded {counts[r]} examples, expected micro_batch_size x "
                         f"num_microbatches = {expected}")
    config.check_phases(phases)
    if config.cost_profile is not None:
        phases = config.cost_profile.apply(phases)
    if config.context_parallel_size > 1:  # the backbone's cost and memory on each CP rank
        backbone_cost = ContextParallelCost(phases.backbone.cost, config.context_parallel_size)
        phases = dataclasses.replace(phases, backbone=dataclasses.replace(phases.backbone, cost=backbone_cost))
    items = phase_items(sizes, phases)
    examples_home = Placement.from_counts(counts)
    home = examples_home.rank
    encoders, stats, rank_of_item, loads = {}, {}, {}, []

    for phase in phases.encoder_names:
        phase_item = items[phase]
        example, costs, item_bytes = phase_item.example, phase_item.cost, phase_item.nbytes
        rank, method = _balance_encoder(costs, phase_item.home, item_bytes, num_ranks, topology, config,
                                        config.balances(phase))
        # the loader's placement of the items (their slots computed when first read: counting the bytes of their
        # moves needs their ranks alone)
        items_home = examples_home.expand(example)
        encode = items_home if rank is phase_item.home else Placement.from_ranks(rank, num_ranks)
        encoders[phase] = EncoderPhasePlan(example=example, home=items_home, encode=encode)
        rank_of_item[phase] = (example, rank, phase_item.output_nbytes)
        stats[phase], home_loads = _phase_stats(method, costs, phase_item.home, rank, num_ranks)
        loads.append((home_loads, stats[phase].max_after))

    backbone = phases.backbone.name
    backbone_costs, text_bytes = items[backbone].cost, items[backbone].nbytes
    packed = config.packed
    pipelined_microbatch = None  # the micro-batches :func:`_pipelined` chose with its plan (PP > 1)
    if not config.balances(backbone):
        backbone_rank, method = home, "none"
    else:
        part = (partition(backbone_costs, num_ranks, method=config.algorithm, home=home) if packed
                else partition_equal_count(backbone_costs, num_ranks, home=home))
        method, bins = part.method, part.bin_of_item
        keeps_home = part.outcome is Outcome.HOME
        if not keeps_home and config.step_model.pipeline_stages > 1:
            bins, pipelined_microbatch, method = _pipelined(bins, part.method, backbone_costs, sizes.num_tokens, home,
                                                            num_ranks, micro_batch_size, num_microbatches, config)
            keeps_home = bins is home
        if keeps_home:
            backbone_rank = home
        else:
            sources = _example_sources(home, text_bytes, rank_of_item)
            example, source, nbytes = sources
            backbone_rank = _place(bins, [(bins[example], source, nbytes)], num_ranks, topology, config)
        if config.locality and not keeps_home:
            plain_rank, plain_microbatch = backbone_rank, pipelined_microbatch

            def pipelined(rank):
                """The modeled backbone of backbone ranks ``rank``: the plain plan's micro-batches where it is that
                plan, else :func:`_microbatches`'s, through the pipeline schedule."""
                model = config.step_model
                costs = model.compute_seconds(backbone_costs, config.cost_profile is not None)
                if model.pipeline_stages == 1:  # the slowest rank's sum
                    return model.pipelined_even(_plan_kernels.rank_loads_max(rank, costs, num_ranks), 1)
                microbatch = plain_microbatch if rank is plain_rank and plain_microbatch is not None else (
                    _microbatches(rank, backbone_costs, sizes.num_tokens, num_ranks, micro_batch_size,
                                  num_microbatches, packed, config.algorithm))
                cells = np.bincount(rank * num_microbatches + microbatch, weights=costs,
                                    minlength=num_ranks * num_microbatches)
                return model.pipelined(cells.reshape(num_ranks, num_microbatches))

            # what an example pulls to its backbone rank: its text, and its embeddings (counted from its home
            # rank: the encoder plans keep items on their node)
            example_bytes = text_bytes + sum(np.bincount(example, weights=out_bytes, minlength=sizes.num_examples)
                                             for example, _, out_bytes in rank_of_item.values())
            # the rank that holds most of an example's bytes (its encoders may have run elsewhere)
            pull = _pull_rank(home, sources, num_ranks) if packed else None
            # (where the locality plan misses its capacity, the plain plan runs as placed above: its fallback's own
            # placement is not needed)
            if packed:
                near = partition_locality(backbone_costs, pull, num_ranks, _gpus_per_node(topology),
                                          item_bytes=example_bytes, reference=part, place_fallback=False)
            else:  # (counts are kept: from the loader's ranks)
                near = partition_equal_count_locality(backbone_costs, home, num_ranks, _gpus_per_node(topology),
                                                      item_bytes=example_bytes, reference=part, place_fallback=False)
            near_bins, near_method = near.bin_of_item, near.method
            slower_than = _SlowerThan(backbone_rank, items, rank_of_item, home, topology, pipelined, config)
            slower = None if near.outcome is Outcome.FALLBACK else slower_than(near_bins)
            if slower is not None and slower[0] > 0:  # a near tie: unload its busiest links (balance/repair.py)
                near_bins, near_method, slower = _repaired(near_bins, near_method, slower, backbone_rank,
                                                           backbone_costs, home, text_bytes, rank_of_item, topology,
                                                           slower_than, config, swaps_only=not packed)
            if slower is None or slower[0] > 0:  # the plain plan, its examples swapped home where that fits
                if pull is None:
                    pull = _pull_rank(home, sources, num_ranks)
                local_bins, local_method, local_slower = _localized(
                    backbone_rank, part.method, backbone_costs, home, text_bytes, example_bytes, pull, rank_of_item,
                    topology, slower_than, config, swaps_only=not packed)
                if local_slower[0] <= 0:
                    near_bins, near_method, slower = local_bins, local_method, local_slower
            if slower is None or math.isinf(slower[0]):
                method = f"{part.method}+placed ({near_method}: capacity not met)"
            elif slower[0] > 0:
                method = f"{part.method}+placed ({near_method} {100 * slower[0]:.2g}% slower at {slower[1]:.3g} Gb/s)"
            else:  # (its own micro-batches)
                backbone_rank, method, pipelined_microbatch = near_bins, near_method, None

    if config.exchange_alike and backbone_rank is not home:  # fewer peers, every rank's load as planned
        taken = exchange_alike(backbone_rank, home, _alike_examples(sizes, items[backbone]), topology.node_of_rank)
        backbone_rank = backbone_rank[taken]
        if pipelined_microbatch is not None:
            pipelined_microbatch = pipelined_microbatch[taken]
    home_microbatch = np.arange(sizes.num_examples) % expected // micro_batch_size  # the loader's
    if backbone_rank is home and not packed:
        microbatch = home_microbatch
    elif pipelined_microbatch is not None:
        microbatch = pipelined_microbatch
    else:
        microbatch = _microbatches(backbone_rank, backbone_costs, sizes.num_tokens, num_ranks, micro_batch_size,
                                   num_microbatches, packed, config.algorithm)
    examples_backbone = Placement.from_ranks(backbone_rank, num_ranks, key=microbatch)  # (ties: by example id)
    stats[backbone], home_loads = _phase_stats(method, backbone_costs, home, backbone_rank, num_ranks)
    loads.append((home_loads, stats[backbone].max_after))
    chunks, memory = _plan_memory(items, phases, encoders, backbone_rank, microbatch, home_microbatch, num_ranks,
                                  num_microbatches, packed, config)
    encoders = {phase: dataclasses.replace(plan, chunks=chunks[phase]) for phase, plan in encoders.items()}
    digest = checksum(examples_backbone.rank, examples_backbone.slot, microbatch,
                      *(a for e in encoders.values() for a in (e.encode.rank, e.encode.slot, e.chunks.kept)),
                      np.array([e.chunks.items for e in encoders.values()], dtype=np.int64))
    plan = StepPlan(examples_home=examples_home, examples_backbone=examples_backbone, microbatch_of_example=microbatch,
                    num_microbatches=num_microbatches, encoders=encoders, backbone=backbone, stats=stats, traffic={},
                    digest=digest, memory=memory, step_time=_step_time(loads, num_ranks))
    traffic = {move.name: move.moved_bytes(topology.node_of_rank, config.all_to_all).times(move.times)
               for move in step_transfers(plan, items)}
    connected = functools.reduce(operator.or_, (moved.connections for moved in traffic.values()),
                                 Connections.none(num_ranks))
    return dataclasses.replace(plan, traffic=traffic, peers=connected.peers(topology.node_of_rank),
                               connections=connected)


def _alike_examples(sizes: StepSizes, backbone: PhaseItems) -> np.ndarray:
    """Class of every example for :func:`~megatron_orch.balance.exchange.exchange_alike`: examples of one class
    have the same backbone tokens and cost (so memory and text bytes, functions of the tokens) and the same items
    of every encoder phase (each item of a phase sends the same embedding bytes: ``phase_items``), so a bin's load,
    memory and bytes stay the same whichever of them it holds."""
    return classes_of(backbone.tokens, backbone.cost, *(np.asarray(counts) for counts in sizes.items.values()))


def _plan_memory(items: Dict[str, PhaseItems], phases: ModelPhases, encoders: Dict[str, EncoderPhasePlan],
                 backbone_rank: np.ndarray, microbatch: np.ndarray, home_microbatch: np.ndarray, num_ranks: int,
                 num_microbatches: int, packed: bool, config: OrchestratorConfig):
    """The chunks of every encoder phase and the step's modeled memory (:class:`StepMemory`).

    The cap is ``config.encoder_memory_cap``, else upstream's peak at this global batch (its busiest
    micro-batch of encoders and backbone). A chunk holds ``encoder_chunk_tokens`` worth of items, else as
    many as the cap holds (without a cap given: as upstream's busiest micro-batch of encoders holds, so
    no chunk needs more than upstream's encoders ever do). Each rank keeps whole chunks, phase by phase,
    while they fit beside its largest backbone micro-batch under the cap (none with ``encoder_recompute``).
    """
    backbone = phases.backbone.name
    cells = num_ranks * num_microbatches  # (rank, micro-batch)

    def per_rank(per_cell: np.ndarray) -> np.ndarray:
        return _plan_kernels.row_max(per_cell.reshape(num_ranks, num_microbatches))

    llm = items[backbone]
    upstream_key = llm.home * num_microbatches + home_microbatch
    upstream_encoders = {p: _plan_kernels.sums_by_parent(upstream_key, items[p].example,
                                                         np.asarray(items[p].memory, dtype=np.float64), cells)
                         for p in encoders}
    upstream_backbone = _microbatch_memory(upstream_key, llm.memory, cells, padded=True)
    encoders_per_cell = sum(upstream_encoders.values(), np.zeros(cells))
    upstream_peak = per_rank(encoders_per_cell + upstream_backbone)
    backbone_peak = per_rank(_microbatch_memory(backbone_rank * num_microbatches + microbatch, llm.memory, cells,
                                                padded=not packed))
    given = config.encoder_memory_cap
    cap = float(upstream_peak.max(initial=0.0)) if given is None else float(given)
    chunk_budget = float(encoders_per_cell.max(initial=0.0)) if given is None else cap
    keep_left = np.zeros(num_ranks) if config.encoder_recompute else np.maximum(cap - backbone_peak, 0.0)

    chunks, phase_peak = {}, {}
    kept_bytes, largest_recomputed = np.zeros(num_ranks), np.zeros(num_ranks)
    for phase in phases.encoders:
        count = encoders[phase.name].encode.counts()
        per_item = float(items[phase.name].memory[0]) if len(items[phase.name]) else 0.0
        chunk_items = _chunk_items(phase.item_tokens, per_item, chunk_budget, int(count.max(initial=0)),
                                   config.encoder_chunk_tokens)
        fit = count if per_item == 0 else np.minimum(np.floor(keep_left / per_item), count).astype(np.int64)
        kept = np.where(fit >= count, count, fit // chunk_items * chunk_items)
        keep_left = keep_left - kept * per_item
        recomputed = np.minimum(chunk_items, count - kept) * per_item
        phase_peak[phase.name] = np.maximum(kept * per_item, recomputed)
        kept_bytes += kept * per_item
        largest_recomputed = np.maximum(largest_recomputed, recomputed)
        chunks[phase.name] = EncoderChunks(items=chunk_items, kept=kept.astype(np.int64))
    phase_peak[backbone] = backbone_peak
    upstream_phase_peak = {p: per_rank(v) for p, v in upstream_encoders.items()}
    upstream_phase_peak[backbone] = per_rank(upstream_backbone)
    memory = StepMemory(phase_peak=phase_peak, peak=np.maximum(kept_bytes + backbone_peak, largest_recomputed),
                        upstream_phase_peak=upstream_phase_peak, upstream_peak=upstream_peak, encoder_cap=cap)
    return chunks, memory


def _chunk_items(item_tokens: int, per_item: float, budget: float, most: int, chunk_tokens) -> int:
    """Items of one encoder chunk: ``chunk_tokens`` worth if given, else as many as ``budget`` bytes hold (at
    least one; ``most``, a rank's largest share, when memory is free or unbounded)."""
    if chunk_tokens is not None:
        return max(1, chunk_tokens // item_tokens)
    if per_item == 0 or math.isinf(budget):
        return max(1, most)
    return max(1, min(int(budget // per_item), most))


def _microbatch_memory(key: np.ndarray, memory: np.ndarray, cells: int, padded: bool) -> np.ndarray:
    """Modeled activation bytes of every (rank, micro-batch) cell ``key`` of examples of ``memory`` bytes: rows
    padded to their longest example (``padded``), or the examples back to back."""
    if not padded:
        return np.bincount(key, weights=memory, minlength=cells)
    return _plan_kernels.padded_sums(np.ascontiguousarray(key, dtype=np.int64),
                                     np.ascontiguousarray(memory, dtype=np.float64), cells)


def _step_time(loads: Sequence[Tuple[np.ndarray, float]], num_ranks: int) -> Tuple[float, float]:
    """Modeled step time from each phase's (per-rank load as loaded, busiest rank's load as planned), in the cost
    models' unit, the lower estimate for upstream: as loaded, the busiest rank's phases back to back (ranks wait
    for each other once, at the gradient reduction); as planned, the sum of each phase's busiest rank (every
    phase's moves make the ranks wait for each other)."""
    before = sum((home_loads for home_loads, _ in loads), np.zeros(num_ranks))
    return float(before.max(initial=0)), sum(max_after for _, max_after in loads)


def _phase_stats(method, costs, home_rank, rank, num_ranks) -> Tuple[PhaseStats, np.ndarray]:
    """The phase's :class:`PhaseStats` and its per-rank load as loaded (for :func:`_step_time`)."""
    home_loads, max_after = _plan_kernels.loads_before_after(np.ascontiguousarray(home_rank, dtype=np.int64),
                                                             np.ascontiguousarray(rank, dtype=np.int64),
                                                             np.asarray(costs, dtype=np.float64),
                                                             num_ranks)
    return PhaseStats(method=method, items=int(costs.size), max_before=float(home_loads.max(initial=0)),
                      mean=float(costs.sum() / num_ranks), max_after=max_after), home_loads


def warm_up(phases: ModelPhases, config: OrchestratorConfig,
            announce: Optional[Callable[[str], None]] = None) -> None:
    """Plan a tiny step once, so numba compiles (or loads) the partition kernels now.

    Compilation holds the GIL for seconds: done on the training thread before the first step, the
    planning thread never stalls the training loop with it. Where numba must compile (not load from its
    cache), ``announce`` is told so before and how long it took after, so a first run does not sit silent.
    """
    items = {name: np.array([1, 2, 0, 3]) if k % 2 == 0 else np.array([0, 1, 2, 1])
             for k, name in enumerate(phases.encoder_names)}
    sizes = StepSizes(counts=np.array([2, 2]), items=items, num_tokens=np.array([5, 9, 3, 7]))
    with announcing_compilation(announce):
        plan_step(sizes, phases, config, Topology.uniform(2, 1), micro_batch_size=1, num_microbatches=2)
