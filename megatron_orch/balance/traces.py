"""Real per-example length traces (``data/traces/*.csv.gz``, copies of ``shared/traces``) and random global batches drawn from them.

A :class:`Trace` holds a CSV's columns as numpy arrays (an empty cell, i.e. an absent modality, reads
as 0). Every row is checked when a trace is loaded or built: a size that is not a number, negative or
not finite is an error naming the file, the row and the column, whether or not a batch would draw it. A :class:`TraceMixture` draws a global batch the way upstream Megatron's blended, shuffled
datasets do: every example independently picks a trace with the mixture's weights and a row of it
uniformly at random; DP rank ``r`` then loads the consecutive block ``[r*M, (r+1)*M)`` of the batch.

Parsed CSVs are cached as ``.npz`` (keyed by file size and mtime) under ``$MEGATRON_ORCH_CACHE`` or
``~/.cache/megatron_orch``, so a benchmark does not spend its time in the CSV reader.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence, Tuple

import numpy as np

NUMERIC_COLUMNS = ("n_images", "vision_tiles", "vision_tokens", "video_sec", "video_frames", "width", "height",
                   "audio_sec", "audio_frames", "text_tokens", "text_words")
TEXT_COLUMNS = ("source", "task", "split")

# image SFT + image captions + ASR + audio captions + music captions + video QA / captions.
DEFAULT_MIXTURE: Tuple[Tuple[str, float], ...] = (
    ("omnibal_internvl_sft.csv", 0.25),
    ("image_caption_coco_val2017.csv", 0.15),
    ("asr_librispeech_commonvoice.csv", 0.15),
    ("audio_caption_clotho_audiocaps_soundbible.csv", 0.12),
    ("music_caption_musiccaps.csv", 0.08),
    ("video_qa_nextqa.csv", 0.10),
    ("video_activitynet_captions_qa.csv", 0.15),
)


def default_traces_dir() -> Path:
    """``$MEGATRON_ORCH_TRACES``, else the gzipped copies shipped in ``<repo>/data/traces``."""
    env = os.environ.get("MEGATRON_ORCH_TRACES")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "data" / "traces"


def _cache_dir() -> Path:
    env = os.environ.get("MEGATRON_ORCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "megatron_orch"


@dataclass(frozen=True, eq=False)
class Trace:
    """Rows of one trace file (or of a drawn batch): text columns and float64 numeric columns."""

    name: str
    text: Mapping[str, np.ndarray]  # TEXT_COLUMNS -> str arrays
    numeric: Mapping[str, np.ndarray]  # NUMERIC_COLUMNS -> float64 arrays, 0 where absent

    def __post_init__(self):
        missing = [c for c in TEXT_COLUMNS if c not in self.text] + [c for c in NUMERIC_COLUMNS if c not in self.numeric]
        if missing:
            raise ValueError(f"trace {self.name!r} lacks columns {missing}")
        lengths = {len(v) for v in (*self.text.values(), *self.numeric.values())}
        if len(lengths) != 1:
            raise ValueError(f"trace {self.name!r} has columns of different lengths {sorted(lengths)}")
        _check_sizes(f"trace {self.name!r}", self.numeric)

    def __len__(self) -> int:
        return len(self.numeric["text_tokens"])

    def __getitem__(self, column: str) -> np.ndarray:
        if column in self.numeric:
            return self.numeric[column]
        if column in self.text:
            return self.text[column]
        raise KeyError(f"trace {self.name!r} has no column {column!r}; columns: {TEXT_COLUMNS + NUMERIC_COLUMNS}")

    def take(self, rows, name: Optional[str] = None) -> "Trace":
        rows = np.asarray(rows, dtype=np.int64)
        return Trace(name or self.name, {k: v[rows] for k, v in self.text.items()},
                     {k: v[rows] for k, v in self.numeric.items()})

    @classmethod
    def from_rows(cls, name: str, rows: Sequence[Mapping[str, object]]) -> "Trace":
        """Build a trace from dicts (missing or empty numeric cells read as 0): for tests and tools."""
        text = {c: np.array([str(r.get(c, "")) for r in rows], dtype=str) for c in TEXT_COLUMNS}
        numeric = {c: np.array([float(r.get(c) or 0) for r in rows], dtype=np.float64) for c in NUMERIC_COLUMNS}
        return cls(name, text, numeric)


def _check_sizes(where: str, numeric: Mapping[str, np.ndarray], line_offset: Optional[int] = None) -> None:
    """Refuse the first negative or non-finite size, naming its row (1-based; with ``line_offset``, also
    the file line) and column."""
    for column in NUMERIC_COLUMNS:
        values = np.asarray(numeric[column])
        bad = np.flatnonzero(~np.isfinite(values) | (values < 0))
        if bad.size:
            row, value = int(bad[0]), float(values[bad[0]])
            line = f" (line {row + 1 + line_offset})" if line_offset is not None else ""
            problem = "is negative" if value < 0 else "is not finite"
            raise ValueError(f"{where}: row {row + 1}{line}, column {column!r}: {value} {problem}")


def _parse_csv(path: Path) -> Trace:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", newline="") as f:
        reader = csv.reader(f)
        header = next(reader)
        missing = [c for c in TEXT_COLUMNS + NUMERIC_COLUMNS if c not in header]
        if missing:
            raise ValueError(f"{path}: missing columns {missing} (header: {header})")
        cols = list(zip(*reader)) or [()] * len(header)
    by_name = dict(zip(header, cols))
    text = {c: np.array(by_name[c], dtype=str) for c in TEXT_COLUMNS}
    numeric = {}
    for c in NUMERIC_COLUMNS:
        raw = np.array(by_name[c], dtype=str)
        values = np.zeros(raw.size, dtype=np.float64)
        present = raw != ""
        try:
            values[present] = raw[present].astype(np.float64)
        except ValueError:
            row = next(i for i, cell in enumerate(raw) if cell != "" and not _is_number(cell))
            raise ValueError(f"{path}: row {row + 1} (line {row + 2}), column {c!r}: {str(raw[row])!r} is not "
                             "a number") from None
        numeric[c] = values
    _check_sizes(str(path), numeric, line_offset=1)  # line 1 is the header
    return Trace(path.name.removesuffix(".gz"), text, numeric)


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def load_trace(name_or_path: str, traces_dir: Optional[Path] = None) -> Trace:
    """Load a trace CSV by file name (looked up in the traces dir) or by path, through the .npz cache; or
    build a :data:`DERIVED_TRACES` trace by its name."""
    if name_or_path in DERIVED_TRACES:
        return DERIVED_TRACES[name_or_path].build(traces_dir)
    path = Path(name_or_path)
    if not path.is_file():
        path = Path(traces_dir or default_traces_dir()) / name_or_path
        if not path.is_file() and path.with_name(path.name + ".gz").is_file():
            path = path.with_name(path.name + ".gz")  # the repo ships its traces gzipped
    if not path.is_file():
        raise FileNotFoundError(f"trace {name_or_path!r} not found (looked in {path.parent}; set "
                                "MEGATRON_ORCH_TRACES to the folder of the trace CSVs)")
    stat = path.stat()
    key = hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = path.name.removesuffix(".gz")
    cached = _cache_dir() / "traces" / f"{Path(name).stem}-{key}.npz"
    if cached.is_file():
        with np.load(cached) as data:
            return Trace(name, {c: data[c] for c in TEXT_COLUMNS}, {c: data[c] for c in NUMERIC_COLUMNS})
    trace = _parse_csv(path)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp.npz")
        np.savez(tmp, **trace.text, **trace.numeric)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only cache only costs the parse next time
    return trace


@dataclass(frozen=True, eq=False)
class TraceMixture:
    """Traces mixed with weights (normalised to sum to 1)."""

    traces: Tuple[Trace, ...]
    weights: Tuple[float, ...]

    def __post_init__(self):
        if not self.traces or len(self.traces) != len(self.weights):
            raise ValueError(f"a mixture needs one weight per trace, got {len(self.traces)} traces and "
                             f"{len(self.weights)} weights")
        w = np.asarray(self.weights, dtype=np.float64)
        if not np.all(np.isfinite(w)) or w.min() < 0 or w.sum() <= 0:
            raise ValueError(f"mixture weights must be finite, >= 0 and not all 0, got {list(self.weights)}")
        for trace in self.traces:
            if len(trace) == 0:
                raise ValueError(f"trace {trace.name!r} has no rows")
        object.__setattr__(self, "weights", tuple(float(x) for x in w / w.sum()))

    def draw(self, num_examples: int, seed: int) -> Trace:
        """A global batch of ``num_examples`` random rows (trace by weight, then a uniform row)."""
        if num_examples < 0:
            raise ValueError(f"num_examples must be >= 0, got {num_examples}")
        rng = np.random.default_rng(seed)
        which = rng.choice(len(self.traces), size=num_examples, p=np.asarray(self.weights))
        text = {c: np.empty(num_examples, dtype=object) for c in TEXT_COLUMNS}
        numeric = {c: np.empty(num_examples, dtype=np.float64) for c in NUMERIC_COLUMNS}
        for k, trace in enumerate(self.traces):
            slots = np.flatnonzero(which == k)
            rows = rng.integers(0, len(trace), size=slots.size)
            for c in TEXT_COLUMNS:
                text[c][slots] = trace.text[c][rows]
            for c in NUMERIC_COLUMNS:
                numeric[c][slots] = trace.numeric[c][rows]
        text = {c: v.astype(str) for c, v in text.items()}
        return Trace(f"batch(seed={seed}, n={num_examples})", text, numeric)


def parse_trace_spec(spec: str) -> Tuple[str, float]:
    """``"file.csv:0.3"`` -> ("file.csv", 0.3); ``"file.csv"`` -> ("file.csv", 1.0)."""
    name, sep, weight = spec.rpartition(":")
    if sep and name:
        try:
            return name, float(weight)
        except ValueError:
            pass
    return spec, 1.0


def load_mixture(specs: Sequence[Tuple[str, float]] = DEFAULT_MIXTURE,
                 traces_dir: Optional[Path] = None) -> TraceMixture:
    """Load the traces of ``(file, weight)`` pairs into a mixture (default: :data:`DEFAULT_MIXTURE`)."""
    return TraceMixture(tuple(load_trace(name, traces_dir) for name, _ in specs),
                        tuple(weight for _, weight in specs))


@dataclass(frozen=True)
class DerivedTrace:
    """Examples made from the real rows of a shipped trace: a selection of them, or runs of them merged.

    Rows of ``source`` whose text columns hold the ``select`` values (and whose numeric columns are at most
    their ``at_most`` values) are taken in file order. Without a
    ``length_column`` they are the examples. With one, example i starts at selected row i and takes the
    rows after it (wrapping around at the end) until their ``length_column`` sums to a target drawn
    log-uniformly in [``low``, ``high``] (a fixed seed per trace: the same examples every time); its
    sizes are the rows' sums (width and height: the largest), ``drop`` columns zeroed. Every length is
    a real length or a sum of them; only the selection and the grouping are ours.
    """

    name: str
    description: str
    source: str
    select: Tuple[Tuple[str, Tuple[str, ...]], ...]  # (text column, the values it may hold): all must hold
    length_column: Optional[str] = None
    low: float = 0.0
    high: float = 0.0
    drop: Tuple[str, ...] = ()
    at_most: Tuple[Tuple[str, float], ...] = ()  # (numeric column, its largest value kept)

    def build(self, traces_dir: Optional[Path] = None) -> Trace:
        rows = load_trace(self.source, traces_dir)
        kept = [np.isin(rows[column], values) for column, values in self.select]
        kept += [rows[column] <= bound for column, bound in self.at_most]
        keep = np.flatnonzero(np.logical_and.reduce(kept + [np.ones(len(rows), dtype=bool)]))
        if keep.size == 0:
            raise ValueError(f"derived trace {self.name!r}: no row of {self.source} matches {self.select}"
                             + (f" within {self.at_most}" if self.at_most else ""))
        start = np.arange(keep.size)
        if self.length_column is None:
            num_rows = np.ones(keep.size, dtype=np.int64)
        else:  # example i: selected rows i, i + 1, ... (wrapping), the fewest whose lengths reach its target
            length = rows[self.length_column][keep]
            rng = np.random.default_rng(zlib.crc32(self.name.encode()))
            target = np.exp(rng.uniform(np.log(self.low), np.log(self.high), keep.size))
            prefix = np.concatenate(([0.0], np.cumsum(np.concatenate((length, length)))))
            num_rows = np.clip(np.searchsorted(prefix, prefix[start] + target) - start, 1, keep.size)
        runs = np.repeat(start, num_rows)
        within = np.arange(runs.size) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
        members = keep[(runs + within) % keep.size]
        numeric = {c: np.bincount(runs, weights=rows[c][members], minlength=keep.size) for c in NUMERIC_COLUMNS}
        for c in ("width", "height"):  # sizes of one image, not additive
            numeric[c] = np.zeros(keep.size)
            np.maximum.at(numeric[c], runs, rows[c][members])
        for c in self.drop:
            numeric[c] = np.zeros(keep.size)
        text = {"source": np.char.add(f"{self.name}:", rows["source"][keep]),
                "task": rows["task"][keep], "split": rows["split"][keep]}
        return Trace(self.name, text, numeric)


_DOCVQA = (("source", ("internvl_sft/docvqa_train_10k",)),)
AUDIO_CAPTIONS = "audio_caption_clotho_audiocaps_soundbible.csv"
# Built from the shipped rows for the benchmarks' mixtures (docs/benchmarks.md).
DERIVED_TRACES = {t.name: t for t in (
    DerivedTrace("audio_captions_20min", "Clotho, AudioCaps and SoundBible captions of clips up to 20 minutes (the "
                 "file's one clip of 41 minutes needs 61.5k backbone tokens: beyond the models' 32k positions, "
                 "training refuses it)", AUDIO_CAPTIONS, (), at_most=(("audio_sec", 1200.0),)),
    DerivedTrace("audio_captions_30s", "Clotho and AudioCaps captions of clips up to 30 s (the file's SoundBible "
                 "clips, up to 41 minutes, left out)", "audio_caption_clotho_audiocaps_soundbible.csv",
                 (("source", ("clotho_v2", "audiocaps")),)),
    DerivedTrace("long_documents", "multi-page documents: 16-64 tiles (about 3-13 DocVQA pages of 5 tiles) with "
                 "the pages' questions and answers", "omnibal_internvl_sft.csv", _DOCVQA, "vision_tiles", 16, 64),
    DerivedTrace("long_asr", "1-10 minute ASR clips: consecutive LibriSpeech dev/test-clean utterances (file "
                 "order: by speaker and chapter) with their transcripts", "asr_librispeech_commonvoice.csv",
                 (("source", ("librispeech",)), ("split", ("dev-clean", "test-clean"))), "audio_sec", 60, 600),
    DerivedTrace("long_chats", "text-only chats of 4k-16k tokens: consecutive DocVQA conversations, images "
                 "dropped", "omnibal_internvl_sft.csv", _DOCVQA, "text_tokens", 4096, 16384,
                 drop=("n_images", "vision_tiles", "vision_tokens", "width", "height")),
)}
TAIL_TRACES = ("long_documents", "long_asr", "long_chats")


def _heavy_tailed(tail_weight: float) -> Tuple[Tuple[str, float], ...]:
    """Short examples (image SFT, ASR, audio captions, video QA and captions) at 1 - ``tail_weight``,
    the long ones of :data:`TAIL_TRACES` sharing ``tail_weight`` equally."""
    short = (("omnibal_internvl_sft.csv", 0.30), ("asr_librispeech_commonvoice.csv", 0.25),
             ("audio_captions_30s", 0.20), ("video_qa_nextqa.csv", 0.10), ("video_activitynet_captions_qa.csv", 0.15))
    return tuple((name, weight * (1.0 - tail_weight)) for name, weight in short) + tuple(
        (name, tail_weight / len(TAIL_TRACES)) for name in TAIL_TRACES)


# Mostly short examples and a heavy tail of long ones: 5% (0.8 per rank of 16: 44% of ranks get none,
# some three or more), 2% (72% get none; a long example is up to a rank's worth of work among short ones),
# 15% (2.4 per rank: most ranks hold several long examples, 7% none).
HEAVY_TAILED_MIXTURES = {"heavy-tail": _heavy_tailed(0.05), "heavy-tail-rare": _heavy_tailed(0.02),
                         "heavy-tail-harsh": _heavy_tailed(0.15)}
# The shipped mixture as a trainable global batch: DEFAULT_MIXTURE with the audio captions whose clips fit the
# models' 32k backbone positions (the benchmarks refuse an example training would refuse).
SHIPPED_MIXTURE: Tuple[Tuple[str, float], ...] = tuple(
    ("audio_captions_20min" if name == AUDIO_CAPTIONS else name, weight) for name, weight in DEFAULT_MIXTURE)
