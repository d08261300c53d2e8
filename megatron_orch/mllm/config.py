"""This project's MLLM configurations: encoders by name (ViTs over image tiles and/or video frames,
Whisper-style audio encoders), their projectors and the GPT backbone; the phases they give the balancer
(:meth:`MLLMConfig.phases`) and the input policies that turn a trace row into encoder items
(:func:`sizes_from_trace`).

Loaded from ``configs/<name>.yaml``::

    name: tiny
    shaped_after: ...
    encoders:                 # phase name -> encoder, in the order they run
      vision: {kind: vit, media: [images, video], placeholder_id: 260, ...}
      audio: {kind: whisper, placeholder_id: 259, ...}
    backbone: {...}           # transformer.num_experts etc.: a mixture-of-experts backbone (tiny_moe)

Each encoder takes some of the media of the data (``images`` and ``video`` for a ViT, ``audio`` for a
Whisper-style encoder), each medium goes to at most one encoder (a separate video encoder is one more
``kind: vit`` entry with ``media: [video]``), and each encoder's output rows replace its own placeholder
token in the backbone's sequence. Every size the balancer needs (tokens per tile / frame / window, bytes
per raw input, FLOPs and activation bytes per item) derives from these fields. Torch-free.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Dict, Mapping, Optional, Tuple, Union

import numpy as np
import yaml

from megatron_orch.balance.cost import ProjectorShape, TransformerCost, TransformerShape
from megatron_orch.balance.traces import Trace
from megatron_orch.balance.workload import BackbonePhase, EncoderPhase, ModelPhases, StepSizes

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL = "mllm_84b"
BACKBONE_PHASE = "llm"  # the backbone's phase name in plans, flags and logs
# Token ids. Text uses the 256 byte values; the special ids sit above them and each encoder's placeholder
# above those (configured per encoder), so no tokenizer ever produces a placeholder as text.
BYTE_VOCAB_SIZE = 256
BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
PAD_TOKEN_ID = 258
FIRST_PLACEHOLDER_ID = 259
SOURCE_VIDEO_FPS = 30.0  # NExT-QA / VidOR source videos (traces README): video_frames -> seconds


@dataclass(frozen=True)
class VisionEncoderConfig:
    """A ViT that encodes every image tile and/or every sampled video frame (``media``) as one independent
    item. Video frames are resized to the tile size, so every item has one shape and one cost."""

    transformer: TransformerShape
    tile_px: int  # square tile side (InternVL dynamic resolution: 448)
    patch_px: int  # square patch side (14)
    class_tokens: int  # extra tokens the ViT prepends (InternViT / CLIP: 1), dropped before the projector
    merge_factor: int  # pixel shuffle: merge_factor x merge_factor patches -> one LLM token
    projector_ffn_hidden_size: int
    placeholder_id: int  # token id of the placeholders its output rows replace
    media: Tuple[str, ...] = ("images", "video")
    video_fps: Optional[float] = None  # frames sampled per second of video (with video in media)
    video_max_frames: Optional[int] = None  # cap on sampled frames per video
    channels: int = 3
    input_bytes_per_element: int = 2  # normalised pixels travel as bf16

    kind = "vit"  # its key in a config's encoders

    def __post_init__(self):
        object.__setattr__(self, "media", tuple(self.media))
        _check_encoder(self, causal=False)
        if not self.media or not set(self.media) <= {"images", "video"} or len(set(self.media)) != len(self.media):
            raise ValueError(f"media {list(self.media)}: a ViT takes images and/or video")
        if self.tile_px < 1 or self.tile_px % (self.patch_px * self.merge_factor):
            raise ValueError(f"tile_px={self.tile_px} must be a positive multiple of patch_px * merge_factor "
                             f"= {self.patch_px * self.merge_factor}")
        sampling = (self.video_fps, self.video_max_frames)
        if "video" in self.media and (self.video_fps is None or self.video_max_frames is None
                                      or self.video_fps <= 0 or self.video_max_frames < 1):
            raise ValueError(f"an encoder of video needs video_fps > 0 and video_max_frames >= 1, got {sampling}")
        if "video" not in self.media and sampling != (None, None):
            raise ValueError(f"video_fps / video_max_frames {sampling} given, but video is not in media")

    def patches(self, side_px: int) -> int:
        return (side_px // self.patch_px) ** 2

    @property
    def item_tokens(self) -> int:
        """ViT sequence length of one tile or frame (patches + class tokens)."""
        return self.patches(self.tile_px) + self.class_tokens

    @property
    def output_rows(self) -> int:
        """Backbone embeddings of one tile or frame (pixel shuffle: merge_factor**2 patches per token)."""
        return self.patches(self.tile_px) // self.merge_factor ** 2

    @property
    def input_bytes(self) -> int:
        """Raw input of one tile or frame as it travels."""
        return self.channels * self.tile_px ** 2 * self.input_bytes_per_element

    @property
    def item_shape(self) -> Tuple[int, int]:
        """One item as the model takes it: patch rows (raster order) of channels * patch_px**2 values."""
        return self.patches(self.tile_px), self.channels * self.patch_px ** 2

    @property
    def details(self) -> Tuple[Tuple[str, object], ...]:
        return ()

    def projector(self, backbone_hidden: int) -> ProjectorShape:
        return ProjectorShape(self.transformer.hidden_size * self.merge_factor ** 2,
                              self.projector_ffn_hidden_size, backbone_hidden)

    def num_parameters(self, backbone_hidden: int) -> int:
        h = self.transformer.hidden_size
        embeddings = (self.channels * self.patch_px ** 2 + 1) * h + self.item_tokens * h + self.class_tokens * h
        return self.transformer.num_parameters() + embeddings + self.projector(backbone_hidden).num_parameters()


@dataclass(frozen=True)
class AudioEncoderConfig:
    """A Whisper-style encoder: log-mel frames in fixed windows, a stride-2 conv stem, one item per window.

    As in Whisper, every window is encoded at full length (the last one of a clip zero-padded), and every
    window gives the backbone ``output_rows`` embeddings: the data, the model and the planner
    all count windows this way.
    """

    transformer: TransformerShape
    num_mel_bins: int  # 128 for Whisper-large-v3
    window_frames: int  # mel frames per window (Whisper: 30 s at 100 frames/s = 3000)
    conv_stride: int  # conv stem subsampling (Whisper: 2 -> 1500 tokens per window)
    projector_downsample: int  # encoder tokens stacked into one LLM token (Qwen2-Audio pools by 2)
    projector_ffn_hidden_size: int
    placeholder_id: int  # token id of the placeholders its output rows replace
    input_bytes_per_element: int = 2  # mel features travel as bf16

    kind = "whisper"
    media = ("audio",)

    def __post_init__(self):
        _check_encoder(self, causal=False)
        if self.window_frames < 1 or self.conv_stride < 1 or self.window_frames % self.conv_stride:
            raise ValueError(f"window_frames={self.window_frames} must be a positive multiple of "
                             f"conv_stride={self.conv_stride}")
        if self.projector_downsample < 1 or self.num_mel_bins < 1:
            raise ValueError("projector_downsample and num_mel_bins must be >= 1")
        if self.item_tokens % self.projector_downsample:
            raise ValueError(f"window tokens {self.item_tokens} (window_frames / conv_stride) must be "
                             f"divisible by projector_downsample={self.projector_downsample}")

    @property
    def item_tokens(self) -> int:
        """Encoder tokens of one full window."""
        return self.window_frames // self.conv_stride

    @property
    def output_rows(self) -> int:
        """Backbone embeddings of one window (``projector_downsample`` encoder tokens stacked into one)."""
        return self.item_tokens // self.projector_downsample

    @property
    def input_bytes(self) -> int:
        """Raw input of one window (padded mel frames) as it travels."""
        return self.window_frames * self.num_mel_bins * self.input_bytes_per_element

    @property
    def item_shape(self) -> Tuple[int, int]:
        return self.window_frames, self.num_mel_bins

    @property
    def details(self) -> Tuple[Tuple[str, object], ...]:
        """The conv stem's input width: a measured window's time depends on it."""
        return (("num_mel_bins", self.num_mel_bins),)

    def projector(self, backbone_hidden: int) -> ProjectorShape:
        return ProjectorShape(self.transformer.hidden_size * self.projector_downsample,
                              self.projector_ffn_hidden_size, backbone_hidden)

    def num_parameters(self, backbone_hidden: int) -> int:
        h = self.transformer.hidden_size
        conv_stem = self.num_mel_bins * h * 3 + h * h * 3 + 2 * h  # two kernel-3 convs with biases
        embeddings = self.item_tokens * h
        return self.transformer.num_parameters() + conv_stem + embeddings + self.projector(backbone_hidden).num_parameters()


EncoderConfig = Union[VisionEncoderConfig, AudioEncoderConfig]
ENCODER_KINDS = {cls.kind: cls for cls in (VisionEncoderConfig, AudioEncoderConfig)}


@dataclass(frozen=True)
class BackboneConfig:
    """The GPT backbone over text tokens and projected modality embeddings."""

    transformer: TransformerShape
    untie_embeddings_and_output_weights: bool
    max_position_embeddings: int
    prompt_tokens: int  # chat template / system prompt added to every example's text

    def __post_init__(self):
        _check_shape(self.transformer, causal=True)
        if self.transformer.vocab_size < 1:
            raise ValueError("transformer.vocab_size must be >= 1")
        if self.prompt_tokens < 0 or self.max_position_embeddings < 1:
            raise ValueError("prompt_tokens must be >= 0 and max_position_embeddings >= 1")

    def num_parameters(self) -> int:
        """Layers, the token embedding (and the output layer when untied) and the learned absolute
        position embedding the model uses (it keeps packed rows' restarting position ids exact)."""
        t = self.transformer
        tables = 2 if self.untie_embeddings_and_output_weights else 1
        return t.num_parameters() + (tables * t.vocab_size + self.max_position_embeddings) * t.hidden_size


@dataclass(frozen=True)
class MLLMConfig:
    name: str
    shaped_after: str  # the public models whose shapes this config follows
    backbone: BackboneConfig
    encoders: Mapping[str, EncoderConfig] = field(default_factory=dict)  # phase name -> encoder, in order
    token_id_bytes: int = 8  # int64 token ids, as Megatron's data path carries them
    embedding_bytes_per_element: int = 2  # projected embeddings move between ranks as bf16

    def __post_init__(self):
        object.__setattr__(self, "encoders", dict(self.encoders))
        takers = {}
        for name, encoder in self.encoders.items():
            if name == BACKBONE_PHASE:
                raise ValueError(f"encoders.{name}: {BACKBONE_PHASE!r} names the backbone phase")
            for medium in encoder.media:
                if medium in takers:
                    raise ValueError(f"encoders.{name} and encoders.{takers[medium]} both take {medium}")
                takers[medium] = name
        ids = [encoder.placeholder_id for encoder in self.encoders.values()]
        if len(set(ids)) != len(ids) or (ids and min(ids) < FIRST_PLACEHOLDER_ID):
            raise ValueError(f"encoder placeholder ids {ids} must be distinct and >= {FIRST_PLACEHOLDER_ID} (the "
                             "byte, BOS, EOS and pad ids come first)")

    @property
    def hidden_size(self) -> int:
        return self.backbone.transformer.hidden_size

    @property
    def text_bytes_per_token(self) -> int:
        """What one backbone token moves with its example: token id and label, and a float32 loss mask."""
        return 2 * self.token_id_bytes + 4

    @property
    def min_vocab_size(self) -> int:
        """Ids the data uses: bytes, BOS, EOS, pad and every encoder's placeholder."""
        return max([PAD_TOKEN_ID, *(e.placeholder_id for e in self.encoders.values())]) + 1

    def encoder_of(self, medium: str) -> Optional[str]:
        """The encoder phase that takes ``medium`` (images, video, audio), or None."""
        return next((name for name, e in self.encoders.items() if medium in e.media), None)

    def encoder_cost(self, name: str) -> TransformerCost:
        """FLOPs of one item of encoder ``name``: its transformer over the item, its projector over the rows."""
        encoder = self.encoders[name]
        return TransformerCost(encoder.transformer, encoder.projector(self.hidden_size), encoder.output_rows,
                               encoder.details)

    def phases(self) -> ModelPhases:
        """The phases the balancer plans: every encoder (in order), then the backbone."""
        row_bytes = self.hidden_size * self.embedding_bytes_per_element
        encoders = tuple(EncoderPhase(name, self.encoder_cost(name), item_tokens=e.item_tokens,
                                      input_bytes=e.input_bytes, output_rows=e.output_rows, output_row_bytes=row_bytes)
                         for name, e in self.encoders.items())
        return ModelPhases(encoders, BackbonePhase(BACKBONE_PHASE, TransformerCost(self.backbone.transformer),
                                                   token_bytes=self.text_bytes_per_token))

    def num_parameters(self) -> dict:
        """Parameters per component (encoders include their projector) and in total."""
        counts = self.phase_parameters()
        counts["total"] = sum(counts.values())
        return counts

    def phase_parameters(self) -> dict:
        """Parameters per phase (the backbone's, each encoder's with its projector): what the per-GPU memory model
        takes (``ModelSummary.parameters``)."""
        counts = {BACKBONE_PHASE: self.backbone.num_parameters()}
        counts.update({name: e.num_parameters(self.hidden_size) for name, e in self.encoders.items()})
        return counts


def _check_shape(shape: TransformerShape, causal: bool) -> None:
    if shape.causal != causal:
        raise ValueError(f"transformer.causal must be {causal} for this phase, got {shape.causal}")
    if not causal and shape.vocab_size:
        raise ValueError("transformer.vocab_size must be 0 (encoders have no logits layer)")
    if not causal and shape.is_moe:
        raise ValueError("transformer.num_experts: the encoders are dense (a mixture of experts is the backbone's)")


def _check_encoder(encoder, causal: bool) -> None:
    _check_shape(encoder.transformer, causal)
    if isinstance(encoder.placeholder_id, bool) or not isinstance(encoder.placeholder_id, int):
        raise ValueError(f"placeholder_id must be an int, got {encoder.placeholder_id!r}")


def _build(cls, data, where: str):
    """Instantiate a (nested) config dataclass from a dict, rejecting unknown or missing keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    kwargs = {}
    for key, value in data.items():
        if key == "transformer":
            value = _build(TransformerShape, value, f"{where}.{key}")
        elif cls is MLLMConfig and key == "backbone":
            value = _build(BackboneConfig, value, f"{where}.{key}")
        elif cls is MLLMConfig and key == "encoders":
            value = _build_encoders(value, f"{where}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:  # missing required fields
        raise ValueError(f"{where}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _build_encoders(data, where: str) -> Dict[str, EncoderConfig]:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping of phase name -> encoder, got {type(data).__name__}")
    out = {}
    for name, spec in data.items():
        kind = spec.get("kind") if isinstance(spec, dict) else None
        if kind not in ENCODER_KINDS:
            raise ValueError(f"{where}.{name}.kind: expected one of {sorted(ENCODER_KINDS)}, got {kind!r}")
        out[name] = _build(ENCODER_KINDS[kind], {k: v for k, v in spec.items() if k != "kind"}, f"{where}.{name}")
    return out


def model_config_path(name_or_path: str) -> Path:
    """``configs/<name>.yaml`` for a bare name, else the given path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        return path
    return CONFIGS_DIR / f"{name_or_path}.yaml"


def is_shipped_config(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is one of the configs in ``configs/`` (tested against upstream by the suite)."""
    return model_config_path(name_or_path).resolve().parent == CONFIGS_DIR.resolve()


def load_model_config(name_or_path: str = DEFAULT_MODEL) -> MLLMConfig:
    """Load an MLLM config by name (``tiny``, ``tiny_video``, ``mllm_10b``, ...) or YAML path."""
    path = model_config_path(name_or_path)
    if not path.is_file():
        available = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"model config {name_or_path!r} not found at {path}; available: {available}")
    with open(path) as f:
        data = yaml.safe_load(f)
    return _build(MLLMConfig, data, str(path))


def with_encoder_layers(config: MLLMConfig, name: str, num_layers: int) -> MLLMConfig:
    """``config`` with encoder ``name``'s transformer cut (or grown) to ``num_layers``."""
    encoder = config.encoders[name]
    cut = dataclasses.replace(encoder, transformer=dataclasses.replace(encoder.transformer, num_layers=num_layers))
    return dataclasses.replace(config, encoders={**config.encoders, name: cut})


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


def sizes_from_trace(rows: Trace, counts, config: MLLMConfig) -> StepSizes:
    """The sizes of trace rows as the data pipeline would load them, rank r loading ``counts[r]`` rows.

    Each medium counts for the encoder that takes it (none: it is left out): images are the row's tiles;
    video is its sampled frames (``ceil(duration * video_fps)``, at least 1, at most ``video_max_frames``
    of the encoder that takes video; the duration is ``video_sec``, else ``video_frames`` of the source
    file at :data:`SOURCE_VIDEO_FPS`); audio is ``ceil(audio_frames / window_frames)`` windows. The
    backbone sequence is the prompt, the text and the embeddings of every item.
    """
    counts = np.asarray(counts, dtype=np.int64)
    if int(counts.sum()) != len(rows):
        raise ValueError(f"counts {counts.tolist()[:16]} sum to {int(counts.sum())}, the trace has {len(rows)} rows")
    media = {"images": lambda encoder: _count(rows["vision_tiles"], "vision_tiles"),
             "video": lambda encoder: sampled_video_frames(
                 np.where(rows["video_sec"] > 0, rows["video_sec"], rows["video_frames"] / SOURCE_VIDEO_FPS),
                 encoder.video_fps, encoder.video_max_frames),
             "audio": lambda encoder: -(-_count(rows["audio_frames"], "audio_frames") // encoder.window_frames)}
    items = {name: sum((media[m](encoder) for m in encoder.media), np.zeros(len(rows), dtype=np.int64))
             for name, encoder in config.encoders.items()}
    tokens = _count(rows["text_tokens"], "text_tokens") + config.backbone.prompt_tokens
    for name, encoder in config.encoders.items():
        tokens = tokens + items[name] * encoder.output_rows
    return StepSizes(counts=counts, items=items, num_tokens=tokens)


def main(argv=None) -> None:
    """Print the parameter count of each named config (default: all in configs/)."""
    import sys
    names = (argv if argv is not None else sys.argv[1:]) or sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
    for name in names:
        config = load_model_config(name)
        counts = ", ".join(f"{k} {v / 1e9:.3f}B" if v >= 1e8 else f"{k} {v / 1e6:.3f}M"
                           for k, v in config.num_parameters().items())
        print(f"{config.name}: {counts}  ({config.shaped_after})")


if __name__ == "__main__":
    main()
