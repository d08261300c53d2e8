"""Megatron-Energon datasets in: ``--data-path`` naming a folder with ``.nv-meta`` (``energon prepare``).

Energon reads the dataset, as Megatron-LM's multimodal examples do: each DP rank its own part of the shards
through a ``WorkerConfig`` (DP rank, DP size, DP group; the TP/PP peers of a rank read the same samples),
shuffled by Energon with ``--seed``, repeated epoch after epoch. :class:`ExampleTaskEncoder` is Energon's
``TaskEncoder`` with one hook per pipeline step:

* ``decoder`` (:class:`RawMediaDecoder`): text parts (``.json``, ``.txt``) are decoded, media parts stay the
  encoded bytes of their file, so every size and limit is known from the file headers before any pixel or
  mel frame is decoded;
* ``encode_sample``: the sample as a manifest entry (:func:`sample_entry`), checked, sized and turned into
  the contract's :class:`~megatron_orch.megatron.batch.Example` by the same
  :class:`~megatron_orch.mllm.manifest.ExampleReader` as a JSONL manifest's lines (so ``check_data``, the
  limits flags and the ``sizes`` field mean the same). A bad sample ends the run (``--max-bad-examples 0``,
  one line naming the shard and the sample key) or is skipped: Energon takes the next sample of the
  rank's shard instead, and the skip travels with that sample to the trainer's count;
* ``batch``: the micro-batch's encoded samples as they are; :class:`EnergonTrainIterator` numbers them in
  Megatron's sample order and collates them as a JSONL manifest's are.

Sample types (the ``sample_type`` of the dataset's ``dataset.yaml``):

* :class:`MultimodalSample` (this project's): a ``.json`` part holding one manifest entry (``text``,
  ``prompt``, ``images``, ``audio``, ``sizes``: the schema of :class:`~megatron_orch.mllm.manifest.ManifestDataset`)
  whose ``images`` and ``audio`` name other parts of the same sample (``"img0.png"`` is the member
  ``<key>.img0.png``); its ``dataset.yaml`` names :class:`MultimodalWebdatasetFactory` (no code in the dataset);
* Energon's ``VQASample`` (``context`` is the prompt, the answer of highest weight, else the first, is
  trained on), ``CaptioningSample`` (an image and its caption) and ``InterleavedSample`` (the text before its
  first image is the prompt; its images in order; the text after, joined with spaces, is the answer: this
  project's layout puts every medium after the prompt).

The loader's state is saved with each checkpoint (Energon's ``save_state_rank``, as plain dicts, lists,
ints, strings and bytes: :func:`plain_state`) and restored (``restore_state_rank``) on resume, at the
micro-batch the checkpoint trained up to (post-balancing reads steps ahead), so a resumed run continues on
exactly the samples the uninterrupted run trains on. Energon's worker processes are not used: the loader
runs on the reading thread of the iterator that wraps it (post-balancing reads ahead on a thread of its own).
A dataset that brings Python (:func:`dataset_code`) opens only with ``--trust-dataset-code``.
Requires the ``energon`` extra (``pip install -e .[energon]``).
"""
from __future__ import annotations

import bisect
import collections
import dataclasses
import hashlib
import importlib
import json
import tarfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

try:
    from megatron.energon import (CaptioningSample, InterleavedSample, Sample, SkipSample, TaskEncoder,
                                  VQASample, WorkerConfig, edataclass, get_savable_loader, get_train_dataset,
                                  get_val_dataset, get_loader, reraise_exception)
    from megatron.energon.cache import FileStoreDecoder
    from megatron.energon.eyaml import load_yaml
    from megatron.energon.flavors.webdataset.config import MAIN_FOLDER_NAME
    from megatron.energon.flavors.webdataset.sample_loader import WebdatasetSampleLoaderDataset
    from megatron.energon.flavors.webdataset.standard_webdataset import StandardWebdatasetFactory
    from megatron.energon.state import FlexState
except ImportError as err:  # the optional extra
    raise ImportError(f"an Energon dataset needs megatron-energon: pip install -e .[energon] ({err})") from None

from megatron_orch.megatron.batch import Example, MicroBatch, collate
from megatron_orch.mllm.data_config import MAX_REPLACEMENT_DRAWS, DataConfig
from megatron_orch.mllm.manifest import ExampleReader, ManifestError, MediaBytes
from megatron_orch.trainer.data_events import DataEvent, DataEvents

# Energon's shuffling (``get_train_dataset``), as Megatron-LM's multimodal example sets it.
SHUFFLE_BUFFER_SIZE = 100
MAX_SAMPLES_PER_SEQUENCE = 100
# Loader states kept for the micro-batches read but not trained yet (post-balancing reads a few steps ahead).
MAX_PENDING_STATES = 1024
# Energon's loaders ask torch's DataLoader for pinned memory, which warns (once per loader) without a GPU.
warnings.filterwarnings("ignore", message=r"'pin_memory' argument is set as true but no accelerator")
_TEXT_PARTS = {"json": json.loads, "txt": lambda raw: raw.decode("utf-8"), "text": lambda raw: raw.decode("utf-8")}


class RawMediaDecoder(FileStoreDecoder):
    """Energon's decoder step: ``.json`` and ``.txt`` parts decoded, every other part (images, ``.npy``
    arrays) left as the bytes of its file, for :class:`ExampleTaskEncoder` to size from its header first.
    A text part that does not decode stays bytes too: the sample is then reported, not the loader stopped."""

    def decode(self, fname: str, raw: bytes) -> Any:
        decode = _TEXT_PARTS.get(fname.rsplit(".", 1)[-1].lower())
        if decode is None:
            return raw
        try:
            return decode(raw)
        except ValueError:  # not JSON, not UTF-8 (UnicodeDecodeError is a ValueError)
            return raw

    def __call__(self, sample: dict) -> dict:
        return {key: value if key.startswith("__") or not isinstance(value, bytes) else self.decode(key, value)
                for key, value in sample.items()}

    def config(self) -> dict:
        return {"type": type(self).__qualname__}


@edataclass
class MultimodalSample(Sample):
    """One example: ``entry`` is the sample's ``.json`` part, a manifest entry (``text``, ``prompt``,
    ``images``, ``audio``, ``sizes``) whose ``images`` and ``audio`` name other parts of the sample;
    ``parts`` holds those parts' bytes by part name (``img0.png`` for the member ``<key>.img0.png``)."""

    entry: Any
    parts: Dict[str, bytes]


def sample_loader(raw: dict) -> dict:
    """Energon's sample loader of :class:`MultimodalSample` (name it in ``dataset.yaml``)."""
    return {"entry": raw.get("json"),
            "parts": {name: data for name, data in raw.items() if not name.startswith("__") and name != "json"}}


def part_filter(part: str) -> bool:
    """Every part of a :class:`MultimodalSample` is loaded (its entry names the ones it uses)."""
    return True


class MultimodalWebdatasetFactory(StandardWebdatasetFactory):
    """A dataset of :class:`MultimodalSample`, loaded by :func:`sample_loader` and :func:`part_filter`, with no
    code in the dataset: its ``dataset.yaml`` is ``__module__: megatron_orch.mllm.energon`` and ``__class__:
    MultimodalWebdatasetFactory`` (Energon then builds this factory instead of its standard one)."""

    def __init__(self, path, **kwargs):
        super().__init__(path, sample_type=MultimodalSample, sample_loader=sample_loader, part_filter=part_filter,
                         **kwargs)


SUPPORTED_SAMPLE_TYPES = (MultimodalSample, VQASample, CaptioningSample, InterleavedSample)


def sample_entry(sample) -> Tuple[Any, Callable[[str], MediaBytes]]:
    """The manifest entry of an Energon sample and the media its ``images`` / ``audio`` names refer to."""
    key = sample.__key__
    if isinstance(sample, MultimodalSample):
        return sample.entry, lambda name: MediaBytes(f"{key}.{name}", sample.parts.get(name))
    if isinstance(sample, VQASample):
        answers = list(sample.answers or [])
        weights = sample.answer_weights
        best = 0 if weights is None or not answers else int(torch.as_tensor(weights)[:len(answers)].argmax())
        entry = {"prompt": sample.context, "text": answers[best] if answers else None, "images": ["image"]}
        media = {"image": sample.image}
    elif isinstance(sample, CaptioningSample):
        entry, media = {"text": sample.caption, "images": ["image"]}, {"image": sample.image}
    elif isinstance(sample, InterleavedSample):
        texts = [part for part in sample.sequence if isinstance(part, str)]
        first = next((i for i, part in enumerate(sample.sequence) if not isinstance(part, str)), len(sample.sequence))
        media = {f"image{i}": part for i, part in enumerate(p for p in sample.sequence if not isinstance(p, str))}
        before = [part for part in sample.sequence[:first] if isinstance(part, str)]
        entry = {"prompt": " ".join(before), "text": " ".join(texts[len(before):]), "images": list(media)}
    else:
        raise ManifestError(f"sample type {type(sample).__name__} is not supported (use "
                            f"{', '.join(t.__name__ for t in SUPPORTED_SAMPLE_TYPES)})")
    for name, value in media.items():
        if value is not None and not isinstance(value, bytes):
            raise ManifestError(f"its {name} is a {type(value).__name__}, expected the bytes of the image file (the "
                                "task encoder's decoder leaves media encoded)")
    return entry, lambda name: MediaBytes(f"{key}.{name}", media.get(name))


def _checked_entry(entry, where: str):
    if entry is None:
        raise ManifestError(f"{where}: the sample has no .json part (its manifest entry)")
    if isinstance(entry, bytes):
        raise ManifestError(f"{where}: its .json part is not valid UTF-8 JSON")
    return entry


@dataclass(frozen=True, eq=False)
class EncodedSample:
    """What :class:`ExampleTaskEncoder` makes of one sample: its example (None for a bad one that ends the
    run: ``problem``), the note of a truncated answer, and the bad samples skipped for it (their messages)."""

    where: str
    example: Optional[Example] = None
    note: Optional[str] = None
    skipped: Tuple[str, ...] = ()
    problem: Optional[str] = None


@dataclass(frozen=True)
class CheckedSample:
    """What ``check_data`` finds in one sample (:class:`ExampleTaskEncoder` with ``check``)."""

    index: int  # in the dataset, for the report's order
    bad: Optional[str]
    note: Optional[str]
    damaged: Tuple[Tuple[int, str], ...] = ()  # (index, message) of samples that could not be read before it


class ExampleTaskEncoder(TaskEncoder):
    """Energon's task encoder of this project's examples (the module docstring): ``decoder`` (text decoded,
    media left encoded), ``encode_sample`` (sample -> :class:`EncodedSample`, or a skip), ``batch`` (the
    encoded samples as they are). ``check``: ``encode_sample`` returns a :class:`CheckedSample` instead
    (``decode``: loading the sample as training does), for ``check_data``."""

    decoder = RawMediaDecoder()

    def __init__(self, reader: ExampleReader, dataset: str, max_bad_examples: int = 0, check: bool = False,
                 decode: bool = False):
        self.reader, self.dataset = reader, dataset
        self.max_bad_examples, self.check, self.decode = max_bad_examples, check, decode
        self._skipped: List[str] = []  # bad samples skipped since the last good one (this worker's)
        self._damaged: List[Tuple[int, str]] = []  # check: samples that could not be read since the last one read

    def damaged(self, index: int, message: str) -> None:
        """Sample ``index`` could not be read from its shard (:class:`DamageTolerantReader`): a bad sample like
        any other, already skipped by Energon: it ends the run (``max_bad_examples`` 0), is counted with the
        next sample read, or (``check``) reported with it."""
        if self.check:
            self._damaged.append((index, message))
            return
        if self.max_bad_examples == 0:
            raise ManifestError(message)
        self._skip(message)

    def _skip(self, message: str) -> None:
        """Count a bad sample skipped; too many in a row (the data is then mostly bad) end the run."""
        self._skipped.append(message)
        if len(self._skipped) > MAX_REPLACEMENT_DRAWS:
            first, self._skipped = self._skipped[0], []
            raise ManifestError(f"{first}; and the next {MAX_REPLACEMENT_DRAWS} samples of the shard were bad too "
                                f"(the last: {message})")

    def where(self, sample) -> str:
        """``<dataset>/<shard>:<key>``: where a sample is, in messages."""
        sources = sample.__sources__ or ()
        shard = sources[0].shard_name if sources else "?"
        return f"{self.dataset}/{shard}:{sample.__key__}"

    def encode_sample(self, sample):
        where = self.where(sample)
        try:
            entry, media = sample_entry(sample)
            record = self.reader.parse_entry(_checked_entry(entry, where), where, media)
            if self.check:
                note = self.reader.check_record(record, 0, decode=self.decode)
            else:
                example, note = self.reader.read_record(record, 0)
        except ManifestError as bad:
            message = str(bad) if str(bad).startswith(where) else f"{where}: {bad}"
            if self.check:
                return self._checked(sample, message, None)
            if self.max_bad_examples == 0:
                return EncodedSample(where, problem=message)
            try:
                self._skip(message)
            except ManifestError as too_many:
                return EncodedSample(where, problem=str(too_many))
            raise SkipSample() from None
        if self.check:
            return self._checked(sample, None, note)
        skipped, self._skipped = tuple(self._skipped), []
        return EncodedSample(where, example, note, skipped)

    def _checked(self, sample, bad: Optional[str], note: Optional[str]) -> CheckedSample:
        damaged, self._damaged = tuple(self._damaged), []
        return CheckedSample(_dataset_index(sample), bad, note, damaged)

    def take_damaged(self) -> List[Tuple[int, str]]:
        """check: the samples that could not be read after the last one read (the end of the split)."""
        damaged, self._damaged = self._damaged, []
        return damaged

    def batch(self, samples: list) -> list:
        return list(samples)


class DamageTolerantReader:
    """Energon's reader of a dataset's shards, through which a sample that cannot be read (a truncated or
    corrupt shard: tar's "unexpected end of data") is given as None, which Energon skips, and reported to
    the task encoder (:meth:`ExampleTaskEncoder.damaged`) naming the shard and the sample, instead of
    ending the loader with a bare tar error."""

    def __init__(self, reader, encoder: ExampleTaskEncoder):
        self.reader, self.encoder = reader, encoder

    def __getitem__(self, index: int):
        try:
            return self.reader[index]
        except (ValueError, OSError, tarfile.TarError) as err:
            self.encoder.damaged(index, f"{self.encoder.dataset}/{self._sample(index)}: cannot be read from its shard "
                                        f"({type(err).__name__}: {err}): the shard is damaged (truncated or corrupt)")
            return None

    def _sample(self, index: int) -> str:
        """``<shard>: sample N of M`` (its key is in the part that could not be read)."""
        shard = bisect.bisect_right(self.reader.shard_count_cumsum, index) - 1
        info = self.reader.shard_infos[shard]
        return f"{info.name}: sample {index - self.reader.shard_count_cumsum[shard] + 1} of {info.count}"

    def __getattr__(self, name: str):
        return getattr(self.reader, name)


def read_through_damage(dataset, encoder: ExampleTaskEncoder):
    """Energon's ``dataset`` with the shard readers of its sample loaders (found through the wrappers'
    ``dataset``) in :class:`DamageTolerantReader`; raises if it has none (another Energon layout)."""
    node, wrapped = dataset, 0
    while node is not None:
        if isinstance(node, WebdatasetSampleLoaderDataset):
            node.join_readers = [DamageTolerantReader(reader, encoder) for reader in node.join_readers]
            wrapped += 1
        node = getattr(node, "dataset", None)
    if not wrapped:
        raise RuntimeError(f"no WebdatasetSampleLoaderDataset in Energon's dataset {dataset}: this Energon version "
                           "reads shards otherwise (a damaged shard would not be named)")
    return dataset


# Modules a dataset.yaml may name (its sample type, its factory) without trusting the dataset's code.
TRUSTED_MODULES = ("megatron.energon", "megatron_orch.mllm.energon")
# dataset.yaml keys whose string value is a file of the dataset that Energon runs as Python ("file:function").
_CODE_KEYS = ("sample_loader", "part_filter")


def dataset_code(path) -> List[str]:
    """The Python that opening the Energon dataset at ``path`` would run, one description each: a ``.py`` file
    in its ``.nv-meta``, a file its YAML names as a sample loader or part filter, a module its YAML names that
    is neither Energon's nor this project's. Reads the files, imports and runs nothing."""
    meta = Path(path) / MAIN_FOLDER_NAME
    found = [str(file) for file in sorted(meta.rglob("*.py"))]
    for config in sorted(meta.glob("*.yaml")):
        try:
            tree = load_yaml(config.read_bytes())
        except Exception:  # noqa: BLE001 -- what Energon cannot parse, it does not run either
            continue
        found += [f"{config} names {what}" for what in _code_references(tree)]
    return found


def _code_references(node) -> List[str]:
    if isinstance(node, list):
        return [ref for item in node for ref in _code_references(item)]
    if not isinstance(node, dict):
        return []
    refs = []
    module = node.get("__module__")
    if module is not None and not any(str(module) == m or str(module).startswith(m + ".") for m in TRUSTED_MODULES):
        refs.append(f"the module {module}")
    refs += [f"{key}: {node[key]}" for key in _CODE_KEYS if isinstance(node.get(key), str)]
    return refs + [ref for value in node.values() for ref in _code_references(value)]


def _dataset_index(sample) -> int:
    sources = sample.__sources__ or ()
    index = sources[0].index if sources else 0
    return index if isinstance(index, int) else 0


class EnergonDataset:
    """An Energon dataset at ``path`` whose examples ``reader`` reads: its train split's metadata is read
    and its sample type checked when it is opened (before any model is built). A dataset holding Python
    (:func:`dataset_code`) is refused before any of it is imported, unless ``trust_code``
    (``--trust-dataset-code``, as ``trust_remote_code`` of Hugging Face's loaders)."""

    def __init__(self, path, reader: ExampleReader, split_part: str = "train", *, trust_code: bool = False):
        from megatron.energon.dataset_config import get_dataset_from_config
        self.path, self.reader, self.split_part = Path(path), reader, split_part
        code = [] if trust_code else dataset_code(self.path)
        if code:
            raise ManifestError(f"--data-path {path}: opening this Energon dataset runs its Python code ({code[0]}"
                                f"{f' and {len(code) - 1} more' if len(code) > 1 else ''}); pass "
                                "--trust-dataset-code if you trust it")
        try:
            factory = get_dataset_from_config(self.path, split_part=split_part, training=False,
                                              worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
        except Exception as err:  # noqa: BLE001 -- Energon raises many kinds on a bad .nv-meta
            raise ManifestError(f"--data-path {path}: cannot open the Energon dataset: {type(err).__name__}: "
                                f"{err}") from None
        self.sample_type = factory.__sample_type__
        if not issubclass(self.sample_type, SUPPORTED_SAMPLE_TYPES):
            raise ManifestError(f"--data-path {path}: sample type {self.sample_type.__name__} (its .nv-meta/"
                                f"dataset.yaml) is not supported; use one of "
                                f"{', '.join(t.__name__ for t in SUPPORTED_SAMPLE_TYPES)}")
        self.num_samples = len(factory)
        if self.num_samples == 0:
            raise ManifestError(f"--data-path {path}: its {split_part} split holds no samples")

    def __len__(self) -> int:
        return self.num_samples

    def task_encoder(self, max_bad_examples: int = 0, check: bool = False, decode: bool = False) -> ExampleTaskEncoder:
        return ExampleTaskEncoder(self.reader, str(self.path), max_bad_examples, check, decode)

    def train_loader(self, worker_config, micro_batch_size: int, max_bad_examples: int):
        """Energon's savable loader of this rank's micro-batches (lists of :class:`EncodedSample`)."""
        encoder = self.task_encoder(max_bad_examples)
        dataset = get_train_dataset(self.path, split_part=self.split_part, worker_config=worker_config,
                                    batch_size=micro_batch_size, shuffle_buffer_size=SHUFFLE_BUFFER_SIZE,
                                    max_samples_per_sequence=MAX_SAMPLES_PER_SEQUENCE, task_encoder=encoder)
        loader = get_savable_loader(read_through_damage(dataset, encoder))
        # torch's DataLoader draws its workers' base seed from the global torch RNG when its iterator starts (at
        # the first batch read). There are no workers here; a private generator keeps that draw off the training's
        # RNG streams, which a resumed run restores before its first read (dropout would then differ).
        loader.generator = torch.Generator()
        return loader

    def checked_samples(self, decode: bool = False, workers: int = 0):
        """Every sample of the split checked as training checks it (:class:`CheckedSample`, in loader order;
        a sample that cannot be read from its shard is one too; ``workers``: Energon's loader processes, 0: in
        this one)."""
        worker_config = WorkerConfig(rank=0, world_size=1, num_workers=workers, global_error_handler=reraise_exception)
        encoder = self.task_encoder(check=True, decode=decode)
        dataset = get_val_dataset(self.path, split_part=self.split_part, worker_config=worker_config, batch_size=None,
                                  task_encoder=encoder)
        for checked in get_loader(read_through_damage(dataset, encoder)):
            for index, message in checked.damaged:
                yield CheckedSample(index, message, None)
            yield checked
        for index, message in encoder.take_damaged():  # in this process (workers 0); a worker's are lost
            yield CheckedSample(index, message, None)


class EnergonTrainIterator(DataEvents):
    """This DP rank's micro-batches from an Energon dataset (the module docstring), numbered in Megatron's
    sample order from ``consumed_samples`` on (of micro-batch step ``k``, rank ``r`` holds samples
    ``k*mbs*dp + r*mbs ...``; the trainer takes events by these positions), ending after the run's
    ``config.num_samples`` as the JSONL sampler does.

    ``loader_state``: what :meth:`loader_state` returned when the checkpoint was saved; a run resumed at
    ``consumed_samples > 0`` needs it (Energon's order is its loader's state, not a function of the position).
    """

    def __init__(self, dataset: EnergonDataset, config: DataConfig, consumed_samples: int, data_parallel_rank: int,
                 data_parallel_size: int, pin_memory: bool = False, *, data_parallel_group=None,
                 loader_state: Optional[dict] = None):
        super().__init__()
        self.dataset, self.config, self.pin_memory = dataset, config, pin_memory
        self.rank, self.size = data_parallel_rank, data_parallel_size
        self._per_step = config.micro_batch_size * data_parallel_size
        if consumed_samples % self._per_step:
            raise ValueError(f"consumed_samples={consumed_samples} is not a whole number of micro-batch steps "
                             f"({config.micro_batch_size} x DP {data_parallel_size})")
        self._step = consumed_samples // self._per_step  # micro-batch steps read, the resumed ones included
        worker_config = WorkerConfig(rank=data_parallel_rank, world_size=data_parallel_size, num_workers=0,
                                     data_parallel_group=data_parallel_group, seed_offset=config.seed,
                                     global_error_handler=reraise_exception)
        self.loader = dataset.train_loader(worker_config, config.micro_batch_size, config.max_bad_examples)
        if loader_state is not None:
            self._restore(loader_state)
        elif consumed_samples:
            raise ValueError(f"--data-path {dataset.path}: resuming an Energon dataset at {consumed_samples} consumed "
                             "samples needs the loader state saved with the checkpoint, and there is none (the "
                             "compact trainer's checkpoints hold it)")
        self._states_lock = threading.Lock()
        self._states = collections.deque([(self._step, plain_state(self.loader.save_state_rank()))],
                                         maxlen=MAX_PENDING_STATES)
        self._wheres: Dict[int, str] = {}  # position -> sample, of the batches read since the last trained one
        self._trained = consumed_samples
        self._batches = iter(self.loader)
        self._pad_to = config.seq_length if config.pad_to_seq_length else None
        self._spec = config.layout.spec

    def _restore(self, saved: dict) -> None:
        expected = {"rank": self.rank, "world_size": self.size, "micro_batch_steps": self._step}
        found = {key: saved.get(key) for key in expected}
        if found != expected:
            raise ValueError(f"--data-path {self.dataset.path}: the checkpoint's loader state is of DP rank "
                             f"{found['rank']} of {found['world_size']} after {found['micro_batch_steps']} "
                             f"micro-batch steps; this rank resumes as rank {self.rank} of {self.size} after "
                             f"{self._step}")
        self.loader.restore_state_rank(energon_state(saved["state"]))

    def __iter__(self):
        return self

    def __next__(self) -> MicroBatch:
        if (self._step + 1) * self._per_step > self.config.num_samples:
            raise StopIteration
        start = self._step * self._per_step + self.rank * self.config.micro_batch_size
        examples = []
        batch_samples = next(self._batches)
        for slot, encoded in enumerate(batch_samples):
            position = start + slot
            if encoded.problem is not None:
                raise ManifestError(encoded.problem)
            # one event per bad sample: Energon's draws for one position may meet the same bad sample twice
            for message in dict.fromkeys(encoded.skipped):
                self._report(DataEvent(position, True, message, encoded.where))
            if encoded.note is not None:
                self._report(DataEvent(position, False, encoded.note))
            examples.append(dataclasses.replace(encoded.example, sample_index=position))
        self._step += 1
        state = plain_state(self.loader.save_state_rank())
        with self._states_lock:
            self._states.append((self._step, state))
            self._wheres.update((start + slot, encoded.where) for slot, encoded in enumerate(batch_samples))
        batch = collate(examples, self._spec, pad_to=self._pad_to)
        return batch.pin_memory() if self.pin_memory else batch

    def take_events(self, before: int) -> List[DataEvent]:
        """As :meth:`DataEvents.take_events`; the loader states of steps before ``before`` are dropped too."""
        with self._states_lock:
            while len(self._states) > 1 and self._states[1][0] * self._per_step <= before:
                self._states.popleft()
            # the samples of the last trained batch stay nameable (describe_samples) until the next one
            self._wheres = {p: w for p, w in self._wheres.items() if p >= self._trained}
            self._trained = before
        return super().take_events(before)

    def describe_samples(self, positions: range, replaced: Dict[int, str], shown: int = 8) -> str:
        """Where this DP rank's samples among ``positions`` come from (``<dataset>/<shard>:<key>``), the first
        ``shown`` of them; the other ranks' samples are known to them only (Energon's order is each rank's
        loader state, not a function of the position)."""
        with self._states_lock:
            wheres = [replaced.get(p) or self._wheres[p] for p in positions if p in self._wheres]
        more = f" (and {len(wheres) - shown} more)" if len(wheres) > shown else ""
        return ", ".join(wheres[:shown]) + more + f" (DP rank {self.rank}'s; each rank names its own)"

    def describe_examples(self, sample_ids: Sequence[int], shown: int = 8) -> str:
        """Where the examples of ``sample_ids`` (their sample positions) come from, as :meth:`describe_samples`;
        a position this DP rank did not read by its number."""
        with self._states_lock:
            wheres = [self._wheres.get(p, f"sample {p}") for p in sample_ids[:shown]]
        more = f" (and {len(sample_ids) - shown} more)" if len(sample_ids) > shown else ""
        return ", ".join(wheres) + more

    def loader_state(self, consumed_samples: int) -> dict:
        """The loader's state after ``consumed_samples`` (the samples trained so far), as plain types, for the
        checkpoint; :meth:`__init__` restores it."""
        step = consumed_samples // self._per_step
        with self._states_lock:
            state = next((s for k, s in self._states if k == step), None)
            held = [k for k, _ in self._states]
        if state is None or consumed_samples % self._per_step:
            raise ValueError(f"no loader state after {consumed_samples} samples ({consumed_samples / self._per_step:g} "
                             f"micro-batch steps); held: steps {held[0]}..{held[-1]}")
        return {"rank": self.rank, "world_size": self.size, "micro_batch_steps": step, "state": state}

    def epoch_note(self) -> Optional[str]:
        """What the user should know when the run is longer than the dataset; None if it is not."""
        if self.config.num_samples <= len(self.dataset):
            return None
        return (f" > the Energon dataset holds {len(self.dataset)} samples, the run trains on "
                f"{self.config.num_samples}: each DP rank repeats its own part of the shards, reshuffled by Energon "
                f"(--seed {self.config.seed})")


# -- loader state as plain types ----------------------------------------------------------------------------

def plain_state(state) -> Any:
    """An Energon loader state as dicts, lists, ints, floats, strings, bytes and None only (it passes a
    ``torch.load(weights_only=True)``): every dict, tuple, array and Energon state object is tagged with
    its kind; :func:`energon_state` rebuilds it."""
    if state is None or isinstance(state, (bool, int, float, str, bytes)):
        return state
    if isinstance(state, list):
        return [plain_state(v) for v in state]
    if isinstance(state, tuple):
        return {"tuple": [plain_state(v) for v in state]}
    if isinstance(state, FlexState):
        return {"flexstate": [[plain_state(k), plain_state(v)] for k, v in state.items()]}
    if isinstance(state, dict):
        return {"dict": [[plain_state(k), plain_state(v)] for k, v in state.items()]}
    if isinstance(state, torch.Tensor):
        array = state.detach().cpu().contiguous()
        return {"tensor": array.reshape(-1).view(torch.uint8).numpy().tobytes(),
                "dtype": str(array.dtype).removeprefix("torch."), "shape": list(array.shape)}
    if isinstance(state, (np.ndarray, np.generic)):
        array = np.ascontiguousarray(state)
        return {"ndarray": array.tobytes(), "dtype": array.dtype.str, "shape": list(array.shape),
                "scalar": isinstance(state, np.generic)}
    if dataclasses.is_dataclass(state) and type(state).__module__.startswith("megatron.energon."):
        return {"energon": f"{type(state).__module__}:{type(state).__qualname__}",
                "fields": {f.name: plain_state(getattr(state, f.name)) for f in dataclasses.fields(state)}}
    raise TypeError(f"cannot save a {type(state).__module__}.{type(state).__qualname__} of the Energon loader's state")


def energon_state(plain) -> Any:
    """The Energon loader state :func:`plain_state` wrote; rebuilds Energon's own state classes only."""
    if plain is None or isinstance(plain, (bool, int, float, str, bytes)):
        return plain
    if isinstance(plain, list):
        return [energon_state(v) for v in plain]
    if not isinstance(plain, dict):
        raise ValueError(f"not a saved Energon loader state: {type(plain).__name__}")
    if "tuple" in plain:
        return tuple(energon_state(v) for v in plain["tuple"])
    if "flexstate" in plain:
        return FlexState((energon_state(k), energon_state(v)) for k, v in plain["flexstate"])
    if "dict" in plain:
        return {energon_state(k): energon_state(v) for k, v in plain["dict"]}
    if "tensor" in plain:
        raw = torch.frombuffer(bytearray(plain["tensor"]), dtype=torch.uint8)
        return raw.view(getattr(torch, plain["dtype"])).reshape(plain["shape"]).clone()
    if "ndarray" in plain:
        array = np.frombuffer(plain["ndarray"], dtype=np.dtype(plain["dtype"])).reshape(plain["shape"]).copy()
        return array[()] if plain["scalar"] else array
    if "energon" in plain:
        module, _, name = plain["energon"].partition(":")
        if not module.startswith("megatron.energon."):
            raise ValueError(f"not an Energon state class: {plain['energon']}")
        cls = importlib.import_module(module)
        for part in name.split("."):
            cls = getattr(cls, part)
        if not dataclasses.is_dataclass(cls):
            raise ValueError(f"not an Energon state class: {plain['energon']}")
        return cls(**{key: energon_state(value) for key, value in plain["fields"].items()})
    raise ValueError(f"not a saved Energon loader state: a dict of {sorted(plain)}")


def energon_identity(path) -> dict:
    """What identifies an Energon dataset's content in checkpoints: the sha256 of its ``.nv-meta`` files
    (dataset and split config, shard counts, sample loader) and every shard's name and size."""
    from megatron.energon.epathlib import EPath
    from megatron.energon.flavors.webdataset.metadata import get_dataset_info

    root, digest = Path(path), hashlib.sha256()
    meta = root / ".nv-meta"
    for file in sorted(p for p in meta.iterdir() if p.is_file() and p.name not in ("index.sqlite", "index.uuid")):
        digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    shards = sorted(get_dataset_info(EPath(root))["shard_counts"])
    for shard in shards:
        digest.update(f"{shard}\0{(root / shard).stat().st_size}\0".encode())
    return {"energon_shards": len(shards), "sha256": digest.hexdigest()}
