"""MLLM configurations: a vision encoder (images and video frames), an audio encoder, their
projectors and the GPT backbone, with the input policies that turn a trace row into encoder items.

Loaded from ``configs/<name>.yaml``. Every size the balancer needs (tokens per tile / frame / window,
bytes per raw input, FLOPs and activation bytes per item) derives from these fields.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Optional

import yaml

from megatron_orch.balance.cost import ProjectorShape, TransformerShape

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_MODEL = "mllm_84b"


@dataclass(frozen=True)
class VisionEncoderConfig:
    """A ViT that encodes every image tile and every sampled video frame as one independent item.

    Video frames are resized to the tile size, so every vision item has one shape and one cost.
    """

    transformer: TransformerShape
    tile_px: int  # square tile side (InternVL dynamic resolution: 448)
    patch_px: int  # square patch side (14)
    class_tokens: int  # extra tokens the ViT prepends (InternViT / CLIP: 1), dropped before the projector
    merge_factor: int  # pixel shuffle: merge_factor x merge_factor patches -> one LLM token
    video_fps: float  # frames sampled per second of video
    video_max_frames: int  # cap on sampled frames per video
    projector_ffn_hidden_size: int
    channels: int = 3
    input_bytes_per_element: int = 2  # normalised pixels travel as bf16

    def __post_init__(self):
        _check_shape("vision", self.transformer, causal=False)
        if self.tile_px < 1 or self.tile_px % (self.patch_px * self.merge_factor):
            raise ValueError(f"vision.tile_px={self.tile_px} must be a positive multiple of patch_px * merge_factor "
                             f"= {self.patch_px * self.merge_factor}")
        if self.video_fps <= 0 or self.video_max_frames < 1:
            raise ValueError(f"vision.video_fps must be > 0 and video_max_frames >= 1, got "
                             f"{self.video_fps}, {self.video_max_frames}")

    def patches(self, side_px: int) -> int:
        return (side_px // self.patch_px) ** 2

    @property
    def tile_seq_len(self) -> int:
        """ViT sequence length of one tile (patches + class tokens)."""
        return self.patches(self.tile_px) + self.class_tokens

    @property
    def tile_llm_tokens(self) -> int:
        return self.patches(self.tile_px) // self.merge_factor ** 2

    @property
    def tile_bytes(self) -> int:
        return self.channels * self.tile_px ** 2 * self.input_bytes_per_element

    def projector(self, backbone_hidden: int) -> ProjectorShape:
        return ProjectorShape(self.transformer.hidden_size * self.merge_factor ** 2,
                              self.projector_ffn_hidden_size, backbone_hidden)

    def num_parameters(self, backbone_hidden: int) -> int:
        h = self.transformer.hidden_size
        embeddings = (self.channels * self.patch_px ** 2 + 1) * h + self.tile_seq_len * h + self.class_tokens * h
        return self.transformer.num_parameters() + embeddings + self.projector(backbone_hidden).num_parameters()


@dataclass(frozen=True)
class AudioEncoderConfig:
    """A Whisper-style encoder: log-mel frames in fixed windows, a stride-2 conv stem, one item per window.

    As in Whisper, every window is encoded at full length (the last one of a clip zero-padded), and every
    window gives the backbone ``llm_tokens_per_window`` embeddings: the data, the model and the planner
    all count windows this way.
    """

    transformer: TransformerShape
    num_mel_bins: int  # 128 for Whisper-large-v3
    window_frames: int  # mel frames per window (Whisper: 30 s at 100 frames/s = 3000)
    conv_stride: int  # conv stem subsampling (Whisper: 2 -> 1500 tokens per window)
    projector_downsample: int  # encoder tokens stacked into one LLM token (Qwen2-Audio pools by 2)
    projector_ffn_hidden_size: int
    input_bytes_per_element: int = 2  # mel features travel as bf16

    def __post_init__(self):
        _check_shape("audio", self.transformer, causal=False)
        if self.window_frames < 1 or self.conv_stride < 1 or self.window_frames % self.conv_stride:
            raise ValueError(f"audio.window_frames={self.window_frames} must be a positive multiple of "
                             f"conv_stride={self.conv_stride}")
        if self.projector_downsample < 1 or self.num_mel_bins < 1:
            raise ValueError("audio.projector_downsample and audio.num_mel_bins must be >= 1")
        if self.window_tokens % self.projector_downsample:
            raise ValueError(f"audio window tokens {self.window_tokens} (window_frames / conv_stride) must be "
                             f"divisible by projector_downsample={self.projector_downsample}")

    @property
    def window_tokens(self) -> int:
        """Encoder tokens of one full window."""
        return self.window_frames // self.conv_stride

    @property
    def llm_tokens_per_window(self) -> int:
        """Backbone embeddings of one window (``projector_downsample`` encoder tokens stacked into one)."""
        return self.window_tokens // self.projector_downsample

    @property
    def window_bytes(self) -> int:
        """Raw input of one window (padded mel frames) as it travels."""
        return self.window_frames * self.num_mel_bins * self.input_bytes_per_element

    def projector(self, backbone_hidden: int) -> ProjectorShape:
        return ProjectorShape(self.transformer.hidden_size * self.projector_downsample,
                              self.projector_ffn_hidden_size, backbone_hidden)

    def num_parameters(self, backbone_hidden: int) -> int:
        h = self.transformer.hidden_size
        conv_stem = self.num_mel_bins * h * 3 + h * h * 3 + 2 * h  # two kernel-3 convs with biases
        embeddings = self.window_tokens * h
        return self.transformer.num_parameters() + conv_stem + embeddings + self.projector(backbone_hidden).num_parameters()


@dataclass(frozen=True)
class BackboneConfig:
    """The GPT backbone over text tokens and projected modality embeddings."""

    transformer: TransformerShape
    untie_embeddings_and_output_weights: bool
    max_position_embeddings: int
    prompt_tokens: int  # chat template / system prompt added to every example's text

    def __post_init__(self):
        _check_shape("backbone", self.transformer, causal=True)
        if self.transformer.vocab_size < 1:
            raise ValueError("backbone.transformer.vocab_size must be >= 1")
        if self.prompt_tokens < 0 or self.max_position_embeddings < 1:
            raise ValueError("backbone.prompt_tokens must be >= 0 and max_position_embeddings >= 1")

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
    vision: Optional[VisionEncoderConfig] = None
    audio: Optional[AudioEncoderConfig] = None
    token_id_bytes: int = 8  # int64 token ids, as Megatron's data path carries them
    embedding_bytes_per_element: int = 2  # projected embeddings move between ranks as bf16

    @property
    def hidden_size(self) -> int:
        return self.backbone.transformer.hidden_size

    @property
    def text_bytes_per_token(self) -> int:
        """What one backbone token moves with its example: token id and label, and a float32 loss mask."""
        return 2 * self.token_id_bytes + 4

    def vision_item_train_flops(self) -> float:
        """Training FLOPs of one image tile or video frame: ViT over its patches, projector over its tokens."""
        vision = self.vision
        return float(vision.transformer.train_flops(vision.tile_seq_len)
                     + vision.projector(self.hidden_size).train_flops(vision.tile_llm_tokens))

    def audio_window_train_flops(self) -> float:
        """Training FLOPs of one audio window as the model encodes it (a whole window, padded)."""
        audio = self.audio
        return float(audio.transformer.train_flops(audio.window_tokens)
                     + audio.projector(self.hidden_size).train_flops(audio.llm_tokens_per_window))

    def num_parameters(self) -> dict:
        """Parameters per component (encoders include their projector) and in total."""
        counts = {"backbone": self.backbone.num_parameters()}
        if self.vision is not None:
            counts["vision"] = self.vision.num_parameters(self.hidden_size)
        if self.audio is not None:
            counts["audio"] = self.audio.num_parameters(self.hidden_size)
        counts["total"] = sum(counts.values())
        return counts


def _check_shape(where: str, shape: TransformerShape, causal: bool) -> None:
    if shape.causal != causal:
        raise ValueError(f"{where}.transformer.causal must be {causal} for this phase, got {shape.causal}")
    if not causal and shape.vocab_size:
        raise ValueError(f"{where}.transformer.vocab_size must be 0 (encoders have no logits layer)")


def _build(cls, data, where: str):
    """Instantiate a (nested) config dataclass from a dict, rejecting unknown or missing keys."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed: {sorted(known)}")
    nested = {"transformer": TransformerShape, "backbone": BackboneConfig,
              "vision": VisionEncoderConfig, "audio": AudioEncoderConfig}
    kwargs = {}
    for key, value in data.items():
        if key in nested and value is not None:
            value = _build(nested[key], value, f"{where}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except TypeError as err:  # missing required fields
        raise ValueError(f"{where}: {err}") from None
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def model_config_path(name_or_path: str) -> Path:
    """``configs/<name>.yaml`` for a bare name, else the given path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        return path
    return CONFIGS_DIR / f"{name_or_path}.yaml"


def load_model_config(name_or_path: str = DEFAULT_MODEL) -> MLLMConfig:
    """Load an MLLM config by name (``tiny``, ``mllm_10b``, ``mllm_18b``, ``mllm_84b``) or YAML path."""
    path = model_config_path(name_or_path)
    if not path.is_file():
        available = sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml"))
        raise FileNotFoundError(f"model config {name_or_path!r} not found at {path}; available: {available}")
    with open(path) as f:
        data = yaml.safe_load(f)
    return _build(MLLMConfig, data, str(path))


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
