"""Encoders on every pipeline stage (``EncoderRanks.ALL``): which rank of the encoder group encodes each item, and
the step's moves that follow from it. Torch-free, the same on every rank.

The encoder group is the job's DP x PP ranks at one TP (and CP) rank; its rank ``g = stage * DP + dp`` (the
order of the global ranks in megatron-core's ``tp-cp-dp-pp`` layout). The step's plan balances each encoder
phase over DP (:func:`~megatron_orch.orchestrator.step_plan.plan_step`); :func:`spread_over_stages` then splits
each DP rank's items of a phase over its pipeline stages, consecutive slots per stage. Every item of a phase
costs the same (one fixed shape), so the split by count is exact: ``ceil(ceil(n / DP) / PP) = ceil(n / (DP x
PP))`` items on the busiest rank, the bound over the whole group. The stages that get one item more rotate
with the phase, so that no stage gets every phase's extra item.

The moves (:func:`group_moves`): raw inputs from the first-stage rank that loaded their example (only the
first stage stages what it loads) to their encoder rank, and the encoder outputs from there straight to the
first-stage rank that runs their example's first backbone layers, in one all-to-all over the encoder group;
their gradients back by the inverse. The text moves within each stage's DP group, as with ``FIRST_STAGE``.
:func:`unsupported_layout` names the parallel layouts it does not run (checked before any collective).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import numpy as np

from megatron_orch.balance.plan import Placement, Transfer
from megatron_orch.orchestrator.step_plan import EncoderChunks, StepMove, StepPlan, step_moves

FLAG = "--orch-encoder-ranks all"


def unsupported_layout(*, virtual_pipeline_size: Optional[int], context_parallel_size: int,
                       overlap_grad_reduce: bool, sharded: Optional[str]) -> Optional[str]:
    """Why the encoders cannot go on every pipeline stage in this layout (None: they can), one line naming the
    setting."""
    if virtual_pipeline_size is not None and virtual_pipeline_size > 1:
        return (f"{FLAG} with virtual pipeline stages ({virtual_pipeline_size} model chunks per rank) is not "
                "supported: the encoders sit in the first model chunk only")
    if context_parallel_size > 1:
        return f"{FLAG} with --context-parallel-size {context_parallel_size} is not supported"
    if overlap_grad_reduce:
        return (f"{FLAG} with --overlap-grad-reduce is not supported: the encoders' gradients are summed over the "
                "pipeline stages before DDP reduces them, which its overlapped reduction would start first")
    if sharded is not None:
        return f"{FLAG} with {sharded} is not supported (each stage's encoders are sharded over DP alone)"
    return None


@dataclass(frozen=True, eq=False)
class EncoderGroupPlan:
    """Where every encoder phase's items are encoded over the encoder group (``encode``, ranks ``stage * DP +
    dp``, slots in the order of the DP plan's) and in which chunks (``chunks``: the DP plan's chunk size,
    each rank keeping at most what its DP rank's plan keeps; None where the DP plan has none)."""

    data_parallel_size: int
    pipeline_size: int
    encode: Dict[str, Placement]
    chunks: Dict[str, Optional[EncoderChunks]]

    @property
    def num_ranks(self) -> int:
        return self.data_parallel_size * self.pipeline_size

    def group_rank(self, stage: int, dp_rank: int) -> int:
        """The encoder-group rank of pipeline stage ``stage`` of DP rank ``dp_rank``."""
        return stage * self.data_parallel_size + dp_rank

    def counts(self, phase: str) -> np.ndarray:
        """Items of ``phase`` each encoder-group rank encodes."""
        return self.encode[phase].counts()


def stage_of_items(encode: Placement, pipeline_size: int, rotation: int = 0) -> np.ndarray:
    """The pipeline stage of every item placed by ``encode`` (over DP ranks): each DP rank's items in slot order,
    split into ``pipeline_size`` runs of consecutive slots whose sizes differ by one at most; the longer runs
    go to stages ``rotation, rotation + 1, ...`` (mod ``pipeline_size``)."""
    if pipeline_size < 1:
        raise ValueError(f"pipeline_size must be >= 1, got {pipeline_size}")
    count = encode.counts()[encode.rank]  # items on the item's DP rank
    base, extra = count // pipeline_size, count % pipeline_size
    stage = np.zeros(encode.num_items, dtype=np.int64)
    end = np.zeros(encode.num_items, dtype=np.int64)
    for s in range(pipeline_size - 1):  # the item lies past the end of stage s's run: a later stage
        end += base + (((s - rotation) % pipeline_size) < extra)
        stage += encode.slot >= end
    return stage


def spread_over_stages(plan: StepPlan, pipeline_size: int) -> EncoderGroupPlan:
    """Every encoder phase of ``plan`` spread over the encoder group of ``pipeline_size`` stages (module
    docstring); phase ``k`` gives its extra items to the stages from ``k`` on."""
    dp = plan.examples_home.num_ranks
    encode, chunks = {}, {}
    for k, (phase, encoder) in enumerate(plan.encoders.items()):
        stage = stage_of_items(encoder.encode, pipeline_size, rotation=k)
        placement = Placement.from_ranks(stage * dp + encoder.encode.rank, dp * pipeline_size, key=encoder.encode.slot)
        encode[phase] = placement
        dp_chunks = encoder.chunks
        chunks[phase] = None if dp_chunks is None else EncoderChunks(
            dp_chunks.items, np.minimum(placement.counts(), np.tile(np.asarray(dp_chunks.kept), pipeline_size)))
    return EncoderGroupPlan(dp, pipeline_size, encode, chunks)


def _on_first_stage(placement: Placement, num_ranks: int) -> Placement:
    """``placement`` (over DP ranks) as a placement over the encoder group: the same ranks of the first stage."""
    return Placement(placement.rank, placement.slot, num_ranks)


def group_moves(plan: StepPlan, group: EncoderGroupPlan) -> List[StepMove]:
    """The step's moves (:func:`~megatron_orch.orchestrator.step_plan.step_moves`, in its order and names) with
    every encoder phase's raw inputs and embeddings moving over the encoder group (module docstring)."""
    out = []
    for move in step_moves(plan):
        if move.kind == "text":
            out.append(move)
            continue
        encoder = plan.encoders[move.items_of]
        encoded = group.encode[move.items_of]
        if move.kind == "inputs":
            transfer = Transfer(_on_first_stage(encoder.home, group.num_ranks), encoded)
        else:
            transfer = Transfer(encoded, _on_first_stage(plan.examples_backbone.expand(encoder.example),
                                                         group.num_ranks))
        out.append(StepMove(move.name, move.kind, move.items_of, move.phase, transfer, move.with_gradients))
    return out
