"""How every example of the MLLM is laid out, and the batch spec a model config implies.

Every example is laid out the same way (placeholders are runs of each encoder's placeholder id, the
encoders in the config's order)::

    ids    = BOS, prompt..., placeholders of encoder 1..., placeholders of encoder 2..., answer..., EOS
    tokens = ids[:-1]      labels = ids[1:]      loss_mask = 1 where the label is answer text or EOS

so ``num_tokens = 1 + prompt + sum over encoders of n_items * output_rows + answer`` and
``num_loss_tokens = answer + 1``. The data's media (images, video, audio) go to the encoder that takes
each (:attr:`ExampleLayout.media`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from megatron_orch.megatron.batch import BatchSpec, EncoderInput, Example, ExampleSizes
from megatron_orch.mllm.config import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, MLLMConfig


@dataclass(frozen=True)
class ExampleLayout:
    """The layout of this project's examples for one model config: the batch spec its model expects, and
    which encoder phase takes each medium of the data."""

    spec: BatchSpec
    media: Mapping[str, str]  # medium (images, video, audio) -> encoder phase
    min_vocab_size: int  # ids below it are bytes, BOS, EOS, pad and placeholders

    @property
    def seq_length(self) -> int:
        return self.spec.seq_length

    def phase_of(self, medium: str, where: str = "") -> str:
        """The encoder phase that takes ``medium``; ValueError (prefixed by ``where``) if none does."""
        if medium not in self.media:
            raise ValueError(f"{where}{': ' if where else ''}the model has no encoder of {medium} (its encoders "
                             f"take {', '.join(sorted(self.media)) or 'nothing'})")
        return self.media[medium]

    def input_of(self, medium: str, where: str = "") -> EncoderInput:
        return self.spec.input(self.phase_of(medium, where))


def layout_sizes(sample_index: int, prompt_tokens: int, items: Mapping[str, int], answer_tokens: int,
                 spec: BatchSpec) -> ExampleSizes:
    """Sizes of the example :func:`assemble_example` builds from these parts (no tensors)."""
    num_tokens = 1 + prompt_tokens + sum(items.get(p, 0) * spec.rows_per_item(p) for p in spec.phases.encoder_names)
    return ExampleSizes(sample_index, {p: n for p, n in items.items() if n}, num_tokens + answer_tokens,
                        answer_tokens + 1)


def assemble_example(sample_index: int, prompt: Sequence[int], answer: Sequence[int],
                     items: Mapping[str, torch.Tensor], spec: BatchSpec) -> Example:
    """Lay out one example (module docstring) and check it against ``spec``."""
    placeholders = []
    for encoder_input in spec.inputs:
        count = items[encoder_input.phase].shape[0] if encoder_input.phase in items else 0
        placeholders += [encoder_input.placeholder_id] * (count * spec.rows_per_item(encoder_input.phase))
    ids = torch.tensor([BOS_TOKEN_ID, *prompt] + placeholders + [*answer, EOS_TOKEN_ID], dtype=torch.long)
    loss_mask = torch.zeros(ids.numel() - 1, dtype=torch.float32)
    loss_mask[loss_mask.numel() - len(answer) - 1:] = 1.0
    example = Example(sample_index=sample_index, tokens=ids[:-1], labels=ids[1:], loss_mask=loss_mask,
                      items=items)
    spec.check(example)
    return example


def batch_spec(model_config: MLLMConfig, seq_length: Optional[int] = None) -> BatchSpec:
    """The batch spec an ``MLLMConfig`` implies: its phases, each encoder's item shape (image tiles and
    video frames resized to the tile; audio windows at full length, Whisper-style zero padding) and
    placeholder id, the pad id. ``seq_length`` defaults to the backbone's ``max_position_embeddings``."""
    backbone = model_config.backbone
    if backbone.transformer.vocab_size < model_config.min_vocab_size:
        raise ValueError(f"model config {model_config.name!r}: backbone vocab_size="
                         f"{backbone.transformer.vocab_size} is below the {model_config.min_vocab_size} ids the "
                         "data uses")
    seq_length = backbone.max_position_embeddings if seq_length is None else seq_length
    if seq_length > backbone.max_position_embeddings:
        raise ValueError(f"seq_length={seq_length} exceeds max_position_embeddings="
                         f"{backbone.max_position_embeddings} of model config {model_config.name!r}")
    inputs = tuple(EncoderInput(name, e.item_shape, e.placeholder_id) for name, e in model_config.encoders.items())
    return BatchSpec(model_config.phases(), inputs, pad_token_id=PAD_TOKEN_ID, seq_length=seq_length,
                     takes_packed_rows=True)


def example_layout(model_config: MLLMConfig, seq_length: Optional[int] = None) -> ExampleLayout:
    """The layout of ``model_config``'s examples (:func:`batch_spec` checks the config's sizes)."""
    media = {medium: name for name, e in model_config.encoders.items() for medium in e.media}
    return ExampleLayout(batch_spec(model_config, seq_length), media, model_config.min_vocab_size)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: the default tokenizer, nothing to download."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))
