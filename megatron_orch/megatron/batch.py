"""The example and micro-batch format shared by the data pipeline, the model and the orchestrator.

An :class:`Example` is one training sample on the CPU: the backbone's token ids with placeholder ids
where encoder outputs go, next-token labels, a loss mask, and the raw items of every encoder phase
(``items[phase]``: one row per item, e.g. an image tile's patch rows or an audio window's mel frames).
Every item of a phase contributes exactly that phase's ``output_rows`` placeholders (its
:class:`EncoderInput`'s ``placeholder_id``), in item order, so the model can splice encoder outputs in
without any other metadata. :class:`BatchSpec` says, for one model, the phases, each phase's item shape
and placeholder id, the pad id and the longest sequence, and checks examples against them.

A :class:`MicroBatch` is what :func:`collate` (right-padded rows) or :func:`collate_packed` (all
examples concatenated in one row, ``cu_seqlens`` marking the boundaries; attention is causal within each
example, through a variable-length kernel given :class:`PackedRowParams`, never a dense mask) builds from
examples; :meth:`MicroBatch.examples` splits it back, which is how single
examples move between data-parallel ranks. :class:`ExampleSizes` is the cheap per-example record the
balancer plans with; datasets give it without materialising tensors.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Sequence, Tuple

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_orch.balance.workload import ModelPhases, check_sequence_length


@dataclass(frozen=True)
class EncoderInput:
    """How the items of one encoder phase sit in a batch: the shape of one raw item, and the token id of
    the placeholders (the phase's ``output_rows`` per item) that its encoder outputs replace."""

    phase: str
    item_shape: Tuple[int, ...]
    placeholder_id: int

    def __post_init__(self):
        object.__setattr__(self, "item_shape", tuple(self.item_shape))
        if not self.item_shape or any(isinstance(d, bool) or not isinstance(d, int) or d < 1
                                      for d in self.item_shape):
            raise ValueError(f"phase {self.phase}: item_shape must be positive ints, got {self.item_shape}")


@dataclass(frozen=True)
class BatchSpec:
    """What every batch of a model provides (the batch half of the contract): the model's ``phases``; for
    each encoder phase, in the same order, its :class:`EncoderInput`; the pad token id of padded rows; the
    longest example (backbone tokens). Packing is the model's to opt into: ``takes_packed_rows`` says its
    ``forward`` takes packed rows (:func:`collate_packed`: it passes :meth:`MicroBatch.packed_seq_params` to its
    attention, so examples sharing a row do not attend to each other); only then does ``--orch-microbatching
    auto`` pack. ``cannot_pack``: why it does not, where it says so (an adapter whose answer depends on the
    installed model), for the log and for the refusal of ``--orch-microbatching packed``."""

    phases: ModelPhases
    inputs: Tuple[EncoderInput, ...]
    pad_token_id: int
    seq_length: int
    cannot_pack: Optional[str] = None
    takes_packed_rows: bool = False  # after cannot_pack: a call that gives it by position keeps its meaning

    def __post_init__(self):
        if self.takes_packed_rows and self.cannot_pack is not None:
            raise ValueError(f"BatchSpec: takes_packed_rows=True and cannot_pack={self.cannot_pack!r} contradict "
                             "each other")
        object.__setattr__(self, "inputs", tuple(self.inputs))
        names = tuple(i.phase for i in self.inputs)
        if names != self.phases.encoder_names:
            raise ValueError(f"BatchSpec inputs are for phases {list(names)}, the model's encoder phases are "
                             f"{list(self.phases.encoder_names)} (one input each, in that order)")
        ids = [i.placeholder_id for i in self.inputs]
        if len(set(ids + [self.pad_token_id])) != len(ids) + 1:
            raise ValueError(f"placeholder ids {dict(zip(names, ids))} and pad id {self.pad_token_id} must be distinct")
        if self.seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {self.seq_length}")

    def why_not_packed(self) -> Optional[str]:
        """Why the model's backbone gets no packed rows (None: it takes them)."""
        if self.takes_packed_rows:
            return None
        return self.cannot_pack or ("its BatchSpec leaves takes_packed_rows=False (a forward that takes packed rows "
                                    "passes batch.packed_seq_params() to its attention, and says so with "
                                    "BatchSpec(takes_packed_rows=True))")

    def input(self, phase: str) -> EncoderInput:
        for encoder_input in self.inputs:
            if encoder_input.phase == phase:
                return encoder_input
        raise KeyError(f"no encoder phase {phase!r}; the model's are {list(self.phases.encoder_names)}")

    def rows_per_item(self, phase: str) -> int:
        """Placeholders (encoder output rows) one item of ``phase`` occupies."""
        return self.phases.encoder(phase).output_rows

    def no_items(self, phase: str) -> torch.Tensor:
        """An empty items tensor of ``phase``."""
        return torch.zeros((0, *self.input(phase).item_shape))

    def check(self, example: "Example") -> None:
        """Raise ValueError (naming the sample) unless ``example`` fits this spec."""
        where = f"example {example.sample_index}"
        unknown = sorted(set(example.items) - set(self.phases.encoder_names))
        if unknown:
            raise ValueError(f"{where}: items of {unknown}, which are not encoder phases of the model "
                             f"({list(self.phases.encoder_names)})")
        check_sequence_length(example.num_tokens, self.seq_length, where)
        for encoder_input in self.inputs:
            phase = encoder_input.phase
            items = example.items.get(phase)
            if items is not None and tuple(items.shape[1:]) != encoder_input.item_shape:
                raise ValueError(f"{where}: {phase} items have shape {tuple(items.shape[1:])}, expected "
                                 f"{encoder_input.item_shape}")
            found = int((example.tokens == encoder_input.placeholder_id).sum())
            count, per_item = example.num_items(phase), self.rows_per_item(phase)
            if found != count * per_item:
                raise ValueError(f"{where}: {found} {phase} placeholders, expected {count} items x "
                                 f"{per_item} tokens = {count * per_item}")


@dataclass(frozen=True)
class ExampleSizes:
    """What the balancer needs to know of an example, without its tensors."""

    sample_index: int
    items: Mapping[str, int]  # items of each encoder phase that has any
    num_tokens: int        # backbone sequence length S (text + placeholders)
    num_loss_tokens: int   # tokens whose label counts in the loss

    def num_items(self, phase: str) -> int:
        return self.items.get(phase, 0)


@dataclass(frozen=True, eq=False)
class Example:
    """One sample: ``tokens``/``labels``/``loss_mask`` [S] and ``items[phase]`` [n, *item_shape] (a phase
    left out has no items)."""

    sample_index: int
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    items: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        where = f"example {self.sample_index}"
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.long or self.tokens.numel() == 0:
            raise ValueError(f"{where}: tokens must be a non-empty 1-D int64 tensor, "
                             f"got {self.tokens.dtype} {tuple(self.tokens.shape)}")
        if self.labels.shape != self.tokens.shape or self.labels.dtype != torch.long:
            raise ValueError(f"{where}: labels must be int64 of shape {tuple(self.tokens.shape)}, "
                             f"got {self.labels.dtype} {tuple(self.labels.shape)}")
        if self.loss_mask.shape != self.tokens.shape or not self.loss_mask.is_floating_point():
            raise ValueError(f"{where}: loss_mask must be float of shape {tuple(self.tokens.shape)}, "
                             f"got {self.loss_mask.dtype} {tuple(self.loss_mask.shape)}")
        object.__setattr__(self, "items", dict(self.items))
        for name, tensor in self.items.items():
            if tensor.dim() < 2 or not tensor.is_floating_point():
                raise ValueError(f"{where}: {name} items must be a float tensor [n, *item_shape], "
                                 f"got {tensor.dtype} {tuple(tensor.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def num_items(self, phase: str) -> int:
        items = self.items.get(phase)
        return 0 if items is None else items.shape[0]

    def sizes(self) -> ExampleSizes:
        return ExampleSizes(self.sample_index, {name: t.shape[0] for name, t in self.items.items() if t.shape[0]},
                            self.num_tokens, int(self.loss_mask.count_nonzero()))


@dataclass
class PackedRowParams(PackedSeqParams):
    """Megatron-Core's ``PackedSeqParams`` (THD) of a packed row, with ``host_cu_seqlens``: the sequence
    bounds as host ints, for a kernel launched sequence by sequence or sliced to the real tokens
    (reading ``cu_seqlens_q`` from the device would stall the host once per layer). Megatron's own code
    sees the base class's fields only."""

    host_cu_seqlens: Tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """Examples batched for one forward pass.

    Padded layout (``cu_seqlens is None``): row ``i`` holds example ``i`` right-padded to the row length
    (padding: the spec's pad id, loss_mask 0); plain causal attention suffices since padding comes after
    every real token. Packed layout: one row holding all examples back to back; example ``i`` spans
    ``cu_seqlens[i]:cu_seqlens[i+1]``, position ids restart at each example, and attention is causal
    within each example (:meth:`packed_seq_params`); a tail after ``cu_seqlens[-1]`` is padding.
    ``cu_seqlens`` travels with the batch (the kernels read it on the device); ``host_cu_seqlens`` holds
    the same bounds as ints, so launching a kernel or splitting the batch never reads the device.

    ``items[phase]`` holds every example's items of an encoder phase in example order;
    ``item_counts[phase][i]`` says how many belong to example ``i``; ``placeholders[phase]`` is ``[2, n]``:
    the (row, column) of each of that phase's placeholders, row by row, i.e. in the order its encoder
    outputs fill them. Collate finds them on the host, so the model inserts encoder outputs without
    searching the tokens on its device (a search whose result size the host must wait for).
    """

    tokens: torch.Tensor          # [rows, T] int64
    labels: torch.Tensor          # [rows, T] int64
    loss_mask: torch.Tensor       # [rows, T] float32
    position_ids: torch.Tensor    # [rows, T] int64
    seq_lengths: torch.Tensor     # [n] int64, unpadded length of each example
    items: Dict[str, torch.Tensor]         # phase -> [sum n_phase, *item_shape]
    item_counts: Dict[str, torch.Tensor]   # phase -> [n] int64
    sample_ids: torch.Tensor      # [n] int64, global sample index of each example
    placeholders: Dict[str, torch.Tensor]  # phase -> [2, placeholders] int64 (row, column)
    cu_seqlens: Optional[torch.Tensor] = None  # [n + 1] int32 in the packed layout
    host_cu_seqlens: Tuple[int, ...] = ()      # the same n + 1 bounds as ints (packed layout)

    @property
    def num_examples(self) -> int:
        return self.sample_ids.numel()

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def _map(self, fn) -> "MicroBatch":
        """The same batch with ``fn`` applied to every tensor."""
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, dict):
                changes[f.name] = {name: fn(t) for name, t in value.items()}
            elif isinstance(value, torch.Tensor):
                changes[f.name] = fn(value)
        return dataclasses.replace(self, **changes)

    def pin_memory(self) -> "MicroBatch":
        """The same batch in pinned host memory, so its copies to a GPU do not block the host."""
        return self._map(torch.Tensor.pin_memory)

    def to(self, device: torch.device) -> "MicroBatch":
        """The same batch on ``device`` (copies that do not block the host from pinned memory)."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def _spans(self) -> list[tuple[int, int, int]]:
        """(row, start, end) of each example's tokens."""
        if self.is_packed:
            bounds = self.host_cu_seqlens
            return [(0, bounds[i], bounds[i + 1]) for i in range(self.num_examples)]
        return [(i, 0, length) for i, length in enumerate(self.seq_lengths.tolist())]

    def examples(self) -> list[Example]:
        """Split back into the examples it was built from (tensors are views where possible)."""
        split = {name: torch.split(tensor, self.item_counts[name].tolist()) for name, tensor in self.items.items()}
        return [Example(sample_index=int(self.sample_ids[i]),
                        tokens=self.tokens[row, start:end], labels=self.labels[row, start:end],
                        loss_mask=self.loss_mask[row, start:end],
                        items={name: parts[i] for name, parts in split.items()})
                for i, (row, start, end) in enumerate(self._spans())]

    def sizes(self) -> list[ExampleSizes]:
        loss_tokens = [int(self.loss_mask[row, start:end].count_nonzero()) for row, start, end in self._spans()]
        counts = {name: c.tolist() for name, c in self.item_counts.items()}
        return [ExampleSizes(int(s), {name: c[i] for name, c in counts.items() if c[i]}, int(n), lt)
                for i, (s, n, lt) in enumerate(zip(self.sample_ids.tolist(), self.seq_lengths.tolist(), loss_tokens))]

    def packed_seq_params(self, tail_as_sequence: bool = False) -> Optional[PackedRowParams]:
        """Megatron's THD parameters of the packed row (None when padded): one sequence per example, each
        attending causally to its own tokens only. The padding tail is in no sequence, or, with
        ``tail_as_sequence`` (for Transformer Engine's THD kernels, whose output for a token outside every
        sequence is not defined), one more sequence that attends only to itself (its loss mask is 0); its
        bound is appended on the device, so no host-to-device copy."""
        if not self.is_packed:
            return None
        bounds, cu_seqlens, length = self.host_cu_seqlens, self.cu_seqlens, self.tokens.shape[1]
        if tail_as_sequence and bounds[-1] < length:
            bounds, cu_seqlens = (*bounds, length), torch.nn.functional.pad(cu_seqlens, (0, 1), value=length)
        longest = max(end - start for start, end in zip(bounds, bounds[1:]))
        return PackedRowParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest, host_cu_seqlens=bounds)


def _stack_items(examples: Sequence[Example], spec: BatchSpec) -> tuple[dict, dict]:
    items, counts = {}, {}
    for encoder_input in spec.inputs:
        phase = encoder_input.phase
        tensors = [example.items.get(phase, spec.no_items(phase)) for example in examples]
        for example, tensor in zip(examples, tensors):
            if tuple(tensor.shape[1:]) != encoder_input.item_shape:
                raise ValueError(f"example {example.sample_index}: {phase} items have shape "
                                 f"{tuple(tensor.shape[1:])}, expected {encoder_input.item_shape}")
        items[phase] = torch.cat(tensors)
        counts[phase] = torch.tensor([tensor.shape[0] for tensor in tensors], dtype=torch.long)
    return items, counts


def placeholder_positions(tokens: torch.Tensor, spec: BatchSpec) -> Dict[str, torch.Tensor]:
    """(row, column) of every encoder phase's placeholders in ``tokens`` [rows, T] (on the host), row-major."""
    return {i.phase: torch.stack(torch.nonzero(tokens == i.placeholder_id, as_tuple=True)) for i in spec.inputs}


def _row_length(needed: int, pad_to: Optional[int], pad_to_multiple_of: int) -> int:
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if pad_to is None:
        return -(-needed // pad_to_multiple_of) * pad_to_multiple_of
    if pad_to < needed:
        raise ValueError(f"pad_to={pad_to} is shorter than the {needed} tokens to place in a row")
    return pad_to


def collate(examples: Sequence[Example], spec: BatchSpec, pad_to: Optional[int] = None,
            pad_to_multiple_of: int = 1) -> MicroBatch:
    """Batch examples as right-padded rows [n, T] (padding: ``spec.pad_token_id``).

    T is ``pad_to`` if given (a fixed sequence length, as pipeline parallelism needs), else the longest
    example rounded up to ``pad_to_multiple_of``.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    lengths = torch.tensor([example.num_tokens for example in examples], dtype=torch.long)
    length = _row_length(int(lengths.max()), pad_to, pad_to_multiple_of)
    rows = len(examples)
    tokens = torch.full((rows, length), spec.pad_token_id, dtype=torch.long)
    labels = torch.full((rows, length), spec.pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros((rows, length), dtype=torch.float32)
    for row, example in enumerate(examples):
        tokens[row, :example.num_tokens] = example.tokens
        labels[row, :example.num_tokens] = example.labels
        loss_mask[row, :example.num_tokens] = example.loss_mask
    items, counts = _stack_items(examples, spec)
    return MicroBatch(tokens=tokens, labels=labels, loss_mask=loss_mask,
                      position_ids=torch.arange(length).expand(rows, length).contiguous(),
                      seq_lengths=lengths, items=items, item_counts=counts,
                      sample_ids=torch.tensor([e.sample_index for e in examples], dtype=torch.long),
                      placeholders=placeholder_positions(tokens, spec))


def collate_packed(examples: Sequence[Example], spec: BatchSpec, pad_to: Optional[int] = None,
                   pad_to_multiple_of: int = 1) -> MicroBatch:
    """Batch examples back to back in one row [1, T] with ``cu_seqlens`` (causal attention per example).

    T is ``pad_to`` if given (e.g. a token budget), else the total length rounded up to
    ``pad_to_multiple_of``; the tail is padding (``spec.pad_token_id``) with loss_mask 0.
    """
    if not examples:
        raise ValueError("collate_packed needs at least one example")
    lengths = torch.tensor([example.num_tokens for example in examples], dtype=torch.long)
    total = int(lengths.sum())
    length = _row_length(total, pad_to, pad_to_multiple_of)
    pad = torch.full((length - total,), spec.pad_token_id, dtype=torch.long)
    tokens = torch.cat([e.tokens for e in examples] + [pad])
    labels = torch.cat([e.labels for e in examples] + [pad])
    loss_mask = torch.cat([e.loss_mask.to(torch.float32) for e in examples] + [torch.zeros(pad.numel())])
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()] + [torch.arange(pad.numel())])
    bounds = (0, *torch.cumsum(lengths, 0).tolist())
    items, counts = _stack_items(examples, spec)
    return MicroBatch(tokens=tokens[None], labels=labels[None], loss_mask=loss_mask[None],
                      position_ids=positions[None], seq_lengths=lengths, items=items, item_counts=counts,
                      sample_ids=torch.tensor([e.sample_index for e in examples], dtype=torch.long),
                      placeholders=placeholder_positions(tokens[None], spec),
                      cu_seqlens=torch.tensor(bounds, dtype=torch.int32), host_cu_seqlens=bounds)
