"""What the training data iterator of this project's model is given: :class:`DataConfig` (from a parsed
command line: :func:`data_config`), and what both of its readers share (the JSONL manifests' and synthetic
data's :mod:`~megatron_orch.mllm.data`, Energon datasets' :mod:`~megatron_orch.mllm.energon`). Imports
neither torch nor either reader.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_orch.megatron.moe import pads_rows_to_seq_length
from megatron_orch.mllm.examples import ExampleLayout, example_layout
from megatron_orch.mllm.manifest import InputLimits

# Seeded draws of a replacement for a bad example before giving up (the data is then mostly bad).
MAX_REPLACEMENT_DRAWS = 16


@dataclass(frozen=True)
class DataConfig:
    """What the training data iterator needs: the model (for shapes), batch sizes and the data source."""

    model_config: object  # megatron_orch.mllm.config.MLLMConfig
    seq_length: int
    micro_batch_size: int
    num_samples: int  # samples the run consumes in total (train_iters * global_batch_size)
    seed: int = 1234
    data_path: Optional[str] = None  # --data-path: a JSONL manifest or an Energon dataset; None: synthetic
    pad_to_seq_length: bool = False  # rows of exactly seq_length tokens (pipeline parallelism, MoE backbones)
    max_num_tiles: int = 6  # tiles per image (--max-num-tiles)
    limits: InputLimits = field(default_factory=InputLimits)  # what one manifest example may hold
    max_bad_examples: int = 0  # --max-bad-examples: 0, a bad example ends the run; else it is replaced
    refuse_long_answers: bool = False  # --refuse-long-answers: an answer that does not fit is a bad example
    allow_external_media: bool = False  # --allow-external-media: a manifest's media may be outside its folder
    trust_dataset_code: bool = False  # --trust-dataset-code: an Energon dataset's own Python may run

    @property
    def layout(self) -> ExampleLayout:
        return example_layout(self.model_config, self.seq_length)


def data_config(args: argparse.Namespace) -> DataConfig:
    """The data of a parsed ``pretrain_mllm.py`` command line."""
    return DataConfig(model_config=args.mllm_config, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size,
                      num_samples=args.train_iters * args.global_batch_size, seed=args.seed,
                      data_path=_data_path(args.data_path),
                      # 1F1B sends fixed [seq_length, micro_batch_size, hidden] tensors between stages; an
                      # MoE backbone's per-sequence losses count a row's padding (megatron_orch.megatron.moe).
                      pad_to_seq_length=(args.pipeline_model_parallel_size > 1
                                         or pads_rows_to_seq_length(args.mllm_config.backbone.transformer.num_experts)),
                      max_num_tiles=args.max_num_tiles,
                      limits=InputLimits(max_image_pixels=args.max_image_pixels,
                                         max_audio_seconds=args.max_audio_seconds,
                                         max_vision_items_per_sample=args.max_vision_items_per_sample),
                      max_bad_examples=args.max_bad_examples, refuse_long_answers=args.refuse_long_answers,
                      allow_external_media=args.allow_external_media, trust_dataset_code=args.trust_dataset_code)


def _data_path(data_path):
    """``--data-path``: one manifest or Energon dataset (Megatron-LM's parser gives a list)."""
    if isinstance(data_path, (list, tuple)):
        if len(data_path) > 1:
            raise ValueError(f"--data-path takes one JSONL manifest or Energon dataset here, got {len(data_path)} "
                             f"paths: {data_path}")
        return data_path[0] if data_path else None
    return data_path


def is_energon_dataset(path) -> bool:
    """Whether ``path`` is an Energon dataset: a folder with the ``.nv-meta`` that ``energon prepare`` writes."""
    return path is not None and (Path(path) / ".nv-meta").is_dir()
