"""The plan of one training step: where every encoder item and every example is computed, and the
transfers that move raw inputs, text and encoder outputs there.

Every rank of a DP group calls :func:`plan_step` with the same gathered sizes and gets the same plan
(the partitioners and the placement solvers are deterministic); :attr:`StepPlan.digest` lets the
caller check that cheaply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

from megatron_orch.balance.model_config import MLLMConfig
from megatron_orch.balance.partition import partition, partition_equal_count, partition_locality
from megatron_orch.balance.placement import BinTraffic, PlacementConfig, place_bins
from megatron_orch.balance.plan import Placement, Transfer, checksum
from megatron_orch.balance.topology import Topology
from megatron_orch.orchestrator.config import OrchestratorConfig


@dataclass(frozen=True, eq=False)
class StepSizes:
    """Per-example sizes of a global batch, examples in loader order (rank 0's first)."""

    counts: np.ndarray           # examples loaded by each DP rank
    num_vision_items: np.ndarray
    num_audio_items: np.ndarray
    num_tokens: np.ndarray       # backbone sequence length

    def __post_init__(self):
        n = int(np.sum(self.counts))
        for name in ("num_vision_items", "num_audio_items", "num_tokens"):
            values = np.asarray(getattr(self, name))
            if values.shape != (n,):
                raise ValueError(f"StepSizes.{name} has shape {values.shape}, expected ({n},) "
                                 f"for counts {np.asarray(self.counts).tolist()}")
            if n and values.min() < 0:
                raise ValueError(f"StepSizes.{name} has a negative entry at example {int(values.argmin())}")
        if n and self.num_tokens.min() < 1:
            raise ValueError(f"example {int(self.num_tokens.argmin())} has no tokens")

    @property
    def num_examples(self) -> int:
        return int(self.num_tokens.size)


@dataclass(frozen=True)
class PhaseStats:
    """Load of one phase across DP ranks before (loader) and after (plan) balancing, and bytes moved."""

    method: str
    items: int
    max_before: float
    mean: float
    max_after: float
    intra_node_bytes: float
    inter_node_bytes: float

    @property
    def imbalance_before(self) -> float:
        return self.max_before / self.mean if self.mean > 0 else 1.0

    @property
    def imbalance_after(self) -> float:
        return self.max_after / self.mean if self.mean > 0 else 1.0


@dataclass(frozen=True, eq=False)
class EncoderPhasePlan:
    """Items of one encoder phase: their example, where they are loaded and where they are encoded."""

    example: np.ndarray
    home: Placement
    encode: Placement


@dataclass(frozen=True, eq=False)
class StepPlan:
    examples_home: Placement
    examples_llm: Placement           # slot order = micro-batch order on every rank
    microbatch_of_example: np.ndarray
    num_microbatches: int
    encoders: Dict[str, EncoderPhasePlan]  # "vision", "audio"
    stats: Dict[str, PhaseStats]
    digest: int

    def text_transfer(self) -> Transfer:
        """Token ids / labels / loss masks: loader rank -> backbone rank."""
        return Transfer(self.examples_home, self.examples_llm)

    def input_transfer(self, phase: str) -> Transfer:
        """Raw encoder inputs: loader rank -> encoder rank."""
        enc = self.encoders[phase]
        return Transfer(enc.home, enc.encode)

    def output_transfer(self, phase: str) -> Transfer:
        """Encoder outputs: encoder rank -> backbone rank of their example, in one move."""
        enc = self.encoders[phase]
        return Transfer(enc.encode, self.examples_llm.expand(enc.example))


def _item_costs(model_config: MLLMConfig):
    """Training FLOPs of one vision item, one audio window, and a backbone example of n tokens."""
    vision_cost = 0.0 if model_config.vision is None else model_config.vision_item_train_flops()
    audio_cost = 0.0 if model_config.audio is None else model_config.audio_window_train_flops()
    return vision_cost, audio_cost, model_config.backbone.transformer.train_flops


def _moved_bytes(transfer: Transfer, item_bytes, topology: Topology):
    traffic = transfer.traffic_matrix(item_bytes)
    node = topology.node_of_rank
    cross = node[:, None] != node[None, :]
    off_gpu = ~np.eye(transfer.num_ranks, dtype=bool)
    return float(traffic[off_gpu & ~cross].sum()), float(traffic[cross].sum())


def _place(bin_of_item, sources, num_ranks, topology, config: OrchestratorConfig):
    """Rank of every bin (``sources``: (bin, source rank, bytes) arrays of what each bin pulls)."""
    bins = np.concatenate([s[0] for s in sources])
    ranks = np.concatenate([s[1] for s in sources])
    nbytes = np.concatenate([s[2] for s in sources])
    traffic = BinTraffic.from_items(bins, ranks, np.rint(nbytes).astype(np.int64), num_ranks, num_ranks)
    placed = place_bins(traffic, topology, PlacementConfig(
        method=config.placement, time_limit_s=config.placement_time_limit_s, deterministic=True))
    return placed.rank_of_bin[bin_of_item]


def _balance_encoder(costs, home_rank, item_bytes, num_ranks, topology, config, balanced: bool):
    """Encoder rank of every item of one phase, and the method name."""
    if not balanced or costs.size == 0:
        return home_rank, "none"
    if config.locality:
        part = partition_locality(costs, home_rank, num_ranks, _gpus_per_node(topology),
                                  item_bytes=item_bytes)
        return part.bin_of_item, part.method
    part = partition(costs, num_ranks, method=config.algorithm, home=home_rank)
    if part.method == "home":
        return home_rank, "home"
    return _place(part.bin_of_item, [(part.bin_of_item, home_rank, item_bytes)], num_ranks,
                  topology, config), part.method


def _gpus_per_node(topology: Topology) -> int:
    per_node = topology.ranks_per_node()
    if per_node.min() != per_node.max():
        raise ValueError(f"locality balancing needs the same number of ranks per node, got {per_node.tolist()}")
    if not np.array_equal(topology.node_of_rank, np.arange(topology.num_ranks) // per_node[0]):
        raise ValueError("locality balancing needs DP ranks numbered node by node")
    return int(per_node[0])


def _microbatches(rank_llm, costs, num_tokens, num_ranks, micro_batch_size, num_microbatches,
                  packed: bool, algorithm: str):
    """Micro-batch of every example on its backbone rank."""
    microbatch = np.empty(rank_llm.size, dtype=np.int64)
    for r in range(num_ranks):
        ids = np.flatnonzero(rank_llm == r)
        if packed:
            microbatch[ids] = partition(costs[ids], num_microbatches, method=algorithm).bin_of_item
        else:
            # Longest first, so the rows of a micro-batch have similar lengths (little padding).
            order = ids[np.lexsort((ids, -num_tokens[ids]))]
            microbatch[order] = np.arange(order.size) // micro_batch_size
    return microbatch


def plan_step(sizes: StepSizes, model_config: MLLMConfig, config: OrchestratorConfig,
              topology: Topology, micro_batch_size: int, num_microbatches: int) -> StepPlan:
    """Plan every phase of one global batch (deterministic: same inputs, same plan on every rank)."""
    counts = np.asarray(sizes.counts, dtype=np.int64)
    num_ranks = int(counts.size)
    if topology.num_ranks != num_ranks:
        raise ValueError(f"topology spans {topology.num_ranks} ranks but sizes come from {num_ranks}")
    expected = micro_batch_size * num_microbatches
    if (counts != expected).any():
        r = int(np.flatnonzero(counts != expected)[0])
        raise ValueError(f"DP rank {r} loaded {counts[r]} examples, expected micro_batch_size x "
                         f"num_microbatches = {expected}")
    vision_cost, audio_cost, backbone_flops = _item_costs(model_config)
    examples_home = Placement.from_counts(counts)
    home = examples_home.rank
    encoders, stats, rank_of_item = {}, {}, {}
    emb_bytes = model_config.hidden_size * model_config.embedding_bytes_per_element

    for phase, per_example, cost, tokens_per_item, raw_bytes in (
            ("vision", sizes.num_vision_items, vision_cost,
             model_config.vision.tile_llm_tokens if model_config.vision else 0,
             model_config.vision.tile_bytes if model_config.vision else 0),
            ("audio", sizes.num_audio_items, audio_cost,
             -(-model_config.audio.window_tokens // model_config.audio.projector_downsample)
             if model_config.audio else 0,
             model_config.audio.window_frames * model_config.audio.num_mel_bins
             * model_config.audio.input_bytes_per_element if model_config.audio else 0)):
        per_example = np.asarray(per_example, dtype=np.int64)
        example = np.repeat(np.arange(sizes.num_examples, dtype=np.int64), per_example)
        costs = np.full(example.size, cost)
        item_bytes = np.full(example.size, float(raw_bytes))
        rank, method = _balance_encoder(costs, home[example], item_bytes, num_ranks, topology, config,
                                        phase in config.phases)
        encoders[phase] = EncoderPhasePlan(example=example, home=examples_home.expand(example),
                                           encode=Placement.from_ranks(rank, num_ranks))
        rank_of_item[phase] = (example, rank, np.full(example.size, float(tokens_per_item * emb_bytes)))
        stats[phase] = _phase_stats(method, costs, home[example], rank, item_bytes, num_ranks, topology)

    llm_costs = np.asarray(backbone_flops(sizes.num_tokens), dtype=np.float64)
    text_bytes = sizes.num_tokens.astype(np.float64) * model_config.token_id_bytes * 3  # ids, labels, mask
    packed = config.microbatching == "packed"
    if "llm" not in config.phases:
        rank_llm, method = home, "none"
    elif config.locality and packed:
        part = partition_locality(llm_costs, home, num_ranks, _gpus_per_node(topology), item_bytes=text_bytes)
        rank_llm, method = part.bin_of_item, part.method
    else:
        part = (partition(llm_costs, num_ranks, method=config.algorithm, home=home) if packed
                else partition_equal_count(llm_costs, num_ranks, home=home))
        method = part.method
        if part.method == "home":
            rank_llm = home
        else:
            sources = [(part.bin_of_item, home, text_bytes)]
            for example, enc_rank, out_bytes in rank_of_item.values():
                sources.append((part.bin_of_item[example], enc_rank, out_bytes))
            rank_llm = _place(part.bin_of_item, sources, num_ranks, topology, config)

    if rank_llm is home and not packed:
        microbatch = np.arange(sizes.num_examples) % expected // micro_batch_size  # the loader's
    else:
        microbatch = _microbatches(rank_llm, llm_costs, sizes.num_tokens, num_ranks, micro_batch_size,
                                   num_microbatches, packed, config.algorithm)
    examples_llm = Placement.from_ranks(rank_llm, num_ranks,
                                        key=microbatch * (sizes.num_examples + 1) + np.arange(sizes.num_examples))
    stats["llm"] = _phase_stats(method, llm_costs, home, rank_llm, text_bytes, num_ranks, topology)
    digest = checksum(examples_llm.rank, examples_llm.slot, microbatch,
                      *(a for e in encoders.values() for a in (e.encode.rank, e.encode.slot)))
    return StepPlan(examples_home=examples_home, examples_llm=examples_llm,
                    microbatch_of_example=microbatch, num_microbatches=num_microbatches,
                    encoders=encoders, stats=stats, digest=digest)


def _phase_stats(method, costs, home_rank, rank, item_bytes, num_ranks, topology) -> PhaseStats:
    before = np.bincount(home_rank, weights=costs, minlength=num_ranks)
    after = np.bincount(rank, weights=costs, minlength=num_ranks)
    move = Transfer(Placement.from_ranks(home_rank, num_ranks), Placement.from_ranks(rank, num_ranks))
    intra, inter = _moved_bytes(move, item_bytes, topology)
    return PhaseStats(method=method, items=int(costs.size), max_before=float(before.max(initial=0)),
                      mean=float(costs.sum() / num_ranks), max_after=float(after.max(initial=0)),
                      intra_node_bytes=intra, inter_node_bytes=inter)


def warm_up(model_config: MLLMConfig, config: OrchestratorConfig) -> None:
    """Plan a tiny step once, so numba compiles (or loads) the partition kernels now.

    Compilation holds the GIL for seconds: done on the training thread before the first step, the
    planning thread never stalls the training loop with it.
    """
    sizes = StepSizes(counts=np.array([2, 2]), num_vision_items=np.array([1, 2, 0, 3]),
                      num_audio_items=np.array([0, 1, 2, 1]), num_tokens=np.array([5, 9, 3, 7]))
    plan_step(sizes, model_config, config, Topology.uniform(2, 1), micro_batch_size=1, num_microbatches=2)
