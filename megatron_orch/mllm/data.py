"""The training data of one DP rank: which dataset, Megatron's pretraining sampler, the micro-batch iterator.

Two datasets produce :class:`~megatron_orch.megatron.batch.Example` objects and, for planning, their
:class:`~megatron_orch.megatron.batch.ExampleSizes` without materialising any tensor:
:class:`~megatron_orch.mllm.synthetic.SyntheticMultimodalDataset` (the embedded default) and
:class:`~megatron_orch.mllm.manifest.ManifestDataset` (users' own data from a JSONL manifest), read in
Megatron's sample order by :class:`TrainIterator`. An Energon dataset (a folder with ``.nv-meta``) is read
by Energon's own loader instead, each DP rank its own part of the shards
(:class:`~megatron_orch.mllm.energon.EnergonTrainIterator`, with the optional ``energon`` extra).
"""
from __future__ import annotations

import argparse
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import numpy as np

from megatron_orch.megatron.batch import Example, MicroBatch, collate
from megatron_orch.megatron.moe import pads_rows_to_seq_length
from megatron_orch.mllm.examples import ExampleLayout, example_layout
from megatron_orch.mllm.manifest import (ExampleReader, InputLimits, ManifestDataset, ManifestError, image_tiling,
                                         manifest_identity)
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
    data_path: Optional[str] = None  # --data-path: a JSONL manifest or an Energon dataset; None: synthetic
    pad_to_seq_length: bool = False  # rows of exactly seq_length tokens (pipeline parallelism, MoE backbones)
    max_num_tiles: int = 6  # tiles per image (--max-num-tiles)
    limits: InputLimits = field(default_factory=InputLimits)  # what one manifest example may hold
    max_bad_examples: int = 0  # --max-bad-examples: 0, a bad example ends the run; else it is replaced
    refuse_long_answers: bool = False  # --refuse-long-answers: an answer that does not fit is a bad example

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
                      max_bad_examples=args.max_bad_examples, refuse_long_answers=args.refuse_long_answers)


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


def data_identity(path) -> dict:
    """What identifies the content of ``--data-path`` in checkpoints (a manifest's or an Energon dataset's)."""
    if is_energon_dataset(path):
        from megatron_orch.mllm.energon import energon_identity
        return energon_identity(path)
    return manifest_identity(path)


def example_reader(config: DataConfig) -> ExampleReader:
    """How the examples of ``config``'s data are read and checked (its model's layout, tiling and limits)."""
    return ExampleReader(config.layout, image_tiling(config.model_config, config.max_num_tiles), limits=config.limits,
                         refuse_long_answers=config.refuse_long_answers)


def checked_dataset(config: DataConfig):
    """The dataset a :class:`DataConfig` names: the user's manifest (parsed and checked line by line
    here, before any model is built), an Energon dataset (its metadata read and its sample type
    checked here), else the synthetic default."""
    if is_energon_dataset(config.data_path):
        from megatron_orch.mllm.energon import EnergonDataset
        return EnergonDataset(config.data_path, example_reader(config))
    if config.data_path is not None:
        return ManifestDataset(config.data_path, config.layout,
                               image_tiling(config.model_config, config.max_num_tiles),
                               limits=config.limits, refuse_long_answers=config.refuse_long_answers)
    return SyntheticMultimodalDataset(config.model_config, config.num_samples, config.seed,
                                      seq_length=config.seq_length)


# Streams of the seeded draws (numpy SeedSequence entropy [seed, stream, ...]).
_EPOCH_STREAM, _REPLACEMENT_STREAM = 1, 2
# Seeded draws of a replacement for a bad example before giving up (the data is then mostly bad).
MAX_REPLACEMENT_DRAWS = 16


class SampleOrder:
    """Which example of a dataset of ``num_examples`` each sample position of the run trains on.

    Positions count samples in Megatron's consumed-samples order. A run longer than the dataset
    wraps around: epoch 0 is the dataset's own order, each later epoch a new permutation seeded by
    ``(seed, epoch)``. A bad example's replacements are seeded draws by ``(seed, position, attempt)``.
    Both are pure functions of the position, so every rank agrees and a resumed run continues exactly.
    """

    def __init__(self, num_examples: int, seed: int):
        self.num_examples, self.seed = num_examples, seed
        self._epoch, self._order = 0, None

    def epoch(self, position: int) -> int:
        return position // self.num_examples

    def __getitem__(self, position: int) -> int:
        epoch, offset = divmod(position, self.num_examples)
        if epoch == 0:
            return offset
        if epoch != self._epoch:
            self._epoch = epoch
            self._order = np.random.default_rng([self.seed, _EPOCH_STREAM, epoch]).permutation(self.num_examples)
        return int(self._order[offset])

    def replacement(self, position: int, attempt: int) -> int:
        return int(np.random.default_rng([self.seed, _REPLACEMENT_STREAM, position, attempt]).integers(
            self.num_examples))


class TooManyBadExamplesError(ManifestError):
    """More bad examples were skipped than ``--max-bad-examples`` allows."""


@dataclass(frozen=True)
class DataEvent:
    """Something the user should read about one sample position: a bad example skipped (``replacement``
    says where the position's example came from instead) or an answer truncated."""

    position: int
    skipped: bool
    message: str  # "manifest.jsonl:7: <reason>"
    replacement: Optional[str] = None


class DataEvents:
    """What one DP rank's loader reports to the trainer: :class:`DataEvent` objects by sample position,
    collected as its examples are read (post-balancing reads ahead on a thread of its own) and taken once
    those samples are trained (:meth:`take_events`), and its state for a checkpoint (:meth:`loader_state`)."""

    def __init__(self):
        self.events: List[DataEvent] = []
        self._events_lock = threading.Lock()

    def _report(self, event: DataEvent) -> None:
        with self._events_lock:
            self.events.append(event)

    def take_events(self, before: int) -> List[DataEvent]:
        """The events of positions below ``before`` (the samples trained so far), removed from :attr:`events`."""
        with self._events_lock:
            taken = [e for e in self.events if e.position < before]
            self.events = [e for e in self.events if e.position >= before]
        return taken

    def loader_state(self, consumed_samples: int) -> Optional[dict]:
        """What a checkpoint saves of the loader after ``consumed_samples`` (the samples trained so far);
        None: nothing, a resumed run restarts from its consumed-sample count (a loader whose order is a
        function of the sample position)."""
        return None


class TrainIterator(DataEvents):
    """This DP rank's micro-batches, in Megatron's order (:class:`MegatronPretrainingSampler` over
    :class:`SampleOrder` positions), starting after ``consumed_samples``.

    A bad example (a :class:`ManifestError` while loading it) ends the run with that one-line error
    when ``max_bad_examples`` is 0; otherwise it is replaced by the first good seeded draw of
    :meth:`SampleOrder.replacement`, so the global batch keeps its size and every rank (the TP/PP peers
    read the same positions) makes the same choice. :attr:`events` collects the skips and truncated
    answers; the trainer takes them (:meth:`take_events`), counts them and enforces the limit.
    """

    def __init__(self, dataset, config: DataConfig, consumed_samples: int, data_parallel_rank: int,
                 data_parallel_size: int, pin_memory: bool = False):
        super().__init__()
        self.dataset, self.config, self.pin_memory = dataset, config, pin_memory
        self.order = SampleOrder(len(dataset), config.seed)
        sampler = MegatronPretrainingSampler(config.num_samples, consumed_samples, config.micro_batch_size,
                                             data_parallel_rank, data_parallel_size)
        self._positions = iter(sampler)
        self._pad_to = config.seq_length if config.pad_to_seq_length else None
        self._spec = config.layout.spec

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        batch = collate([self._read(position) for position in next(self._positions)], self._spec,
                        pad_to=self._pad_to)
        return batch.pin_memory() if self.pin_memory else batch

    def epoch_note(self) -> Optional[str]:
        """What the user should know when the run is longer than the dataset; None if it is not."""
        if self.config.num_samples <= len(self.dataset):
            return None
        epochs = -(-self.config.num_samples // len(self.dataset))
        return (f" > the dataset holds {len(self.dataset)} examples, the run trains on {self.config.num_samples} "
                f"samples: {epochs} epochs, the first in the dataset's order, each later one in a new order "
                f"seeded by --seed {self.config.seed} and the epoch")

    def describe_samples(self, positions: range, replaced: Dict[int, str], shown: int = 8) -> str:
        """Where the samples at ``positions`` come from (``dataset.where``: a manifest's lines), the first
        ``shown`` of them; ``replaced``: the replacement's ``where`` of a position whose example was skipped."""
        wheres = [replaced.get(p) or self.dataset.where(self.order[p]) for p in positions[:shown]]
        more = f" (and {len(positions) - shown} more)" if len(positions) > shown else ""
        return ", ".join(wheres) + more

    def _read(self, position: int) -> Example:
        index = self.order[position]
        try:
            example, note = self.dataset.read(index)
        except ManifestError as bad:
            if self.config.max_bad_examples == 0:
                raise
            index, example, note = self._replacement(position, bad)
            self._report(DataEvent(position, True, str(bad), self.dataset.where(index)))
        if note is not None:
            self._report(DataEvent(position, False, note))
        return example

    def _replacement(self, position: int, bad: ManifestError):
        for attempt in range(MAX_REPLACEMENT_DRAWS):
            index = self.order.replacement(position, attempt)
            try:
                return (index, *self.dataset.read(index))
            except ManifestError as also_bad:
                last = also_bad
        raise ManifestError(f"{bad}; and {MAX_REPLACEMENT_DRAWS} seeded draws of a replacement were bad too "
                            f"(the last: {last})")


def build_train_iterator(config: DataConfig, consumed_samples: int, data_parallel_rank: int,
                         data_parallel_size: int, pin_memory: bool = False, *, data_parallel_group=None,
                         loader_state: Optional[dict] = None) -> DataEvents:
    """This DP rank's micro-batches from ``consumed_samples`` on (``pin_memory``: in pinned host memory, for
    asynchronous copies to a GPU): a :class:`TrainIterator` in Megatron's order, or for an Energon dataset
    an :class:`~megatron_orch.mllm.energon.EnergonTrainIterator` over this rank's part of the shards
    (``data_parallel_group``: the rank's DP group, for Energon's ``WorkerConfig``), restored to
    ``loader_state`` (what its ``loader_state`` returned when the checkpoint was saved)."""
    dataset = checked_dataset(config)
    if is_energon_dataset(config.data_path):
        from megatron_orch.mllm.energon import EnergonTrainIterator
        return EnergonTrainIterator(dataset, config, consumed_samples, data_parallel_rank, data_parallel_size,
                                    pin_memory, data_parallel_group=data_parallel_group, loader_state=loader_state)
    return TrainIterator(dataset, config, consumed_samples, data_parallel_rank, data_parallel_size, pin_memory)
