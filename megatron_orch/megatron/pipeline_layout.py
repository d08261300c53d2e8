"""Megatron's rules for virtual pipeline stages (the interleaved 1F1B schedule), checked on the command line:
torch-free, before any process group exists, each broken rule one line naming the flags.

* :func:`virtual_pipeline_size`: model chunks per pipeline rank from ``--num-layers-per-virtual-pipeline-stage``
  or ``--num-virtual-stages-per-pipeline-rank``, as Megatron-LM derives it (``megatron/training/arguments.py``);
* :func:`check_interleaved_microbatches`: megatron-core's interleaved schedule's own conditions on the
  micro-batches of a step, which ``forward_backward_pipelining_with_interleaving`` raises only once the
  step runs (with post-balancing: after the step's plan and its moves).
"""
from __future__ import annotations

from typing import Optional

LAYERS_FLAG = "--num-layers-per-virtual-pipeline-stage"
STAGES_FLAG = "--num-virtual-stages-per-pipeline-rank"


def virtual_pipeline_size(num_layers: int, pipeline_size: int, layers_per_virtual_stage: Optional[int],
                          virtual_stages: Optional[int]) -> Optional[int]:
    """Model chunks per pipeline rank (None: one, no interleaving), or ValueError naming the flag. Each
    chunk holds ``num_layers / (pipeline_size x chunks)`` of the backbone's layers."""
    if layers_per_virtual_stage is not None and virtual_stages is not None:
        raise ValueError(f"{LAYERS_FLAG} and {STAGES_FLAG} exclude each other (Megatron-LM's rule)")
    if layers_per_virtual_stage is None and virtual_stages is None:
        return None
    flag, value = (LAYERS_FLAG, layers_per_virtual_stage) if virtual_stages is None else (STAGES_FLAG, virtual_stages)
    if value < 1:
        raise ValueError(f"{flag} must be >= 1, got {value}")
    if pipeline_size < 2:
        raise ValueError(f"{flag} {value}: virtual pipeline stages need --pipeline-model-parallel-size > 1 (the "
                         "interleaved schedule splits each pipeline rank's layers into model chunks)")
    per_stage = num_layers // pipeline_size
    if virtual_stages is None:
        if per_stage % layers_per_virtual_stage:
            raise ValueError(f"{LAYERS_FLAG} {layers_per_virtual_stage}: the {per_stage} backbone layers of each "
                             f"pipeline stage ({num_layers} / --pipeline-model-parallel-size {pipeline_size}) are "
                             "not divisible by it")
        virtual_stages = per_stage // layers_per_virtual_stage
    elif per_stage % virtual_stages:
        raise ValueError(f"{STAGES_FLAG} {virtual_stages}: the {per_stage} backbone layers of each pipeline stage "
                         f"({num_layers} / --pipeline-model-parallel-size {pipeline_size}) do not split into "
                         f"{virtual_stages} model chunks")
    return virtual_stages if virtual_stages > 1 else None


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int,
                                   group_size: Optional[int] = None) -> None:
    """ValueError unless megatron-core's interleaved schedule runs ``num_microbatches`` micro-batches per step
    with ``group_size`` consecutive micro-batches per virtual stage (``--microbatch-group-size-per-virtual-
    pipeline-stage``; default the pipeline size): ``pipeline_size <= group_size <= num_microbatches``, and the
    last group empty or of at least ``pipeline_size`` (with the default: a multiple of the pipeline size)."""
    group = pipeline_size if group_size is None else group_size
    where = (f"{num_microbatches} micro-batches per step (--global-batch-size / (--micro-batch-size x "
             f"data-parallel size))")
    if not pipeline_size <= group <= num_microbatches:
        raise ValueError(f"virtual pipeline stages with {where}: the interleaved schedule runs {group} consecutive "
                         f"micro-batches per virtual stage, which must lie in [--pipeline-model-parallel-size "
                         f"{pipeline_size}, {num_microbatches}]; use a multiple of {pipeline_size} micro-batches")
    if 0 < num_microbatches % group < pipeline_size:
        raise ValueError(f"virtual pipeline stages with {where}: the interleaved schedule's last group of "
                         f"{num_microbatches % group} micro-batches is shorter than --pipeline-model-parallel-size "
                         f"{pipeline_size}; use a multiple of {group} micro-batches")
