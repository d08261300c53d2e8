"""data/example: the shipped files are what scripts/make_example_data.py writes, and the data commands of
docs/data.md (its "Example data" block, read from the page) run on them as written."""
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

from dist_utils import scaled

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "data" / "example"
BAD_LINES = [3, 5, 7, 10, 12, 14, 17, 19]  # 21 too, found only by decoding its image


def readme_data_commands() -> list:
    """The commands of docs/data.md's "Example data" block, as written."""
    text = (REPO / "docs" / "data.md").read_text()
    block = re.search(r"\*\*Example data\*\*.*?```bash\n(.*?)```", text, re.S)
    assert block, "docs/data.md has no Example data block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def _run(command: str, timeout: float):
    argv = shlex.split(command)
    if argv[0] == "python":  # the page's python is this venv's
        argv[0] = sys.executable
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=scaled(timeout))


def test_the_readme_shows_check_data_on_both_forms_and_a_training_run():
    commands = readme_data_commands()
    assert [c.split()[:3] for c in commands] == [["python", "-m", "megatron_orch.mllm.check_data"]] * 2 + [
        ["bash", "scripts/train_tiny_cpu.sh", "--data-path"]]
    assert "data/example/manifest.jsonl" in commands[0] and "data/example/energon" in commands[1]


@pytest.mark.distributed
def test_check_data_on_the_example_manifest_names_its_bad_lines_as_the_readme_shows():
    command = readme_data_commands()[0]
    proc = _run(command, timeout=60)
    assert proc.returncode == 1, proc.stderr[-2000:]
    named = [int(m) for m in re.findall(r"^data/example/manifest.jsonl:(\d+): ", proc.stdout, re.M)]
    assert named == BAD_LINES + [20], proc.stdout  # line 20: its answer is truncated
    assert re.search(r"^data/example/manifest.jsonl:20: answer of 319 tokens", proc.stdout, re.M), proc.stdout
    assert "21 examples (file headers checked)" in proc.stdout and ": 8 bad, 1 answers longer" in proc.stdout


@pytest.mark.distributed
def test_check_data_on_the_example_energon_dataset_names_the_same_samples_as_the_readme_shows():
    command = readme_data_commands()[1]
    proc = _run(command, timeout=90)
    assert proc.returncode == 1, proc.stderr[-2000:]
    named = [int(m) for m in re.findall(r"^data/example/energon/shard_00\d.tar:(\d{6}): ", proc.stdout, re.M)]
    assert named == BAD_LINES + [21, 20], proc.stdout  # --decode: the damaged PNG too; then the long answer
    assert re.search(r"shard_001.tar:000021: cannot read image 000021.img0.png: image file is truncated",
                     proc.stdout), proc.stdout
    assert "21 examples (decoded)" in proc.stdout and ": 9 bad, 1 answers longer" in proc.stdout


@pytest.mark.distributed
def test_the_readmes_training_command_on_the_example_energon_dataset():
    proc = _run(readme_data_commands()[2], timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    iterations = re.findall(r"^ iteration +(\d+)/ +2 \|.*lm loss: ([\d.E+-]+)", proc.stdout, re.M)
    assert [int(i) for i, _ in iterations] == [1, 2] and all(np.isfinite(float(x)) for _, x in iterations), proc.stdout
    assert re.search(r"bad example skipped \(--max-bad-examples 64\): data/example/energon/shard_00\d.tar:\d{6}: ",
                     proc.stdout), proc.stdout


# ----------------------------------------------------------------------- the script writes what ships

def _make_example_data():
    spec = importlib.util.spec_from_file_location("make_example_data", REPO / "scripts" / "make_example_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _members(path: Path) -> dict:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _pixels(data: bytes):
    from PIL import Image
    try:
        return np.asarray(Image.open(io.BytesIO(data)))
    except OSError:  # the truncated PNG: its bytes
        return data


@pytest.mark.distributed
def test_the_shipped_example_data_is_what_the_script_writes(tmp_path):
    _make_example_data().write_example_data(tmp_path)
    assert (tmp_path / "manifest.jsonl").read_text() == (EXAMPLE / "manifest.jsonl").read_text()
    shipped = sorted(p.name for p in (EXAMPLE / "media").iterdir())
    assert sorted(p.name for p in (tmp_path / "media").iterdir()) == shipped
    for name in shipped:  # PNG bytes may differ between Pillow versions; their pixels may not
        new, old = (tmp_path / "media" / name).read_bytes(), (EXAMPLE / "media" / name).read_bytes()
        if name.endswith(".png") and new != old:
            assert np.array_equal(_pixels(new), _pixels(old)), name
        else:
            assert new == old, name
    for shard in ("shard_000.tar", "shard_001.tar"):
        new, old = _members(tmp_path / "energon" / shard), _members(EXAMPLE / "energon" / shard)
        assert list(new) == list(old), shard
        for name in new:
            assert new[name] == old[name] or np.array_equal(_pixels(new[name]), _pixels(old[name])), name
    assert sorted(p.name for p in (EXAMPLE / "energon" / ".nv-meta").iterdir()) == \
        sorted(p.name for p in (tmp_path / "energon" / ".nv-meta").iterdir())
    for name in ("dataset.yaml", "split.yaml", ".info.json"):
        assert (tmp_path / "energon" / ".nv-meta" / name).read_text() == \
            (EXAMPLE / "energon" / ".nv-meta" / name).read_text(), name
    entries = [json.loads(line) for line in (EXAMPLE / "manifest.jsonl").read_text().splitlines()]
    assert len(entries) == 21 and all(set(e) <= {"text", "prompt", "images", "audio", "sizes"} for e in entries)
