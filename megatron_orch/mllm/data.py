"""The training data of one DP rank: which dataset, Megatron's pretraining sampler, the micro-batch iterator.

Two datasets produce :class:`~megatron_orch.megatron.batch.Example` objects and, for planning, their
:class:`~megatron_orch.megatron.batch.ExampleSizes` without materialising any tensor:
:class:`~megatron_orch.mllm.synthetic.SyntheticMultimodalDataset` (the embedded default) and
:class:`~megatron_orch.mllm.manifest.ManifestDataset` (users' own data from a JSONL manifest).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Iterator, Optional

from megatron_orch.megatron.batch import MicroBatch, collate
from megatron_orch.mllm.examples import ExampleLayout, example_layout
from megatron_orch.mllm.manifest import InputLimits, ManifestDataset, image_tiling
from megatron_orch.mllm.synthetic import SyntheticMultimodalDataset


class MegatronPretrainingSampler:
    """Megatron-LM's ``MegatronPretrainingSampler`` index arithmetic (dataloader type ``single``).

    Samples are consumed in order, ``micro_batch_size * data_parallel_size`` per micro-batch step; of
    the step starting at sample ``start``, rank ``r`` gets ``[start + r*mbs, start + (r+1)*mbs)``.
    ``consumed_samples`` counts samples of all ranks (Megatron's ``args.consumed_train_samples``), so
    a sampler built with the consumed count of a checkpoint continues exactly where training stopped.
    An incomplete last step is dropped, as upstream with ``drop_last=True``.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples < 1:
            raise ValueError(f"no sample to consume: total_samples={total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: consumed_samples={consumed_samples}, "
                             f"total_samples={total_samples}")
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} and data_parallel_size="
                             f"{data_parallel_size} must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} outside 0..{data_parallel_size - 1}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        offset = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + offset, start + offset + self.micro_batch_size))


@dataclass(frozen=True)
class DataConfig:
    """What the training data iterator needs: the model (for shapes), batch sizes and the data source."""

    model_config: object  # megatron_orch.mllm.config.MLLMConfig
    seq_length: int
    micro_batch_size: int
    num_samples: int  # samples the run consumes in total (train_iters * global_batch_size)
    seed: int = 1234
    manifest: Optional[str] = None  # JSONL manifest of the user's data; None: the synthetic default
    pad_to_seq_length: bool = False  # rows of exactly seq_length tokens (pipeline parallelism needs it)
    max_num_tiles: int = 6  # tiles per image (--max-num-tiles)
    limits: InputLimits = field(default_factory=InputLimits)  # what one manifest example may hold

    @property
    def layout(self) -> ExampleLayout:
        return example_layout(self.model_config, self.seq_length)


def build_dataset(config: DataConfig):
    """The dataset a :class:`DataConfig` names: the user's manifest, else the synthetic default."""
    if config.manifest is not None:
        return ManifestDataset(config.manifest, config.layout, image_tiling(config.model_config, config.max_num_tiles),
                               limits=config.limits)
    return SyntheticMultimodalDataset(config.model_config, config.num_samples, config.seed,
                                      seq_length=config.seq_length)


def data_config(args: argparse.Namespace) -> DataConfig:
    """The data of a parsed ``pretrain_mllm.py`` command line."""
    return DataConfig(model_config=args.mllm_config, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size,
                      num_samples=args.train_iters * args.global_batch_size, seed=args.seed,
                      manifest=_manifest_path(args.data_path),
                      # 1F1B sends fixed [seq_length, micro_batch_size, hidden] tensors between stages.
                      pad_to_seq_length=args.pipeline_model_parallel_size > 1,
                      max_num_tiles=args.max_num_tiles,
                      limits=InputLimits(max_image_pixels=args.max_image_pixels,
                                         max_audio_seconds=args.max_audio_seconds,
                                         max_vision_items_per_sample=args.max_vision_items_per_sample))


def _manifest_path(data_path):
    """``--data-path``: one manifest path (Megatron-LM's parser gives a list)."""
    if isinstance(data_path, (list, tuple)):
        if len(data_path) > 1:
            raise ValueError(f"--data-path takes one JSONL manifest here, got {len(data_path)} paths: {data_path}")
        return data_path[0] if data_path else None
    return data_path


def checked_dataset(config: DataConfig):
    """:func:`build_dataset`, refused unless it holds every sample the run consumes (a manifest is parsed
    and checked line by line here, before any model is built)."""
    dataset = build_dataset(config)
    if len(dataset) < config.num_samples:
        raise ValueError(f"the dataset has {len(dataset)} examples, fewer than the {config.num_samples} "
                         "samples the run consumes")
    return dataset


def build_train_iterator(config: DataConfig, consumed_samples: int, data_parallel_rank: int,
                         data_parallel_size: int) -> Iterator[MicroBatch]:
    """This DP rank's micro-batches, in Megatron's order, starting after ``consumed_samples``."""
    dataset = checked_dataset(config)
    sampler = MegatronPretrainingSampler(config.num_samples, consumed_samples, config.micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    pad_to = config.seq_length if config.pad_to_seq_length else None
    spec = config.layout.spec
    return (collate([dataset[i] for i in indices], spec, pad_to=pad_to) for indices in sampler)
