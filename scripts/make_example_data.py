"""Write the example data of ``data/example/``: a JSONL manifest and the same examples as an Energon dataset.

    python scripts/make_example_data.py [--out data/example]

Every image, log-mel array and text is generated here (seeded: the same files on every run; nothing is
downloaded, no licence to follow). The examples fit the ``tiny`` model config (16 px tiles, 16 mel bins)
at ``--seq-length`` 128 or more: ``manifest.jsonl`` holds 12 good examples (images, audio, both, text only,
16-bit and grey images, ``.npy`` images, declared sizes, one answer too long for ``--seq-length`` 256, which
training truncates) and, among them (lines 3, 5, 7, 10, 12, 14, 17, 19, 21), one bad example of each kind
``check_data`` finds. ``energon/`` holds the
same examples as WebDataset shards prepared for Energon (``.nv-meta``): the sample of manifest line N has
the key N (six digits), its ``.json`` part is the line's entry, its media are parts of the sample
(``img0.png``, ``mel0.npy``, ...), its sample type is :class:`megatron_orch.mllm.energon.MultimodalSample`.
Needs Pillow and megatron-energon (``pip install -e .[energon]``).
"""
from __future__ import annotations

import argparse
import io
import json
import shutil
import tarfile
from pathlib import Path

import numpy as np

SHARD_SIZE = 11  # samples per shard: two shards


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def _npy_header_only(shape, dtype) -> bytes:
    """A .npy file whose header declares ``shape`` but holds no data: a size check from the header finds
    it too large before reading any of it (a real one would be megabytes)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": np.dtype(dtype).str, "fortran_order": False,
                                                 "shape": tuple(shape)})
    return buffer.getvalue()


def media_files() -> dict:
    """``{file name: bytes}`` of every image and log-mel array the examples use."""
    rng = np.random.default_rng(2024)
    square = np.zeros((32, 32, 3), np.uint8)
    square[:, :] = (30, 60, 200)
    square[8:24, 8:24] = (220, 30, 30)
    gradient = np.linspace(0, 255, 40 * 24 * 3).reshape(24, 40, 3).astype(np.uint8)
    grid = (rng.integers(0, 4, (32, 48, 1)) * 64 + np.array([[[0, 20, 40]]])).astype(np.uint8)
    wide = np.repeat(np.linspace(0, 255, 64, dtype=np.uint8)[None, :, None], 16, axis=0).repeat(3, axis=2)
    grey16 = (np.add.outer(np.arange(20), np.arange(20)) * 1700).astype(np.uint16)
    truncated = _png(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))

    def mel(frames, bins=16):
        return _npy((rng.standard_normal((frames, bins)) * 2 - 4).astype(np.float16))

    return {
        "square.png": _png(square),
        "gradient.png": _png(gradient),
        "grid.png": _png(grid),
        "wide.png": _png(wide),
        "grey.png": _png(rng.integers(0, 255, (24, 24), dtype=np.uint8)),
        "grey16.png": _png(grey16),
        "tile.npy": _npy(rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)),
        "float_image.npy": _npy(rng.random((16, 16, 3), dtype=np.float32)),
        "speech.npy": mel(120),
        "chirp.npy": mel(64),
        "short.npy": mel(50),
        "long.npy": mel(90),
        "not_an_image.png": b"this file is text, not an image\n",
        "mel_80_bins.npy": mel(10, bins=80),
        "huge_image.npy": _npy_header_only((9000, 9000, 3), np.uint8),
        "hour_of_audio.npy": _npy_header_only((360000, 16), np.float16),
        "truncated.png": truncated[:len(truncated) // 2],
    }


def manifest_entries() -> list:
    """The manifest's entries, in line order (media names are file names under ``media/``)."""
    long_answer = "a long description that goes on " * 10
    good = [
        {"prompt": "describe:", "text": "a red square on a blue field", "images": ["square.png"]},
        {"prompt": "transcribe:", "text": "hello world, this is a test", "audio": ["speech.npy"]},
        {"prompt": "what do you see and hear?", "text": "a gradient and a chirp", "images": ["gradient.png"],
         "audio": ["chirp.npy"]},
        {"prompt": "continue:", "text": "the quick brown fox jumps over the lazy dog"},
        {"prompt": "compare:", "text": "a colour tile and a grey one", "images": ["tile.npy", "grey.png"]},
        {"prompt": "describe:", "text": "a 16-bit grey ramp", "images": ["grey16.png"]},
        {"prompt": "describe:", "text": "random colours", "images": ["float_image.npy"]},
        {"prompt": "transcribe both:", "text": "one short and one longer clip", "audio": ["short.npy", "long.npy"]},
        {"prompt": "describe:", "text": "a grid of colours", "images": ["grid.png"],
         "sizes": {"vision_items": 7, "audio_items": 0, "text_tokens": 17}},
        {"prompt": "what colour is the square?", "text": "red", "images": ["square.png"]},
        {"prompt": "describe:", "text": "a wide ramp from dark to light", "images": ["wide.png"]},
        {"prompt": "describe at length:", "text": long_answer.strip(), "images": ["square.png"]},
    ]
    bad = [
        {"prompt": "describe:", "text": "a picture that is not there", "images": ["missing.png"]},
        {"prompt": "describe:", "text": "a file that is not an image", "images": ["not_an_image.png"]},
        {"prompt": "transcribe:", "text": "mel features of another model", "audio": ["mel_80_bins.npy"]},
        {"prompt": "describe:", "text": "declared sizes that are wrong", "images": ["square.png"],
         "sizes": {"vision_items": 3, "audio_items": 0, "text_tokens": 29}},
        {"prompt": "count them:", "text": "ten grids", "images": ["grid.png"] * 10},
        {"text": "nine grids and a chirp", "images": ["grid.png"] * 9, "audio": ["chirp.npy"]},
        {"prompt": "describe:", "text": "an image too large", "images": ["huge_image.npy"]},
        {"prompt": "transcribe:", "text": "an hour of audio", "audio": ["hour_of_audio.npy"]},
        {"prompt": "describe:", "text": "a damaged png", "images": ["truncated.png"]},
    ]
    entries, good, bad = [], iter(good), iter(bad)
    # Bad examples spread among the good ones: every DP rank's part of the Energon shards holds good ones.
    for entry in (next(bad) if line % 7 in (3, 5, 0) else next(good) for line in range(1, 22)):
        # media under media/, keys in the order of the schema
        entry = {key: entry[key] for key in ("text", "prompt", "images", "audio", "sizes") if key in entry}
        for key in ("images", "audio"):
            if key in entry:
                entry[key] = [f"media/{name}" for name in entry[key]]
        entries.append(entry)
    return entries


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def write_energon(folder: Path, entries: list, files: dict) -> None:
    """The entries as Energon samples (the module docstring) in shards of :data:`SHARD_SIZE`, prepared."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    folder.mkdir(parents=True)
    shards = []
    for first in range(0, len(entries), SHARD_SIZE):
        shard = f"shard_{first // SHARD_SIZE:03d}.tar"
        with tarfile.open(folder / shard, "w", format=tarfile.USTAR_FORMAT) as tar:
            for line, entry in enumerate(entries[first:first + SHARD_SIZE], start=first + 1):
                key, parts, sample = f"{line:06d}", {}, dict(entry)
                for medium, prefix in (("images", "img"), ("audio", "mel")):
                    names = []
                    for i, path in enumerate(entry.get(medium, [])):
                        name = f"{prefix}{i}{Path(path).suffix}"
                        names.append(name)
                        if Path(path).name in files:  # a missing file is a missing part
                            parts[name] = files[Path(path).name]
                    if names:
                        sample[medium] = names
                _add(tar, f"{key}.json", json.dumps(sample).encode())
                for name, data in parts.items():
                    _add(tar, f"{key}.{name}", data)
        shards.append(shard)
    splits = [("train", 1.0), ("val", 0.0), ("test", 0.0)]  # every sample in the train split
    BaseWebdatasetFactory.prepare_dataset(folder, shards, split_parts_ratio=splits, shuffle_seed=None, workers=1)
    meta = folder / ".nv-meta"
    # MultimodalSample by this project's factory: no code in the dataset (no --trust-dataset-code needed)
    (meta / "dataset.yaml").write_text("__module__: megatron_orch.mllm.energon\n"
                                       "__class__: MultimodalWebdatasetFactory\n")


def write_example_data(out: Path) -> None:
    """``out/manifest.jsonl``, ``out/media/`` and ``out/energon/`` (replaced if they exist)."""
    files, entries = media_files(), manifest_entries()
    for old in (out / "media", out / "energon"):
        shutil.rmtree(old, ignore_errors=True)
    (out / "media").mkdir(parents=True)
    for name, data in files.items():
        (out / "media" / name).write_bytes(data)
    (out / "manifest.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    write_energon(out / "energon", entries, files)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python scripts/make_example_data.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "data" / "example",
                        help="folder to write (default: the repository's data/example)")
    args = parser.parse_args(argv)
    write_example_data(args.out)
    print(f"make_example_data: wrote {args.out}/manifest.jsonl, {args.out}/media/ and {args.out}/energon/")


if __name__ == "__main__":
    main()
