"""Checkpoints: atomic saves (marker last), resume checks against the checkpoint's run (Megatron-LM's
rules and scheduler flags), interrupted saves skipped, damaged files named on every rank.

One spawned DP 2 run does every resume in turn (process start-up dominates the cost): save at
iteration 2, then resume with changed flags (refused, both values named), with
``--override-opt_param-scheduler`` and ``--use-checkpoint-opt_param-scheduler`` (learning rates of
the schedule each one picks), with nothing left to train, past an interrupted save, with a save that fails on one rank, and from
a truncated rank file.
"""
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed

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
    "failed_save": ["--exit-interval", "3"],  # + --save; rank 1 cannot write its file
    "truncated": ["--exit-interval", "3"],
}


def linear_lr(iteration: int, train_iters: int, warmup: int = 1) -> float:
    """Megatron's linear schedule after ``iteration`` steps (warm-up from 0, decay to 0 over train_iters)."""
    if iteration <= warmup:
        return LR * iteration / warmup
    return LR * (1 - (iteration - warmup) / (train_iters - warmup))


def _resumes(rank, world_size, out_dir):
    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state

    from megatron_orch.trainer import arguments, checkpointing, loop as trainer

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

    def run(name, flags):
        lines = []
        args = arguments.parse_args(COMMON + flags, world_size=world_size)
        try:
            records = trainer.pretrain(args, print_fn=lines.append)
            outcome = {"lr": {r.iteration: r.learning_rate for r in records}}
        except Exception as err:  # noqa: BLE001 -- what each rank raised is the result
            outcome = {"error": f"{type(err).__name__}: {err}"}
        finally:
            parallel_state.destroy_model_parallel()
        torch.save({**outcome, "lines": lines}, out / f"{name}_rank{rank}.pt")

    run("first", ["--exit-interval", "2", "--save", checkpoint])
    for name, flags in RESUMES.items():
        if name == "interrupted_save" and rank == 0:
            # A save of iteration 3 that died after one rank file: no marker update.
            (Path(checkpoint) / "iter_0000003").mkdir()
            (Path(checkpoint) / "iter_0000003" / "mp_rank_00_000_dp_000.pt").write_bytes(b"partial")
        if name == "truncated" and rank == 0:
            path = Path(checkpoint) / "iter_0000002" / "mp_rank_00_000_dp_000.pt"
            path.write_bytes(path.read_bytes()[:1000])
        if name == "failed_save":
            disk_full.append(True)
            flags = flags + ["--save", checkpoint]
        torch.distributed.barrier()
        run(name, flags + ["--load", checkpoint])
        disk_full.clear()


@pytest.fixture(scope="module")
def resumes(tmp_path_factory):
    out = tmp_path_factory.mktemp("resumes")
    run_distributed(_resumes, 2, str(out), timeout_s=300.0)
    return out, {name: [torch.load(out / f"{name}_rank{rank}.pt") for rank in range(2)]
                 for name in ["first", *RESUMES]}


def test_save_is_atomic_and_writes_the_marker_last(resumes):
    out, runs = resumes
    assert all("error" not in result for result in runs["first"]), runs["first"]
    folder = out / "checkpoint"
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "2\n"
    writes = [line.split(" ", 1) for rank in range(2)
              for line in (out / f"writes_rank{rank}.txt").read_text().splitlines()]
    saves = sorted((float(t), Path(p).relative_to(folder).as_posix()) for t, p in writes
                   if not p.startswith(str(folder / "iter_0000003")))  # the failed save's rank 0 file
    assert saves[-1][1] == "latest_checkpointed_iteration.txt", saves
    assert sorted(name for _, name in saves[:2]) == ["iter_0000002/mp_rank_00_000_dp_000.pt",
                                                    "iter_0000002/mp_rank_00_000_dp_001.pt"], saves
    assert not list(folder.rglob(".*tmp*")), "temporary files left behind"
    lines = runs["first"][1]["lines"]  # Megatron-LM's lines, from the rank that logs the iterations
    assert any(re.fullmatch(rf"\[[\d\-: .]+\] saving checkpoint at iteration       2 to {folder}", line)
               for line in lines), lines
    assert any(f"successfully saved checkpoint from iteration       2 to {folder}" in line for line in lines), lines
    assert lines[-1].startswith("[exiting program at iteration 2 (--exit-interval 2)] datetime: "), lines


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


def test_failed_write_raises_on_every_rank_and_leaves_the_marker(resumes):
    out, runs = resumes
    for rank, result in enumerate(runs["failed_save"]):
        assert re.search(r"cannot write checkpoint file \S+/iter_0000003/mp_rank_00_000_dp_001\.pt: "
                         r"OSError: \[Errno 28\] No space left on device", result.get("error", "")), (rank, result)
    assert runs["failed_save"][0]["error"].startswith("PeerFailedError: saving checkpoint iteration 3")
    assert (out / "checkpoint" / "latest_checkpointed_iteration.txt").read_text() == "2\n"


def test_truncated_rank_file_is_named_on_every_rank_and_nothing_says_resumed(resumes):
    _, runs = resumes
    for rank, result in enumerate(runs["truncated"]):
        error = result.get("error", "")
        assert re.search(r"cannot read checkpoint file \S+/iter_0000002/mp_rank_00_000_dp_000\.pt "
                         r"\(truncated or corrupt\?\)", error), (rank, error)
        assert not any("resumed from" in line for line in result["lines"]), (rank, result["lines"])
    assert runs["truncated"][1]["error"].startswith("PeerFailedError: loading the checkpoint under")


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
