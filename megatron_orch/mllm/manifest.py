"""Users' own data: a JSONL manifest of images, log-mel arrays and text, and InternVL-style image tiling."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from megatron_orch.megatron.batch import BYTE_VOCAB_SIZE, MIN_VOCAB_SIZE, Example, ExampleShape, ExampleSizes
from megatron_orch.mllm.examples import ByteTokenizer, assemble_example, layout_sizes


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
