"""The example and micro-batch format shared by the data pipeline, the model and the orchestrator.

An :class:`Example` is one training sample on the CPU: the backbone's token ids with placeholder ids
where projected encoder embeddings go, next-token labels, a loss mask, and the raw encoder inputs
(image tiles / video frames as patch rows, fixed-length audio windows as log-mel frames). Every vision
item contributes exactly ``vision_llm_tokens_per_item`` consecutive :data:`IMAGE_TOKEN_ID`
placeholders and every audio window ``audio_llm_tokens_per_item`` :data:`AUDIO_TOKEN_ID` placeholders,
in item order, so the model can splice encoder outputs in without any other metadata.

A :class:`MicroBatch` is what :func:`collate` (right-padded rows) or :func:`collate_packed` (all
examples concatenated in one row, ``cu_seqlens`` marking the boundaries for block-diagonal causal
attention) builds from examples; :meth:`MicroBatch.examples` splits it back, which is how single
examples move between data-parallel ranks. :class:`ExampleSizes` is the cheap per-example record the
balancer plans with; datasets give it without materialising tensors.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

# Token ids. Text uses the 256 byte values; the special ids sit above them, the two placeholders at the
# top, so no tokenizer ever produces a placeholder as text. A model's vocabulary must hold
# MIN_VOCAB_SIZE ids (ids at or above it are never produced by this data pipeline).
BYTE_VOCAB_SIZE = 256
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
AUDIO_TOKEN_ID = 259
IMAGE_TOKEN_ID = 260
MIN_VOCAB_SIZE = 261


@dataclass(frozen=True)
class ExampleShape:
    """The fixed per-item tensor shapes and placeholder counts a model expects of every example."""

    seq_length: int                    # longest allowed example (backbone tokens)
    vision_patches_per_item: int       # patch rows of one image tile or video frame
    vision_patch_dim: int              # channels * patch_size**2
    vision_llm_tokens_per_item: int    # placeholders one vision item occupies in the backbone sequence
    audio_frames_per_window: int       # log-mel frames of one fixed-length audio window
    audio_mel_bins: int
    audio_llm_tokens_per_item: int     # placeholders one audio window occupies

    def __post_init__(self):
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ExampleShape.{name} must be a positive int, got {value!r}")

    def check(self, example: "Example") -> None:
        """Raise ValueError (naming the sample) unless ``example`` has this shape."""
        where = f"example {example.sample_index}"
        if example.vision.shape[1:] != (self.vision_patches_per_item, self.vision_patch_dim):
            raise ValueError(f"{where}: vision items have shape {tuple(example.vision.shape[1:])}, expected "
                             f"({self.vision_patches_per_item}, {self.vision_patch_dim})")
        if example.audio.shape[1:] != (self.audio_frames_per_window, self.audio_mel_bins):
            raise ValueError(f"{where}: audio windows have shape {tuple(example.audio.shape[1:])}, expected "
                             f"({self.audio_frames_per_window}, {self.audio_mel_bins})")
        if example.num_tokens > self.seq_length:
            raise ValueError(f"{where}: {example.num_tokens} tokens exceed seq_length {self.seq_length}")
        for name, token_id, items, per_item in (
                ("image", IMAGE_TOKEN_ID, example.num_vision_items, self.vision_llm_tokens_per_item),
                ("audio", AUDIO_TOKEN_ID, example.num_audio_items, self.audio_llm_tokens_per_item)):
            found = int((example.tokens == token_id).sum())
            if found != items * per_item:
                raise ValueError(f"{where}: {found} {name} placeholders, expected {items} items x "
                                 f"{per_item} tokens = {items * per_item}")


@dataclass(frozen=True)
class ExampleSizes:
    """What the balancer needs to know of an example, without its tensors."""

    sample_index: int
    num_vision_items: int
    num_audio_items: int
    num_tokens: int        # backbone sequence length S (text + placeholders)
    num_loss_tokens: int   # tokens whose label counts in the loss


@dataclass(frozen=True, eq=False)
class Example:
    """One sample: ``tokens``/``labels``/``loss_mask`` [S], ``vision`` [n_v, P, D], ``audio`` [n_a, F, M]."""

    sample_index: int
    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    vision: torch.Tensor
    audio: torch.Tensor

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
        for name in ("vision", "audio"):
            tensor = getattr(self, name)
            if tensor.dim() != 3 or not tensor.is_floating_point():
                raise ValueError(f"{where}: {name} must be a 3-D float tensor, "
                                 f"got {tensor.dtype} {tuple(tensor.shape)}")

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    @property
    def num_vision_items(self) -> int:
        return self.vision.shape[0]

    @property
    def num_audio_items(self) -> int:
        return self.audio.shape[0]

    def sizes(self) -> ExampleSizes:
        return ExampleSizes(self.sample_index, self.num_vision_items, self.num_audio_items,
                            self.num_tokens, int(self.loss_mask.count_nonzero()))


@dataclass(frozen=True, eq=False)
class MicroBatch:
    """Examples batched for one forward pass.

    Padded layout (``cu_seqlens is None``): row ``i`` holds example ``i`` right-padded to the row length
    (padding: :data:`PAD_TOKEN_ID`, loss_mask 0); plain causal attention suffices since padding comes
    after every real token. Packed layout: one row holding all examples back to back; example ``i``
    spans ``cu_seqlens[i]:cu_seqlens[i+1]``, position ids restart at each example, and attention must
    be block-diagonal causal (:meth:`attention_mask`); a tail after ``cu_seqlens[-1]`` is padding.

    ``vision``/``audio`` hold every example's items in example order; ``vision_counts[i]`` /
    ``audio_counts[i]`` say how many belong to example ``i``.
    """

    tokens: torch.Tensor          # [rows, T] int64
    labels: torch.Tensor          # [rows, T] int64
    loss_mask: torch.Tensor       # [rows, T] float32
    position_ids: torch.Tensor    # [rows, T] int64
    seq_lengths: torch.Tensor     # [n] int64, unpadded length of each example
    vision: torch.Tensor          # [sum n_v, P, D]
    audio: torch.Tensor           # [sum n_a, F, M]
    vision_counts: torch.Tensor   # [n] int64
    audio_counts: torch.Tensor    # [n] int64
    sample_ids: torch.Tensor      # [n] int64, global sample index of each example
    cu_seqlens: Optional[torch.Tensor] = None  # [n + 1] int32 in the packed layout

    @property
    def num_examples(self) -> int:
        return self.sample_ids.numel()

    @property
    def is_packed(self) -> bool:
        return self.cu_seqlens is not None

    def pin_memory(self) -> "MicroBatch":
        """The same batch in pinned host memory, so its copies to a GPU do not block the host."""
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).pin_memory() for f in dataclasses.fields(self)
                                            if getattr(self, f.name) is not None})

    def _spans(self) -> list[tuple[int, int, int]]:
        """(row, start, end) of each example's tokens."""
        if self.is_packed:
            bounds = self.cu_seqlens.tolist()
            return [(0, bounds[i], bounds[i + 1]) for i in range(self.num_examples)]
        return [(i, 0, length) for i, length in enumerate(self.seq_lengths.tolist())]

    def examples(self) -> list[Example]:
        """Split back into the examples it was built from (tensors are views where possible)."""
        vision = torch.split(self.vision, self.vision_counts.tolist())
        audio = torch.split(self.audio, self.audio_counts.tolist())
        return [Example(sample_index=int(self.sample_ids[i]),
                        tokens=self.tokens[row, start:end], labels=self.labels[row, start:end],
                        loss_mask=self.loss_mask[row, start:end], vision=vision[i], audio=audio[i])
                for i, (row, start, end) in enumerate(self._spans())]

    def sizes(self) -> list[ExampleSizes]:
        loss_tokens = [int(self.loss_mask[row, start:end].count_nonzero()) for row, start, end in self._spans()]
        return [ExampleSizes(int(s), int(v), int(a), int(n), lt) for s, v, a, n, lt in zip(
            self.sample_ids.tolist(), self.vision_counts.tolist(), self.audio_counts.tolist(),
            self.seq_lengths.tolist(), loss_tokens)]

    def attention_mask(self) -> Optional[torch.Tensor]:
        """Megatron-style bool mask [1, 1, T, T] (True = masked) for the packed layout; None when padded.

        Block-diagonal causal: a token sees earlier tokens of its own example only. The padding tail,
        if any, forms one more block so no attention row is empty.
        """
        if not self.is_packed:
            return None
        length = self.tokens.shape[1]
        bounds = self.cu_seqlens.to(torch.long)
        segment = torch.bucketize(torch.arange(length), bounds[1:], right=True)
        same = segment[:, None] == segment[None, :]
        causal = torch.ones(length, length, dtype=torch.bool).tril()
        return ~(same & causal)[None, None]


def _stack_items(examples: Sequence[Example], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    tensors = [getattr(example, name) for example in examples]
    trailing = tensors[0].shape[1:]
    for example, tensor in zip(examples, tensors):
        if tensor.shape[1:] != trailing:
            raise ValueError(f"example {example.sample_index}: {name} items have shape {tuple(tensor.shape[1:])}, "
                             f"but example {examples[0].sample_index} has {tuple(trailing)}")
    counts = torch.tensor([tensor.shape[0] for tensor in tensors], dtype=torch.long)
    return torch.cat(tensors), counts


def _row_length(needed: int, pad_to: Optional[int], pad_to_multiple_of: int) -> int:
    if pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if pad_to is None:
        return -(-needed // pad_to_multiple_of) * pad_to_multiple_of
    if pad_to < needed:
        raise ValueError(f"pad_to={pad_to} is shorter than the {needed} tokens to place in a row")
    return pad_to


def collate(examples: Sequence[Example], pad_to: Optional[int] = None,
            pad_to_multiple_of: int = 1) -> MicroBatch:
    """Batch examples as right-padded rows [n, T].

    T is ``pad_to`` if given (a fixed sequence length, as pipeline parallelism needs), else the longest
    example rounded up to ``pad_to_multiple_of``.
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    lengths = torch.tensor([example.num_tokens for example in examples], dtype=torch.long)
    length = _row_length(int(lengths.max()), pad_to, pad_to_multiple_of)
    rows = len(examples)
    tokens = torch.full((rows, length), PAD_TOKEN_ID, dtype=torch.long)
    labels = torch.full((rows, length), PAD_TOKEN_ID, dtype=torch.long)
    loss_mask = torch.zeros((rows, length), dtype=torch.float32)
    for row, example in enumerate(examples):
        tokens[row, :example.num_tokens] = example.tokens
        labels[row, :example.num_tokens] = example.labels
        loss_mask[row, :example.num_tokens] = example.loss_mask
    vision, vision_counts = _stack_items(examples, "vision")
    audio, audio_counts = _stack_items(examples, "audio")
    return MicroBatch(tokens=tokens, labels=labels, loss_mask=loss_mask,
                      position_ids=torch.arange(length).expand(rows, length).contiguous(),
                      seq_lengths=lengths, vision=vision, audio=audio, vision_counts=vision_counts,
                      audio_counts=audio_counts,
                      sample_ids=torch.tensor([e.sample_index for e in examples], dtype=torch.long))


def collate_packed(examples: Sequence[Example], pad_to: Optional[int] = None,
                   pad_to_multiple_of: int = 1) -> MicroBatch:
    """Batch examples back to back in one row [1, T] with ``cu_seqlens`` (block-diagonal causal attention).

    T is ``pad_to`` if given (e.g. a token budget), else the total length rounded up to
    ``pad_to_multiple_of``; the tail is padding with loss_mask 0.
    """
    if not examples:
        raise ValueError("collate_packed needs at least one example")
    lengths = torch.tensor([example.num_tokens for example in examples], dtype=torch.long)
    total = int(lengths.sum())
    length = _row_length(total, pad_to, pad_to_multiple_of)
    pad = length - total
    tokens = torch.cat([e.tokens for e in examples] + [torch.full((pad,), PAD_TOKEN_ID, dtype=torch.long)])
    labels = torch.cat([e.labels for e in examples] + [torch.full((pad,), PAD_TOKEN_ID, dtype=torch.long)])
    loss_mask = torch.cat([e.loss_mask.to(torch.float32) for e in examples] + [torch.zeros(pad)])
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()] + [torch.arange(pad)])
    cu_seqlens = torch.zeros(len(examples) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    vision, vision_counts = _stack_items(examples, "vision")
    audio, audio_counts = _stack_items(examples, "audio")
    return MicroBatch(tokens=tokens[None], labels=labels[None], loss_mask=loss_mask[None],
                      position_ids=positions[None], seq_lengths=lengths, vision=vision, audio=audio,
                      vision_counts=vision_counts, audio_counts=audio_counts,
                      sample_ids=torch.tensor([e.sample_index for e in examples], dtype=torch.long),
                      cu_seqlens=cu_seqlens)
