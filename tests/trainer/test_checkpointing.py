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
import dataclasses
import errno
import hashlib
import json
import os
import pickle
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
from megatron_orch.mllm.task import MLLM_TASK

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
    "forged_checksums": ["--exit-interval", "3"],   # rank 1's momentum changed, its sha256 in checksums.json too
    "forged_digest": ["--exit-interval", "3"],      # ... and checksums.json's keyed digest recomputed
    "no_marker": ["--exit-interval", "3"],          # + --save; the marker deleted
    "fresh_into_used": ["--exit-interval", "3"],    # no --load, + --save of the first run's checkpoints
    "nan_grad": ["--save-interval", "1"],           # no --load, + a --save of its own; a NaN gradient in step 2
}
FRESH = ("fresh_into_used", "nan_grad")  # runs without --load
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
    if name == "locked":  # held by a live run (the process that started the ranks), its pid kept for the test
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getppid(), "since": time.time()}))
        (out / "locked_pid").write_text(str(os.getppid()))
    if name == "failed_save":  # the holder died; its interrupted save left temporary files
        lock.write_text(json.dumps({"host": socket.gethostname(), "pid": _dead_pid(), "since": time.time()}))
        (checkpoint / "iter_0000003" / f".{RANK_FILES[1]}.tmp-4242").write_bytes(b"half")
        (checkpoint / ".latest_checkpointed_iteration.txt.tmp-4242").write_bytes(b"")
    if name == "damaged":  # 4 KB of flipped bytes in one rank's file, same size
        for rank_file in (*RANK_FILES, "checksums.json"):
            (out / f"good_{rank_file}").write_bytes((iteration_2 / rank_file).read_bytes())
        data = bytearray((iteration_2 / RANK_FILES[0]).read_bytes())
        middle = len(data) // 2
        data[middle:middle + 4096] = bytes(b ^ 0xFF for b in data[middle:middle + 4096])
        (iteration_2 / RANK_FILES[0]).write_bytes(bytes(data))
    if name == "mixed_runs":  # rank 1's file of another run (the pruned one) dropped into the folder
        (iteration_2 / RANK_FILES[0]).write_bytes((out / f"good_{RANK_FILES[0]}").read_bytes())
        (iteration_2 / RANK_FILES[1]).write_bytes((out / "pruned" / "iter_0000004" / RANK_FILES[1]).read_bytes())
    if name == "diverged":  # rank 1's replica differs, its checksum rewritten to match (as a forger would)
        payload = torch.load(out / f"good_{RANK_FILES[1]}", weights_only=False)
        key = next(k for k, v in payload["model"][0].items() if torch.is_floating_point(v) and v.numel() > 1)
        payload["model"][0][key] = payload["model"][0][key] + 1e-3
        torch.save(payload, iteration_2 / RANK_FILES[1])
        _forge_checksums(iteration_2, RANK_FILES[1])
    if name in ("forged_checksums", "forged_digest"):  # rank 1's optimizer state damaged (one momentum value)
        _restore_good_files(out)
        payload = torch.load(out / f"good_{RANK_FILES[1]}", weights_only=False)
        momentum = _first_float_tensor(payload["optimizer"])
        momentum.view(-1)[0] += 1e-3
        torch.save(payload, iteration_2 / RANK_FILES[1])
        if name == "forged_checksums":  # the file's sha256 edited into checksums.json, nothing else
            checksums = json.loads((iteration_2 / "checksums.json").read_text())
            checksums["sha256"][RANK_FILES[1]] = hashlib.sha256((iteration_2 / RANK_FILES[1]).read_bytes()).hexdigest()
            (iteration_2 / "checksums.json").write_text(json.dumps(checksums))
        else:
            _forge_checksums(iteration_2, RANK_FILES[1])
    if name == "no_marker":
        _restore_good_files(out)
        (checkpoint / "latest_checkpointed_iteration.txt").unlink()
    if name == "fresh_into_used":
        (checkpoint / "latest_checkpointed_iteration.txt").write_text("2\n")
    if name in ("no_marker", "fresh_into_used"):
        (out / f"{name}_before.json").write_text(json.dumps(_hashes(checkpoint)))


def _restore_good_files(out: Path) -> None:
    for name in (*RANK_FILES, "checksums.json"):
        (out / "checkpoint" / "iter_0000002" / name).write_bytes((out / f"good_{name}").read_bytes())


def _first_float_tensor(tree):
    if isinstance(tree, torch.Tensor):
        return tree if torch.is_floating_point(tree) and tree.numel() else None
    values = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return next((found for found in map(_first_float_tensor, values) if found is not None), None)


def _hashes(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _poisoned_train_step(rank: int):
    """train_step with a NaN in one gradient of DP rank 0 in the second step (every rank's grad norm is NaN
    once DP has reduced it)."""
    from megatron_orch.trainer import loop

    stock, steps = loop.train_step, []

    def train_step(forward_step, data_iterator, model, *args, **kwargs):
        steps.append(True)
        if len(steps) != 2 or rank != 0:
            return stock(forward_step, data_iterator, model, *args, **kwargs)
        param = max(model[0].parameters(), key=torch.numel)  # the word embeddings: a gradient every step
        handle = param.register_hook(lambda grad: grad * float("nan"))
        try:
            return stock(forward_step, data_iterator, model, *args, **kwargs)
        finally:
            handle.remove()

    return stock, train_step


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
    from megatron_orch.trainer import loop
    for name, flags in RESUMES.items():
        if rank == 0:
            _prepare(name, out)
        if name in ("locked", "failed_save", "no_marker", "fresh_into_used"):
            flags = flags + ["--save", checkpoint]
        if name == "nan_grad":
            flags = flags + ["--save", str(out / "nan")]
            stock, loop.train_step = _poisoned_train_step(rank)
        if name == "failed_save":
            disk_full.append(True)
        torch.distributed.barrier()
        _pretrain(name, flags + ([] if name in FRESH else ["--load", checkpoint]), world_size, rank, out)
        disk_full.clear()
        if name == "nan_grad":
            loop.train_step = stock
        if name == "locked" and rank == 0:
            (out / "checkpoint" / "megatron_orch.lock").unlink()
        if name in ("no_marker", "fresh_into_used") and rank == 0:
            (out / f"{name}_after.json").write_text(json.dumps(_hashes(Path(checkpoint))))


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


@pytest.mark.distributed
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


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_keep_last_checkpoints_prunes_older_iterations(resumes):
    out, runs = resumes
    assert all("error" not in result for result in runs["pruned"]), runs["pruned"]
    assert sorted(p.name for p in (out / "pruned").iterdir()) == ["iter_0000003", "iter_0000004",
                                                                 "latest_checkpointed_iteration.txt"]


@pytest.mark.distributed
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


@pytest.mark.distributed
def test_a_finished_run_says_there_is_nothing_left_to_train(resumes):
    out, runs = resumes
    for result in runs["finished"]:
        assert result.get("error") == (f"ValueError: nothing left to train: the checkpoint under --load "
                                       f"{out / 'checkpoint'} is at iteration 2 and --train-iters is 2; raise "
                                       "--train-iters to train further, with --override-opt_param-scheduler "
                                       "(--train-iters is part of the LR schedule, which must otherwise match the "
                                       "checkpoint's)"), result


@pytest.mark.distributed
def test_scheduler_flags_pick_this_runs_or_the_checkpoints_schedule(resumes):
    _, runs = resumes
    override, checkpoint = runs["override"][1], runs["use_checkpoint"][1]  # rank 1 logs
    assert override.get("lr") and checkpoint.get("lr"), (override, checkpoint)
    assert override["lr"][3] == pytest.approx(linear_lr(3, train_iters=6))       # 1.2e-3
    assert checkpoint["lr"][3] == pytest.approx(linear_lr(3, train_iters=ITERS))  # 6.7e-4
    assert any("LR schedule: this run's (--train-iters: checkpoint 4, this run 6" in line
               for line in override["lines"]), override["lines"]
    assert any("LR schedule: the checkpoint's" in line for line in checkpoint["lines"]), checkpoint["lines"]


@pytest.mark.distributed
def test_interrupted_save_is_skipped_and_said(resumes):
    _, runs = resumes
    result = runs["interrupted_save"][1]
    assert result.get("lr", {}).keys() == {3}, result
    assert any(re.search(r"skipping iter_0000003 under .*: newer than the last complete checkpoint "
                         r"\(latest_checkpointed_iteration.txt: 2\), an interrupted save", line)
               for line in result["lines"]), result["lines"]
    assert any("resumed from" in line and "at iteration 2" in line for line in result["lines"]), result["lines"]


@pytest.mark.distributed
def test_a_save_folder_held_by_a_live_run_is_refused_naming_host_and_pid(resumes):
    out, runs = resumes
    holder = int((out / "locked_pid").read_text())
    for rank, result in enumerate(runs["locked"]):
        assert re.search(rf"--save \S+/checkpoint is in use by another run: host {re.escape(socket.gethostname())}, "
                         rf"pid {holder} ", result.get("error", "")), (rank, result)
    assert runs["locked"][1]["error"].startswith("PeerFailedError: taking the lock of --save")


@pytest.mark.distributed
def test_failed_write_raises_on_every_rank_and_leaves_the_marker(resumes):
    out, runs = resumes
    for rank, result in enumerate(runs["failed_save"]):
        assert re.search(r"cannot write checkpoint file \S+/iter_0000003/mp_rank_00_000_dp_001\.pt: "
                         r"OSError: \[Errno 28\] No space left on device", result.get("error", "")), (rank, result)
    assert runs["failed_save"][0]["error"].startswith("PeerFailedError: saving checkpoint iteration 3")
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "2\n"


@pytest.mark.distributed
def test_a_stale_lock_is_taken_over_and_old_temporary_files_removed(resumes):
    out, runs = resumes
    lines = runs["failed_save"][0]["lines"]  # rank 0 holds the lock
    assert any(re.search(r"took over the stale lock \S+megatron_orch.lock of host .*: process \d+ is gone", line)
               for line in lines), lines
    assert any("removed 2 temporary file(s) of interrupted saves" in line for line in lines), lines
    assert not (out / "checkpoint" / "megatron_orch.lock").exists()  # released although the run failed


@pytest.mark.distributed
def test_a_damaged_rank_file_is_named_on_every_rank_with_the_previous_iteration(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["damaged"]):
        error = result.get("error", "")
        assert re.search(r"checkpoint file \S+/iter_0000002/mp_rank_00_000_dp_000\.pt does not match its checksum "
                         r"in checksums.json .*damaged since it was written, or a file of another run or iteration "
                         r"\(not read\); the previous complete iteration is 1: resume from it with --ckpt-step 1",
                         error), (rank, error)
        assert not any("resumed from" in line for line in result["lines"]), (rank, result["lines"])
    assert runs["damaged"][1]["error"].startswith("PeerFailedError: loading the checkpoint under")


@pytest.mark.distributed
def test_ckpt_step_resumes_the_earlier_iteration_exactly(resumes):
    _, runs = resumes
    first, resumed = runs["first"][1], runs["ckpt_step"][1]
    assert resumed.get("loss", {}).keys() == {2}, resumed
    assert resumed["loss"][2] == first["loss"][2] and resumed["lr"][2] == first["lr"][2]
    assert any("resumed from" in line and "at iteration 1" in line for line in resumed["lines"]), resumed["lines"]


@pytest.mark.distributed
def test_a_folder_mixing_two_runs_is_refused(resumes):
    """Another run's rank file is refused by its checksum, unread: which run it is from is not asked of it."""
    _, runs = resumes
    for rank, result in enumerate(runs["mixed_runs"]):
        assert re.search(r"iter_0000002/mp_rank_00_000_dp_001\.pt does not match its checksum in checksums.json "
                         r".*: damaged since it was written, or a file of another run or iteration \(not read\)",
                         result.get("error", "")), (rank, result)


@pytest.mark.distributed
def test_replicas_that_differ_over_dp_are_refused(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["diverged"]):
        assert re.search(r"after loading \S+/iter_0000002, the parameters differ over the DP group \(global ranks "
                         r"\[0, 1\], hash per rank", result.get("error", "")), (rank, result)
        assert not any("resumed from" in line for line in result["lines"]), (rank, result["lines"])


@pytest.mark.distributed
def test_checksums_edited_to_match_a_damaged_optimizer_file_are_refused_at_resume(resumes):
    """Editing the damaged file's sha256 into checksums.json breaks its keyed digest; recomputing that too
    (knowing the scheme) leaves the optimizer state of the DP replicas differing: refused before a step."""
    _, runs = resumes
    for rank, result in enumerate(runs["forged_checksums"]):
        assert re.search(r"\S+/iter_0000002/checksums.json was edited or damaged since it was written \(its digest "
                         r"does not match its content\); the previous complete iteration is 1",
                         result.get("error", "")), (rank, result)
    for rank, result in enumerate(runs["forged_digest"]):
        assert re.search(r"after loading \S+/iter_0000002, the optimizer state, LR schedule or progress counters "
                         r"differ over the DP group \(global ranks \[0, 1\], hash per rank .*: its rank files hold "
                         r"replicas that diverged; the previous complete iteration is 1", result.get("error", "")), \
            (rank, result)
    for result in runs["forged_checksums"] + runs["forged_digest"]:
        assert not any("resumed from" in line or line.startswith(" iteration") for line in result["lines"]), result


@pytest.mark.distributed
def test_a_deleted_marker_or_a_fresh_run_into_a_used_folder_is_refused_and_overwrites_nothing(resumes):
    out, runs = resumes
    for rank, result in enumerate(runs["no_marker"]):
        assert re.search(r"--load \S+/checkpoint holds complete checkpoints \(iterations 1, 2 of run [0-9a-f]{12}"
                         r"\.\.\.\) but no latest_checkpointed_iteration.txt, .*: resume from the newest with "
                         r"--ckpt-step 2, or start a new run without --load \(--allow-overwrite-checkpoints lets it "
                         r"save into that folder\)", result.get("error", "")), (rank, result)
    for rank, result in enumerate(runs["fresh_into_used"]):
        assert re.search(r"--save \S+/checkpoint holds complete checkpoints of another run \(iterations 1, 2 of run "
                         r"[0-9a-f]{12}\.\.\.\): resume that run with --load \S+/checkpoint, or pass "
                         r"--allow-overwrite-checkpoints to save this run there", result.get("error", "")), \
            (rank, result)
    for name in ("no_marker", "fresh_into_used"):
        before, after = (json.loads((out / f"{name}_{when}.json").read_text()) for when in ("before", "after"))
        assert after == before and len(before) >= 5, name  # every file of both iterations, byte for byte
        assert not any(line.startswith(" iteration") for result in runs[name] for line in result["lines"]), name


@pytest.mark.distributed
def test_a_nan_grad_norm_stops_the_run_before_its_next_save(resumes):
    out, runs = resumes
    errors = [result.get("error", "") for result in runs["nan_grad"]]
    assert errors[0] == errors[1], errors  # the grad norm is global: every rank stops alike, one line
    assert re.fullmatch(r"NonFiniteStepError: iteration 2: the grad norm is nan; its examples: synthetic example 2, "
                        r"synthetic example 3; the run stops before saving it \(--no-check-for-nan-in-loss-and-grad "
                        r"trains on\)", errors[0]), errors[0]
    assert (out / "nan" / "latest_checkpointed_iteration.txt").read_text() == "1\n"
    assert sorted(p.name for p in (out / "nan").glob("iter_*")) == ["iter_0000001"]


@pytest.mark.distributed
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
        arguments.parse_args(MLLM_TASK, COMMON + ["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"],
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
    temporary = calls[0][1]
    assert re.fullmatch(re.escape(str(tmp_path / f".{path.name}.tmp-{os.getpid()}-")) + r"[0-9a-f]{12}", temporary)
    assert calls == [("fsync", temporary), ("replace", temporary, str(path)), ("fsync", str(tmp_path))], calls


def test_write_atomically_never_writes_through_a_planted_link(tmp_path, monkeypatch):
    """A symlink at every temporary name a writer could pick (the old predictable one, and the next random
    one): the file it points to, outside the folder, stays as it was; the write lands in a new file."""
    from megatron_orch.trainer import checkpointing

    folder, outside = tmp_path / "ck", tmp_path / "outside.txt"
    folder.mkdir()
    outside.write_text("precious\n")
    path = folder / "latest_checkpointed_iteration.txt"
    (folder / f".{path.name}.tmp-{os.getpid()}").symlink_to(outside)  # the name used to be predictable
    tokens = iter(["planted0000000000000000000000000", "fresh000000000000000000000000000"])
    monkeypatch.setattr(checkpointing.uuid, "uuid4", lambda: type("U", (), {"hex": next(tokens)})())
    planted = folder / f".{path.name}.tmp-{os.getpid()}-planted00000"
    planted.symlink_to(outside)  # the random name guessed: refused by the exclusive create, another one taken
    checkpointing.write_atomically(path, lambda handle: handle.write(b"2\n"))
    assert outside.read_text() == "precious\n" and path.read_text() == "2\n" and not path.is_symlink()
    assert planted.is_symlink()  # left alone, not written through


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


@pytest.mark.distributed
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


# ------------------------------------------------------------------ one process: what loading runs and refuses

class _Planted:
    """A pickle that would create ``path`` when unpickled (a rank file dropped into a checkpoint folder)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _tiny_run():
    """A model, an SGD optimizer with momentum (state to replicate) and an LR schedule, after one step."""
    torch.manual_seed(0)
    model = [torch.nn.Linear(4, 3)]
    optimizer = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model[0](torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _saved(root: Path, iterations=(1,), run_id="a" * 32, rank_state=None):
    from megatron_orch.trainer.checkpointing import TrainState, save_checkpoint

    model, optimizer, scheduler = _tiny_run()
    for iteration in iterations:
        save_checkpoint(str(root), TrainState(iteration=iteration, consumed_samples=2 * iteration, run_id=run_id,
                                              rank_state=rank_state or {}), model, optimizer, scheduler, False)
    return model, optimizer, scheduler


def _load(root: Path, **kwargs):
    from megatron_orch.trainer.checkpointing import load_checkpoint

    model, optimizer, scheduler = _tiny_run()
    return load_checkpoint(str(root), model, optimizer, scheduler, False, **kwargs)


def _files(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _forge_checksums(folder: Path, rank_file: str) -> None:
    """What a forger who knows the scheme does: the rank file's sha256 and the keyed digest recomputed."""
    from megatron_orch.trainer.checkpointing import checksums_digest

    checksums = json.loads((folder / "checksums.json").read_text())
    checksums["sha256"][rank_file] = hashlib.sha256((folder / rank_file).read_bytes()).hexdigest()
    checksums["digest"] = checksums_digest(checksums)
    (folder / "checksums.json").write_text(json.dumps(checksums))


@pytest.fixture
def one_rank(request):
    """A gloo world of one process with megatron-core's state, on CPU (the harness first)."""
    from megatron_orch.trainer import cpu_harness
    cpu_harness.install()
    request.getfixturevalue("world_of_one")


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # the planted file is a bare pickle on purpose
def test_a_planted_pickle_runs_no_code(one_rank, tmp_path):
    """A ``__reduce__`` payload as the rank file: refused by its checksum; with checksums.json edited to
    match, by the keyed digest; with both forged, by ``weights_only`` -- never unpickled with code."""
    from megatron_orch.trainer.checkpointing import CheckpointError

    root = tmp_path / "ck"
    _saved(root)
    folder, rank_file = root / "iter_0000001", RANK_FILES[0]
    created = tmp_path / "created_by_the_pickle"
    (folder / rank_file).write_bytes(pickle.dumps(_Planted(created)))
    assert len((folder / rank_file).read_bytes()) < 2000
    with pytest.raises(CheckpointError, match=rf"checkpoint file {re.escape(str(folder / rank_file))} does not match "
                                              r"its checksum in checksums.json .*\(not read\)"):
        _load(root)
    checksums = json.loads((folder / "checksums.json").read_text())
    checksums["sha256"][rank_file] = hashlib.sha256((folder / rank_file).read_bytes()).hexdigest()
    (folder / "checksums.json").write_text(json.dumps(checksums))
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder / 'checksums.json'))} was edited or damaged "
                                              r"since it was written \(its digest does not match its content\)"):
        _load(root)
    _forge_checksums(folder, rank_file)
    refused = r"holds objects other than tensors, numbers, strings and containers \(Unsupported "
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder / rank_file))} {refused}operand \d+\): "
                                              "not read"):
        _load(root)
    # the same payload in torch's own (zip) format: torch's weights_only unpickler names the refused global
    torch.save({"model": _Planted(created)}, folder / rank_file)
    _forge_checksums(folder, rank_file)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(folder / rank_file))} {refused}global: GLOBAL "
                                              r"_?io.open\): not read"):
        _load(root)
    assert not created.exists(), "the planted pickle ran"
    pickle.loads(pickle.dumps(_Planted(created)))  # not vacuous: unpickled, the payload does create the file
    assert created.exists()


def test_a_rank_state_is_restored_and_its_classes_must_be_allowed(one_rank, tmp_path):
    from megatron_orch.trainer.checkpointing import CheckpointError

    position = _LoaderPosition(epoch=2, offset=7)
    _saved(tmp_path, rank_state={"loader": position, "seen": torch.arange(3)})
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors.*_LoaderPosition"):
        _load(tmp_path)
    state = _load(tmp_path, safe_types=[_LoaderPosition])
    assert state.rank_state["loader"] == position and torch.equal(state.rank_state["seen"], torch.arange(3))
    assert (state.iteration, state.consumed_samples, state.run_id) == (1, 2, "a" * 32)


@dataclasses.dataclass
class _LoaderPosition:
    epoch: int
    offset: int


def test_saved_work_no_marker_names_is_refused_with_the_choices(one_rank, tmp_path):
    from megatron_orch.trainer.checkpointing import CheckpointError

    _saved(tmp_path, iterations=(2, 4))
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    before = _files(tmp_path)
    with pytest.raises(CheckpointError, match=r"--load \S+ holds complete checkpoints \(iterations 2, 4 of run a{12}"
                                              r"\.\.\.\) but no latest_checkpointed_iteration.txt.*: resume from the "
                                              r"newest with --ckpt-step 4, or start a new run without --load "
                                              r"\(--allow-overwrite-checkpoints lets it save into that folder\)"):
        _load(tmp_path)
    assert _load(tmp_path, step=4).iteration == 4
    # a complete iteration of the marker's run newer than the marker (the marker's update failed)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    with pytest.raises(CheckpointError, match=r"iteration 4 of run a{12}\.\.\. newer than "
                                              r"latest_checkpointed_iteration.txt's iteration 2 .*: resume from the "
                                              r"newest with --ckpt-step 4, or from the marker's with --ckpt-step 2"):
        _load(tmp_path)
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    assert _files(tmp_path) == before


def test_a_marker_that_is_not_text_is_refused_naming_it(one_rank, tmp_path):
    from megatron_orch.trainer.checkpointing import CheckpointError

    _saved(tmp_path, iterations=(2,))
    marker = tmp_path / "latest_checkpointed_iteration.txt"
    marker.write_bytes(b"\xff\xfe2\x00\n\x00")
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(marker))}: expected an iteration number, found 6 "
                                              r"bytes that are not text"):
        _load(tmp_path)
    marker.write_text("2\n")
    assert _load(tmp_path).iteration == 2


def test_a_newer_iteration_whose_checksums_fail_is_refused_not_passed_over(one_rank, tmp_path):
    """Iteration 4 complete but its checksums.json damaged, the marker at 2 (its update failed): refused with
    the choices, as a newer iteration of the same run is; with --ckpt-step 4 its damage is named."""
    from megatron_orch.trainer.checkpointing import CheckpointError

    _saved(tmp_path, iterations=(2, 4))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("2\n")
    checksums = tmp_path / "iter_0000004" / "checksums.json"
    checksums.write_text(checksums.read_text().replace('"iteration": 4', '"iteration": 5'))
    with pytest.raises(CheckpointError, match=r"iteration 4 whose checksums.json does not verify newer than "
                                              r"latest_checkpointed_iteration.txt's iteration 2 .*--ckpt-step 4, or "
                                              r"from the marker's with --ckpt-step 2"):
        _load(tmp_path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(checksums))} was edited or damaged"):
        _load(tmp_path, step=4)
    assert _load(tmp_path, step=2).iteration == 2


def test_a_run_saving_over_another_runs_checkpoints_is_refused_unless_allowed(one_rank, tmp_path):
    from megatron_orch.trainer.checkpointing import CheckpointError, check_save_folder

    _saved(tmp_path, iterations=(2, 4), run_id="b" * 32)
    with pytest.raises(CheckpointError, match=r"--save \S+ holds complete checkpoints of another run \(iterations 2, "
                                              r"4 of run b{12}\.\.\.\): resume that run with --load \S+, or pass "
                                              r"--allow-overwrite-checkpoints to save this run there"):
        check_save_folder(str(tmp_path), "c" * 32, allow_overwrite=False)
    assert check_save_folder(str(tmp_path), "b" * 32, allow_overwrite=False) == []  # its own folder
    notes = check_save_folder(str(tmp_path), "c" * 32, allow_overwrite=True)
    assert "this run saves over the complete checkpoints of another run" in notes[0], notes
    # once this run's save is the marker's, the other run's iterations left there are noted, not refused
    _saved(tmp_path, iterations=(1,), run_id="c" * 32)
    assert check_save_folder(str(tmp_path), "c" * 32, allow_overwrite=False) == []
    state = _load(tmp_path)
    assert state.iteration == 1 and state.run_id == "c" * 32
    assert any("skipping iterations 2, 4 of run b" in note and "complete checkpoints of another run" in note
               for note in state.notes), state.notes
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(CheckpointError, match=r"resume that run with --load \S+ --ckpt-step 4"):
        check_save_folder(str(tmp_path), "d" * 32, allow_overwrite=False)


def test_replicated_state_digest_sees_the_optimizer_state():
    from megatron_orch.trainer.checkpointing import replicated_state_digest

    _, optimizer, scheduler = _tiny_run()
    progress = {"iteration": 1, "consumed_samples": 2}
    digest = replicated_state_digest(optimizer, scheduler, progress)
    assert replicated_state_digest(optimizer, scheduler, dict(progress)) == digest
    buffer = next(iter(optimizer.state.values()))["momentum_buffer"]
    buffer[0, 0] += 1e-6
    assert replicated_state_digest(optimizer, scheduler, progress) != digest
    buffer[0, 0] -= 1e-6
    assert replicated_state_digest(optimizer, scheduler, {**progress, "consumed_samples": 4}) != digest


def test_a_checkpoint_of_the_other_backbone_class_is_refused_naming_both():
    """GPTModel (megatron-core before 0.19) and HybridModel (0.19+) name the backbone's parameters differently:
    a checkpoint of one does not resume on the other, and the refusal says so before anything is loaded."""
    import copy

    from megatron_orch.mllm.model import BACKBONE_MODULE
    from megatron_orch.trainer import arguments
    from megatron_orch.trainer.checkpointing import CheckpointError, check_run_config, run_config

    current = run_config(arguments.parse_args(MLLM_TASK, COMMON, world_size=1), MLLM_TASK)
    assert current["model_config"]["backbone.module"] == BACKBONE_MODULE
    other = {"GPTModel": "HybridModel", "HybridModel": "GPTModel"}[BACKBONE_MODULE]
    saved = copy.deepcopy(current)
    saved["model_config"]["backbone.module"] = other
    with pytest.raises(CheckpointError, match=re.escape(f"model config backbone.module: checkpoint {other!r}, "
                                                        f"this run {BACKBONE_MODULE!r}")):
        check_run_config(saved, current, Path("iter_0000002"), "match")
    assert check_run_config(copy.deepcopy(current), current, Path("iter_0000002"), "match") == []
