"""Checkpoints: atomic saves (checksums, then the marker, last), verified loads (checksums, run ids,
replicas compared over DP), resume checks against the checkpoint's run (Megatron-LM's rules and
scheduler flags), interrupted saves skipped and their temporary files removed, one run per save folder,
pruning, damaged files named on every rank.

One spawned DP 2 run does every resume in turn (process start-up dominates the cost): save at
iterations 1 and 2 (and another run that prunes to its last two iterations), then resume with changed
flags (refused, both values named), with ``--override-opt_param-scheduler`` and
``--use-checkpoint-opt_param-scheduler`` (learning rates of the schedule each one picks), with nothing
left to train, past an
interrupted save, into a folder another live run holds, with a save that fails on one rank (after
taking over a stale lock), from a damaged rank file, from the previous iteration (``--ckpt-step``),
from a folder mixing two runs' files and from replicas that differ; a DP 1 run then tries the DP 2
checkpoint.
"""
import errno
import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import time
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from pretrain_outcome import pretrain_outcome

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

LR, ITERS = 2e-3, 4
COMMON = ["--model-config", "tiny", "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2",
          "--train-iters", str(ITERS), "--lr", str(LR), "--lr-warmup-iters", "1", "--log-interval", "1",
          "--seed", "7", "--distributed-backend", "gloo", "--optimizer", "sgd"]
RESUMES = {
    "changed": ["--train-iters", "6", "--global-batch-size", "4", "--seq-length", "96", "--num-layers", "4"],
    "override": ["--train-iters", "6", "--exit-interval", "3", "--override-opt_param-scheduler"],
    "use_checkpoint": ["--train-iters", "6", "--exit-interval", "3", "--use-checkpoint-opt_param-scheduler"],
    "finished": ["--train-iters", "2", "--override-opt_param-scheduler"],  # the checkpoint is at iteration 2
    "interrupted_save": ["--exit-interval", "3"],
    "locked": ["--exit-interval", "3"],  # + --save, which a live process holds
    "failed_save": ["--exit-interval", "3"],  # + --save (a stale lock); rank 1 cannot write its file
    "damaged": ["--exit-interval", "3"],
    "ckpt_step": ["--ckpt-step", "1", "--exit-interval", "2"],
    "mixed_runs": ["--exit-interval", "3"],
    "diverged": ["--exit-interval", "3"],
}
RANK_FILES = ("mp_rank_00_000_dp_000.pt", "mp_rank_00_000_dp_001.pt")


def linear_lr(iteration: int, train_iters: int, warmup: int = 1) -> float:
    """Megatron's linear schedule after ``iteration`` steps (warm-up from 0, decay to 0 over train_iters)."""
    if iteration <= warmup:
        return LR * iteration / warmup
    return LR * (1 - (iteration - warmup) / (train_iters - warmup))


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _prepare(name: str, out: Path) -> None:
    """What rank 0 does to the checkpoint folder before the resume ``name``."""
    checkpoint, iteration_2 = out / "checkpoint", out / "checkpoint" / "iter_0000002"
    lock = checkpoint / "megatron_orch.lock"
    if name == "interrupted_save":  # a save of iteration 3 that died after one rank file: no marker update
        (checkpoint / "iter_0000003").mkdir()
        (checkpoint / "iter_0000003" / RANK_FILES[0]).write_bytes(b"partial")
    if name == "locked":  # held by a live run (the test's own process)
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "since": time.time()}))
    if name == "failed_save":  # the holder died; its interrupted save left temporary files
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "since": time.time()}))
        (checkpoint / "iter_0000003" / f".{RANK_FILES[1]}.tmp-4242").write_bytes(b"half")
        (checkpoint / ".latest_checkpointed_iteration.txt.tmp-4242").write_bytes(b"")
    if name == "damaged":  # 4 KB of flipped bytes in one rank's file, same size
        for rank_file in RANK_FILES:
            (out / f"good_{rank_file}").write_bytes((iteration_2 / rank_file).read_bytes())
        data = bytearray((iteration_2 / RANK_FILES[0]).read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
        (iteration_2 / RANK_FILES[0]).write_bytes(bytes(data))
    if name == "mixed_runs":  # rank 1's file of another run (the pruned one) dropped into the folder
        (iteration_2 / RANK_FILES[0]).write_bytes((out / f"good_{RANK_FILES[0]}").read_bytes())
        (iteration_2 / RANK_FILES[1]).write_bytes((out / "pruned" / "iter_0000004" / RANK_FILES[1]).read_bytes())
    if name == "diverged":  # rank 1's replica differs, its checksum rewritten to match
        payload = torch.load(out / f"good_{RANK_FILES[1]}", weights_only=False)
        key = next(k for k, v in payload["model"][0].items() if torch.is_floating_point(v) and v.numel() > 1)
        payload["model"][0][key] = payload["model"][0][key] + 1e-3
        torch.save(payload, iteration_2 / RANK_FILES[1])
        checksums = json.loads((iteration_2 / "checksums.json").read_text())
        checksums["sha256"][RANK_FILES[1]] = hashlib.sha256((iteration_2 / RANK_FILES[1]).read_bytes()).hexdigest()
        (iteration_2 / "checksums.json").write_text(json.dumps(checksums))


def _pretrain(name, flags, world_size, rank, out):
    outcome = pretrain_outcome(COMMON + flags, world_size, lr="learning_rate", loss="lm_loss")
    torch.save(outcome, out / f"{name}_rank{rank}.pt")


def _resumes(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    from megatron_orch.trainer import checkpointing

    out, checkpoint = Path(out_dir), str(Path(out_dir) / "checkpoint")
    write = checkpointing.write_atomically

    disk_full = []

    def logged_write(path, fn):  # the order in which files land under their final names, per rank
        if disk_full and rank == 1 and path.name.startswith("mp_rank"):
            raise OSError(28, "No space left on device")
        write(path, fn)
        with open(out / f"writes_rank{rank}.txt", "a") as log:
            log.write(f"{time.time()!r} {path}\n")

    checkpointing.write_atomically = logged_write

    _pretrain("first", ["--exit-interval", "2", "--save", checkpoint, "--save-interval", "1"], world_size, rank, out)
    _pretrain("pruned", ["--save", str(out / "pruned"), "--save-interval", "1", "--keep-last-checkpoints", "2"],
              world_size, rank, out)
    for name, flags in RESUMES.items():
        if rank == 0:
            _prepare(name, out)
        if name in ("locked", "failed_save"):
            flags = flags + ["--save", checkpoint]
        if name == "failed_save":
            disk_full.append(True)
        torch.distributed.barrier()
        _pretrain(name, flags + ["--load", checkpoint], world_size, rank, out)
        disk_full.clear()
        if name == "locked" and rank == 0:
            (out / "checkpoint" / "megatron_orch.lock").unlink()


def _resume_with_dp1(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    _pretrain("dp1", ["--load", str(Path(out_dir) / "checkpoint")], world_size, rank, Path(out_dir))


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    out = tmp_path_factory.mktemp("resumes")
    run_distributed(_resumes, 2, str(out), timeout_s=400.0)
    run_distributed(_resume_with_dp1, 1, str(out), timeout_s=90.0)
    return out, {name: [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(2 if name != "dp1" else 1)]
                 for name in ["first", "pruned", *RESUMES, "dp1"]}


def test_save_is_atomic_and_writes_the_checksums_then_the_marker_last(resumes):
    out, runs = resumes
    assert all("error" not in result for result in runs["first"]), runs["first"]
    folder = out / "checkpoint"
    writes = [line.split(" ", 1) for rank in range(2)
              for line in (out / f"writes_rank{rank}.txt").read_text().splitlines()]
    for iteration in (1, 2):
        prefix = f"iter_{iteration:07d}/"
        saves = sorted((float(t), Path(p).relative_to(folder).as_posix()) for t, p in writes
                       if p.startswith(str(folder)) and (prefix in p or p.endswith("iteration.txt")))
        ours = [name for _, name in saves if name.startswith(prefix)]
        assert sorted(ours[:2]) == [prefix + f for f in RANK_FILES] and ours[2:] == [prefix + "checksums.json"], saves
        marker = [t for t, name in saves if name == "latest_checkpointed_iteration.txt"]
        assert any(t > max(t for t, name in saves if name.startswith(prefix)) for t in marker), saves
        checksums = json.loads((folder / prefix / "checksums.json").read_text())
        assert checksums["parallel_sizes"] == {"tp": 1, "pp": 1, "dp": 2}
    assert not list(folder.rglob(".*tmp*")), "temporary files left behind"
    lines = runs["first"][1]["lines"]  # Megatron-LM's lines, from the rank that logs the iterations
    assert any(re.fullmatch(rf"\[[\d\-: .]+\] saving checkpoint at iteration       2 to {folder}", line)
               for line in lines), lines
    assert any(f"successfully saved checkpoint from iteration       2 to {folder}" in line for line in lines), lines
    assert lines[-1].startswith("[exiting program at iteration 2 (--exit-interval 2)] datetime: "), lines


def test_every_file_of_a_run_carries_its_run_id(resumes):
    out, _ = resumes
    run_ids = set()
    for folder in (out / "pruned" / "iter_0000004", out / "checkpoint" / "iter_0000001"):
        checksums = json.loads((folder / "checksums.json").read_text())
        for rank_file in RANK_FILES:
            assert hashlib.sha256((folder / rank_file).read_bytes()).hexdigest() == checksums["sha256"][rank_file]
            assert torch.load(folder / rank_file, weights_only=False)["run_id"] == checksums["run_id"]
        run_ids.add(checksums["run_id"])
    assert len(run_ids) == 2 and all(len(run_id) == 32 for run_id in run_ids)


def test_keep_last_checkpoints_prunes_older_iterations(resumes):
    out, runs = resumes
    assert all("error" not in result for result in runs["pruned"]), runs["pruned"]
    assert sorted(p.name for p in (out / "pruned").iterdir()) == ["iter_0000003", "iter_0000004",
                                                                 "latest_checkpointed_iteration.txt"]


def test_changed_flags_are_refused_naming_both_values_on_every_rank(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["changed"]):
        error = result.get("error", "")
        for mismatch in ("--seq-length: checkpoint 128, this run 96",
                         "model config backbone.transformer.num_layers: checkpoint 2, this run 4",
                         "--train-iters: checkpoint 4, this run 6",
                         "--global-batch-size: checkpoint 2, this run 4",
                         "--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
            assert mismatch in error, (rank, error)
        assert not any("resumed from" in line for line in result["lines"]), result["lines"]
    # the same message on every rank (the iteration's folder, not a rank's file): the launcher prints it once
    assert runs["changed"][0]["error"] == runs["changed"][1]["error"]


def test_a_finished_run_says_there_is_nothing_left_to_train(resumes):
    out, runs = resumes
    for result in runs["finished"]:
        assert result.get("error") == (f"ValueError: nothing left to train: the checkpoint under --load "
                                       f"{out / 'checkpoint'} is at iteration 2 and --train-iters is 2; raise "
                                       "--train-iters to train further"), result


def test_scheduler_flags_pick_this_runs_or_the_checkpoints_schedule(resumes):
    _, runs = resumes
    override, checkpoint = runs["override"][1], runs["use_checkpoint"][1]  # rank 1 logs
    assert override.get("lr") and checkpoint.get("lr"), (override, checkpoint)
    assert override["lr"][3] == pytest.approx(linear_lr(3, train_iters=6))       # 1.2e-3
    assert checkpoint["lr"][3] == pytest.approx(linear_lr(3, train_iters=ITERS))  # 6.7e-4
    assert any("LR schedule: this run's (--train-iters: checkpoint 4, this run 6" in line
               for line in override["lines"]), override["lines"]
    assert any("LR schedule: the checkpoint's" in line for line in checkpoint["lines"]), checkpoint["lines"]


def test_interrupted_save_is_skipped_and_said(resumes):
    _, runs = resumes
    result = runs["interrupted_save"][1]
    assert result.get("lr", {}).keys() == {3}, result
    assert any(re.search(r"skipping iter_0000003 under .*: newer than the last complete checkpoint "
                         r"\(latest_checkpointed_iteration.txt: 2\), an interrupted save", line)
               for line in result["lines"]), result["lines"]
    assert any("resumed from" in line and "at iteration 2" in line for line in result["lines"]), result["lines"]


def test_a_save_folder_held_by_a_live_run_is_refused_naming_host_and_pid(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["locked"]):
        assert re.search(rf"--save \S+/checkpoint is in use by another run: host {re.escape(socket.gethostname())}, "
                         rf"pid {os.getpid()} ", result.get("error", "")), (rank, result)
    assert runs["locked"][1]["error"].startswith("PeerFailedError: taking the lock of --save")


def test_failed_write_raises_on_every_rank_and_leaves_the_marker(resumes):
    out, runs = resumes
    for rank, result in enumerate(runs["failed_save"]):
        assert re.search(r"cannot write checkpoint file \S+/iter_0000003/mp_rank_00_000_dp_001\.pt: "
                         r"OSError: \[Errno 28\] No space left on device", result.get("error", "")), (rank, result)
    assert runs["failed_save"][0]["error"].startswith("PeerFailedError: saving checkpoint iteration 3")
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "2\n"


def test_a_stale_lock_is_taken_over_and_old_temporary_files_removed(resumes):
    out, runs = resumes
    lines = runs["failed_save"][0]["lines"]  # rank 0 holds the lock
    assert any(re.search(r"took over the stale lock \S+megatron_orch.lock of host .*: process \d+ is gone", line)
               for line in lines), lines
    assert any("removed 2 temporary file(s) of interrupted saves" in line for line in lines), lines
    assert not (out / "checkpoint" / "megatron_orch.lock").exists()  # released although the run failed


def test_a_damaged_rank_file_is_named_on_every_rank_with_the_previous_iteration(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["damaged"]):
        error = result.get("error", "")
        assert re.search(r"checkpoint file \S+/iter_0000002/mp_rank_00_000_dp_000\.pt does not match its checksum "
                         r"in checksums.json .*damaged since it was written; the previous complete iteration is 1: "
                         r"resume from it with --ckpt-step 1", error), (rank, error)
        assert not any("resumed from" in line for line in result["lines"]), (rank, result["lines"])
    assert runs["damaged"][1]["error"].startswith("PeerFailedError: loading the checkpoint under")


def test_ckpt_step_resumes_the_earlier_iteration_exactly(resumes):
    _, runs = resumes
    first, resumed = runs["first"][1], runs["ckpt_step"][1]
    assert resumed.get("loss", {}).keys() == {2}, resumed
    assert resumed["loss"][2] == first["loss"][2] and resumed["lr"][2] == first["lr"][2]
    assert any("resumed from" in line and "at iteration 1" in line for line in resumed["lines"]), resumed["lines"]


def test_a_folder_mixing_two_runs_is_refused(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["mixed_runs"]):
        assert re.search(r"iter_0000002/mp_rank_00_000_dp_001\.pt belongs to run [0-9a-f]{32}, the checkpoint of "
                         r"iteration 2 to run [0-9a-f]{32}: the folder mixes two runs' files",
                         result.get("error", "")), (rank, result)


def test_replicas_that_differ_over_dp_are_refused(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["diverged"]):
        assert re.search(r"after loading \S+/iter_0000002, the parameters differ over the DP group \(global ranks "
                         r"\[0, 1\], hash per rank", result.get("error", "")), (rank, result)
        assert not any("resumed from" in line for line in result["lines"]), (rank, result["lines"])


def test_other_parallel_sizes_are_refused(resumes):
    _, runs = resumes
    error = runs["dp1"][0].get("error", "")
    assert re.search(r"iteration 2 under \S+ was saved with parallel sizes \{'tp': 1, 'pp': 1, 'dp': 2\}, this run "
                     r"has \{'tp': 1, 'pp': 1, 'dp': 1\}", error), error


def test_interrupted_write_leaves_the_old_file(tmp_path):
    from megatron_orch.trainer.checkpointing import write_atomically

    path = tmp_path / "latest_checkpointed_iteration.txt"
    write_atomically(path, lambda handle: handle.write(b"2\n"))

    def dies_midway(handle):
        handle.write(b"1")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, dies_midway)
    assert path.read_text() == "2\n"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_scheduler_flags_exclude_each_other():
    from megatron_orch.trainer import arguments

    with pytest.raises(arguments.ArgumentError, match="exclude each other"):
        arguments.parse_args(COMMON + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
                             world_size=1)


def test_write_atomically_fsyncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    from megatron_orch.trainer import checkpointing

    calls, fsync, replace = [], os.fsync, os.replace

    def logged_fsync(descriptor):
        calls.append(("fsync", os.readlink(f"/proc/self/fd/{descriptor}")))
        fsync(descriptor)

    def logged_replace(source, target):
        calls.append(("replace", str(source), str(target)))
        replace(source, target)

    monkeypatch.setattr(checkpointing.os, "fsync", logged_fsync)
    monkeypatch.setattr(checkpointing.os, "replace", logged_replace)
    path = tmp_path / "latest_checkpointed_iteration.txt"
    checkpointing.write_atomically(path, lambda handle: handle.write(b"2\n"))
    temporary = str(tmp_path / f".{path.name}.tmp-{os.getpid()}")
    assert calls == [("fsync", temporary), ("replace", temporary, str(path)), ("fsync", str(tmp_path))], calls


class _FullDisk:
    """A file handle on a disk that fills up after ``room`` bytes (the write raises ENOSPC, as a real one)."""

    def __init__(self, handle, room):
        self.handle, self.room = handle, room

    def write(self, data):
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def flush(self):
        self.handle.flush()


def test_a_failed_write_is_the_os_error_naming_the_file(tmp_path):
    """torch's serializer turns a failed write into "unexpected pos ..."; the error must be the operating
    system's, with the path: a full disk (simulated under torch.save) and a real file-size limit."""
    from megatron_orch.trainer.checkpointing import write_atomically

    payload = {"weights": torch.zeros(100_000)}
    path = tmp_path / "mp_rank_00_000_dp_000.pt"
    with pytest.raises(OSError, match=re.escape(f"[Errno 28] No space left on device: '{path}'")):
        write_atomically(path, lambda handle: torch.save(payload, _FullDisk(handle, 4096)))
    limits, handler = resource.getrlimit(resource.RLIMIT_FSIZE), signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))
    try:
        with pytest.raises(OSError, match=re.escape(f"[Errno 27] File too large: '{path}'")):
            write_atomically(path, lambda handle: torch.save(payload, handle))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
    assert list(tmp_path.iterdir()) == []  # no temporary file left


def _write_lock(root: Path, host: str, pid: int, age_s: float = 0.0) -> Path:
    path = root / "megatron_orch.lock"
    path.write_text(json.dumps({"host": host, "pid": pid, "since": time.time() - age_s}))
    os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


def test_save_folder_lock_rules(tmp_path, monkeypatch):
    from megatron_orch.trainer import checkpointing
    from megatron_orch.trainer.checkpointing import CheckpointError, SaveFolderLock

    host = socket.gethostname()
    _write_lock(tmp_path, host, os.getpid())
    with pytest.raises(CheckpointError, match=rf"in use by another run: host {re.escape(host)}, pid {os.getpid()} "):
        SaveFolderLock.acquire(str(tmp_path))
    _write_lock(tmp_path, "elsewhere", 1, age_s=10)  # another host: only its age tells
    with pytest.raises(CheckpointError, match=r"host elsewhere, pid 1 .*refreshed 10 s ago"):
        SaveFolderLock.acquire(str(tmp_path))
    _write_lock(tmp_path, "elsewhere", 1, age_s=checkpointing.LOCK_STALE_S + 1)
    lock, notes = SaveFolderLock.acquire(str(tmp_path))
    assert len(notes) == 1 and re.search(r"took over the stale lock .* of host elsewhere, pid 1: not refreshed for "
                                         r"30\d s", notes[0]), notes
    lock.verify()
    lock.release()
    assert list(tmp_path.iterdir()) == []
    _write_lock(tmp_path, host, _dead_pid())
    lock, notes = SaveFolderLock.acquire(str(tmp_path))
    assert "is gone" in notes[0], notes
    _write_lock(tmp_path, "elsewhere", 2)  # taken over meanwhile by another run
    with pytest.raises(CheckpointError, match=r"this run lost the lock .* to host elsewhere, pid 2"):
        lock.verify()
    lock.release()  # leaves the other run's lock alone
    assert json.loads((tmp_path / "megatron_orch.lock").read_text())["pid"] == 2


def test_the_holder_refreshes_its_lock(tmp_path, monkeypatch):
    from megatron_orch.trainer import checkpointing

    monkeypatch.setattr(checkpointing, "LOCK_HEARTBEAT_S", 0.05)
    lock, _ = checkpointing.SaveFolderLock.acquire(str(tmp_path))
    try:
        os.utime(lock.path, (time.time() - 1000, time.time() - 1000))
        deadline = time.time() + 10
        while time.time() - lock.path.stat().st_mtime > 100 and time.time() < deadline:
            time.sleep(0.05)
        assert time.time() - lock.path.stat().st_mtime < 100
    finally:
        lock.release()


def test_a_checkpoint_of_the_other_backbone_class_is_refused_naming_both():
    """GPTModel (megatron-core before 0.19) and HybridModel (0.19+) name the backbone's parameters differently:
    a checkpoint of one does not resume on the other, and the refusal says so before anything is loaded."""
    import copy

    from megatron_orch.mllm.model import BACKBONE_MODULE
    from megatron_orch.trainer import arguments
    from megatron_orch.trainer.checkpointing import CheckpointError, check_run_config, run_config

    current = run_config(arguments.parse_args(COMMON, world_size=1))
    assert current["model_config"]["backbone.module"] == BACKBONE_MODULE
    other = {"GPTModel": "HybridModel", "HybridModel": "GPTModel"}[BACKBONE_MODULE]
    saved = copy.deepcopy(current)
    saved["model_config"]["backbone.module"] = other
    with pytest.raises(CheckpointError, match=re.escape(f"model config backbone.module: checkpoint {other!r}, "
                                                        f"this run {BACKBONE_MODULE!r}")):
        check_run_config(saved, current, Path("iter_0000002"), "match")
    assert check_run_config(copy.deepcopy(current), current, Path("iter_0000002"), "match") == []
