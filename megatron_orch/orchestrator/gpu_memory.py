"""Per-GPU memory of a training step by where the encoders run (torch-free): parameters, gradients, optimizer
state and activations of the busiest GPU of every pipeline stage. ``bench.memory --per-gpu`` tabulates it, the
simulator prints its model state, and ``--orch-encoder-ranks all`` is refused by it where it would not fit
(:func:`encoder_ranks_all_refusal`, called while the flags are checked, before any collective; ``auto`` then
picks ``first-stage``).

The model, Megatron's mixed precision:

* **parameters** bf16 (2 bytes each), **gradients** fp32 (4 bytes: DDP's main-gradient buffer), **optimizer**
  Adam's fp32 main parameters and two moments (12 bytes), sharded over the data-parallel group with the
  distributed optimizer, else whole on every GPU. The backbone's parameters are split over TP x PP (layers
  evenly over the stages; its embedding and output tables counted with them). The encoders (with their
  projectors) are held whole over the encoders' TP size by every GPU that encodes: the first stage's GPUs
  (``first-stage``), or every GPU (``all``). Their optimizer is sharded over DP alone in both layouts, as the
  trainer runs them: each stage's encoders are one DDP module over that stage's DP group (their gradients are
  summed over the pipeline stages before DDP reduces them), so every stage keeps its own optimizer shard.
  Sharding it over the whole encoder group (DP x PP x TP / encoder TP) would hold that many times less
  optimizer state; the trainer does not do that.
* **activations**, bf16, nothing recomputed but what the schedule recomputes for the encoders: the backbone's
  per token (its cost model's ``item_memory``, all layers) times the tokens of the micro-batches a stage holds
  at once (1F1B: ``PP - stage`` of them in flight, at most the step's micro-batches), over the stage's share of
  the layers (``1 / PP``), over TP with sequence parallelism (without it a GPU holds them whole); plus the
  encoders' activations a GPU holds through the backbone (kept encoder chunks), given by the caller: the
  planner knows them per batch (``bench.memory --per-gpu``), a command line does not.

Not counted: the last stage's logits, the received embeddings and their gradients, communication buffers,
temporary buffers of the kernels, the CUDA context and the allocator's fragmentation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence

import numpy as np

from megatron_orch.balance.step_model import ENCODER_RANKS
from megatron_orch.balance.workload import ModelPhases
from megatron_orch.orchestrator.config import SettingNaming, config_setting

PARAMETER_BYTES = 2   # bf16
GRADIENT_BYTES = 4    # fp32 main gradients (Megatron DDP's buffer)
OPTIMIZER_BYTES = 12  # Adam: fp32 main parameters, first and second moments
GB = 1e9


@dataclass(frozen=True)
class ParallelLayout:
    """A job's parallel sizes and where the encoders run (``encoder_ranks``: one of ``ENCODER_RANKS``; their TP
    size ``encoder_tensor_parallel``, None: the backbone's)."""

    data_parallel: int
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    encoder_ranks: str = "first-stage"
    encoder_tensor_parallel: Optional[int] = None
    distributed_optimizer: bool = True
    sequence_parallel: bool = True

    def __post_init__(self):
        for name in ("data_parallel", "tensor_parallel", "pipeline_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel layout: {name} must be >= 1, got {getattr(self, name)}")
        if self.encoder_ranks not in ENCODER_RANKS:
            raise ValueError(f"parallel layout: encoder_ranks must be one of {ENCODER_RANKS}, "
                             f"got {self.encoder_ranks!r}")
        etp = self.encoder_tensor_parallel
        if etp is not None and not (etp >= 1 and self.tensor_parallel % etp == 0):
            raise ValueError(f"parallel layout: encoder_tensor_parallel {etp} must divide tensor_parallel "
                             f"{self.tensor_parallel}")

    @property
    def encoder_tp(self) -> int:
        return self.encoder_tensor_parallel or self.tensor_parallel

    def encodes(self, stage: int) -> bool:
        """Whether the GPUs of pipeline stage ``stage`` hold and run the encoders."""
        return self.encoder_ranks == "all" or stage == 0


@dataclass(frozen=True)
class GpuMemory:
    """Bytes one GPU holds at its step's peak, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    backbone_activations: float
    encoder_activations: float

    @property
    def model_state(self) -> float:
        return self.parameters + self.gradients + self.optimizer

    @property
    def activations(self) -> float:
        return self.backbone_activations + self.encoder_activations

    @property
    def total(self) -> float:
        return self.model_state + self.activations

    def line(self) -> str:
        """The bytes in GB, by kind, as one clause."""
        return (f"{self.total / GB:.1f} GB = parameters {self.parameters / GB:.1f} + gradients "
                f"{self.gradients / GB:.1f} + optimizer {self.optimizer / GB:.1f} + activations "
                f"{self.activations / GB:.1f} (backbone {self.backbone_activations / GB:.1f}, encoders "
                f"{self.encoder_activations / GB:.1f})")


def in_flight(stage: int, pipeline_stages: int, num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at once under 1F1B: its warm-up forwards and one."""
    return max(1, min(pipeline_stages - stage, num_microbatches))


def backbone_bytes_per_token(phases: ModelPhases) -> float:
    """Activation bytes one backbone token keeps for its backward, all layers (the phase's cost model)."""
    tokens = 4096
    return float(phases.backbone.cost.item_memory(np.array([tokens]))[0]) / tokens


def stage_memory(layout: ParallelLayout, parameters: Mapping[str, int], phases: ModelPhases,
                 in_flight_tokens: Sequence[float], encoder_activation_bytes: float = 0.0) -> List[GpuMemory]:
    """The busiest GPU of every pipeline stage (module docstring). ``parameters``: each phase's (encoders with
    their projectors; what ``MLLMConfig.num_parameters`` gives); ``in_flight_tokens[stage]``: the backbone tokens
    of the micro-batches that stage holds at once (:func:`in_flight` of them); ``encoder_activation_bytes``: what
    the busiest encoder group (``encoder_tp`` GPUs) keeps of the encoders' activations through the backbone."""
    if len(in_flight_tokens) != layout.pipeline_stages:
        raise ValueError(f"in_flight_tokens: one figure per pipeline stage ({layout.pipeline_stages}), "
                         f"got {len(in_flight_tokens)}")
    tp, pp, dp = layout.tensor_parallel, layout.pipeline_stages, layout.data_parallel
    shards = dp if layout.distributed_optimizer else 1
    backbone = parameters[phases.backbone.name] / (tp * pp)
    encoders = sum(parameters[name] for name in phases.encoder_names) / layout.encoder_tp
    per_token = backbone_bytes_per_token(phases) / pp / (tp if layout.sequence_parallel else 1)
    out = []
    for stage in range(pp):
        held = backbone + (encoders if layout.encodes(stage) else 0.0)
        out.append(GpuMemory(parameters=held * PARAMETER_BYTES, gradients=held * GRADIENT_BYTES,
                             optimizer=held * OPTIMIZER_BYTES / shards,
                             backbone_activations=float(in_flight_tokens[stage]) * per_token,
                             encoder_activations=(encoder_activation_bytes / layout.encoder_tp
                                                  if layout.encodes(stage) else 0.0)))
    return out


def busiest(stages: Sequence[GpuMemory]) -> int:
    """The stage whose GPU holds the most."""
    return int(np.argmax([m.total for m in stages]))


def padded_in_flight_tokens(layout: ParallelLayout, seq_length: int, micro_batch_size: int,
                            num_microbatches: int) -> List[float]:
    """Every stage's in-flight backbone tokens when every micro-batch is padded to ``seq_length`` (the compact
    trainer's pipelined micro-batches: fixed-shape P2P tensors): the most any step holds."""
    return [float(in_flight(s, layout.pipeline_stages, num_microbatches) * micro_batch_size * seq_length)
            for s in range(layout.pipeline_stages)]


def encoder_ranks_all_refusal(layout: ParallelLayout, parameters: Mapping[str, int], phases: ModelPhases,
                              seq_length: int, micro_batch_size: int, num_microbatches: int,
                              gpu_memory_bytes: Optional[float], limit: str = "gpu_memory_bytes",
                              naming: SettingNaming = config_setting) -> Optional[str]:
    """Why the encoders cannot go on every GPU (``layout`` with ``encoder_ranks="all"``) within
    ``gpu_memory_bytes`` (None: no check; ``limit`` names where it comes from), one line naming the bytes and the
    encoder layouts (as ``naming`` names the setting); None where they fit. What every step
    holds whatever its batch: the model state and the backbone's activations of micro-batches padded to
    ``seq_length``; the encoders' kept activations come on top, the planner keeps them under
    ``OrchestratorConfig.encoder_memory_cap``."""
    if gpu_memory_bytes is None or layout.encoder_ranks != "all":
        return None
    stages = stage_memory(layout, parameters, phases,
                          padded_in_flight_tokens(layout, seq_length, micro_batch_size, num_microbatches))
    stage = busiest(stages)
    if stages[stage].total <= gpu_memory_bytes:
        return None
    first = stage_memory(dataclasses.replace(layout, encoder_ranks="first-stage", encoder_tensor_parallel=None),
                         parameters, phases, padded_in_flight_tokens(layout, seq_length, micro_batch_size,
                                                                     num_microbatches))
    return (f"{naming('encoder_ranks', 'all')} does not fit {limit} ({gpu_memory_bytes / GB:.1f} GB): pipeline stage {stage}'s "
            f"GPUs need {stages[stage].line()} before any encoder activation (TP {layout.tensor_parallel}, "
            f"encoder TP {layout.encoder_tp}, PP {layout.pipeline_stages}, DP {layout.data_parallel}, "
            f"{micro_batch_size} x {seq_length} tokens per micro-batch; {naming('encoder_ranks', 'first-stage')}: "
            f"{max(m.total for m in first) / GB:.1f} GB)")
