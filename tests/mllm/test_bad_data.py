"""Bad examples found before the run (``check_data``) and handled during it (``--max-bad-examples``).

``python -m megatron_orch.mllm.check_data`` names every bad line of a manifest (a missing image, mel
arrays with the wrong bins, wrong declared sizes, media that do not fit, a truncated PNG with
``--decode``). Then one spawned DP 2 run trains on a manifest of 7 examples whose line 2 names a
missing image, 8 samples (so the last one comes from a second epoch), with dropout on (the resume must
restore the RNG streams): with ``--max-bad-examples 1`` the run completes and reports the skip, and a
run stopped at iteration 2 and resumed gives the uninterrupted run's losses; with post-balancing the
skip is reported once too; with ``--max-bad-examples 0`` the bad example ends the run naming its line;
a second bad example beyond the limit stops the run; resuming over the manifest with two lines
swapped is refused, unless ``--allow-changed-data``.
"""
import dataclasses
import json
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from dist_utils import run_distributed
from pretrain_outcome import pretrain_outcome
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

SEED = 5
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
          "--train-iters", "4", "--lr", "2e-3", "--log-interval", "1", "--seed", str(SEED),
          "--distributed-backend", "gloo", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
NUM_EXAMPLES = 7


def write_data(folder: Path, missing_lines=(2,), name="m.jsonl") -> Path:
    from PIL import Image
    rng = np.random.default_rng(0)
    np.save(folder / "square.npy", rng.random((16, 16, 3)).astype(np.float32))
    np.save(folder / "speech.npy", rng.standard_normal((100, 16)).astype(np.float32))
    Image.fromarray(rng.integers(0, 255, (40, 24, 3), dtype=np.uint8)).save(folder / "tall.png")
    entries = [{"text": f"example number {i}", "prompt": "describe:",
                "images": ["tall.png" if i % 3 == 0 else "square.npy"], "audio": ["speech.npy"] if i % 2 else []}
               for i in range(NUM_EXAMPLES)]
    for line in missing_lines:
        entries[line - 1]["images"] = ["gone.png"]
    path = folder / name
    path.write_text("".join(json.dumps(e) + "\n" for e in entries))
    return path


# ----------------------------------------------------------------------------------------------- check_data

def test_check_data_names_every_bad_line(tmp_path, capsys):
    from PIL import Image

    from megatron_orch.mllm import check_data

    path = write_data(tmp_path)
    np.save(tmp_path / "wrong_bins.npy", np.zeros((10, 80), np.float32))
    Image.open(tmp_path / "tall.png").save(tmp_path / "cut.png")
    data = (tmp_path / "cut.png").read_bytes()
    (tmp_path / "cut.png").write_bytes(data[:len(data) // 2])
    extra = [{"text": "a", "audio": ["wrong_bins.npy"]},
             {"text": "abc", "images": ["square.npy"], "sizes": {"vision_items": 3, "audio_items": 0, "text_tokens": 3}},
             {"text": "a", "images": ["cut.png"]},
             {"text": "x" * 500}]
    with open(path, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in extra))
    argv = ["--data-path", str(path), "--seq-length", "128", "--workers", "3"]
    assert check_data.main(argv) == 1
    out, err = capsys.readouterr()
    bad = [line for line in out.splitlines() if re.match(r"\S+m.jsonl:\d+: ", line) and "answer of" not in line]
    assert len(bad) == 3, out
    assert re.fullmatch(r"\S+m.jsonl:2: image file \S+gone.png does not exist", bad[0]), bad
    assert re.fullmatch(r"\S+m.jsonl:8: audio \S+wrong_bins.npy has shape \(10, 80\), expected \[frames >= 1, 16\]",
                        bad[1]), bad
    assert re.search(r"m.jsonl:9: declared 'sizes' differ from the data \(declared, real\): \{'vision_items': \(3, 1\)\}",
                     bad[2]), bad
    assert re.search(r"m.jsonl:11: answer of 500 tokens, \d+ fit in --seq-length 128", out), out
    assert re.search(r"check_data: \S+m.jsonl: 11 examples \(file headers checked\) in [\d.]+ s: 3 bad, 1 answers "
                     r"longer than --seq-length 128", out), out
    assert "checked 11/11 examples (100%), 3 bad" in err  # the progress line
    assert check_data.main(argv + ["--decode"]) == 1
    out, _ = capsys.readouterr()
    assert re.search(r"m.jsonl:10: cannot read image \S+cut.png: image file is truncated", out), out
    assert "4 bad" in out
    assert check_data.main(argv + ["--refuse-long-answers"]) == 1
    out, _ = capsys.readouterr()
    assert re.search(r"m.jsonl:11: answer of 500 tokens, .*\(--refuse-long-answers\)", out) and "4 bad" in out, out


def test_check_data_passes_good_data_and_stops_at_a_line_that_does_not_parse(tmp_path, capsys):
    from megatron_orch.mllm import check_data

    path = write_data(tmp_path, missing_lines=())
    assert check_data.main(["--data-path", str(path), "--seq-length", "128", "--decode"]) == 0
    assert "7 examples (decoded)" in capsys.readouterr().out
    with open(path, "a") as f:
        f.write('{"text": \n')
    assert check_data.main(["--data-path", str(path), "--seq-length", "128"]) == 2
    out, err = capsys.readouterr()
    assert re.search(r"m.jsonl:8: not valid JSON", out) and "checking stops at it" in err, (out, err)


BAD_ARRAYS = {  # file: (array, refused from the header, what the message says)
    "nan_mel.npy": (np.where(np.arange(1600).reshape(100, 16) == 7 * 16 + 3, np.nan, 0.5).astype(np.float32), False,
                    r"audio \S+nan_mel.npy holds nan at index \[7, 3\]: log-mel frames must be finite"),
    "inf_mel.npy": (np.where(np.arange(1600).reshape(100, 16) == 99 * 16, -np.inf, 0.5), False,
                    r"audio \S+inf_mel.npy holds -inf at index \[99, 0\]: log-mel frames must be finite"),
    "big_mel.npy": (np.where(np.arange(1600).reshape(100, 16) == 40, 1e300, 0.5), False,
                    r"audio \S+big_mel.npy holds 1e\+300 \(float64, beyond float32's range\) at index \[2, 8\]"),
    "int64_mel.npy": (np.full((100, 16), 2 ** 62, dtype=np.int64), True,
                      r"audio \S+int64_mel.npy has dtype int64 \(signed integers are neither pixel values nor "
                      r"log-mel frames\); pixel and log-mel arrays must be of a real floating or an unsigned integer "
                      r"dtype"),
    "complex_mel.npy": (np.full((100, 16), 1 + 2j, dtype=np.complex64), True,
                        r"audio \S+complex_mel.npy has dtype complex64 \(complex: its imaginary part would be "
                        r"dropped\)"),
    "nan_image.npy": (np.where(np.arange(16 * 16 * 3).reshape(16, 16, 3) == 5 * 48 + 4 * 3 + 2, np.nan, 0.25), False,
                      r"image \S+nan_image.npy holds nan at index \[5, 4, 2\]: pixel values must be finite"),
    "int64_image.npy": (np.full((16, 16, 3), 300, dtype=np.int64), True, r"image \S+int64_image.npy has dtype int64"),
    # finite but out of range: float pixels outside [0, 1] (1/255 tolerated), log-mel values beyond +-1000
    "negative_image.npy": (np.where(np.arange(16 * 16 * 3).reshape(16, 16, 3) == 3 * 48 + 2 * 3 + 1, -50, 0.25)
                           .astype(np.float32), False, r"image \S+negative_image.npy holds -50 at index \[3, 2, 1\]: "
                           r"pixel values must be within \[0, 1\] \(1/255 tolerated outside\)"),
    "huge_image.npy": (np.where(np.arange(16 * 16).reshape(16, 16) == 255, 1e30, 1.0 + 0.9 / 255).astype(np.float32),
                       False, r"image \S+huge_image.npy holds 1e\+30 at index \[15, 15\]: pixel values must be within"),
    "loud_mel.npy": (np.where(np.arange(1600).reshape(100, 16) == 50 * 16 + 5, 3e38, -999.0).astype(np.float32), False,
                     r"audio \S+loud_mel.npy holds 3e\+38 at index \[50, 5\]: log-mel frames must be within \+-1000"),
}


def _bad_arrays_manifest(folder: Path) -> Path:
    """A good example, then one per entry of :data:`BAD_ARRAYS` (lines 2...)."""
    path = write_data(folder, missing_lines=())
    lines = path.read_text().splitlines(keepends=True)[:1]
    for name, (array, _, _) in BAD_ARRAYS.items():
        np.save(folder / name, array)
        key = "images" if "image" in name else "audio"
        lines.append(json.dumps({"text": "fine", key: [name]}) + "\n")
    path.write_text("".join(lines))
    return path


def test_check_data_refuses_non_finite_and_wrongly_typed_arrays(tmp_path, capsys):
    """Complex and signed integer dtypes from the header alone; NaN, infinite and beyond-float32 values
    with --decode, as training reads them, naming the line, the file and the first bad index."""
    from megatron_orch.mllm import check_data

    path = _bad_arrays_manifest(tmp_path)
    argv = ["--data-path", str(path), "--seq-length", "128", "--workers", "2"]
    for decode in (False, True):
        assert check_data.main(argv + (["--decode"] if decode else [])) == 1
        out = capsys.readouterr().out
        bad = [line for line in out.splitlines() if re.match(r"\S+m.jsonl:\d+: ", line)]
        expected = [(line, message) for line, (_, header, message) in enumerate(BAD_ARRAYS.values(), start=2)
                    if header or decode]
        assert len(bad) == len(expected), out
        for found, (line, message) in zip(bad, expected):
            assert re.match(rf"\S+m.jsonl:{line}: {message}", found), (found, message)


def test_media_that_are_not_files_or_outside_the_folder_are_named_as_such(tmp_path, capsys):
    """A folder and a FIFO named as media are said to be one (a FIFO is never opened: it would block); media
    resolving outside the manifest's folder (absolute, '..', a symlink out) are bad unless
    --allow-external-media; a folder without .nv-meta as --data-path is named as such."""
    import os

    from megatron_orch.mllm import check_data

    data, outside = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    outside.mkdir()
    path = write_data(data, missing_lines=())
    np.save(outside / "square.npy", np.load(data / "square.npy"))
    (data / "folder.png").mkdir()
    os.mkfifo(data / "pipe.npy")
    (data / "link.npy").symlink_to(outside / "square.npy")
    entries = [{"text": "a", "images": ["folder.png"]}, {"text": "a", "audio": ["pipe.npy"]},
               {"text": "a", "images": [str(outside / "square.npy")]},
               {"text": "a", "images": ["../elsewhere/square.npy"]},
               {"text": "a", "images": ["link.npy"]}]
    with open(path, "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in entries))
    argv = ["--data-path", str(path), "--seq-length", "128", "--workers", "2"]
    for decode in ([], ["--decode"]):
        assert check_data.main(argv + decode) == 1
        bad = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\S+m.jsonl:\d+: ", line)]
        real = os.path.realpath(outside / "square.npy")
        assert bad == [f"{path}:8: image file {data}/folder.png is a folder",
                       f"{path}:9: file {data}/pipe.npy is a FIFO (named pipe)"] + [
                       f"{path}:{line}: media file {shown} is outside the manifest's folder {data} (it resolves to "
                       f"{real}); pass --allow-external-media to read media outside it"
                       for line, shown in ((10, outside / "square.npy"), (11, data / "../elsewhere/square.npy"),
                                           (12, data / "link.npy"))], bad
    assert check_data.main(argv + ["--allow-external-media"]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\S+m.jsonl:\d+: ", line)]
    assert [line.split(": ")[0] for line in bad] == [f"{path}:8", f"{path}:9"], bad
    assert check_data.main(["--data-path", str(outside), "--seq-length", "128"]) == 2
    assert capsys.readouterr().err.strip() == (f"check_data: error: --data-path {outside}: a folder without .nv-meta: "
                                               "not an Energon dataset (energon prepare writes .nv-meta), nor a JSONL "
                                               "manifest")


def test_float_tiff_pixels_are_read_as_floats_and_checked_by_range(tmp_path):
    """A float (mode F) TIFF keeps its values (8-bit conversion would turn 0.5 into 0 or 1/255) and one at
    5.0 is refused by line, as a float .npy image is."""
    from PIL import Image

    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.data import example_reader
    from megatron_orch.mllm.data_config import DataConfig
    from megatron_orch.mllm.manifest import ManifestDataset, ManifestError

    grey = np.linspace(0.0, 1.0, 16 * 16, dtype=np.float32).reshape(16, 16)
    Image.fromarray(grey, mode="F").save(tmp_path / "grey.tif")
    Image.fromarray(np.full((16, 16), 5.0, np.float32), mode="F").save(tmp_path / "bright.tif")
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"text": "a", "images": ["grey.tif"]}) + "\n"
                    + json.dumps({"text": "a", "images": ["bright.tif"]}) + "\n")
    config = DataConfig(load_model_config("tiny"), seq_length=128, micro_batch_size=1, num_samples=2,
                        data_path=str(path))
    dataset = ManifestDataset(path, config.layout, example_reader(config).tiling)
    tiles = dataset[0].items[config.layout.phase_of("images", "")]
    assert sorted(set(tiles.flatten().tolist())) == sorted(set(grey.flatten().tolist()))
    with pytest.raises(ManifestError, match=rf"{re.escape(str(path))}:2: image \S+bright.tif holds 5 at index "
                                            r"\[0, 0\]: pixel values must be within \[0, 1\]"):
        dataset.read(1)


def test_training_refuses_the_same_arrays_naming_the_line(tmp_path):
    """The trainer's loader (every sample in turn, as training reads them) stops at each bad array with the
    line check_data names."""
    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.mllm.data import build_train_iterator
    from megatron_orch.mllm.data_config import DataConfig
    from megatron_orch.mllm.manifest import ManifestError

    path = _bad_arrays_manifest(tmp_path)
    config = DataConfig(load_model_config("tiny"), seq_length=128, micro_batch_size=1, num_samples=1 + len(BAD_ARRAYS),
                        data_path=str(path))
    for line, (_, _, message) in enumerate(BAD_ARRAYS.values(), start=2):
        loader = build_train_iterator(config, consumed_samples=line - 1, data_parallel_rank=0, data_parallel_size=1)
        with pytest.raises(ManifestError, match=rf"\S+m.jsonl:{line}: {message}"):
            next(loader)
    next(build_train_iterator(config, consumed_samples=0, data_parallel_rank=0, data_parallel_size=1))  # line 1
    # under --max-bad-examples each is skipped (replaced by a good draw: the manifest then mostly good) and
    # counted, one event per bad line
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines + lines[:1] * 60))
    skipping = build_train_iterator(dataclasses.replace(config, max_bad_examples=len(BAD_ARRAYS)), consumed_samples=0,
                                    data_parallel_rank=0, data_parallel_size=1)
    batches = list(skipping)
    skips = [event for event in skipping.take_events(config.num_samples) if event.skipped]
    assert len(batches) == 1 + len(BAD_ARRAYS) and [e.position for e in skips] == list(range(1, 1 + len(BAD_ARRAYS)))
    for event, (_, _, message) in zip(skips, BAD_ARRAYS.values(), strict=True):
        assert re.match(rf"\S+m.jsonl:{event.position + 1}: {message}", event.message), (event, message)
    # a non-finite loss names its examples by sample id: a skipped position's, the line that replaced it
    ids = [int(batches[event.position].sample_ids[0]) for event in skips[:2]]
    assert skipping.describe_examples(ids) == f"{skips[0].replacement}, {skips[1].replacement}"
    assert skipping.describe_examples([0]) == skipping.describe_samples(range(0, 1), {})


# ------------------------------------------------------------------------------------------ training over it

RUNS = {
    "whole": ["--max-bad-examples", "1"],
    "first": ["--max-bad-examples", "1", "--exit-interval", "2"],  # + --save
    "second": ["--max-bad-examples", "1"],                         # + --load
    "balanced": ["--max-bad-examples", "1", "--orch-post-balancing", "--orch-gpus-per-node", "2"],
    "strict": [],
    "too_many": ["--max-bad-examples", "1"],                       # a manifest with two bad lines
    "changed_data": ["--max-bad-examples", "1"],                   # + --load; lines 3 and 4 swapped
    "allowed_changed_data": ["--max-bad-examples", "1", "--allow-changed-data"],  # + --load
    "nan_mel": [],                                                  # line 2's log-mel array holds a NaN
}
DATA = {"too_many": "two_bad.jsonl", "nan_mel": "nan_mel.jsonl"}  # else m.jsonl


def _train_over_bad_data(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    out = Path(out_dir)
    for name, flags in RUNS.items():
        data = out / DATA.get(name, "m.jsonl")
        flags = flags + ["--data-path", str(data)]
        if name == "first":
            flags += ["--save", str(out / "checkpoint")]
        if name in ("second", "changed_data", "allowed_changed_data"):
            flags += ["--load", str(out / "checkpoint")]
        if name == "changed_data" and rank == 0:  # the same lines, two of them swapped: the same size
            lines = data.read_text().splitlines(keepends=True)
            lines[2], lines[3] = lines[3], lines[2]
            data.write_text("".join(lines))
        torch.distributed.barrier()
        if name == "whole":
            flags += ["--tensorboard-dir", str(out / "tensorboard")]
        outcome = pretrain_outcome(COMMON + flags, world_size, losses="lm_loss", skipped="bad_examples")
        torch.save(outcome, out / f"{name}_rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from megatron_orch.mllm.data import SampleOrder

    out = tmp_path_factory.mktemp("bad_data")
    write_data(out)
    write_data(out, missing_lines=(2, 3), name="two_bad.jsonl")
    nan_mel = write_data(out, missing_lines=(), name="nan_mel.jsonl")
    np.save(out / "nan_mel.npy", BAD_ARRAYS["nan_mel.npy"][0])
    lines = nan_mel.read_text().splitlines(keepends=True)
    lines[1] = json.dumps({"text": "example number 1", "audio": ["nan_mel.npy"]}) + "\n"
    nan_mel.write_text("".join(lines))
    # The precondition of the scenario: the second epoch's first sample (the run's last) is not the bad
    # example again, so --max-bad-examples 1 suffices.
    assert SampleOrder(NUM_EXAMPLES, SEED)[NUM_EXAMPLES] != 1
    run_distributed(_train_over_bad_data, 2, str(out), timeout_s=300.0)
    return out, {name: [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(2)] for name in RUNS}


def _skip_lines(result):
    return [line for line in result["lines"] if "bad example skipped" in line]


@pytest.mark.distributed
def test_a_run_with_max_bad_examples_completes_reporting_the_skip(runs):
    out, results = runs
    whole = results["whole"][1]  # the logging rank
    assert "error" not in whole, whole
    assert sorted(whole["losses"]) == [1, 2, 3, 4] and all(np.isfinite(list(whole["losses"].values())))
    skips = _skip_lines(whole)
    assert len(skips) == 1 and re.fullmatch(
        r" > bad example skipped \(--max-bad-examples 1\): \S+m.jsonl:2: image file \S+gone.png does not exist; "
        r"sample 1 trains on \S+m.jsonl:\d instead", skips[0]), skips
    assert whole["skipped"] == {1: 1, 2: 0, 3: 0, 4: 0}
    iteration_1 = next(line for line in whole["lines"] if line.startswith(" iteration        1/"))
    assert "| number of bad examples skipped:   1 |" in iteration_1, iteration_1
    assert any("7 examples, the run trains on 8 samples: 2 epochs" in line for line in whole["lines"]), whole["lines"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("bad-examples-skipped")] == [(1, 1), (2, 0), (3, 0), (4, 0)]


@pytest.mark.distributed
def test_resume_after_a_skip_is_exact(runs):
    """Dropout is on: equal losses need the RNG streams restored as well as the data order."""
    _, results = runs
    whole, first, second = (results[name][1] for name in ("whole", "first", "second"))
    assert sorted(first["losses"]) == [1, 2] and sorted(second["losses"]) == [3, 4], (first, second)
    assert {**first["losses"], **second["losses"]} == whole["losses"]
    assert len(_skip_lines(first)) == 1 and _skip_lines(second) == []


@pytest.mark.distributed
def test_post_balancing_reports_the_skip_once(runs):
    _, results = runs
    balanced = results["balanced"][1]
    assert "error" not in balanced, balanced
    assert balanced["skipped"] == {1: 1, 2: 0, 3: 0, 4: 0} and len(_skip_lines(balanced)) == 1


@pytest.mark.distributed
def test_without_max_bad_examples_a_bad_example_ends_the_run_in_one_line(runs):
    _, results = runs
    reader, other = results["strict"][1]["error"], results["strict"][0]["error"]  # DP rank 1 reads sample 1
    assert re.fullmatch(r"ManifestError: \S+m.jsonl:2: image file \S+gone.png does not exist", reader), reader
    assert other.startswith("PeerFailedError: reading the step's input failed on rank(s) [1]") and "\n" not in other
    assert reader.split(": ", 1)[1] in other


@pytest.mark.distributed
def test_training_refuses_a_nan_mel_frame_naming_its_line(runs):
    _, results = runs
    reader, other = results["nan_mel"][1]["error"], results["nan_mel"][0]["error"]  # DP rank 1 reads sample 1
    assert re.fullmatch(r"ManifestError: \S+nan_mel.jsonl:2: audio \S+nan_mel.npy holds nan at index \[7, 3\]: "
                        r"log-mel frames must be finite", reader), reader
    assert other.startswith("PeerFailedError: reading the step's input failed on rank(s) [1]"), other
    assert not any(line.startswith(" iteration") for r in results["nan_mel"] for line in r["lines"])


@pytest.mark.distributed
def test_more_bad_examples_than_allowed_stop_the_run_on_every_rank(runs):
    _, results = runs
    for rank, result in enumerate(results["too_many"]):
        assert re.fullmatch(r"TooManyBadExamplesError: 2 bad examples by iteration 2, more than --max-bad-examples 1; "
                            r"the last: \S+two_bad.jsonl:3: image file \S+gone.png does not exist",
                            result.get("error", "")), (rank, result)


@pytest.mark.distributed
def test_resuming_over_a_changed_manifest_is_refused_unless_allowed(runs):
    _, results = runs
    for rank, result in enumerate(results["changed_data"]):
        assert re.search(r"--data-path \S+m.jsonl: the manifest changed since the checkpoint \(checkpoint bytes \d+, "
                         r"sha256 [0-9a-f]{16}; now bytes \d+, sha256 [0-9a-f]{16}\), so the run's sample positions "
                         r"name other examples \(pass --allow-changed-data to train on regardless\)",
                         result.get("error", "")), (rank, result)
    allowed = results["allowed_changed_data"][1]
    assert sorted(allowed.get("losses", {})) == [3, 4], allowed
    assert any("the manifest changed since the checkpoint" in line and "training on (--allow-changed-data)" in line
               for line in allowed["lines"]), allowed["lines"]


@pytest.mark.parametrize("flags, message", [
    (["--max-bad-examples", "-1"], "--max-bad-examples must be >= 0, got -1"),
    (["--keep-last-checkpoints", "0", "--save", "x"], "--keep-last-checkpoints must be >= 1, got 0"),
    (["--keep-last-checkpoints", "2"], "--keep-last-checkpoints needs --save"),
    (["--ckpt-step", "3"], "--ckpt-step needs --load"),
])
def test_data_and_checkpoint_flags_out_of_range_are_named(flags, message):
    from megatron_orch.trainer import arguments

    with pytest.raises(arguments.ArgumentError, match=re.escape(message)):
        arguments.parse_args(MLLM_TASK, COMMON + flags, world_size=2)
