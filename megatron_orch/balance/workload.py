"""Map the examples of a global batch to the items each phase balances, with their costs and sizes.

Under an :class:`~megatron_orch.balance.model_config.MLLMConfig`:

* ``vision``: one item per image tile (``vision_tiles`` of the row; the ViT sequence is the patches of
  a tile plus its class tokens) and one per sampled video frame (``ceil(duration * video_fps)`` frames,
  at least 1 and at most ``video_max_frames``; the duration is ``video_sec``, else ``video_frames`` of
  the source file at :data:`SOURCE_VIDEO_FPS`). Tiles of an example come first, then its frames.
* ``audio``: one item per window of ``window_frames`` mel frames (``ceil(audio_frames / window_frames)``
  windows). The encoder runs ``window_frames / conv_stride`` tokens per window when the last window is
  padded (Whisper), else ``ceil(real_frames / conv_stride)``. The LLM receives
  ``ceil(real_tokens / projector_downsample)`` tokens per window: the padded tail is dropped before
  the projector (as Qwen2-Audio does).
* ``llm``: one item per example, ``text_tokens + prompt_tokens + all its projected vision/audio tokens``.

An item's cost is training FLOPs (its encoder plus its projector; the backbone for an example), its
memory the activation bytes, its ``nbytes`` what must move if it leaves its home rank: the raw input
(bf16 pixels or mel features) of an encoder item; the token ids plus the projected embeddings of an
example. Encoder items also carry ``output_nbytes``, the bytes of their projected embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import numpy as np

from megatron_orch.balance.model_config import MLLMConfig
from megatron_orch.balance.traces import Trace

PHASES = ("vision", "audio", "llm")
SOURCE_VIDEO_FPS = 30.0  # NExT-QA / VidOR source videos (traces README): video_frames -> seconds


@dataclass(frozen=True, eq=False)
class PhaseItems:
    """The items of one phase of a global batch, as parallel arrays (item ``i`` at index ``i``)."""

    name: str
    example: np.ndarray  # parent example (index into the global batch)
    home: np.ndarray  # rank that loaded the parent example
    tokens: np.ndarray  # sequence length the phase's transformer runs for this item
    cost: np.ndarray  # training FLOPs
    memory: np.ndarray  # activation bytes
    nbytes: np.ndarray  # bytes to move if the item leaves its home rank
    output_nbytes: np.ndarray  # bytes of projected embeddings sent on to the backbone (0 for llm)

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


def _expand(counts: np.ndarray):
    """Parent of each child and the child's index within its parent, for ``counts[p]`` children each."""
    parent = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return parent, np.arange(parent.size, dtype=np.int64) - starts[parent]


def _empty(name: str) -> PhaseItems:
    i, f = np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float64)
    return PhaseItems(name, i, i, i, f, f, f, f)


def build_workload(rows: Trace, home, config: MLLMConfig) -> Dict[str, PhaseItems]:
    """Items of every phase (``vision``, ``audio``, ``llm``) for the examples in ``rows``.

    ``home[e]`` is the DP rank that loaded example ``e``. An absent modality (or encoder) gives a phase
    with 0 items.
    """
    home = np.asarray(home, dtype=np.int64)
    n = len(rows)
    if home.shape != (n,):
        raise ValueError(f"home must give one rank per example: {n} examples, home of shape {home.shape}")
    if n and home.min() < 0:
        raise ValueError("home ranks must be >= 0")
    hidden = config.hidden_size
    emb_bytes = hidden * config.embedding_bytes_per_element
    modality_tokens = np.zeros(n, dtype=np.int64)
    phases = {}

    vision = config.vision
    tiles = _count(rows["vision_tiles"], "vision_tiles")
    duration = np.where(rows["video_sec"] > 0, rows["video_sec"], rows["video_frames"] / SOURCE_VIDEO_FPS)
    if vision is None or not (tiles.sum() or np.any(duration > 0)):
        phases["vision"] = _empty("vision")
    else:
        frames = sampled_video_frames(duration, vision.video_fps, vision.video_max_frames)
        example, index = _expand(tiles + frames)
        is_tile = index < tiles[example]
        seq = np.where(is_tile, vision.tile_seq_len, vision.frame_seq_len)
        out_tokens = np.where(is_tile, vision.tile_llm_tokens, vision.frame_llm_tokens)
        projector = vision.projector(hidden)
        phases["vision"] = PhaseItems(
            "vision", example, home[example], seq,
            vision.transformer.train_flops(seq) + projector.train_flops(out_tokens),
            vision.transformer.activation_bytes(seq) + projector.activation_bytes(out_tokens),
            np.where(is_tile, vision.tile_bytes, vision.frame_bytes).astype(np.float64),
            out_tokens * float(emb_bytes))
        modality_tokens += np.bincount(example, weights=out_tokens, minlength=n).astype(np.int64)

    audio = config.audio
    mel_frames = _count(rows["audio_frames"], "audio_frames")
    if audio is None or not mel_frames.sum():
        phases["audio"] = _empty("audio")
    else:
        windows = -(-mel_frames // audio.window_frames)
        example, index = _expand(windows)
        real_frames = np.minimum(mel_frames[example] - index * audio.window_frames, audio.window_frames)
        real_tokens = -(-real_frames // audio.conv_stride)
        seq = np.full(example.size, audio.window_tokens) if audio.pad_last_window else real_tokens
        out_tokens = -(-real_tokens // audio.projector_downsample)
        projector = audio.projector(hidden)
        phases["audio"] = PhaseItems(
            "audio", example, home[example], seq,
            audio.transformer.train_flops(seq) + projector.train_flops(out_tokens),
            audio.transformer.activation_bytes(seq) + projector.activation_bytes(out_tokens),
            (real_frames * audio.num_mel_bins * audio.input_bytes_per_element).astype(np.float64),
            out_tokens * float(emb_bytes))
        modality_tokens += np.bincount(example, weights=out_tokens, minlength=n).astype(np.int64)

    backbone = config.backbone
    text = _count(rows["text_tokens"], "text_tokens")
    seq = text + backbone.prompt_tokens + modality_tokens
    phases["llm"] = PhaseItems(
        "llm", np.arange(n, dtype=np.int64), home, seq,
        backbone.transformer.train_flops(seq), backbone.transformer.activation_bytes(seq),
        (seq * config.token_id_bytes + modality_tokens * emb_bytes).astype(np.float64),
        np.zeros(n, dtype=np.float64))
    return phases
