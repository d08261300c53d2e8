"""The phases of a model as data, and the items each phase balances: one builder for training and benchmarks.

A model's phases (:class:`ModelPhases`) are its encoder phases, any number of them (:class:`EncoderPhase`:
one item per independent encoder input, such as an image tile, a video frame or an audio window), and one
backbone phase (:class:`BackbonePhase`: one item per example, its sequence). A phase is a record: its
name (the model's configuration chooses it; it names the phase in plans, flags and logs), how its items
are counted from an example (the batch gives each example's item count per encoder phase:
:attr:`StepSizes.items`), its cost model (:class:`~megatron_orch.balance.cost.CostModel`), the bytes an
item moves in and out and, for an encoder, the output rows one item gives the backbone.

Per-example sizes (:class:`StepSizes`: what the trainer gathers over the DP group, or what a model config
maps a trace to) become the items of every phase (:func:`phase_items`). An item's cost and memory come
from its phase's cost model, its ``nbytes`` is what moves if it leaves its home rank (the raw input of an
encoder item; an example's token ids, labels and loss mask), and an encoder item's ``output_nbytes`` the
embeddings it sends on to the backbone rank of its example.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Dict, Mapping, Tuple

import numpy as np

from megatron_orch.balance import _plan_kernels
from megatron_orch.balance.cost import CostModel

_NAME = re.compile(r"[a-z][a-z0-9_]*")


def _check_name(name, what: str) -> None:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{what} name {name!r} must be a lowercase identifier (letters, digits, '_'): it "
                         f"names the phase in plans, the phases to balance, log lines and TensorBoard scalars")


def _check_counts(owner: str, **values) -> None:
    for field, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{owner}.{field} must be an int >= 0, got {value!r}")


@dataclass(frozen=True)
class EncoderPhase:
    """An encoder phase: every item runs ``item_tokens`` tokens through the encoder and gives the backbone
    ``output_rows`` embedding rows (its placeholders in the example's sequence)."""

    name: str
    cost: CostModel
    item_tokens: int  # the sequence length one item runs (what the cost model is asked about)
    input_bytes: int  # raw input of one item, as it moves to its encoder rank
    output_rows: int  # embedding rows one item sends to the backbone rank of its example
    output_row_bytes: int  # bytes of one such row as it moves

    def __post_init__(self):
        _check_name(self.name, "encoder phase")
        _check_counts(f"encoder phase {self.name}", item_tokens=self.item_tokens, input_bytes=self.input_bytes,
                      output_rows=self.output_rows, output_row_bytes=self.output_row_bytes)
        if self.output_rows < 1:
            raise ValueError(f"encoder phase {self.name}: output_rows must be >= 1 (every item fills placeholders)")


@dataclass(frozen=True)
class BackbonePhase:
    """The backbone phase: one item per example, its whole sequence of ``num_tokens`` tokens."""

    name: str
    cost: CostModel
    token_bytes: int  # bytes one token moves with its example (token id, label, loss mask)

    def __post_init__(self):
        _check_name(self.name, "backbone phase")
        _check_counts(f"backbone phase {self.name}", token_bytes=self.token_bytes)


@dataclass(frozen=True)
class ModelPhases:
    """Every phase of a model: its encoder phases in the order they run, then its backbone phase."""

    encoders: Tuple[EncoderPhase, ...]
    backbone: BackbonePhase

    def __post_init__(self):
        object.__setattr__(self, "encoders", tuple(self.encoders))
        for phase in self.encoders:
            if not isinstance(phase, EncoderPhase):
                raise TypeError(f"ModelPhases.encoders holds {type(phase).__name__}, expected EncoderPhase")
        if not isinstance(self.backbone, BackbonePhase):
            raise TypeError(f"ModelPhases.backbone is {type(self.backbone).__name__}, expected BackbonePhase")
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"phase names must be distinct, got {list(self.names)}")

    @property
    def names(self) -> Tuple[str, ...]:
        """Every phase's name: the encoders', then the backbone's."""
        return tuple(p.name for p in self.encoders) + (self.backbone.name,)

    @property
    def encoder_names(self) -> Tuple[str, ...]:
        return tuple(p.name for p in self.encoders)

    def encoder(self, name: str) -> EncoderPhase:
        for phase in self.encoders:
            if phase.name == name:
                return phase
        raise KeyError(f"no encoder phase {name!r}; the model's encoder phases are {list(self.encoder_names)}")


@dataclass(frozen=True, eq=False)
class StepSizes:
    """Per-example sizes of a global batch, examples in loader order (rank 0's first): ``items[phase]`` is
    each example's item count of an encoder phase, ``num_tokens`` its backbone sequence length."""

    counts: np.ndarray  # examples loaded by each DP rank
    items: Mapping[str, np.ndarray]
    num_tokens: np.ndarray

    def __post_init__(self):
        counts = np.asarray(self.counts)
        if counts.ndim != 1 or counts.size == 0 or counts.min() < 0:
            raise ValueError(f"StepSizes.counts must be a non-empty 1-D array of counts >= 0, "
                             f"got {counts.tolist()[:16]}")
        n = int(counts.sum())
        object.__setattr__(self, "items", dict(self.items))
        for name, values in [*((f"items[{p!r}]", v) for p, v in self.items.items()), ("num_tokens", self.num_tokens)]:
            values = np.asarray(values)
            if values.shape != (n,):
                raise ValueError(f"StepSizes.{name} has shape {values.shape}, expected ({n},) "
                                 f"for counts {counts.tolist()[:16]}")
            if n and values.min() < 0:
                raise ValueError(f"StepSizes.{name} has a negative entry at example {int(values.argmin())}")
        if n and np.min(self.num_tokens) < 1:
            raise ValueError(f"example {int(np.argmin(self.num_tokens))} has no tokens")

    @property
    def num_examples(self) -> int:
        return int(np.asarray(self.num_tokens).size)

    @property
    def home(self) -> np.ndarray:
        """DP rank that loaded each example."""
        return np.repeat(np.arange(np.asarray(self.counts).size, dtype=np.int64), self.counts)


@dataclass(frozen=True, eq=False)
class PhaseItems:
    """The items of one phase of a global batch, as parallel arrays (item ``i`` at index ``i``). An encoder
    phase's items all run the same tokens: their tokens, cost, memory and bytes are read-only views of one value
    (stride 0), not arrays written item by item (~800k items of an image phase at DP 10240: ten such arrays a step
    wrote and read back took ~10 ms of a plan); so are the backbone's output bytes (0)."""

    name: str
    example: np.ndarray  # parent example (index into the global batch)
    home: np.ndarray  # rank that loaded the parent example
    tokens: np.ndarray  # sequence length the phase's transformer runs for this item
    cost: np.ndarray  # the phase's cost model: training FLOPs, or measured seconds
    memory: np.ndarray  # activation bytes
    nbytes: np.ndarray  # bytes to move if the item leaves its home rank (int64)
    output_nbytes: np.ndarray  # bytes of embeddings sent on to the backbone (int64; 0 for the backbone)

    def __len__(self) -> int:
        return int(self.example.size)


def check_sequence_length(num_tokens: int, seq_length: int, where: str) -> None:
    """Refuse an example of more than ``seq_length`` backbone tokens, as training does (``BatchSpec.check``,
    on every example it reads); the benchmarks and the simulator refuse a drawn example the same way."""
    if num_tokens > seq_length:
        raise ValueError(f"{where}: {num_tokens} tokens exceed seq_length {seq_length}")


def check_sequence_lengths(num_tokens, seq_length: int, where: Callable[[int], str]) -> None:
    """:func:`check_sequence_length` of every example of a batch (``where(i)`` names example i): the first
    one too long is refused."""
    num_tokens = np.asarray(num_tokens)
    over = np.flatnonzero(num_tokens > seq_length)
    if over.size:
        i = int(over[0])
        check_sequence_length(int(num_tokens[i]), seq_length, where(i))


def _modeled(phase, tokens: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(cost, memory) of items of ``tokens`` tokens under the phase's cost model, checked."""
    out = []
    for what, values in (("cost", phase.cost.item_cost(tokens)), ("memory", phase.cost.item_memory(tokens))):
        values = np.broadcast_to(np.asarray(values, dtype=np.float64), tokens.shape)
        if values.size and not (np.all(np.isfinite(values)) and values.min() >= 0):
            raise ValueError(f"phase {phase.name}: the cost model gave an item {what} that is negative or not "
                             f"finite ({values.min()})")
        out.append(np.array(values))
    return out[0], out[1]


def _every_item(value, dtype, num_items: int) -> np.ndarray:
    """``value`` for each of ``num_items`` items: a read-only view of the one value (stride 0), no array written."""
    return np.broadcast_to(np.asarray(value, dtype=dtype), (num_items,))


def phase_items(sizes: StepSizes, phases: ModelPhases) -> Dict[str, PhaseItems]:
    """Items of every phase of a global batch (encoder phases in order, then the backbone); a batch without
    a phase's items gives that phase 0 items. An encoder phase's items are listed example by example."""
    unknown = sorted(set(sizes.items) - set(phases.encoder_names))
    if unknown:
        raise ValueError(f"the batch has items of {unknown}, which are not encoder phases of the model "
                         f"({list(phases.encoder_names)})")
    home = sizes.home
    n = sizes.num_examples
    out = {}
    for phase in phases.encoders:
        counts = np.ascontiguousarray(sizes.items.get(phase.name, np.zeros(n)), dtype=np.int64)
        example, item_home = _plan_kernels.repeat_parents(counts, home)
        # every item of the phase runs the same tokens: one item's figures, the same value for every item
        one_cost, one_memory = _modeled(phase, np.array([phase.item_tokens], dtype=np.int64))
        out[phase.name] = PhaseItems(phase.name, example, item_home,
                                     *(_every_item(value, dtype, example.size) for value, dtype in (
                                         (phase.item_tokens, np.int64), (one_cost[0], np.float64),
                                         (one_memory[0], np.float64), (phase.input_bytes, np.int64),
                                         (phase.output_rows * phase.output_row_bytes, np.int64))))
    backbone = phases.backbone
    tokens = np.asarray(sizes.num_tokens, dtype=np.int64)
    cost, memory = _modeled(backbone, tokens)
    out[backbone.name] = PhaseItems(backbone.name, np.arange(n, dtype=np.int64), home, tokens, cost, memory,
                                    tokens * backbone.token_bytes, _every_item(0, np.int64, n))
    return out

