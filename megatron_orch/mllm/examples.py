"""How every example of the MLLM is laid out, and the item shapes a model expects of it.

Every example is laid out the same way (placeholders are runs of ``IMAGE_TOKEN_ID`` / ``AUDIO_TOKEN_ID``)::

    ids    = BOS, prompt..., image placeholders..., audio placeholders..., answer..., EOS
    tokens = ids[:-1]      labels = ids[1:]      loss_mask = 1 where the label is answer text or EOS

so ``num_tokens = 1 + prompt + n_v * vision_llm_tokens_per_item + n_a * audio_llm_tokens_per_item +
answer`` and ``num_loss_tokens = answer + 1``.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from megatron_orch.megatron.batch import (AUDIO_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID, IMAGE_TOKEN_ID, MIN_VOCAB_SIZE,
                                          Example, ExampleShape, ExampleSizes)


def layout_sizes(sample_index: int, prompt_tokens: int, num_vision_items: int, num_audio_items: int,
                 answer_tokens: int, shape: ExampleShape) -> ExampleSizes:
    """Sizes of the example :func:`assemble_example` builds from these parts (no tensors)."""
    num_tokens = (1 + prompt_tokens + num_vision_items * shape.vision_llm_tokens_per_item
                  + num_audio_items * shape.audio_llm_tokens_per_item + answer_tokens)
    return ExampleSizes(sample_index, num_vision_items, num_audio_items, num_tokens, answer_tokens + 1)


def assemble_example(sample_index: int, prompt: Sequence[int], answer: Sequence[int], vision: torch.Tensor,
                     audio: torch.Tensor, shape: ExampleShape) -> Example:
    """Lay out one example (module docstring) and check it against ``shape``."""
    ids = torch.tensor([BOS_TOKEN_ID, *prompt]
                       + [IMAGE_TOKEN_ID] * (vision.shape[0] * shape.vision_llm_tokens_per_item)
                       + [AUDIO_TOKEN_ID] * (audio.shape[0] * shape.audio_llm_tokens_per_item)
                       + [*answer, EOS_TOKEN_ID], dtype=torch.long)
    loss_mask = torch.zeros(ids.numel() - 1, dtype=torch.float32)
    loss_mask[loss_mask.numel() - len(answer) - 1:] = 1.0
    example = Example(sample_index=sample_index, tokens=ids[:-1], labels=ids[1:], loss_mask=loss_mask,
                      vision=vision, audio=audio)
    shape.check(example)
    return example


def example_shape(model_config, seq_length: Optional[int] = None) -> ExampleShape:
    """The example shape an ``MLLMConfig`` (megatron_orch.balance.model_config) implies.

    ``seq_length`` defaults to the backbone's ``max_position_embeddings``. Vision items (tiles and video
    frames resized to the tile) have one shape; audio windows travel at full length (Whisper-style zero
    padding).
    """
    vision, audio, backbone = model_config.vision, model_config.audio, model_config.backbone
    if vision is None or audio is None:
        raise ValueError(f"model config {model_config.name!r}: the data pipeline needs both a vision and an "
                         "audio encoder")
    if backbone.transformer.vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"model config {model_config.name!r}: backbone vocab_size="
                         f"{backbone.transformer.vocab_size} is below the {MIN_VOCAB_SIZE} ids the data uses")
    seq_length = backbone.max_position_embeddings if seq_length is None else seq_length
    if seq_length > backbone.max_position_embeddings:
        raise ValueError(f"seq_length={seq_length} exceeds max_position_embeddings="
                         f"{backbone.max_position_embeddings} of model config {model_config.name!r}")
    return ExampleShape(
        seq_length=seq_length,
        vision_patches_per_item=vision.patches(vision.tile_px),
        vision_patch_dim=vision.channels * vision.patch_px ** 2,
        vision_llm_tokens_per_item=vision.tile_llm_tokens,
        audio_frames_per_window=audio.window_frames,
        audio_mel_bins=audio.num_mel_bins,
        audio_llm_tokens_per_item=audio.llm_tokens_per_window)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: the default tokenizer, nothing to download."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))
