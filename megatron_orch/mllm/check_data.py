"""Check a JSONL manifest or an Energon dataset before training on it, every example as the trainer checks
it when it reads it.

    python -m megatron_orch.mllm.check_data --data-path train.jsonl --seq-length 2048 [--model-config M]
        [--max-num-tiles N --max-image-pixels N --max-audio-seconds S --max-vision-items-per-sample N]
        [--refuse-long-answers] [--allow-external-media] [--trust-dataset-code] [--decode] [--workers N]

Each example's files are checked from their headers (a missing or unreadable file, an image above
``--max-image-pixels``, too many tiles, a log-mel array with the wrong mel bins or too long, an array
of a complex or signed integer dtype, prompt and media that do not fit ``--seq-length``, declared
``sizes`` that differ from the files), on a pool of threads, with a progress line on stderr.
``--decode`` loads every example as training does (image pixels decoded, arrays read), which also finds
truncated or corrupt image data behind a good header, NaN or infinite values in arrays, float pixels
outside [0, 1] and log-mel values beyond their magnitude limit (named with the first bad index). A media
file outside the manifest's folder is bad unless ``--allow-external-media``; one that is a folder, a FIFO
or another non-file is named as what it is.
Every bad line is printed as ``manifest.jsonl:LINE: reason``, then a summary; the exit status is 1 if
any line is bad, 0 otherwise (2: the command line or a line's JSON is wrong: the manifest is parsed
first and stops at such a line). Answers longer than ``--seq-length`` allows are counted (training
truncates them, keeping the EOS), or bad with ``--refuse-long-answers``.

An Energon dataset (a folder with ``.nv-meta``; the ``energon`` extra) is checked sample by sample, its
train split in the dataset's order, by the task encoder training uses
(:mod:`megatron_orch.mllm.energon`); a bad sample is printed as ``<dataset>/<shard>:<key>: reason``, and
``--workers`` counts Energon's loader processes (0 or 1: this process). A dataset whose ``.nv-meta`` holds
Python (a sample loader) is refused, naming the file, before any of it runs, unless ``--trust-dataset-code``.

:func:`add_data_args` defines the data flags shared with ``pretrain_mllm.py``. This module imports
torch only when a check runs, so ``megatron_orch.mllm.task`` can take the flags from it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence


def add_data_args(parser: argparse.ArgumentParser):
    """The data flags of ``pretrain_mllm.py`` that decide whether an example is good; returns their group."""
    g = parser.add_argument_group("multimodal data limits (--data-path manifests; checked from file headers "
                                  "before any data is read)")
    g.add_argument("--max-num-tiles", type=int, default=6,
                   help="most tiles of one image's grid (InternVL-style dynamic tiling; Megatron-LM's flag, "
                        "whose default is 1)")
    g.add_argument("--max-image-pixels", type=int, default=8192 * 8192,
                   help="most pixels (width x height) of one image before tiling")
    g.add_argument("--max-audio-seconds", type=float, default=600.0,
                   help="longest audio clip, in seconds of log-mel frames (100 per second)")
    g.add_argument("--max-vision-items-per-sample", type=int, default=64,
                   help="most vision items (tiles and thumbnails of all its images) of one example")
    g.add_argument("--refuse-long-answers", action="store_true",
                   help="an answer longer than --seq-length leaves room for is a bad example (default: it is "
                        "truncated, keeping the EOS, and counted)")
    g.add_argument("--allow-external-media", action="store_true",
                   help="a manifest's media may resolve outside its folder (an absolute path, '..', a symlink out; "
                        "default: such an example is bad)")
    g.add_argument("--trust-dataset-code", action="store_true",
                   help="open an Energon dataset whose .nv-meta holds Python (a sample loader), which runs it "
                        "(default: such a dataset is refused, naming the file)")
    return g


_CHUNK = 64  # examples per task of the thread pool


@dataclass
class CheckReport:
    """What :func:`check_manifest` found: bad lines and truncated answers, in manifest order."""

    checked: int = 0
    bad: List[str] = field(default_factory=list)        # "manifest.jsonl:7: reason"
    truncated: List[str] = field(default_factory=list)  # notes of answers training would truncate


def check_manifest(dataset, decode: bool = False, workers: int = 8,
                   progress: Optional[Callable[[int, int, int], None]] = None) -> CheckReport:
    """Check every example of a :class:`~megatron_orch.mllm.manifest.ManifestDataset` on ``workers``
    threads (``dataset.check``); ``progress(done, total, bad)`` is called as examples complete."""
    from megatron_orch.mllm.manifest import ManifestError

    def check(indices):  # a chunk of examples per task: one example's headers take well under a millisecond
        outcomes = []
        for index in indices:
            try:
                outcomes.append((None, dataset.check(index, decode=decode)))
            except ManifestError as err:
                outcomes.append((str(err), None))
        return outcomes

    report, total = CheckReport(), len(dataset)
    chunks = [range(start, min(start + _CHUNK, total)) for start in range(0, total, _CHUNK)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for outcomes in pool.map(check, chunks):
            for bad, truncated in outcomes:
                report.checked += 1
                if bad is not None:
                    report.bad.append(bad)
                if truncated is not None:
                    report.truncated.append(truncated)
            if progress is not None:
                progress(report.checked, total, len(report.bad))
    return report


def check_energon(dataset, decode: bool = False, workers: int = 0,
                  progress: Optional[Callable[[int, int, int], None]] = None) -> CheckReport:
    """Check every sample of an :class:`~megatron_orch.mllm.energon.EnergonDataset` (its train split) as
    training does, on ``workers`` Energon loader processes (0: this one); the report lists bad samples and
    truncated answers in the dataset's order."""
    report, outcomes, total = CheckReport(), [], len(dataset)
    for checked in dataset.checked_samples(decode, workers):
        outcomes.append(checked)
        report.checked += 1
        if progress is not None:
            progress(report.checked, total, sum(o.bad is not None for o in outcomes))
    outcomes.sort(key=lambda o: o.index)
    report.bad = [o.bad for o in outcomes if o.bad is not None]
    report.truncated = [o.note for o in outcomes if o.note is not None]
    if report.checked < total:  # a damaged shard's last samples, seen by a loader process only
        report.bad.append(f"{dataset.path}: {total - report.checked} of its {total} samples were not read (the end "
                          "of a damaged shard? --workers 0 names them)")
    return report


class _Progress:
    """``checked 1200/5000 examples (24%), 2 bad`` on stderr: rewritten in place on a terminal (10 per
    second at most), else one line per tenth."""

    def __init__(self, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.tty = self.stream.isatty()
        self.last_time, self.last_tenth = 0.0, 0

    def __call__(self, done: int, total: int, bad: int) -> None:
        line = f"[check_data] checked {done}/{total} examples ({100 * done // total}%), {bad} bad"
        if self.tty:
            now = time.monotonic()
            if now - self.last_time >= 0.1 or done == total:
                self.last_time = now
                self.stream.write("\r" + line + ("\n" if done == total else ""))
                self.stream.flush()
        elif 10 * done // total > self.last_tenth:
            self.last_tenth = 10 * done // total
            print(line, file=self.stream, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.mllm.check_data", allow_abbrev=False,
                                     description="Check every example of a JSONL manifest or an Energon dataset "
                                                 "as training would.")
    parser.add_argument("--data-path", required=True, help="the JSONL manifest, or an Energon dataset's folder")
    parser.add_argument("--model-config", default="tiny", help="name in configs/ or a YAML path (as pretrain_mllm.py)")
    parser.add_argument("--seq-length", type=int, required=True, help="longest backbone sequence (tokens)")
    parser.add_argument("--decode", action="store_true",
                        help="load every example (decode images, read arrays), not only the file headers")
    parser.add_argument("--workers", type=int, default=None,
                        help="threads reading files (default: twice the CPU count, at most 32); of an Energon "
                             "dataset: loader processes (0 or 1: this process; default: the CPUs this process may "
                             "use, the most torch's DataLoader takes without a warning)")
    add_data_args(parser)
    return parser


def default_workers(energon: bool) -> int:
    """``--workers``' default: for a manifest, threads (twice the CPUs, at most 32: they wait on files); for an
    Energon dataset, loader processes: the CPUs this process may use, the most torch's DataLoader takes
    without warning that it may run slowly or freeze."""
    return len(os.sched_getaffinity(0)) if energon else min(32, 2 * (os.cpu_count() or 1))


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_orch import quiet_megatron_core_warnings
    quiet_megatron_core_warnings()
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.data_config import is_energon_dataset
    from megatron_orch.mllm.examples import example_layout
    from megatron_orch.mllm.manifest import ExampleReader, InputLimits, ManifestDataset, ManifestError, image_tiling

    from megatron_orch.mllm.files import data_path_problem
    prog, energon = "check_data", is_energon_dataset(args.data_path)
    problem = data_path_problem(args.data_path)
    if problem is not None:
        print(f"{prog}: error: --data-path {args.data_path}: {problem}", file=sys.stderr)
        return 2
    try:
        model_config = load_model_config(args.model_config)
        limits = InputLimits(max_image_pixels=args.max_image_pixels, max_audio_seconds=args.max_audio_seconds,
                             max_vision_items_per_sample=args.max_vision_items_per_sample)
        reading = (example_layout(model_config, args.seq_length), image_tiling(model_config, args.max_num_tiles))
        if energon:
            from megatron_orch.mllm.energon import EnergonDataset
            dataset = EnergonDataset(args.data_path, ExampleReader(*reading, limits=limits,
                                                                   refuse_long_answers=args.refuse_long_answers),
                                     trust_code=args.trust_dataset_code)
        else:
            dataset = ManifestDataset(args.data_path, *reading, limits=limits,
                                      refuse_long_answers=args.refuse_long_answers,
                                      allow_external_media=args.allow_external_media)
    except ManifestError as err:
        print(err, flush=True)
        what = "the dataset does not open" if energon else "the manifest does not parse at this line"
        print(f"{prog}: error: {what} (checking stops at it)", file=sys.stderr)
        return 2
    except (OSError, ValueError, TypeError, ImportError) as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    workers = default_workers(energon) if args.workers is None else args.workers
    if energon:
        report = check_energon(dataset, decode=args.decode, workers=workers if workers > 1 else 0,
                               progress=_Progress())
    else:
        report = check_manifest(dataset, decode=args.decode, workers=workers, progress=_Progress())
    for line in report.bad:
        print(line, flush=True)
    shown = report.truncated[:10]
    for note in shown:
        print(note)
    if len(report.truncated) > len(shown):
        print(f"... and {len(report.truncated) - len(shown)} more answers truncated")
    what = "decoded" if args.decode else "file headers checked"
    print(f"{prog}: {args.data_path}: {report.checked} examples ({what}) in {time.perf_counter() - start:.1f} s: "
          f"{len(report.bad)} bad, {len(report.truncated)} answers longer than --seq-length {args.seq_length} "
          f"allows (training truncates them{'' if args.decode else '; --decode also reads the data'})", flush=True)
    return 1 if report.bad else 0


if __name__ == "__main__":
    sys.exit(main())
