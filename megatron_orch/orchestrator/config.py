"""What the orchestrator balances and how: one frozen dataclass (a command line fills it from its flags, and
names them in its errors: :class:`ConfigError`)."""
from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Tuple

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile
from megatron_orch.balance.plan import ALL_TO_ALL
from megatron_orch.balance.registry import PARTITIONERS, PLACEMENTS
from megatron_orch.balance.step_model import StepModel
from megatron_orch.balance.workload import EncoderPhase, ModelPhases

MICROBATCHING = ("auto", "packed", "equal_count")


class EncoderRanks(enum.Enum):
    """Which ranks hold the encoders (and projectors) and encode the encoder phases' items: ``FIRST_STAGE``,
    Megatron's layout (the first pipeline stage's ranks, the items balanced over DP); ``ALL``, every pipeline
    stage's ranks (the items balanced over DP x PP, their outputs sent to the first stage's ranks that run each
    example's first layers); ``AUTO``, ``ALL`` where it differs from ``FIRST_STAGE``, runs and fits, else
    ``FIRST_STAGE`` (the entry point decides before the model is built:
    :func:`~megatron_orch.orchestrator.encoder_ranks.decide_encoder_ranks`). The value is the command line's
    (``--orch-encoder-ranks``)."""

    AUTO = "auto"
    FIRST_STAGE = "first-stage"
    ALL = "all"


def config_setting(field: str, value: Optional[str] = None) -> str:
    """How the planning layer names a setting in its messages and lines: the :class:`OrchestratorConfig` field
    (``OrchestratorConfig.encoder_ranks``), with ``=value`` where it names one. A command line, which fills the
    config from flags, passes its own naming of the same (:data:`SettingNaming`) to the functions that take one."""
    return f"OrchestratorConfig.{field}" + ("" if value is None else f"={value}")


# (field, value or None) -> the words a message names that setting with (:func:`config_setting`, or a command line's)
SettingNaming = Callable[[str, Optional[str]], str]


class ConfigError(ValueError):
    """A setting of :class:`OrchestratorConfig` that does not hold: ``field`` names it and ``reason`` says what
    is wrong. The message names the field (``OrchestratorConfig.<field>...``); a command line names its own
    flag instead (:meth:`naming`, with its table of flags)."""

    def __init__(self, field: str, reason: str):
        self.field, self.reason = field, reason
        super().__init__(f"OrchestratorConfig.{field}{reason}")

    def naming(self, flags: Mapping[str, str]) -> str:
        """The message with ``flags[field]`` in place of the field (where ``flags`` has one)."""
        return f"{flags.get(self.field, f'OrchestratorConfig.{self.field}')}{self.reason}"


@dataclass(frozen=True)
class OrchestratorConfig:
    """Post-balancing settings.

    ``phases``: the names of the phases rebalanced (None: every phase of the model); the others keep the
    loader's assignment (:meth:`check_phases` refuses a name the model has no phase of). ``algorithm``: the
    partitioner of the encoder phases (and of the backbone in ``packed`` mode), ``auto`` or a name in
    :data:`megatron_orch.balance.registry.PARTITIONERS` (a user's registered there too); under ``auto``, an
    encoder phase of equal items is planned exactly by ``partition_uniform`` (no placement needed).
    ``microbatching``: ``packed`` gives each rank the same number of micro-batches, each one packed
    row of a variable number of examples (each attends causally to itself: variable-length attention);
    ``equal_count`` keeps ``micro_batch_size`` examples per backbone micro-batch (any attention);
    ``auto`` (the default) is ``packed`` wherever the backbone takes packed rows
    (:meth:`resolve_microbatching`: the post-balancing iterator decides for its model; ``plan_step``
    plans ``auto`` as ``packed``). ``locality``: balance every phase with a locality-aware partitioner
    (bins are ranks, few bytes cross nodes, as balanced as the plain plan) instead of partition +
    placement; the backbone's is kept only where ``step_model`` finds the step no slower than with the
    plain plan at any NIC bandwidth up to its link's (else the plain plan). ``placement``: how balanced bins
    are mapped to ranks (``identity``, ``greedy``, ``exact`` min-total inter-node bytes, ``minmax``
    busiest node, or a placement method registered in :data:`megatron_orch.balance.registry.PLACEMENTS`).
    ``background``: plan step k+1 on a CPU thread while step k trains.
    ``encoder_chunk_tokens`` / ``encoder_memory_cap`` (bytes; ``math.inf``: no cap) / ``encoder_recompute``:
    how the encoder phases bound their activation memory (:mod:`megatron_orch.orchestrator.step_plan`:
    each rank runs its items of a phase in chunks, keeps the activations of the chunks that fit beside
    its backbone micro-batches under the cap and recomputes the others for their backward; the cap
    defaults to what upstream needs at the same global batch, ``encoder_recompute`` keeps none).
    ``cost_profile``: item costs measured on the device (``--orch-cost-profile``,
    :mod:`megatron_orch.balance.cost_profile`) instead of training FLOPs. ``step_model``: how a step's time
    is modeled (:mod:`megatron_orch.balance.step_model`: links, achieved FLOP rate, layout). ``shadow``: plan
    every step and report what balancing would gain, but train on the loader's assignment, moving nothing
    (``--orch-shadow``). ``verify_first_step``: the first step, and the first step with items of each encoder phase
    not seen before, runs the loader's (upstream) and the balanced layout on the same batch, in training mode
    with dropout off, and stops the run unless their losses, gradients and encoder outputs agree
    (``--orch-verify-first-step``; on by default here, off on the command line for the shipped configs).
    ``context_parallel_size``: the backbone's (``--context-parallel-size``): its costs and memory are planned
    per CP rank (:class:`~megatron_orch.balance.cost.ContextParallelCost`). ``all_to_all``: how every transfer
    runs (``--orch-all-to-all``): ``flat``, one all-to-all over the DP group, or ``node-wise``, within the
    source's node and then between rail peers (:meth:`~megatron_orch.balance.plan.Transfer.node_wise`: at most
    ``gpus_per_node - 1 + nodes - 1`` peers a rank, the same outputs).
    ``encoder_ranks``: which ranks encode (:class:`EncoderRanks`; ``ALL`` needs pipeline parallelism, or an encoder
    TP below the backbone's, to differ from ``FIRST_STAGE``; its moves over the encoder group run ``all_to_all`` too,
    node-wise over that group's nodes; ``AUTO``, the default, is decided by the entry point, :meth:`with_encoder_ranks`).
    ``encoder_tensor_parallel_size``: with ``encoder_ranks`` ``ALL`` (or ``AUTO``), the encoders' own tensor-parallel size
    (``--orch-encoder-tensor-parallel-size``; None: the backbone's); it must divide the backbone's, which the
    entry points check (:func:`~megatron_orch.orchestrator.encoder_ranks.unsupported_layout`). Below it, each
    backbone TP group holds TP / encoder TP encoder replicas, and the encoder phases are balanced over
    DP x PP x TP / encoder TP ranks (the meaning of the step model's ``encoder_tensor_parallel``).
    ``exchange_alike``: after the backbone is balanced, exchange examples alike in cost, length and items between
    its ranks so each rank pulls from fewer ranks (:mod:`megatron_orch.balance.exchange`: the same balance by
    construction; fewer peers and bytes across nodes; off by default: it adds 7-18% to the planner's CPU time at
    DP 512-2560, docs/benchmarks.md).
    """

    phases: Optional[Tuple[str, ...]] = None
    algorithm: str = "auto"
    microbatching: str = "auto"
    locality: bool = False
    placement: str = "exact"
    placement_time_limit_s: float = 1.0
    gpus_per_node: Optional[int] = None
    background: bool = True
    encoder_recompute: bool = False
    encoder_chunk_tokens: Optional[int] = None
    encoder_memory_cap: Optional[float] = None
    cost_profile: Optional[CostProfile] = None
    context_parallel_size: int = 1
    step_model: StepModel = StepModel()
    shadow: bool = False
    verify_first_step: bool = True
    all_to_all: str = "flat"
    encoder_ranks: EncoderRanks = EncoderRanks.AUTO
    encoder_tensor_parallel_size: Optional[int] = None
    exchange_alike: bool = False

    def __post_init__(self):
        if self.phases is not None:
            object.__setattr__(self, "phases", tuple(self.phases))
            if not self.phases:
                raise ConfigError("phases", " must name at least one phase (to balance nothing, turn post-balancing "
                                            "off)")
            if len(set(self.phases)) != len(self.phases):
                raise ConfigError("phases", f": repeated phases in {list(self.phases)}")
        for field, registry in (("algorithm", PARTITIONERS), ("placement", PLACEMENTS)):
            try:
                registry.check(getattr(self, field))
            except ValueError as err:
                raise ConfigError(field, f": {err}") from None
        if self.microbatching not in MICROBATCHING:
            raise ConfigError("microbatching", f": unknown {self.microbatching!r}; choose one of {MICROBATCHING}")
        if self.all_to_all not in ALL_TO_ALL:
            raise ConfigError("all_to_all", f": unknown {self.all_to_all!r}; choose one of {ALL_TO_ALL}")
        if not (math.isfinite(self.placement_time_limit_s) and self.placement_time_limit_s > 0):
            raise ConfigError("placement_time_limit_s", f" must be > 0, got {self.placement_time_limit_s}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise ConfigError("gpus_per_node", f" must be >= 1, got {self.gpus_per_node}")
        chunk = self.encoder_chunk_tokens
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ConfigError("encoder_chunk_tokens", f" must be an int >= 1, got {chunk!r}")
        if self.context_parallel_size < 1:
            raise ConfigError("context_parallel_size", f" must be >= 1, got {self.context_parallel_size}")
        cap = self.encoder_memory_cap
        if cap is not None and not (cap > 0):  # inf: no cap; NaN fails too
            raise ConfigError("encoder_memory_cap", f" must be > 0 (inf: no cap), got {cap / 1e9} GB")
        if not isinstance(self.encoder_ranks, EncoderRanks):
            raise ConfigError("encoder_ranks", f" must be an EncoderRanks ({', '.join(e.name for e in EncoderRanks)}),"
                                               f" got {self.encoder_ranks!r}")
        etp = self.encoder_tensor_parallel_size
        if etp is not None and (isinstance(etp, bool) or not isinstance(etp, int) or etp < 1):
            raise ConfigError("encoder_tensor_parallel_size", f" must be an int >= 1, got {etp!r}")
        if etp is not None and self.encoder_ranks is EncoderRanks.FIRST_STAGE:
            raise ConfigError("encoder_tensor_parallel_size", f" {etp} needs encoder_ranks ALL or AUTO (the encoders "
                                                              "on the first stage run at the backbone's tensor-parallel "
                                                              "size)")

    def with_encoder_ranks(self, ranks: EncoderRanks) -> "OrchestratorConfig":
        """This config with the layout ``ranks`` (``AUTO`` decided: ``FIRST_STAGE`` drops the encoders' own TP
        size)."""
        etp = self.encoder_tensor_parallel_size if ranks is EncoderRanks.ALL else None
        return dataclasses.replace(self, encoder_ranks=ranks, encoder_tensor_parallel_size=etp)

    @property
    def encoders_on_every_stage(self) -> bool:
        """Whether every pipeline stage holds and runs the encoders: ``encoder_ranks`` ALL, and training on the
        plan (shadow mode trains as loaded, Megatron's layout)."""
        return self.encoder_ranks is EncoderRanks.ALL and not self.shadow

    def encoder_tp_replicas(self, tensor_parallel_size: int) -> int:
        """Encoder replicas in one backbone TP group of ``tensor_parallel_size`` ranks: TP / the encoders' TP with
        the encoders on every rank, else 1."""
        if not self.encoders_on_every_stage or self.encoder_tensor_parallel_size is None:
            return 1
        return tensor_parallel_size // self.encoder_tensor_parallel_size

    def spreads_encoders(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> bool:
        """Whether the encoder phases run over more ranks than DP: the encoders on every pipeline stage, or at a TP
        size below the backbone's (an encoder group of DP x PP x TP / encoder TP replicas)."""
        return self.encoders_on_every_stage and (pipeline_parallel_size > 1
                                                 or self.encoder_tp_replicas(tensor_parallel_size) > 1)

    @property
    def packed(self) -> bool:
        """Whether the backbone's micro-batches are packed rows (``auto`` plans as ``packed``)."""
        return self.microbatching != "equal_count"

    def resolve_microbatching(self, cannot_pack: Optional[str]) -> "OrchestratorConfig":
        """This config with ``auto`` decided for a backbone: ``packed``, or ``equal_count`` where ``cannot_pack``
        says why the backbone cannot take packed rows (None: it can). ``packed`` asked for such a backbone
        raises :class:`ConfigError` with that reason."""
        if cannot_pack is None:
            return self if self.microbatching != "auto" else dataclasses.replace(self, microbatching="packed")
        if self.microbatching == "packed":
            raise ConfigError("microbatching", f" packed: {cannot_pack}")
        return dataclasses.replace(self, microbatching="equal_count")

    def balances(self, phase: str) -> bool:
        """Whether phase ``phase`` is rebalanced (the others keep the loader's assignment)."""
        return self.phases is None or phase in self.phases

    def check_memory(self, phases: ModelPhases) -> None:
        """Raise :class:`ConfigError` unless one item of every encoder phase fits a chunk: its tokens within
        ``encoder_chunk_tokens``, its modeled activation bytes (and a whole chunk's) within ``encoder_memory_cap``."""
        cap = self.encoder_memory_cap
        for phase in phases.encoders:
            tokens = self.encoder_chunk_tokens
            if tokens is not None and phase.item_tokens > tokens:
                raise ConfigError("encoder_chunk_tokens", f" {tokens}: an item of encoder phase {phase.name} runs "
                                                          f"{phase.item_tokens} tokens; a chunk holds at least one item")
            if cap is None or math.isinf(cap):
                continue
            per_item = item_memory(phase)
            items = 1 if tokens is None else tokens // phase.item_tokens
            if items * per_item > cap:
                what = "an item" if items == 1 else f"a chunk of {items} items ({tokens} encoder tokens a chunk)"
                raise ConfigError("encoder_memory_cap", f" {cap / 1e9:g} GB: {what} of encoder phase {phase.name} "
                                                        f"needs {items * per_item / 1e9:.3g} GB of activations (modeled)")

    def check_phases(self, phases: ModelPhases) -> None:
        """Raise :class:`ConfigError` unless the settings fit the model's phases: every phase named in ``phases``
        is one of the model's, and its encoder items fit a chunk (:meth:`check_memory`)."""
        unknown = [name for name in self.phases or () if name not in phases.names]
        if unknown:
            raise ConfigError("phases", f": the model has no phase {', '.join(map(repr, unknown))}; its phases are "
                                        f"{','.join(phases.names)}")
        self.check_memory(phases)


def item_memory(phase: EncoderPhase) -> float:
    """Modeled activation bytes of one item of an encoder phase (its cost model's)."""
    return float(np.asarray(phase.cost.item_memory(np.array([phase.item_tokens])), dtype=np.float64).reshape(-1)[0])
