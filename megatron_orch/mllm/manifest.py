"""Users' own data: a JSONL manifest of images, log-mel arrays and text, and InternVL-style image tiling."""
from __future__ import annotations

import hashlib
import io
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np
import torch

from megatron_orch.megatron.batch import Example, ExampleSizes
from megatron_orch.mllm.config import BYTE_VOCAB_SIZE
from megatron_orch.mllm.examples import ByteTokenizer, ExampleLayout, assemble_example, layout_sizes
from megatron_orch.mllm.files import not_a_file, outside_folder


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

    def __post_init__(self):
        if self.max_tiles < 1:
            raise ValueError(f"--max-num-tiles must be >= 1, got {self.max_tiles}")

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(cols, rows) of the tile grid for an image of ``width`` x ``height`` pixels."""
        limit = max(1, min(self.max_tiles, math.ceil(width * height / self.tile_px ** 2)))
        target = math.log(width / height)
        candidates = [(cols, rows) for cols in range(1, limit + 1) for rows in range(1, limit // cols + 1)]
        return min(candidates, key=lambda g: (abs(math.log(g[0] / g[1]) - target), g[0] * g[1]))

    def num_tiles(self, width: int, height: int) -> int:
        cols, rows = self.grid(width, height)
        return cols * rows + (cols * rows > 1)

    def tiles(self, pixels: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """Vision items [tiles, patches_per_tile, C*p*p] (float32, values times ``scale``) of an image
        [H, W, C] or [H, W] (grey, repeated over the channels) of any dtype, e.g. a memory-mapped uint8
        array: the image is resized to the tiles first, so only the tiles are ever read and converted."""
        height, width = pixels.shape[:2]
        cols, rows = self.grid(width, height)
        side = self.tile_px
        grid_image = _resize_nearest(pixels, rows * side, cols * side)
        tiles = [grid_image[r * side:(r + 1) * side, c * side:(c + 1) * side]
                 for r in range(rows) for c in range(cols)]
        if cols * rows > 1:
            tiles.append(_resize_nearest(pixels, side, side))
        stacked = np.stack(tiles)
        if stacked.ndim == 3:
            stacked = np.repeat(stacked[..., None], self.channels, axis=3)
        per_side, p = side // self.patch_px, self.patch_px
        stacked = stacked.reshape(len(tiles), per_side, p, per_side, p, self.channels)
        items = stacked.transpose(0, 1, 3, 5, 2, 4).reshape(len(tiles), per_side ** 2, -1).astype(np.float32)
        return items * np.float32(scale) if scale != 1.0 else items


def _resize_nearest(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    rows = ((np.arange(height) + 0.5) * pixels.shape[0] / height).astype(np.int64)
    cols = ((np.arange(width) + 0.5) * pixels.shape[1] / width).astype(np.int64)
    return pixels[rows][:, cols]


def image_tiling(model_config, max_tiles: int = 6) -> ImageTiling:
    """The tiling of ``model_config``'s encoder of images, at most ``max_tiles`` tiles (``--max-num-tiles``)."""
    name = model_config.encoder_of("images")
    if name is None:
        raise ValueError(f"model config {model_config.name!r} has no encoder of images, which a manifest's "
                         "images need")
    vision = model_config.encoders[name]
    return ImageTiling(tile_px=vision.tile_px, patch_px=vision.patch_px, channels=vision.channels,
                       max_tiles=max_tiles)


# Log-mel frames per second of audio: Whisper's 10 ms hop (a 30 s window is 3000 frames).
MEL_FRAMES_PER_SECOND = 100


@dataclass(frozen=True)
class ValueRange:
    """The values an array of media may hold (``low`` to ``high``), and how messages say it."""

    low: float
    high: float
    text: str


# Float pixels are in [0, 1]; values up to one 8-bit step outside (rounding, resampling) are accepted.
FLOAT_PIXEL_TOLERANCE = 1.0 / 255.0
FLOAT_PIXEL_RANGE = ValueRange(-FLOAT_PIXEL_TOLERANCE, 1.0 + FLOAT_PIXEL_TOLERANCE, "[0, 1] (1/255 tolerated outside)")
# Largest log-mel magnitude: any log scale (natural, log10, dB) stays far within it; beyond is not a log-mel
# (linear power?) or damaged data, which would overflow the encoder's activations.
MAX_LOG_MEL_MAGNITUDE = 1000.0
LOG_MEL_RANGE = ValueRange(-MAX_LOG_MEL_MAGNITUDE, MAX_LOG_MEL_MAGNITUDE, f"+-{MAX_LOG_MEL_MAGNITUDE:g}")


@dataclass(frozen=True)
class InputLimits:
    """What one example may hold, checked from file headers before any pixel or frame is read.

    ``max_image_pixels`` (``--max-image-pixels``): width x height of one image before tiling;
    ``max_audio_seconds`` (``--max-audio-seconds``): length of one audio clip (at
    :data:`MEL_FRAMES_PER_SECOND`); ``max_vision_items_per_sample`` (``--max-vision-items-per-sample``):
    tiles and thumbnails of all images of one example. Tiles per image are the tiling's ``max_tiles``
    (``--max-num-tiles``).
    """

    max_image_pixels: int = 8192 * 8192
    max_audio_seconds: float = 600.0
    max_vision_items_per_sample: int = 64

    def __post_init__(self):
        for name in ("max_image_pixels", "max_audio_seconds", "max_vision_items_per_sample"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {value!r}")


_MANIFEST_KEYS = {"text", "prompt", "images", "audio", "sizes"}
_SIZE_KEYS = {"vision_items", "audio_items", "text_tokens"}


class ManifestError(ValueError):
    """A manifest line that cannot be used; the message names the file, the line and the problem."""


@dataclass(frozen=True)
class MediaBytes:
    """A media file held in memory (a part of a WebDataset sample), read like a file path: ``data`` None
    is a file that is missing. ``name`` says which file it is in messages; a ``.npy`` array is known by
    its magic bytes, whatever the name."""

    name: str
    data: Optional[bytes]

    @property
    def suffix(self) -> str:
        return ".npy" if self.data is not None and self.data.startswith(b"\x93NUMPY") else Path(self.name).suffix

    def is_file(self) -> bool:
        return self.data is not None

    def open(self, mode: str = "rb") -> io.BytesIO:
        return _NamedBytes(self.data, self.name)

    def __str__(self) -> str:
        return self.name


class _NamedBytes(io.BytesIO):
    """In-memory file bytes that name their file in readers' messages (Pillow's "cannot identify image file")."""

    def __init__(self, data: bytes, name: str):
        super().__init__(data)
        self._name = name

    def __repr__(self) -> str:
        return repr(self._name)


MediaSource = Union[Path, MediaBytes]


@dataclass(frozen=True)
class _ManifestRecord:
    where: str  # "manifest.jsonl:12"
    text: str
    prompt: str
    images: tuple[MediaSource, ...]
    audio: tuple[MediaSource, ...]
    sizes: Optional[dict]


class ExampleReader:
    """How one entry of the manifest schema (:class:`ManifestDataset`) becomes an example, wherever the
    entry and its media come from: a JSONL line and files (:class:`ManifestDataset`), or an Energon
    sample and the parts of its WebDataset sample (:mod:`megatron_orch.mllm.energon`). Every check, size
    and limit is made here, the same for both."""

    def __init__(self, layout: ExampleLayout, tiling: ImageTiling, tokenizer=None,
                 limits: InputLimits = InputLimits(), refuse_long_answers: bool = False,
                 media_folder: Optional[Path] = None):
        self.layout = layout
        self.media_folder = media_folder  # media files must resolve inside it (None: anywhere)
        self.tiling = tiling
        self.limits = limits
        self.refuse_long_answers = refuse_long_answers
        self.tokenizer = ByteTokenizer() if tokenizer is None else tokenizer
        image_shape = layout.input_of("images", "the data").item_shape
        if ((tiling.tile_px // tiling.patch_px) ** 2, tiling.channels * tiling.patch_px ** 2) != image_shape:
            raise ValueError(f"image tiling {tiling} does not give vision items of shape {image_shape}")

    def parse_entry(self, entry, where: str, media: Callable[[str], MediaSource]) -> _ManifestRecord:
        """The record of one manifest entry (a parsed JSON object) found at ``where``; ``media(name)`` is
        the file an ``images`` or ``audio`` name refers to. Raises :class:`ManifestError` for wrong keys
        or types."""
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
            paths[key] = tuple(media(p) for p in value)
        sizes = entry.get("sizes")
        if sizes is not None:
            if not isinstance(sizes, dict) or set(sizes) != _SIZE_KEYS:
                raise ManifestError(f"{where}: 'sizes' must be an object with exactly the keys "
                                    f"{sorted(_SIZE_KEYS)}, got {sizes!r}")
            bad = {k: v for k, v in sizes.items() if not isinstance(v, int) or isinstance(v, bool) or v < 0}
            if bad:
                raise ManifestError(f"{where}: 'sizes' values must be non-negative integers, got {bad}")
            self._check_vision_items(sizes["vision_items"], where, "'sizes' declares")
        return _ManifestRecord(where, entry["text"], entry.get("prompt", ""), paths["images"], paths["audio"],
                               sizes)

    def _check_media_inside(self, record: _ManifestRecord) -> None:
        """Every media file of ``record`` resolves inside :attr:`media_folder` (absolute paths, ``..`` and
        symlinks out of it are refused)."""
        if self.media_folder is None:
            return
        for path in record.images + record.audio:
            real = outside_folder(path, self.media_folder)
            if real is not None:
                raise ManifestError(f"{record.where}: media file {path} is outside the manifest's folder "
                                    f"{self.media_folder} (it resolves to {real}); pass --allow-external-media to "
                                    "read media outside it")

    def _check_vision_items(self, count: int, where: str, what: str) -> None:
        limit = self.limits.max_vision_items_per_sample
        if count > limit:
            raise ManifestError(f"{where}: {what} {count} vision items, above --max-vision-items-per-sample {limit}")

    def _vision_items(self, record: _ManifestRecord) -> int:
        """Tiles and thumbnails of the record's images, from their headers, within the limits."""
        count = sum(self.tiling.num_tiles(*_image_size(p, record.where, self.limits)) for p in record.images)
        limit = self.limits.max_vision_items_per_sample
        if count > limit:
            raise ManifestError(f"{record.where}: {count} vision items (tiles and thumbnails of "
                                f"{len(record.images)} images), above --max-vision-items-per-sample {limit}")
        return count

    def _encode(self, text: str, where: str) -> list[int]:
        ids = list(self.tokenizer.encode(text))
        special = [t for t in ids if BYTE_VOCAB_SIZE <= t < self.layout.min_vocab_size or t < 0]
        if special:
            raise ManifestError(f"{where}: the tokenizer produced reserved or negative ids {special[:5]}")
        return ids

    def _fit(self, record: _ManifestRecord, sample_index: int, prompt_tokens: int, vision_items: int,
             audio_items: int, answer_tokens: int) -> tuple[ExampleSizes, Optional[str]]:
        """Sizes after truncating the answer to the sequence length, and a note saying so if it was
        (with ``refuse_long_answers`` an answer that does not fit is an error instead)."""
        items = self._by_phase(vision_items, audio_items, record.where)
        fixed = layout_sizes(sample_index, prompt_tokens, items, 0, self.layout.spec)
        room = self.layout.seq_length - fixed.num_tokens
        if room < 1:
            raise ManifestError(f"{record.where}: prompt ({prompt_tokens} tokens), {vision_items} vision items "
                                f"and {audio_items} audio windows need {fixed.num_tokens} tokens plus the "
                                f"answer; seq_length is {self.layout.seq_length}")
        kept, note = min(answer_tokens, room), None
        if answer_tokens > room:
            note = (f"{record.where}: answer of {answer_tokens} tokens, {room} fit in --seq-length "
                    f"{self.layout.seq_length} after the prompt and media")
            if self.refuse_long_answers:
                raise ManifestError(f"{note} (--refuse-long-answers)")
            note += f": truncated to {kept} (EOS kept)"
        return layout_sizes(sample_index, prompt_tokens, items, kept, self.layout.spec), note

    def _by_phase(self, images, audio, where: str) -> dict:
        """The record's image tiles and audio windows (counts or tensors) as items of the encoder phases
        that take them (a medium the record lacks needs no encoder)."""
        media = {"images": images, "audio": audio}
        return {self.layout.phase_of(medium, where): value for medium, value in media.items()
                if (value.shape[0] if isinstance(value, torch.Tensor) else value)}

    def _audio_windows(self, record: _ManifestRecord) -> int:
        """Audio windows of the record's log-mel arrays, from their headers, within the limits."""
        return sum(math.ceil(_mel_shape(p, record.where, self.layout, self.limits)[0]
                             / self.layout.input_of("audio", record.where).item_shape[0]) for p in record.audio)

    @staticmethod
    def _check_declared(record: _ManifestRecord, real: dict) -> None:
        wrong = {k: (record.sizes[k], v) for k, v in real.items() if record.sizes[k] != v}
        if wrong:
            raise ManifestError(f"{record.where}: declared 'sizes' differ from the data "
                                f"(declared, real): {wrong}")

    def record_sizes(self, record: _ManifestRecord, sample_index: int) -> ExampleSizes:
        """Sizes of ``record`` (as example ``sample_index``) from its ``sizes`` field or its media's headers;
        loads no data."""
        prompt_tokens = len(self._encode(record.prompt, record.where))
        if record.sizes is not None:
            vision_items, audio_items = record.sizes["vision_items"], record.sizes["audio_items"]
            answer_tokens = record.sizes["text_tokens"]
        else:
            self._check_media_inside(record)
            vision_items = self._vision_items(record)
            audio_items = self._audio_windows(record)
            answer_tokens = len(self._encode(record.text, record.where))
        return self._fit(record, sample_index, prompt_tokens, vision_items, audio_items, answer_tokens)[0]

    def check_record(self, record: _ManifestRecord, sample_index: int, decode: bool = False) -> Optional[str]:
        """Every check loading ``record`` makes, from its media's headers (``decode``: by loading it);
        raises :class:`ManifestError` naming where it is and the reason. Returns the note of a truncated
        answer, or None."""
        if decode:
            return self.read_record(record, sample_index)[1]
        self._check_media_inside(record)
        prompt_tokens = len(self._encode(record.prompt, record.where))
        vision_items, audio_items = self._vision_items(record), self._audio_windows(record)
        answer_tokens = len(self._encode(record.text, record.where))
        if record.sizes is not None:
            self._check_declared(record, {"vision_items": vision_items, "audio_items": audio_items,
                                          "text_tokens": answer_tokens})
        return self._fit(record, sample_index, prompt_tokens, vision_items, audio_items, answer_tokens)[1]

    def read_record(self, record: _ManifestRecord, sample_index: int) -> tuple[Example, Optional[str]]:
        """``record`` as example ``sample_index``, and the note of its truncated answer (None if it fit)."""
        prompt = self._encode(record.prompt, record.where)
        answer = self._encode(record.text, record.where)
        self._check_media_inside(record)
        self._vision_items(record)
        for p in record.audio:
            _mel_shape(p, record.where, self.layout, self.limits)
        tiles = [_load_tiles(p, record.where, self.tiling, self.limits) for p in record.images]
        vision = torch.from_numpy(np.concatenate(tiles)) if tiles else torch.zeros(0)
        windows = [_windows(_load_mel(p, record.where, self.layout, self.limits),
                            self.layout.input_of("audio", record.where).item_shape[0]) for p in record.audio]
        audio = torch.from_numpy(np.concatenate(windows)) if windows else torch.zeros(0)
        if record.sizes is not None:
            self._check_declared(record, {"vision_items": vision.shape[0], "audio_items": audio.shape[0],
                                          "text_tokens": len(answer)})
        sizes, note = self._fit(record, sample_index, len(prompt), vision.shape[0], audio.shape[0], len(answer))
        return assemble_example(sample_index, prompt, answer[:sizes.num_loss_tokens - 1],
                                self._by_phase(vision, audio, record.where), self.layout.spec), note




class ManifestDataset(ExampleReader):
    """Examples from a JSONL manifest, one JSON object per line (blank lines are skipped)::

        {"text": "a cat on a mat", "prompt": "describe:", "images": ["img/0.png"], "audio": ["mel/0.npy"],
         "sizes": {"vision_items": 3, "audio_items": 2, "text_tokens": 14}}

    ``text`` (required) is the answer the loss is computed on; ``prompt`` (optional) precedes the media
    and is not trained on. ``images`` are image files read with PIL (any format it knows) or ``.npy``
    arrays [H, W, C] / [H, W] of pixel values; integer pixels are scaled to [0, 1] (16-bit ones, uint16
    arrays and 16-bit PNGs, by 1/65535, other integers by 1/255). Each image becomes
    :class:`ImageTiling` tiles. ``audio`` are ``.npy`` log-mel arrays [frames, mel_bins] (the model's
    frame rate and mel bins): raw audio decoding and mel extraction are left to the user's
    preprocessing. Each array is cut into fixed windows of the model's length, the last one zero-padded.
    Relative paths are relative to the manifest's folder, and every media file must resolve inside it (an
    absolute path, ``..`` or a symlink out of it is refused unless ``allow_external_media``). Float pixels
    must be in [0, 1] (:data:`FLOAT_PIXEL_RANGE`), log-mel values within :data:`MAX_LOG_MEL_MAGNITUDE`
    (checked as they are loaded). Text is tokenized with ``tokenizer.encode``
    (default :class:`ByteTokenizer`; a custom tokenizer must never produce the special ids
    ``BYTE_VOCAB_SIZE..min_vocab_size-1`` of the layout). A ``.npy`` array must be of a real floating or an
    unsigned integer dtype (checked from its header: complex and signed integer arrays are refused) and
    finite once converted to float32 (checked as it is loaded; the error names the first bad index). An
    answer too long for ``layout.seq_length`` is truncated (the EOS kept; :meth:`read` says so), or refused with ``refuse_long_answers``; media and prompt that
    do not fit are an error. :meth:`check` makes every check loading an example makes, from the headers.

    :meth:`example_sizes` reads no pixels or mel frames: it takes the optional ``sizes`` field, else
    image headers (PIL, or the ``.npy`` header) and ``.npy`` headers. Declared sizes are checked against
    the real ones when the example is loaded. :class:`InputLimits` bound what an example may hold; they
    are checked from the headers (and the ``sizes`` field) before any data is read, and a rejection
    names the line, the file and the flag of the limit. Images are cut into tiles before their pixels
    are converted to float (a ``.npy`` image is read through a memory map), so loading never holds a
    float copy of a large image.
    """

    def __init__(self, path, layout: ExampleLayout, tiling: ImageTiling, tokenizer=None,
                 limits: InputLimits = InputLimits(), refuse_long_answers: bool = False,
                 allow_external_media: bool = False):
        self.path = Path(path)
        layout.input_of("images", f"manifest {self.path}")
        super().__init__(layout, tiling, tokenizer, limits, refuse_long_answers,
                         media_folder=None if allow_external_media else self.path.parent)
        problem = not_a_file(self.path)
        if problem is not None:
            raise FileNotFoundError(f"manifest {self.path} {problem}")
        self.records: list[_ManifestRecord] = []
        with open(self.path, "rb") as f:
            for line_number, raw in enumerate(f, start=1):
                line = _decode_line(raw, f"{self.path}:{line_number}")
                if line.strip():
                    self.records.append(self._parse(line, f"{self.path}:{line_number}"))
        if not self.records:
            raise ManifestError(f"{self.path}: the manifest holds no examples")

    def _parse(self, line: str, where: str) -> _ManifestRecord:
        try:  # without its newline: JSON cut short would be reported at "line 2 column 1"
            entry = json.loads(line.rstrip("\r\n"))
        except json.JSONDecodeError as err:
            raise ManifestError(f"{where}: not valid JSON ({err.msg} at column {err.pos + 1})") from None
        return self.parse_entry(entry, where, lambda name: self.path.parent / name)

    def __len__(self) -> int:
        return len(self.records)

    def where(self, sample_index: int) -> str:
        """``manifest.jsonl:12``: the line of example ``sample_index``."""
        return self.records[sample_index].where

    def example_sizes(self, sample_index: int) -> ExampleSizes:
        """Sizes of example ``sample_index`` from the ``sizes`` field or file headers; loads no data."""
        return self.record_sizes(self.records[sample_index], sample_index)

    def check(self, sample_index: int, decode: bool = False) -> Optional[str]:
        """Every check loading example ``sample_index`` makes, from the file headers (``decode``: by
        loading it); raises :class:`ManifestError` naming the line and the reason. Returns the note of a
        truncated answer, or None."""
        return self.check_record(self.records[sample_index], sample_index, decode)

    def __getitem__(self, sample_index: int) -> Example:
        return self.read(sample_index)[0]

    def read(self, sample_index: int) -> tuple[Example, Optional[str]]:
        """Example ``sample_index`` and the note of its truncated answer (None if it fit)."""
        return self.read_record(self.records[sample_index], sample_index)


def _decode_line(raw: bytes, where: str) -> str:
    """A manifest line as text; not UTF-8: an error naming the line, the column and the byte."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        column = len(raw[:err.start].decode("utf-8", errors="replace")) + 1
        raise ManifestError(f"{where}: not UTF-8 text (byte 0x{raw[err.start]:02x} at column {column}); "
                            "write the manifest in UTF-8") from None


def _image_size(path: MediaSource, where: str, limits: InputLimits) -> tuple[int, int]:
    """(width, height) from the file header only, within ``limits``."""
    if path.suffix == ".npy":
        shape, dtype = _npy_header(path, where)
        if len(shape) not in (2, 3) or min(shape[:2]) < 1:
            raise ManifestError(f"{where}: image {path} has shape {shape}, expected [H, W] or [H, W, C]")
        _check_dtype(dtype, f"{where}: image {path}")
        width, height = shape[1], shape[0]
    else:
        with _open_image(path, where) as image:
            width, height = image.size
    if width * height > limits.max_image_pixels:
        raise ManifestError(f"{where}: image {path} has {width} x {height} = {width * height} pixels, above "
                            f"--max-image-pixels {limits.max_image_pixels}")
    return width, height


def _load_tiles(path: MediaSource, where: str, tiling: ImageTiling, limits: InputLimits) -> np.ndarray:
    """The vision items of one image: sized from its header, cut into tiles, then converted to float."""
    _image_size(path, where, limits)
    if path.suffix == ".npy":
        pixels = _npy_memmap(path, where)
    else:
        with _open_image(path, where) as image:
            try:  # 16-bit grey stays 16-bit and float grey (mode F, e.g. a float TIFF) float: convert() would
                # clip them to 8 bits
                pixels = np.asarray(image if image.mode.startswith("I;16") or image.mode == "F" else
                                    image.convert("RGB" if tiling.channels == 3 else "L"))
            except (OSError, ValueError) as err:
                raise ManifestError(f"{where}: cannot read image {path}: {err}") from None
    _check_finite(pixels, f"{where}: image {path}", "pixel values",
                  FLOAT_PIXEL_RANGE if pixels.dtype.kind == "f" else None)
    channels = 1 if pixels.ndim == 2 else pixels.shape[2]
    if channels not in (1, tiling.channels):
        raise ManifestError(f"{where}: image {path} has {channels} channels, the model takes {tiling.channels}")
    if pixels.ndim == 3 and channels == 1:
        pixels = pixels[:, :, 0]
    return tiling.tiles(pixels, _pixel_scale(pixels.dtype))


def _pixel_scale(dtype: np.dtype) -> float:
    """Pixels to [0, 1]: 16-bit (uint16) by 1/65535, other integers (8-bit) by 1/255; floats as they are."""
    if dtype == np.uint16:
        return 1.0 / 65535.0
    return 1.0 / 255.0 if np.issubdtype(dtype, np.integer) else 1.0


# Pillow refuses images above twice Image.MAX_IMAGE_PIXELS while opening them (DecompressionBombError)
# and warns above it, before the size is known to the caller. --max-image-pixels replaces that check:
# the header is read with Pillow's check off (under this lock, so that no other loader's open runs
# without it), and the size is checked against our limit before any pixel is decoded.
_PIL_OPEN_LOCK = threading.Lock()


def _open_image(path: MediaSource, where: str):
    try:
        from PIL import Image
    except ImportError:
        raise ManifestError(f"{where}: reading {path} needs Pillow (pip install pillow); "
                            "or store images as .npy arrays") from None
    _check_file(path, where, "image file")
    with _PIL_OPEN_LOCK:
        saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        try:
            return Image.open(path if isinstance(path, Path) else path.open())
        except (OSError, ValueError) as err:
            raise ManifestError(f"{where}: cannot read image {path}: {err}") from None
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def _check_file(path: MediaSource, where: str, what: str) -> None:
    """``path`` is a file to read: else what it is (missing, a folder, a FIFO, ...) names it."""
    problem = (None if path.is_file() else "does not exist") if isinstance(path, MediaBytes) else not_a_file(path)
    if problem is not None:
        raise ManifestError(f"{where}: {what} {path} {problem}")


def _npy_header(path: MediaSource, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of a .npy file from its header; reads no data."""
    _check_file(path, where, "file")
    try:
        with path.open("rb") as f:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                np.lib.format.read_array_header_2_0
            shape, _, dtype = read_header(f)
    except (OSError, ValueError) as err:
        raise ManifestError(f"{where}: cannot read {path} as a .npy array: {err}") from None
    return tuple(shape), dtype


def _npy_memmap(path: MediaSource, where: str) -> np.ndarray:
    """The array of a .npy file, memory-mapped: only what is indexed is read (in memory already: as it is)."""
    try:
        return np.load(path, mmap_mode="r") if isinstance(path, Path) else np.load(path.open(), allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ManifestError(f"{where}: cannot read {path} as a .npy array: {err}") from None


def _mel_shape(path: MediaSource, where: str, layout: ExampleLayout, limits: InputLimits) -> tuple[int, int]:
    mel_bins = layout.input_of("audio", where).item_shape[1]
    if path.suffix != ".npy":
        raise ManifestError(f"{where}: audio {path} must be a .npy log-mel array [frames, mel_bins]; decode "
                            "audio and extract mel features in preprocessing")
    mel, dtype = _npy_header(path, where)
    if len(mel) != 2 or mel[0] < 1 or mel[1] != mel_bins:
        raise ManifestError(f"{where}: audio {path} has shape {mel}, expected [frames >= 1, {mel_bins}]")
    _check_dtype(dtype, f"{where}: audio {path}")
    seconds = mel[0] / MEL_FRAMES_PER_SECOND
    if seconds > limits.max_audio_seconds:
        raise ManifestError(f"{where}: audio {path} holds {seconds} s of log-mel frames ({mel[0]} at "
                            f"{MEL_FRAMES_PER_SECOND} per second), above --max-audio-seconds "
                            f"{limits.max_audio_seconds:g}")
    return mel


def _load_mel(path: MediaSource, where: str, layout: ExampleLayout, limits: InputLimits) -> np.ndarray:
    _mel_shape(path, where, layout, limits)
    mel = _npy_memmap(path, where)
    _check_finite(mel, f"{where}: audio {path}", "log-mel frames", LOG_MEL_RANGE)
    return mel


def _check_dtype(dtype: np.dtype, what: str) -> None:
    """Pixel and log-mel arrays hold real floating or unsigned integer values (from the ``.npy`` header)."""
    if dtype.kind in "fu" and dtype.fields is None and dtype.shape == ():
        return
    why = {"c": " (complex: its imaginary part would be dropped)",
           "i": " (signed integers are neither pixel values nor log-mel frames)"}.get(dtype.kind, "")
    raise ManifestError(f"{what} has dtype {dtype}{why}; pixel and log-mel arrays must be of a real floating or an "
                        "unsigned integer dtype")


_FINITE_CHECK_ROWS = 256  # rows converted at a time: a large image is checked without a float copy of it


def _check_finite(array: np.ndarray, what: str, values: str, bounds: Optional[ValueRange] = None) -> None:
    """Every value of a floating array is finite once converted to float32, as the model takes it (a
    float64 beyond float32's range is not), and with ``bounds`` every value of the array is within them;
    else raise naming the first bad index. Integers are always finite."""
    floating = array.dtype.kind == "f"
    if not floating and bounds is None:
        return
    for start in range(0, array.shape[0], _FINITE_CHECK_ROWS):
        block = np.asarray(array[start:start + _FINITE_CHECK_ROWS])
        with np.errstate(over="ignore"):  # a value beyond float32's range becomes inf: what is looked for
            as_float32 = block.astype(np.float32)
        bad = np.argwhere(~np.isfinite(as_float32))
        if bad.size:
            index = [start + int(bad[0][0]), *map(int, bad[0][1:])]
            value = float(block[tuple(bad[0])])
            shown = f"{value:g} ({array.dtype}, beyond float32's range)" if math.isfinite(value) else str(value)
            raise ManifestError(f"{what} holds {shown} at index {index}: {values} must be finite")
        if bounds is not None:
            bad = np.argwhere((as_float32 < bounds.low) | (as_float32 > bounds.high))
            if bad.size:
                index = [start + int(bad[0][0]), *map(int, bad[0][1:])]
                raise ManifestError(f"{what} holds {float(block[tuple(bad[0])]):g} at index {index}: {values} must "
                                    f"be within {bounds.text}")


def _windows(mel: np.ndarray, frames_per_window: int) -> np.ndarray:
    """[frames, M] -> [ceil(frames / F), F, M], the last window zero-padded."""
    count = math.ceil(mel.shape[0] / frames_per_window)
    padded = np.zeros((count * frames_per_window, mel.shape[1]), dtype=np.float32)
    padded[:mel.shape[0]] = mel
    return padded.reshape(count, frames_per_window, mel.shape[1])


# Manifests up to this size are hashed whole (sha256 reads ~1 GB/s); larger ones by SAMPLED_CHUNKS
# evenly spaced chunks of 1 MiB, their size and modification time.
FULLY_HASHED_BYTES = 1 << 30
SAMPLED_CHUNKS = 64


def manifest_identity(path) -> dict:
    """What identifies a manifest's content, recorded in checkpoints: its size and sha256 (above
    :data:`FULLY_HASHED_BYTES`: its size, modification time and a hash of sampled chunks). Two manifests
    with the same identity hold the same examples in the same order."""
    stat = os.stat(path)
    size, digest, chunk = stat.st_size, hashlib.sha256(), 1 << 20
    with open(path, "rb") as f:
        if size <= FULLY_HASHED_BYTES:
            return {"bytes": size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
        for i in range(SAMPLED_CHUNKS):
            f.seek(max(0, size - chunk) * i // (SAMPLED_CHUNKS - 1))
            digest.update(f.read(chunk))
    return {"bytes": size, "mtime_ns": stat.st_mtime_ns, "sampled_mib": SAMPLED_CHUNKS,
            "sampled_sha256": digest.hexdigest()}
