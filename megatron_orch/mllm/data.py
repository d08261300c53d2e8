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

from typing import Dict, Iterator, List, Optional, Sequence

import numpy as np

from megatron_orch.megatron.batch import Example, MicroBatch, collate
from megatron_orch.mllm.data_config import MAX_REPLACEMENT_DRAWS, DataConfig, is_energon_dataset
from megatron_orch.mllm.manifest import ExampleReader, ManifestDataset, ManifestError, image_tiling, manifest_identity
from megatron_orch.mllm.synthetic import SyntheticMultimodalDataset
from megatron_orch.trainer.data_events import DataEvent, DataEvents, TooManyBadExamplesError  # noqa: F401


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
    checked here; refused if it holds Python and ``trust_dataset_code`` is off), else the synthetic default."""
    if is_energon_dataset(config.data_path):
        from megatron_orch.mllm.energon import EnergonDataset
        return EnergonDataset(config.data_path, example_reader(config), trust_code=config.trust_dataset_code)
    if config.data_path is not None:
        return ManifestDataset(config.data_path, config.layout,
                               image_tiling(config.model_config, config.max_num_tiles),
                               limits=config.limits, refuse_long_answers=config.refuse_long_answers,
                               allow_external_media=config.allow_external_media)
    return SyntheticMultimodalDataset(config.model_config, config.num_samples, config.seed,
                                      seq_length=config.seq_length)


# Streams of the seeded draws (numpy SeedSequence entropy [seed, stream, ...]).
_EPOCH_STREAM, _REPLACEMENT_STREAM = 1, 2


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

    def describe_examples(self, sample_ids: Sequence[int], shown: int = 8) -> str:
        """Where the examples of ``sample_ids`` come from (an example's ``sample_index`` is its index in the
        dataset, a skipped one's replacement's too): a manifest's lines, the first ``shown`` of them."""
        more = f" (and {len(sample_ids) - shown} more)" if len(sample_ids) > shown else ""
        return ", ".join(self.dataset.where(i) for i in sample_ids[:shown]) + more

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
