"""Energon datasets (megatron_orch.mllm.energon), in this process: the task encoder against the manifest
reader (the example data as JSONL and as Energon: the same examples, the same bad ones), Energon's
VQA, captioning and interleaved sample types, the loader state (plain types, weights_only, an exact
resume after read-ahead), and the errors of a resume without it or of an unsupported dataset."""
import dataclasses
import io
import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import torch

from megatron.energon import WorkerConfig, get_loader, get_val_dataset

from megatron_orch.mllm import energon
from megatron_orch.mllm.check_data import check_energon, check_manifest
from megatron_orch.mllm.config import load_model_config
from megatron_orch.mllm.data import build_train_iterator, checked_dataset, example_reader
from megatron_orch.mllm.data_config import DataConfig
from megatron_orch.mllm.manifest import ManifestDataset, ManifestError, MediaBytes

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "data" / "example"
TINY = load_model_config("tiny")
SEQ = 128


def data_config(path, **kwargs) -> DataConfig:
    return DataConfig(TINY, seq_length=SEQ, micro_batch_size=kwargs.pop("micro_batch_size", 2),
                      num_samples=kwargs.pop("num_samples", 40), data_path=str(path), **kwargs)


def encoded_samples(path, max_bad_examples=100, trust_dataset_code=False) -> list:
    """Every sample of the dataset's train split through the training task encoder, in the dataset's order."""
    dataset = checked_dataset(data_config(path, trust_dataset_code=trust_dataset_code))
    loader = get_loader(get_val_dataset(path, split_part="train", batch_size=None,
                                        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0),
                                        task_encoder=dataset.task_encoder(max_bad_examples)))
    return list(loader)


def assert_same_example(a, b):
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert set(p for p in a.items if a.num_items(p)) == set(p for p in b.items if b.num_items(p))
    for phase in a.items:
        if a.num_items(phase):
            assert torch.equal(a.items[phase], b.items[phase]), phase


# ------------------------------------------------------------------------------ the example data, twice

def test_the_example_energon_samples_are_the_manifests_examples():
    manifest = ManifestDataset(EXAMPLE / "manifest.jsonl", data_config(EXAMPLE).layout,
                               example_reader(data_config(EXAMPLE)).tiling)
    samples = encoded_samples(EXAMPLE / "energon")
    lines = [int(s.where.rsplit(":", 1)[1]) for s in samples]
    assert lines == [n for n in range(1, 22) if n % 7 not in (3, 5, 0)]  # the good ones, in order
    for line, sample in zip(lines, samples):
        expected, note = manifest.read(line - 1)
        assert_same_example(sample.example, expected)
        assert (sample.note is None) == (note is None), line
    assert [len(s.skipped) for s in samples][:3] == [0, 0, 1]  # line 3 skipped, for line 4
    assert re.fullmatch(r"\S+/energon/shard_000.tar:000003: image file 000003.img0.png does not exist",
                        samples[2].skipped[0]), samples[2].skipped


def _reasons(messages, where):
    """The reasons of bad-example messages, with where they are and file names taken out."""
    out = {}
    for message in messages:
        found = re.match(where, message)
        assert found, message
        reason = re.sub(r"\S*/media/\w+\.\w+|\d{6}\.\w+\.\w+", "FILE", message[found.end():])
        out[int(found.group(1))] = reason.replace("'", "")
    return out


@pytest.mark.parametrize("decode", [False, True])
def test_check_data_finds_the_same_bad_examples_in_both(decode):
    config = data_config(EXAMPLE, refuse_long_answers=False)
    manifest = ManifestDataset(EXAMPLE / "manifest.jsonl", config.layout, example_reader(config).tiling)
    jsonl = check_manifest(manifest, decode=decode, workers=2)
    from_energon = check_energon(checked_dataset(data_config(EXAMPLE / "energon")), decode=decode)
    assert from_energon.checked == jsonl.checked == 21
    a = _reasons(jsonl.bad, r"\S+manifest.jsonl:(\d+): ")
    b = _reasons(from_energon.bad, r"\S+/energon/shard_00\d.tar:(\d+): ")
    assert a == b and sorted(a) == [3, 5, 7, 10, 12, 14, 17, 19] + ([21] if decode else []), (a, b)
    assert len(jsonl.truncated) == len(from_energon.truncated) == 1


def test_without_max_bad_examples_the_first_bad_sample_ends_the_run_naming_it():
    iterator = build_train_iterator(data_config(EXAMPLE / "energon", micro_batch_size=1), 0, 0, 2)
    with pytest.raises(ManifestError, match=r"\S+/energon/shard_00\d.tar:\d{6}: "):
        for _ in range(40):
            next(iterator)


def test_each_rank_reads_its_own_part_in_megatron_order_with_the_skips_reported():
    config = data_config(EXAMPLE / "energon", micro_batch_size=2, num_samples=24, max_bad_examples=100)
    seen = []
    for rank in range(2):
        batches = list(build_train_iterator(config, 0, rank, 2))
        assert len(batches) == 6  # 24 samples / (2 x DP 2); the iterator ends with the run
        ids = [b.sample_ids.tolist() for b in batches]
        assert ids == [[(k * 2 + rank) * 2, (k * 2 + rank) * 2 + 1] for k in range(6)]
        seen.append(ids)
    iterator = build_train_iterator(config, 0, 1, 2)
    list(iterator)
    events = iterator.take_events(before=24)
    assert events and all(e.message.startswith(str(EXAMPLE / "energon")) for e in events)
    assert all(e.replacement is None or ":0000" in e.replacement for e in events)
    assert iterator.take_events(before=24) == []


def test_one_event_per_bad_sample_skipped_for_a_position():
    """Energon's draws for sample 0 meet shard_001.tar:000021 (a truncated image) twice: reported (and counted
    against --max-bad-examples) once."""
    iterator = build_train_iterator(data_config(EXAMPLE / "energon", num_samples=12, max_bad_examples=100), 0, 0, 1)
    list(iterator)
    skipped = [(e.position, e.message) for e in iterator.take_events(before=12) if e.skipped]
    assert any(position == 0 and "000021" in message for position, message in skipped), skipped
    assert len(skipped) == len(set(skipped)), skipped


# ---------------------------------------------------------------------------------- the loader's state

def test_a_resumed_iterator_continues_on_exactly_the_samples_after_the_trained_ones():
    config = data_config(EXAMPLE / "energon", micro_batch_size=2, num_samples=40, max_bad_examples=100, seed=3)
    whole = build_train_iterator(config, 0, 1, 2)
    batches = [next(whole) for _ in range(7)]  # read ahead of the 3 steps trained
    state = whole.loader_state(3 * 2 * 2)
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)  # plain types only
    resumed = build_train_iterator(config, 3 * 2 * 2, 1, 2, loader_state=state)
    for expected in batches[3:]:
        got = next(resumed)
        assert torch.equal(got.sample_ids, expected.sample_ids) and torch.equal(got.tokens, expected.tokens)
        for phase in expected.items:
            assert torch.equal(got.items[phase], expected.items[phase])
    assert ([(e.position, e.message) for e in resumed.take_events(28)]
            == [(e.position, e.message) for e in whole.take_events(28) if e.position >= 12])


def test_the_loader_state_is_kept_from_the_samples_trained_on():
    config = data_config(EXAMPLE / "energon", micro_batch_size=1, num_samples=40, max_bad_examples=100)
    iterator = build_train_iterator(config, 0, 0, 2)
    for _ in range(5):
        next(iterator)
    assert iterator.loader_state(0)["micro_batch_steps"] == 0
    iterator.take_events(before=6)  # 3 steps trained: the states before are dropped
    assert iterator.loader_state(6)["micro_batch_steps"] == 3
    with pytest.raises(ValueError, match=r"no loader state after 2 samples \(1 micro-batch steps\); held: steps 3..5"):
        iterator.loader_state(2)


def test_the_samples_of_the_last_trained_batch_are_named_by_this_rank():
    """What a non-finite step's message names (the trainer's describe_samples): this rank's samples of the
    batch just trained, also after their events were taken, and the other ranks' positions not at all."""
    config = data_config(EXAMPLE / "energon", micro_batch_size=1, num_samples=40, max_bad_examples=100)
    iterator = build_train_iterator(config, 0, 1, 2)
    batches = [next(iterator) for _ in range(4)]  # positions 1, 3, 5, 7 are this rank's
    iterator.take_events(before=4)  # the first global batch of 4 samples trained
    named = iterator.describe_samples(range(0, 4), {})
    keys = [int(name.rsplit(":", 1)[1]) for name in named.split(" (DP rank")[0].split(", ")]
    assert len(keys) == 2 and named.endswith("(DP rank 1's; each rank names its own)")
    mine = named.split(" (DP rank")[0].split(", ")  # the examples whose own loss is not finite: by position
    assert iterator.describe_examples([1, 2, 3]) == f"{mine[0]}, sample 2, {mine[1]}"
    assert iterator.describe_samples(range(0, 4), {3: "replacement"}).startswith(named.split(", ")[0] + ", replacement")
    iterator.take_events(before=8)  # the next batch trained: the first one's samples are no longer held
    assert iterator.describe_samples(range(0, 4), {}).startswith(" (DP rank 1's")
    assert len(batches) == 4


def test_resuming_without_the_loader_state_or_with_another_ranks_is_refused():
    config = data_config(EXAMPLE / "energon", micro_batch_size=1, max_bad_examples=100)
    with pytest.raises(ValueError, match=r"resuming an Energon dataset at 4 consumed samples needs the loader state"):
        build_train_iterator(config, 4, 0, 2)
    state = build_train_iterator(config, 0, 0, 2).loader_state(0)
    with pytest.raises(ValueError, match=r"loader state is of DP rank 0 of 2 after 0 micro-batch steps; this rank "
                                         r"resumes as rank 1 of 2 after 0"):
        build_train_iterator(config, 0, 1, 2, loader_state=state)


def test_plain_state_round_trips_energons_state_objects_and_refuses_other_classes():
    from megatron.energon.rng import SystemRng
    from megatron.energon.savable_loader import SavableDatasetCheckpoint, SavableDatasetState
    from megatron.energon.state import FlexState

    rng = SystemRng.save_state()  # torch tensor, numpy arrays and tuples, Python's nested tuples
    state = SavableDatasetCheckpoint(state=SavableDatasetState(rng=rng, dataset_state=FlexState(a=(1, "x"), b=[None]),
                                                               sample_index=3), offset=2)
    saved = io.BytesIO()
    torch.save(energon.plain_state(state), saved)
    saved.seek(0)
    back = energon.energon_state(torch.load(saved, weights_only=True))
    assert isinstance(back, SavableDatasetCheckpoint) and back.offset == 2 and back.state.sample_index == 3
    assert isinstance(back.state.dataset_state, FlexState) and back.state.dataset_state == {"a": (1, "x"), "b": [None]}
    assert torch.equal(back.state.rng.torch, rng.torch) and back.state.rng.random == rng.random
    assert repr(back.state.rng.numpy) == repr(rng.numpy)
    with pytest.raises(ValueError, match="not an Energon state class: os:system"):
        energon.energon_state({"energon": "os:system", "fields": {}})
    with pytest.raises(TypeError, match="cannot save a builtins.set"):
        energon.plain_state({1, 2})


# ---------------------------------------------------------------------------- Energon's own sample types

def _prepare(folder: Path, samples: dict, dataset_yaml: str, sample_loader: str = None) -> Path:
    """A one-shard Energon dataset of ``samples`` ({key: {part: bytes}}), prepared as energon prepare does."""
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    folder.mkdir()
    with tarfile.open(folder / "shard.tar", "w") as tar:
        for key, parts in samples.items():
            for part, data in parts.items():
                info = tarfile.TarInfo(f"{key}.{part}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    BaseWebdatasetFactory.prepare_dataset(folder, ["shard.tar"], split_parts_ratio=[("train", 1.0)],
                                          shuffle_seed=None, workers=1)
    (folder / ".nv-meta" / "dataset.yaml").write_text(dataset_yaml)
    if sample_loader is not None:
        (folder / ".nv-meta" / "sample_loader.py").write_text(sample_loader)
    return folder


def _manifest_example(tmp_path, entry: dict, files: dict):
    """The example the manifest reader makes of ``entry`` whose media are ``files``."""
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(entry) + "\n")
    config = data_config(path)
    return ManifestDataset(path, config.layout, example_reader(config).tiling)[0]


@pytest.mark.distributed
def test_vqa_captioning_and_interleaved_samples_become_the_manifest_entries_they_are(tmp_path):
    square, wide = (EXAMPLE / "media" / "square.png").read_bytes(), (EXAMPLE / "media" / "wide.png").read_bytes()
    vqa = _prepare(tmp_path / "vqa", {"q1": {"png": square, "json": json.dumps(
        {"question": "what colour?", "answers": ["blue", "red"], "weights": [0.2, 0.8]}).encode()}},
        "sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\nfield_map:\n  image: png\n"
        "  context: json[question]\n  answers: json[answers]\n  answer_weights: json[weights]\n")
    captions = _prepare(tmp_path / "captions", {"c1": {"png": wide, "txt": b"a wide ramp"}},
                        "sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
                        "field_map:\n  image: png\n  caption: txt\n")
    interleaved = _prepare(
        tmp_path / "interleaved", {"i1": {"0.txt": b"look:", "1.png": square, "2.txt": b"a square", "3.png": wide,
                                          "4.txt": b"then a ramp"}},
        "sample_type:\n  __module__: megatron.energon\n  __class__: InterleavedSample\n"
        "sample_loader: sample_loader.py:sample_loader\npart_filter: sample_loader.py:part_filter\n",
        "def sample_loader(raw):\n    return {'sequence': [raw[k] for k in sorted(raw) if not k.startswith('__')]}\n"
        "def part_filter(part):\n    return True\n")
    expected = {
        vqa: ({"prompt": "what colour?", "text": "red", "images": ["square.png"]}, {"square.png": square}),
        captions: ({"text": "a wide ramp", "images": ["wide.png"]}, {"wide.png": wide}),
        interleaved: ({"prompt": "look:", "text": "a square then a ramp", "images": ["square.png", "wide.png"]},
                      {"square.png": square, "wide.png": wide}),
    }
    for folder, (entry, files) in expected.items():
        [sample] = encoded_samples(folder, max_bad_examples=0, trust_dataset_code=folder is interleaved)
        assert sample.problem is None, sample.problem
        assert_same_example(sample.example, _manifest_example(tmp_path, entry, files))


@pytest.mark.distributed
def test_an_unsupported_sample_type_is_refused_when_the_dataset_opens(tmp_path):
    folder = _prepare(tmp_path / "text", {"t1": {"txt": b"hello"}}, "sample_type:\n  __module__: megatron.energon\n"
                      "  __class__: TextSample\nfield_map:\n  text: txt\n")
    with pytest.raises(ManifestError, match=r"sample type TextSample \(its .nv-meta/dataset.yaml\) is not "
                                            r"supported; use one of MultimodalSample, VQASample, CaptioningSample, "
                                            r"InterleavedSample"):
        checked_dataset(data_config(folder))


@pytest.mark.distributed
def test_a_sample_without_its_json_part_is_a_bad_sample_named(tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(EXAMPLE / "energon", folder)
    with tarfile.open(EXAMPLE / "energon" / "shard_000.tar") as source, \
            tarfile.open(folder / "shard_000.tar", "w") as target:
        for member in source.getmembers():  # sample 000001 without its .json part, the same size in bytes
            data = source.extractfile(member).read()
            if member.name == "000001.json":
                member = tarfile.TarInfo("000001.note")
                member.size = len(data)
            target.addfile(member, io.BytesIO(data))
    shutil.rmtree(folder / ".nv-meta")
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory
    BaseWebdatasetFactory.prepare_dataset(folder, ["shard_000.tar", "shard_001.tar"],
                                          split_parts_ratio=[("train", 1.0)], shuffle_seed=None, workers=1)
    shutil.copy(EXAMPLE / "energon" / ".nv-meta" / "dataset.yaml", folder / ".nv-meta" / "dataset.yaml")
    report = check_energon(checked_dataset(data_config(folder)))
    assert report.bad[0] == f"{folder}/shard_000.tar:000001: the sample has no .json part (its manifest entry)"


# ------------------------------------------------------------------------------ a damaged shard

def _damaged_copy(tmp_path, how: str) -> Path:
    """The example dataset with shard_001.tar cut in half ("truncated") or the header of shard_000.tar's 7th
    member (sample 4's first part) overwritten ("flipped")."""
    folder = tmp_path / how
    shutil.copytree(EXAMPLE / "energon", folder)
    shard = folder / ("shard_001.tar" if how == "truncated" else "shard_000.tar")
    data = bytearray(shard.read_bytes())
    if how == "truncated":
        data = data[:len(data) // 2]
    else:
        with tarfile.open(shard) as tar:
            offset = tar.getmembers()[6].offset
        data[offset:offset + 100] = bytes(b ^ 0xFF for b in data[offset:offset + 100])
    shard.write_bytes(bytes(data))
    return folder


def test_a_damaged_shard_is_named_by_shard_and_sample_then_skipped_or_refused(tmp_path):
    damage = r"cannot be read from its shard \(ValueError: Unexpected end of tar file: {shard}\): the shard is damaged"
    truncated, flipped = _damaged_copy(tmp_path, "truncated"), _damaged_copy(tmp_path, "flipped")
    report = check_energon(checked_dataset(data_config(truncated)))
    named = [line for line in report.bad if "cannot be read" in line]
    assert report.checked == 21 and len(named) == 8, report.bad  # samples 3..10 of shard_001's 10
    for number, line in zip(range(3, 11), named):
        assert re.fullmatch(rf"{re.escape(str(truncated))}/shard_001.tar: sample {number} of 10: "
                            + damage.format(shard="shard_001.tar") + r" \(truncated or corrupt\)", line), line
    report = check_energon(checked_dataset(data_config(flipped)))
    assert [line for line in report.bad if "cannot be read" in line] == [
        f"{flipped}/shard_000.tar: sample 4 of 11: cannot be read from its shard (ValueError: Unexpected end of tar "
        "file: shard_000.tar): the shard is damaged (truncated or corrupt)"]
    # training: skipped and counted under --max-bad-examples, or the run ends naming it
    config = data_config(flipped, micro_batch_size=1, num_samples=21, max_bad_examples=64)
    loader = build_train_iterator(config, consumed_samples=0, data_parallel_rank=0, data_parallel_size=1)
    assert len(list(loader)) == 21
    skipped = [event.message for event in loader.take_events(21) if event.skipped]
    assert any("shard_000.tar: sample 4 of 11: cannot be read" in message for message in skipped), skipped  # per epoch
    strict = build_train_iterator(dataclasses.replace(config, max_bad_examples=0), consumed_samples=0,
                                  data_parallel_rank=0, data_parallel_size=1)
    with pytest.raises(ManifestError, match=r"shard_000.tar: sample 4 of 11: cannot be read"):
        list(strict)


@pytest.mark.distributed  # Energon's loader processes
def test_samples_a_loader_process_could_not_read_are_counted(tmp_path):
    """With loader processes, the damaged samples at the end of a process's part never reach this one:
    counted, with the way to name them, never passed over."""
    folder = _damaged_copy(tmp_path, "truncated")
    report = check_energon(checked_dataset(data_config(folder)), workers=2)
    assert report.bad[-1] == (f"{folder}: 8 of its 21 samples were not read (the end of a damaged shard? --workers 0 "
                              "names them)"), report.bad


# ------------------------------------------------------------------------------ code in a dataset

def _with_loader(tmp_path, loader_file="sample_loader.py", yaml_key=None) -> Path:
    """The example dataset whose MultimodalSample is loaded by a planted ``loader_file`` that, when run,
    writes ``.nv-meta/ran``."""
    folder = tmp_path / "planted"
    shutil.copytree(EXAMPLE / "energon", folder)
    (folder / ".nv-meta" / loader_file).write_text(
        f"import pathlib\npathlib.Path({str(folder / '.nv-meta' / 'ran')!r}).write_text('x')\n"
        "from megatron_orch.mllm.energon import part_filter, sample_loader\n")
    (folder / ".nv-meta" / "dataset.yaml").write_text(
        f"sample_type:\n  __module__: megatron_orch.mllm.energon\n  __class__: MultimodalSample\n"
        f"sample_loader: {loader_file}:sample_loader\npart_filter: {loader_file}:part_filter\n")
    return folder


@pytest.mark.distributed  # Energon's loader forks a process
def test_a_dataset_holding_python_is_refused_before_it_runs_unless_trusted(tmp_path, capsys):
    from megatron_orch.mllm import check_data
    folder = _with_loader(tmp_path)
    flags = ["--data-path", str(folder), "--seq-length", "256"]
    assert check_data.main(flags) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"--data-path {folder}: opening this Energon dataset runs its Python code ({folder}/.nv-meta/"
                   f"sample_loader.py and 2 more); pass --trust-dataset-code if you trust it"]
    with pytest.raises(ManifestError, match=r"runs its Python code .*sample_loader.py"):
        checked_dataset(data_config(folder))  # training's path
    assert not (folder / ".nv-meta" / "ran").exists()
    assert check_data.main(flags + ["--trust-dataset-code"]) == 1  # opened, ran, checked: the example's bad ones
    assert (folder / ".nv-meta" / "ran").exists()
    assert "21 examples" in capsys.readouterr().out


def test_what_counts_as_code_in_a_dataset(tmp_path):
    assert energon.dataset_code(EXAMPLE / "energon") == []  # this project's factory: no code in the dataset
    folder = _with_loader(tmp_path, loader_file="loader.txt")  # Energon runs a sample loader of any name
    meta = folder / ".nv-meta"
    assert energon.dataset_code(folder) == [f"{meta}/dataset.yaml names sample_loader: loader.txt:sample_loader",
                                            f"{meta}/dataset.yaml names part_filter: loader.txt:part_filter"]
    (meta / "dataset.yaml").write_text("sample_type:\n  __module__: my_samples\n  __class__: MySample\n"
                                       "field_map:\n  text: txt\n")
    (meta / "helper.py").write_text("")
    assert energon.dataset_code(folder) == [f"{meta}/helper.py", f"{meta}/dataset.yaml names the module my_samples"]
    (meta / "helper.py").unlink()
    (meta / "dataset.yaml").write_text("sample_type:\n  __module__: megatron.energon\n  __class__: VQASample\n"
                                       "field_map:\n  image: png\n")
    assert energon.dataset_code(folder) == []


def test_media_bytes_read_like_files():
    data = (EXAMPLE / "media" / "chirp.npy").read_bytes()
    assert MediaBytes("000003.mel0.npy", data).suffix == ".npy" and MediaBytes("x.image", data).suffix == ".npy"
    assert MediaBytes("x.png", b"\x89PNG").suffix == ".png" and not MediaBytes("x.png", None).is_file()


def test_the_identity_of_an_energon_dataset_follows_its_content(tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(EXAMPLE / "energon", copy)
    first = energon.energon_identity(EXAMPLE / "energon")
    assert first == energon.energon_identity(copy) and first["energon_shards"] == 2
    with open(copy / "shard_001.tar", "ab") as f:
        f.write(b"\0" * 512)
    assert energon.energon_identity(copy) != first
