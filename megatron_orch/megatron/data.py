"""Datasets, the Megatron pretraining sampler and the per-rank micro-batch iterator.

Two datasets produce :class:`~megatron_orch.megatron.batch.Example` objects and, for planning, their
:class:`~megatron_orch.megatron.batch.ExampleSizes` without materialising any tensor:

* :class:`SyntheticMultimodalDataset`, the embedded default: random pixels / mel frames and a
  learnable synthetic text, with per-example modality lengths drawn from the real traces;
* :class:`ManifestDataset`: users' own data from a JSONL manifest (images, log-mel arrays, text).

Every example is laid out the same way (placeholders are runs of ``IMAGE_TOKEN_ID`` / ``AUDIO_TOKEN_ID``)::

    ids    = BOS, prompt..., image placeholders..., audio placeholders..., answer..., EOS
    tokens = ids[:-1]      labels = ids[1:]      loss_mask = 1 where the label is answer text or EOS

so ``num_tokens = 1 + prompt + n_v * vision_llm_tokens_per_item + n_a * audio_llm_tokens_per_item +
answer`` and ``num_loss_tokens = answer + 1``.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from megatron_orch.balance.traces import TraceMixture, load_mixture
from megatron_orch.balance.workload import SOURCE_VIDEO_FPS, sampled_video_frames
from megatron_orch.megatron.batch import (AUDIO_TOKEN_ID, BOS_TOKEN_ID, BYTE_VOCAB_SIZE, EOS_TOKEN_ID,
                                          IMAGE_TOKEN_ID, MIN_VOCAB_SIZE, Example, ExampleShape,
                                          ExampleSizes, MicroBatch, collate)


# ----------------------------------------------------------------------------------------------------
# Example layout
# ----------------------------------------------------------------------------------------------------

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

    ``seq_length`` defaults to the backbone's ``max_position_embeddings``. The batch format holds vision
    items of one shape, so image tiles and video frames must have the same side (``tile_px ==
    frame_px``); audio windows always travel at full length (Whisper-style zero padding).
    """
    vision, audio, backbone = model_config.vision, model_config.audio, model_config.backbone
    if vision is None or audio is None:
        raise ValueError(f"model config {model_config.name!r}: the data pipeline needs both a vision and an "
                         "audio encoder")
    if audio.window_tokens % audio.projector_downsample:
        raise ValueError(f"model config {model_config.name!r}: audio window tokens {audio.window_tokens} are not "
                         f"divisible by projector_downsample={audio.projector_downsample}")
    if vision.tile_px != vision.frame_px:
        raise ValueError(f"model config {model_config.name!r}: vision.tile_px={vision.tile_px} != "
                         f"vision.frame_px={vision.frame_px}; the batch format needs one vision item shape")
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
        audio_llm_tokens_per_item=audio.window_tokens // audio.projector_downsample)


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255: the default tokenizer, nothing to download."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


# ----------------------------------------------------------------------------------------------------
# The embedded default: synthetic examples with trace-driven modality lengths
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyntheticScaling:
    """How a real trace row's lengths shrink to a tiny model's example.

    * vision: image tiles as in the trace (``vision_tiles``, 1-7); video frames sampled from the
      duration at the model config's ``video_fps``, capped at its ``video_max_frames``
      (:func:`~megatron_orch.balance.workload.sampled_video_frames`);
    * audio: ``ceil(audio_sec / audio_window_sec)`` windows, capped at ``max_audio_windows``: the model's
      window (however many frames) stands for ``audio_window_sec`` seconds of real audio (Whisper: 30 s);
      the last window keeps the real fraction of its frames and is zero-padded;
    * text: ``max(1, round(text_tokens * text_scale))`` answer tokens; rows without text (LibriSpeech
      train-clean-100) get ``asr_text_tokens_per_sec * audio_sec`` tokens first (traces README);
    * the backbone's ``prompt_tokens`` precede the media. An example that would exceed ``seq_length``
      loses video frames / tiles, then audio windows, from the end, then answer tokens.

    Answer text follows a fixed random bigram chain over ``a-z`` and space (the next character is the
    chain's successor with probability ``markov_follow_prob``, else uniform), so a tiny model's loss falls
    quickly in a short overfit run.
    """

    audio_window_sec: float = 30.0
    max_audio_windows: int = 16
    text_scale: float = 0.25
    asr_text_tokens_per_sec: float = 3.0
    markov_follow_prob: float = 0.8


_ALPHABET = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz ", dtype=np.uint8).astype(np.int64)
_PROMPTS = {"image": "image:", "video": "video:", "audio": "audio:", "text": "text:"}  # space-padded
# Independent random streams of one dataset seed: which trace, which row, each example's content,
# the text chain. Each is indexed by sample, so example i never depends on the dataset's length.
_TRACE_STREAM, _ROW_STREAM, _CONTENT_STREAM, _CHAIN_STREAM = range(4)


class SyntheticMultimodalDataset:
    """Random pixels, mel frames and text whose per-example lengths come from real traces.

    Example ``i`` draws a trace of ``mixture`` by weight and a row of it uniformly (as upstream's
    blended, shuffled datasets and :meth:`TraceMixture.draw` do), scales its lengths with
    :class:`SyntheticScaling`, and fills the tensors from a generator seeded by ``(seed, i)``: it is a
    pure function of ``(seed, i)`` (and the mixture, scaling and shape), so any rank can build any example
    and resuming from a consumed-sample count is exact. All sizes are drawn up front, vectorised, so
    :meth:`example_sizes` costs nothing.
    """

    def __init__(self, model_config, num_samples: int, seed: int, mixture: Optional[TraceMixture] = None,
                 scaling: SyntheticScaling = SyntheticScaling(), seq_length: Optional[int] = None):
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        self.shape = example_shape(model_config, seq_length)
        self.scaling = scaling
        self.seed = seed
        self.prompt_tokens = model_config.backbone.prompt_tokens
        mixture = load_mixture() if mixture is None else mixture
        trace_u = np.random.default_rng([seed, _TRACE_STREAM]).random(num_samples)
        row_u = np.random.default_rng([seed, _ROW_STREAM]).random(num_samples)
        which = np.minimum(np.searchsorted(np.cumsum(mixture.weights), trace_u, side="right"),
                           len(mixture.traces) - 1)
        columns = {c: np.zeros(num_samples) for c in ("vision_tiles", "video_sec", "video_frames", "audio_sec",
                                                      "text_tokens")}
        for k, trace in enumerate(mixture.traces):
            slots = np.flatnonzero(which == k)
            rows = (row_u[slots] * len(trace)).astype(np.int64)
            for column, values in columns.items():
                values[slots] = trace[column][rows]
        self._draw_lengths(columns, model_config.vision)
        chain_rng = np.random.default_rng([seed, _CHAIN_STREAM])
        self._successor = chain_rng.permutation(_ALPHABET.size)

    def _draw_lengths(self, columns: dict, vision) -> None:
        shape, scaling = self.shape, self.scaling
        video_sec = np.where(columns["video_sec"] > 0, columns["video_sec"],
                             columns["video_frames"] / SOURCE_VIDEO_FPS)
        frames = sampled_video_frames(video_sec, vision.video_fps, vision.video_max_frames)
        tiles = np.rint(columns["vision_tiles"]).astype(np.int64)
        audio_sec = columns["audio_sec"]
        windows = np.ceil(audio_sec / scaling.audio_window_sec - 1e-9).astype(np.int64)
        audio_items = np.minimum(windows, scaling.max_audio_windows)
        text = np.where(columns["text_tokens"] > 0, columns["text_tokens"],
                        scaling.asr_text_tokens_per_sec * audio_sec)
        answer = np.maximum(1, np.rint(text * scaling.text_scale)).astype(np.int64)

        room = shape.seq_length - 2 - self.prompt_tokens  # BOS, prompt, >= 1 answer token
        largest_item = max(shape.vision_llm_tokens_per_item, shape.audio_llm_tokens_per_item)
        if room < largest_item:
            raise ValueError(f"seq_length={shape.seq_length} leaves room for {room} media tokens after BOS, "
                             f"{self.prompt_tokens} prompt tokens and one answer token; one item needs "
                             f"{largest_item}")
        vision_items = np.minimum(tiles + frames, room // shape.vision_llm_tokens_per_item)
        frames = np.maximum(0, vision_items - tiles)
        vision_room = room - vision_items * shape.vision_llm_tokens_per_item
        audio_items = np.minimum(audio_items, vision_room // shape.audio_llm_tokens_per_item)
        media = vision_items * shape.vision_llm_tokens_per_item + audio_items * shape.audio_llm_tokens_per_item
        self.num_vision_items = vision_items
        self.num_audio_items = audio_items
        self.answer_tokens = np.minimum(answer, room + 1 - media)
        last_fraction = np.where(audio_items == windows,
                                 audio_sec / scaling.audio_window_sec - (windows - 1), 1.0)
        self.last_window_frames = np.clip(np.ceil(last_fraction * shape.audio_frames_per_window - 1e-9), 1,
                                          shape.audio_frames_per_window).astype(np.int64)
        self.kind = np.where(frames > 0, "video", np.where(vision_items > 0, "image",
                                                           np.where(audio_items > 0, "audio", "text")))

    def __len__(self) -> int:
        return self.num_vision_items.size

    def _check_index(self, sample_index: int) -> int:
        if not 0 <= sample_index < len(self):
            raise IndexError(f"sample {sample_index} outside the dataset's 0..{len(self) - 1}")
        return int(sample_index)

    def example_sizes(self, sample_index: int) -> ExampleSizes:
        i = self._check_index(sample_index)
        return layout_sizes(i, self.prompt_tokens, int(self.num_vision_items[i]), int(self.num_audio_items[i]),
                            int(self.answer_tokens[i]), self.shape)

    def __getitem__(self, sample_index: int) -> Example:
        i = self._check_index(sample_index)
        shape = self.shape
        rng = np.random.default_rng([self.seed, _CONTENT_STREAM, i])
        prompt = list(_PROMPTS[str(self.kind[i])].encode().ljust(self.prompt_tokens)[:self.prompt_tokens])
        vision = rng.standard_normal((int(self.num_vision_items[i]), shape.vision_patches_per_item,
                                      shape.vision_patch_dim), dtype=np.float32)
        audio = rng.standard_normal((int(self.num_audio_items[i]), shape.audio_frames_per_window,
                                     shape.audio_mel_bins), dtype=np.float32)
        if audio.shape[0]:
            audio[-1, int(self.last_window_frames[i]):] = 0.0
        answer = self._chain_text(rng, int(self.answer_tokens[i]))
        return assemble_example(i, prompt, answer, torch.from_numpy(vision), torch.from_numpy(audio), shape)

    def _chain_text(self, rng: np.random.Generator, length: int) -> list[int]:
        follow = rng.random(length) < self.scaling.markov_follow_prob
        jumps = rng.integers(0, _ALPHABET.size, size=length)
        state = np.empty(length, dtype=np.int64)
        for t in range(length):
            state[t] = self._successor[state[t - 1]] if t and follow[t] else jumps[t]
        return _ALPHABET[state].tolist()


# ----------------------------------------------------------------------------------------------------
# Sampler and iterator
# ----------------------------------------------------------------------------------------------------

class MegatronPretrainingSampler:
    """Megatron-LM's ``MegatronPretrainingSampler`` index arithmetic (dataloader type ``single``).

    Samples are consumed in order, ``micro_batch_size * data_parallel_size`` per micro-batch step; of
    the step starting at sample ``start``, rank ``r`` gets ``[start + r*mbs, start + (r+1)*mbs)``.
    ``consumed_samples`` counts samples of all ranks (Megatron's ``args.consumed_train_samples``), so
    a sampler built with the consumed count of a checkpoint continues exactly where training stopped.
    An incomplete last step is dropped, as upstream with ``drop_last=True``.
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int, data_parallel_size: int):
        if total_samples < 1:
            raise ValueError(f"no sample to consume: total_samples={total_samples}")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: consumed_samples={consumed_samples}, "
                             f"total_samples={total_samples}")
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size} and data_parallel_size="
                             f"{data_parallel_size} must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank={data_parallel_rank} outside 0..{data_parallel_size - 1}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_times_data_parallel_size
        offset = self.data_parallel_rank * self.micro_batch_size
        for start in range(self.consumed_samples, self.total_samples - step + 1, step):
            yield list(range(start + offset, start + offset + self.micro_batch_size))


@dataclass(frozen=True)
class DataConfig:
    """What the training data iterator needs: the model (for shapes), batch sizes and the data source."""

    model_config: object  # megatron_orch.balance.model_config.MLLMConfig
    seq_length: int
    micro_batch_size: int
    num_samples: int  # samples the run consumes in total (train_iters * global_batch_size)
    seed: int = 1234
    manifest: Optional[str] = None  # JSONL manifest of the user's data; None: the synthetic default
    pad_to_seq_length: bool = False  # rows of exactly seq_length tokens (pipeline parallelism needs it)

    @property
    def shape(self) -> ExampleShape:
        return example_shape(self.model_config, self.seq_length)


def build_dataset(config: DataConfig):
    """The dataset a :class:`DataConfig` names: the user's manifest, else the synthetic default."""
    if config.manifest is not None:
        return ManifestDataset(config.manifest, config.shape, image_tiling(config.model_config))
    return SyntheticMultimodalDataset(config.model_config, config.num_samples, config.seed,
                                      seq_length=config.seq_length)


def build_train_iterator(config: DataConfig, consumed_samples: int, data_parallel_rank: int,
                         data_parallel_size: int) -> Iterator[MicroBatch]:
    """This DP rank's micro-batches, in Megatron's order, starting after ``consumed_samples``."""
    dataset = build_dataset(config)
    if len(dataset) < config.num_samples:
        raise ValueError(f"the dataset has {len(dataset)} examples, fewer than the {config.num_samples} "
                         "samples the run consumes")
    sampler = MegatronPretrainingSampler(config.num_samples, consumed_samples, config.micro_batch_size,
                                         data_parallel_rank, data_parallel_size)
    pad_to = config.seq_length if config.pad_to_seq_length else None
    return (collate([dataset[i] for i in indices], pad_to=pad_to) for indices in sampler)


# ----------------------------------------------------------------------------------------------------
# Users' own data: a JSONL manifest
# ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImageTiling:
    """How an image becomes vision items: InternVL-style dynamic tiling into square tiles.

    The grid (cols x rows, at most ``max_tiles`` tiles) is the one whose aspect ratio is closest to the
    image's (ties: fewer tiles), never more tiles than the image has pixels for (``ceil(W*H / tile^2)``).
    The image is resized (nearest neighbour) to the grid, cut into tiles, and a thumbnail of the whole
    image is added when the grid has more than one tile. Each tile is cut into ``patch_px`` patches,
    each flattened channel-major (C, p, p) like a Conv2d patch embedding's weight.
    """

    tile_px: int
    patch_px: int
    channels: int = 3
    max_tiles: int = 6

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(cols, rows) of the tile grid for an image of ``width`` x ``height`` pixels."""
        limit = max(1, min(self.max_tiles, math.ceil(width * height / self.tile_px ** 2)))
        target = math.log(width / height)
        candidates = [(cols, rows) for cols in range(1, limit + 1) for rows in range(1, limit // cols + 1)]
        return min(candidates, key=lambda g: (abs(math.log(g[0] / g[1]) - target), g[0] * g[1]))

    def num_tiles(self, width: int, height: int) -> int:
        cols, rows = self.grid(width, height)
        return cols * rows + (cols * rows > 1)

    def tiles(self, pixels: np.ndarray) -> np.ndarray:
        """Vision items [tiles, patches_per_tile, C*p*p] (float32) of an image [H, W, C] (values as given)."""
        height, width = pixels.shape[:2]
        cols, rows = self.grid(width, height)
        side = self.tile_px
        grid_image = _resize_nearest(pixels, rows * side, cols * side)
        tiles = [grid_image[r * side:(r + 1) * side, c * side:(c + 1) * side]
                 for r in range(rows) for c in range(cols)]
        if cols * rows > 1:
            tiles.append(_resize_nearest(pixels, side, side))
        per_side, p = side // self.patch_px, self.patch_px
        stacked = np.stack(tiles).reshape(len(tiles), per_side, p, per_side, p, self.channels)
        return stacked.transpose(0, 1, 3, 5, 2, 4).reshape(len(tiles), per_side ** 2, -1).astype(np.float32)


def _resize_nearest(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    rows = ((np.arange(height) + 0.5) * pixels.shape[0] / height).astype(np.int64)
    cols = ((np.arange(width) + 0.5) * pixels.shape[1] / width).astype(np.int64)
    return pixels[rows][:, cols]


def image_tiling(model_config, max_tiles: int = 6) -> ImageTiling:
    vision = model_config.vision
    return ImageTiling(tile_px=vision.tile_px, patch_px=vision.patch_px, channels=vision.channels,
                       max_tiles=max_tiles)


_MANIFEST_KEYS = {"text", "prompt", "images", "audio", "sizes"}
_SIZE_KEYS = {"vision_items", "audio_items", "text_tokens"}


class ManifestError(ValueError):
    """A manifest line that cannot be used; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class _ManifestRecord:
    where: str  # "manifest.jsonl:12"
    text: str
    prompt: str
    images: tuple[Path, ...]
    audio: tuple[Path, ...]
    sizes: Optional[dict]


class ManifestDataset:
    """Examples from a JSONL manifest, one JSON object per line (blank lines are skipped)::

        {"text": "a cat on a mat", "prompt": "describe:", "images": ["img/0.png"], "audio": ["mel/0.npy"],
         "sizes": {"vision_items": 3, "audio_items": 2, "text_tokens": 14}}

    ``text`` (required) is the answer the loss is computed on; ``prompt`` (optional) precedes the media
    and is not trained on. ``images`` are image files read with PIL (any format it knows) or ``.npy``
    arrays [H, W, C] / [H, W] of pixel values; integer pixels are scaled by 1/255. Each image becomes
    :class:`ImageTiling` tiles. ``audio`` are ``.npy`` log-mel arrays [frames, mel_bins] (the model's
    frame rate and mel bins): raw audio decoding and mel extraction are left to the user's
    preprocessing. Each array is cut into fixed windows of the model's length, the last one zero-padded.
    Relative paths are relative to the manifest's folder. Text is tokenized with ``tokenizer.encode``
    (default :class:`ByteTokenizer`; a custom tokenizer must never produce the special ids
    ``BYTE_VOCAB_SIZE..MIN_VOCAB_SIZE-1``). An answer too long for ``shape.seq_length`` is truncated
    (the EOS kept); media and prompt that do not fit are an error.

    :meth:`example_sizes` reads no pixels or mel frames: it takes the optional ``sizes`` field, else
    image headers (PIL, or the ``.npy`` header) and ``.npy`` headers. Declared sizes are checked against
    the real ones when the example is loaded.
    """

    def __init__(self, path, shape: ExampleShape, tiling: ImageTiling, tokenizer=None):
        self.path = Path(path)
        self.shape = shape
        self.tiling = tiling
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        if tiling.channels * tiling.patch_px ** 2 != shape.vision_patch_dim or \
                (tiling.tile_px // tiling.patch_px) ** 2 != shape.vision_patches_per_item:
            raise ValueError(f"image tiling {tiling} does not give vision items of shape "
                             f"({shape.vision_patches_per_item}, {shape.vision_patch_dim})")
        if not self.path.is_file():
            raise FileNotFoundError(f"manifest {self.path} does not exist")
        self.records: list[_ManifestRecord] = []
        with open(self.path, encoding="utf-8") as f:
            for line_number, line in enumerate(f, start=1):
                if line.strip():
                    self.records.append(self._parse(line, f"{self.path}:{line_number}"))
        if not self.records:
            raise ManifestError(f"{self.path}: the manifest holds no examples")

    def _parse(self, line: str, where: str) -> _ManifestRecord:
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as err:
            raise ManifestError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: expected a JSON object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - _MANIFEST_KEYS)
        if unknown:
            raise ManifestError(f"{where}: unknown keys {unknown}; allowed: {sorted(_MANIFEST_KEYS)}")
        if not isinstance(entry.get("text"), str):
            raise ManifestError(f"{where}: 'text' must be a string, got {entry.get('text')!r}")
        if not isinstance(entry.get("prompt", ""), str):
            raise ManifestError(f"{where}: 'prompt' must be a string, got {entry['prompt']!r}")
        paths = {}
        for key in ("images", "audio"):
            value = entry.get(key, [])
            if not isinstance(value, list) or not all(isinstance(p, str) and p for p in value):
                raise ManifestError(f"{where}: '{key}' must be a list of file paths, got {value!r}")
            paths[key] = tuple(self.path.parent / p for p in value)
        sizes = entry.get("sizes")
        if sizes is not None:
            if not isinstance(sizes, dict) or set(sizes) != _SIZE_KEYS:
                raise ManifestError(f"{where}: 'sizes' must be an object with exactly the keys "
                                    f"{sorted(_SIZE_KEYS)}, got {sizes!r}")
            bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
            if bad:
                raise ManifestError(f"{where}: 'sizes' values must be non-negative integers, got {bad}")
        return _ManifestRecord(where, entry["text"], entry.get("prompt", ""), paths["images"], paths["audio"],
                               sizes)

    def __len__(self) -> int:
        return len(self.records)

    def _encode(self, text: str, where: str) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        special = [t for t in ids if BYTE_VOCAB_SIZE <= t < MIN_VOCAB_SIZE or t < 0]
        if special:
            raise ManifestError(f"{where}: the tokenizer produced reserved or negative ids {special[:5]}")
        return ids

    def _fit(self, record: _ManifestRecord, sample_index: int, prompt_tokens: int, vision_items: int,
             audio_items: int, answer_tokens: int) -> ExampleSizes:
        """Sizes after truncating the answer to the sequence length."""
        fixed = layout_sizes(sample_index, prompt_tokens, vision_items, audio_items, 0, self.shape)
        room = self.shape.seq_length - fixed.num_tokens
        if room < 1:
            raise ManifestError(f"{record.where}: prompt ({prompt_tokens} tokens), {vision_items} vision items "
                                f"and {audio_items} audio windows need {fixed.num_tokens} tokens plus the "
                                f"answer; seq_length is {self.shape.seq_length}")
        return layout_sizes(sample_index, prompt_tokens, vision_items, audio_items,
                            min(answer_tokens, room), self.shape)

    def example_sizes(self, sample_index: int) -> ExampleSizes:
        """Sizes of example ``sample_index`` from the ``sizes`` field or file headers; loads no data."""
        record = self.records[sample_index]
        prompt_tokens = len(self._encode(record.prompt, record.where))
        if record.sizes is not None:
            vision_items, audio_items = record.sizes["vision_items"], record.sizes["audio_items"]
            answer_tokens = record.sizes["text_tokens"]
        else:
            vision_items = sum(self.tiling.num_tiles(*_image_size(p, record.where)) for p in record.images)
            audio_items = sum(math.ceil(_mel_shape(p, record.where, self.shape)[0]
                                        / self.shape.audio_frames_per_window) for p in record.audio)
            answer_tokens = len(self._encode(record.text, record.where))
        return self._fit(record, sample_index, prompt_tokens, vision_items, audio_items, answer_tokens)

    def __getitem__(self, sample_index: int) -> Example:
        record = self.records[sample_index]
        prompt = self._encode(record.prompt, record.where)
        answer = self._encode(record.text, record.where)
        patch_shape = (self.shape.vision_patches_per_item, self.shape.vision_patch_dim)
        tiles = [self.tiling.tiles(_load_image(p, record.where, self.tiling.channels)) for p in record.images]
        vision = torch.from_numpy(np.concatenate(tiles) if tiles else np.zeros((0, *patch_shape), np.float32))
        windows = [_windows(_load_mel(p, record.where, self.shape), self.shape.audio_frames_per_window)
                   for p in record.audio]
        window_shape = (self.shape.audio_frames_per_window, self.shape.audio_mel_bins)
        audio = torch.from_numpy(np.concatenate(windows) if windows else np.zeros((0, *window_shape), np.float32))
        if record.sizes is not None:
            real = {"vision_items": vision.shape[0], "audio_items": audio.shape[0], "text_tokens": len(answer)}
            wrong = {k: (record.sizes[k], v) for k, v in real.items() if record.sizes[k] != v}
            if wrong:
                raise ManifestError(f"{record.where}: declared 'sizes' differ from the data "
                                    f"(declared, real): {wrong}")
        sizes = self._fit(record, sample_index, len(prompt), vision.shape[0], audio.shape[0], len(answer))
        return assemble_example(sample_index, prompt, answer[:sizes.num_loss_tokens - 1], vision, audio,
                                self.shape)


def _image_size(path: Path, where: str) -> tuple[int, int]:
    """(width, height) from the file header only."""
    if path.suffix == ".npy":
        shape = _npy_shape(path, where)
        if len(shape) not in (2, 3) or min(shape[:2]) < 1:
            raise ManifestError(f"{where}: image {path} has shape {shape}, expected [H, W] or [H, W, C]")
        return shape[1], shape[0]
    image_module = _pil(path, where)
    try:
        with image_module.open(path) as image:
            return image.size
    except (OSError, ValueError) as err:
        raise ManifestError(f"{where}: cannot read image {path}: {err}") from None


def _load_image(path: Path, where: str, channels: int) -> np.ndarray:
    if path.suffix == ".npy":
        _image_size(path, where)
        pixels = np.load(path)
    else:
        image_module = _pil(path, where)
        try:
            with image_module.open(path) as image:
                pixels = np.asarray(image.convert("RGB" if channels == 3 else "L"))
        except (OSError, ValueError) as err:
            raise ManifestError(f"{where}: cannot read image {path}: {err}") from None
    if pixels.ndim == 2:
        pixels = np.repeat(pixels[:, :, None], channels, axis=2)
    if pixels.shape[2] != channels:
        raise ManifestError(f"{where}: image {path} has {pixels.shape[2]} channels, the model takes {channels}")
    scale = 1.0 / 255.0 if np.issubdtype(pixels.dtype, np.integer) else 1.0
    return pixels.astype(np.float32) * scale


def _pil(path: Path, where: str):
    try:
        from PIL import Image
    except ImportError:
        raise ManifestError(f"{where}: reading {path} needs Pillow (pip install pillow); "
                            "or store images as .npy arrays") from None
    if not path.is_file():
        raise ManifestError(f"{where}: image file {path} does not exist")
    return Image


def _npy_shape(path: Path, where: str) -> tuple[int, ...]:
    if not path.is_file():
        raise ManifestError(f"{where}: file {path} does not exist")
    try:
        return tuple(np.load(path, mmap_mode="r").shape)
    except (OSError, ValueError) as err:
        raise ManifestError(f"{where}: cannot read {path} as a .npy array: {err}") from None


def _mel_shape(path: Path, where: str, shape: ExampleShape) -> tuple[int, int]:
    if path.suffix != ".npy":
        raise ManifestError(f"{where}: audio {path} must be a .npy log-mel array [frames, mel_bins]; decode "
                            "audio and extract mel features in preprocessing")
    mel = _npy_shape(path, where)
    if len(mel) != 2 or mel[0] < 1 or mel[1] != shape.audio_mel_bins:
        raise ManifestError(f"{where}: audio {path} has shape {mel}, expected [frames >= 1, "
                            f"{shape.audio_mel_bins}]")
    return mel


def _load_mel(path: Path, where: str, shape: ExampleShape) -> np.ndarray:
    _mel_shape(path, where, shape)
    return np.load(path).astype(np.float32)


def _windows(mel: np.ndarray, frames_per_window: int) -> np.ndarray:
    """[frames, M] -> [ceil(frames / F), F, M], the last window zero-padded."""
    count = math.ceil(mel.shape[0] / frames_per_window)
    padded = np.zeros((count * frames_per_window, mel.shape[1]), dtype=np.float32)
    padded[:mel.shape[0]] = mel
    return padded.reshape(count, frames_per_window, mel.shape[1])
