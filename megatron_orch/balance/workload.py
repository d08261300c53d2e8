"""The items each phase balances, with their costs and sizes: one builder for training and benchmarks.

Per-example sizes (:class:`StepSizes`: what the trainer gathers over the DP group, or what
:func:`sizes_from_trace` maps a trace to) become, under an
:class:`~megatron_orch.balance.model_config.MLLMConfig`, the items of every phase (:func:`phase_items`):

* ``vision``: one item per image tile or sampled video frame (frames are resized to the tile size, so
  every item is one ViT sequence of ``tile_seq_len`` tokens and gives ``tile_llm_tokens`` embeddings);
* ``audio``: one item per window of ``window_frames`` mel frames, encoded at full length (Whisper pads
  the last window of a clip), giving ``llm_tokens_per_window`` embeddings;
* ``llm``: one item per example, its backbone sequence.

An item's cost is training FLOPs (its encoder plus its projector; the backbone for an example) or,
given a :class:`~megatron_orch.balance.cost_profile.CostProfile`, the forward+backward seconds measured
for an item of its length on the profiled device; its memory the activation bytes, its ``nbytes`` what
moves if it leaves its home rank (the raw input of an encoder item; an example's token ids, labels and
loss mask), and an encoder item's ``output_nbytes`` the projected embeddings it sends on to the backbone
rank of its example.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from megatron_orch.balance.cost_profile import CostProfile
from megatron_orch.balance.model_config import MLLMConfig
from megatron_orch.balance.traces import Trace

PHASES = ("vision", "audio", "llm")  # the phase names, here only
ENCODER_PHASES = PHASES[:2]
SOURCE_VIDEO_FPS = 30.0  # NExT-QA / VidOR source videos (traces README): video_frames -> seconds


@dataclass(frozen=True, eq=False)
class StepSizes:
    """Per-example sizes of a global batch, examples in loader order (rank 0's first)."""

    counts: np.ndarray           # examples loaded by each DP rank
    num_vision_items: np.ndarray  # image tiles and video frames
    num_audio_items: np.ndarray   # audio windows
    num_tokens: np.ndarray       # backbone sequence length

    def __post_init__(self):
        counts = np.asarray(self.counts)
        if counts.ndim != 1 or counts.size == 0 or counts.min() < 0:
            raise ValueError(f"StepSizes.counts must be a non-empty 1-D array of counts >= 0, "
                             f"got {counts.tolist()[:16]}")
        n = int(counts.sum())
        for name in ("num_vision_items", "num_audio_items", "num_tokens"):
            values = np.asarray(getattr(self, name))
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
    """The items of one phase of a global batch, as parallel arrays (item ``i`` at index ``i``)."""

    name: str
    example: np.ndarray  # parent example (index into the global batch)
    home: np.ndarray  # rank that loaded the parent example
    tokens: np.ndarray  # sequence length the phase's transformer runs for this item
    cost: np.ndarray  # training FLOPs, or measured seconds under a cost profile
    memory: np.ndarray  # activation bytes
    nbytes: np.ndarray  # bytes to move if the item leaves its home rank (int64)
    output_nbytes: np.ndarray  # bytes of projected embeddings sent on to the backbone (int64; 0 for llm)

    def __len__(self) -> int:
        return int(self.example.size)


def _count(values: np.ndarray, where: str) -> np.ndarray:
    if values.size and (values.min() < 0 or not np.all(np.isfinite(values))):
        raise ValueError(f"{where} must be finite and >= 0, got min {values.min()}")
    return np.ceil(values - 1e-9).astype(np.int64)


def sampled_video_frames(duration_sec, fps: float, max_frames: int) -> np.ndarray:
    """Frames sampled from videos of the given durations: ceil(duration * fps) clipped to [1, max_frames];
    0 where there is no video."""
    d = np.asarray(duration_sec, dtype=np.float64)
    frames = np.clip(np.ceil(d * fps - 1e-9), 1, max_frames)
    return np.where(d > 0, frames, 0).astype(np.int64)


def phase_items(sizes: StepSizes, config: MLLMConfig,
                cost_profile: Optional[CostProfile] = None) -> Dict[str, PhaseItems]:
    """Items of every phase (``vision``, ``audio``, ``llm``) of a global batch. A model without an
    encoder, or a batch without its modality, gives that phase 0 items. Costs are training FLOPs, or
    the profile's seconds (refused unless measured on this model's shape)."""
    if cost_profile is not None:
        cost_profile.check_model(config)
    home = sizes.home
    n = sizes.num_examples
    hidden = config.hidden_size
    emb_bytes = hidden * config.embedding_bytes_per_element
    phases = {}
    for name, encoder, per_example in (("vision", config.vision, sizes.num_vision_items),
                                       ("audio", config.audio, sizes.num_audio_items)):
        counts = np.asarray(per_example, dtype=np.int64)
        if encoder is None and counts.sum():
            raise ValueError(f"the batch has {name} items but model config {config.name!r} has no {name} encoder")
        example = np.repeat(np.arange(n, dtype=np.int64), counts)
        if name == "vision" and encoder is not None:
            seq, out_tokens = encoder.tile_seq_len, encoder.tile_llm_tokens
            cost, raw_bytes = config.vision_item_train_flops(), encoder.tile_bytes
        elif encoder is not None:
            seq, out_tokens = encoder.window_tokens, encoder.llm_tokens_per_window
            cost, raw_bytes = config.audio_window_train_flops(), encoder.window_bytes
        else:
            seq = out_tokens = cost = raw_bytes = 0
        if cost_profile is not None and encoder is not None:
            cost = float(cost_profile.phases[name].item_seconds(seq))
        memory = 0.0 if encoder is None else float(encoder.transformer.activation_bytes(seq)
                                                   + encoder.projector(hidden).activation_bytes(out_tokens))
        ones = np.ones(example.size)
        phases[name] = PhaseItems(name, example, home[example], np.full(example.size, seq, dtype=np.int64),
                                  cost * ones, memory * ones, np.full(example.size, raw_bytes, dtype=np.int64),
                                  np.full(example.size, out_tokens * emb_bytes, dtype=np.int64))
    tokens = np.asarray(sizes.num_tokens, dtype=np.int64)
    backbone = config.backbone.transformer
    llm_cost = (backbone.train_flops(tokens) if cost_profile is None
                else cost_profile.phases["llm"].item_seconds(tokens))
    phases["llm"] = PhaseItems(
        "llm", np.arange(n, dtype=np.int64), home, tokens, np.asarray(llm_cost, dtype=np.float64),
        np.asarray(backbone.activation_bytes(tokens), dtype=np.float64),
        tokens * config.text_bytes_per_token, np.zeros(n, dtype=np.int64))
    return phases


def sizes_from_trace(rows: Trace, counts, config: MLLMConfig) -> StepSizes:
    """The sizes of trace rows as the data pipeline would load them, rank r loading ``counts[r]`` rows.

    Vision items are the row's image tiles plus its video's sampled frames (``ceil(duration *
    video_fps)``, at least 1, at most ``video_max_frames``; the duration is ``video_sec``, else
    ``video_frames`` of the source file at :data:`SOURCE_VIDEO_FPS`); audio windows are
    ``ceil(audio_frames / window_frames)``; the backbone sequence is the prompt, the text and the
    embeddings of every item.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if int(counts.sum()) != len(rows):
        raise ValueError(f"counts {counts.tolist()[:16]} sum to {int(counts.sum())}, the trace has {len(rows)} rows")
    vision, audio = config.vision, config.audio
    tiles = _count(rows["vision_tiles"], "vision_tiles")
    duration = np.where(rows["video_sec"] > 0, rows["video_sec"], rows["video_frames"] / SOURCE_VIDEO_FPS)
    vision_items = np.zeros(len(rows), dtype=np.int64) if vision is None else \
        tiles + sampled_video_frames(duration, vision.video_fps, vision.video_max_frames)
    mel_frames = _count(rows["audio_frames"], "audio_frames")
    windows = np.zeros(len(rows), dtype=np.int64) if audio is None else -(-mel_frames // audio.window_frames)
    tokens = (_count(rows["text_tokens"], "text_tokens") + config.backbone.prompt_tokens
              + vision_items * (vision.tile_llm_tokens if vision else 0)
              + windows * (audio.llm_tokens_per_window if audio else 0))
    return StepSizes(counts=counts, num_vision_items=vision_items, num_audio_items=windows, num_tokens=tokens)
