"""Checkpoint save/resume for the compact trainer: one ``torch.save`` file per rank.

Layout (Megatron-LM's legacy naming, plus the DP rank since every rank writes its own file)::

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000010/mp_rank_<tp>_<pp>_dp_<dp>.pt     model, optimizer, scheduler, progress, RNG, run config

Saving is atomic: each rank writes a temporary file, fsyncs it and renames it into place; once every
rank has (agreed over the world group), rank 0 writes the marker ``latest_checkpointed_iteration.txt``
the same way. So the marker only ever names a complete iteration; an ``iter_*`` folder newer than the
marker is an interrupted save, which ``--load`` skips (and says so). Loading is agreed too: every rank
reads and checks its file, then all ranks learn whether any failed (the failing rank's message, with
the file's path, is raised on every rank) before anything is restored or reported.

Resuming checks the run against the checkpoint's (Megatron-LM's ``check_checkpoint_args`` and
``OptimizerParamScheduler`` checks, extended): the model, sequence length, seed, data path, precision
and optimizer layout must match; the LR/weight-decay schedule and what defines it (``--train-iters``,
``--global-batch-size``, the ``--lr*`` flags, ``--weight-decay``) must match unless
``--override-opt_param-scheduler`` (this run's schedule) or ``--use-checkpoint-opt_param-scheduler``
(the checkpoint's schedule) says which one wins. Every mismatch is reported with both values.

With the distributed optimizer each rank's file also holds its own shard of the optimizer state
(main parameters and moments, megatron-core's "dp_reshardable" per-bucket layout): no gather.

A checkpoint resumes only under the same TP/PP/DP sizes. Resuming restores the RNG streams and the
consumed-sample count (from which the data iterator restarts exactly), so the losses after resuming
are the ones an uninterrupted run produces.
"""
from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_orch.comm.status import describe, raise_if_any_rank_failed

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"

# Flags a resumed run must share with the checkpoint, whatever the scheduler flags say.
FIXED_FLAGS = ("seq_length", "seed", "data_path", "make_vocab_size_divisible_by", "bf16",
               "use_distributed_optimizer", "transformer_impl")
# Flags that define the LR / weight-decay schedule (megatron-core counts its steps in samples, so the
# global batch size is one of them): equal, or --override-opt_param-scheduler /
# --use-checkpoint-opt_param-scheduler.
SCHEDULE_FLAGS = ("train_iters", "global_batch_size", "lr", "min_lr", "lr_decay_style", "lr_decay_iters",
                  "lr_warmup_iters", "lr_warmup_init", "weight_decay")
# Model-config fields that only describe it (a YAML path and a shipped name can hold the same model).
_DESCRIPTIVE_MODEL_FIELDS = ("name", "shaped_after")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or resumed from; the message names the file or flags."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    notes: List[str] = field(default_factory=list)  # what loading decided that the user should read


def run_config(args) -> dict:
    """What a resumed run is checked against: the fixed and schedule flags, the model, the --orch-* flags."""
    config = {name: getattr(args, name, None) for name in FIXED_FLAGS + SCHEDULE_FLAGS}
    config["model_config"] = _flatten(dataclasses.asdict(args.mllm_config))
    config["orch"] = {name: value for name, value in sorted(vars(args).items())
                      if name.startswith("orch_") and name != "orch_config"}
    return config


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif prefix or key not in _DESCRIPTIVE_MODEL_FIELDS:
            out[f"{prefix}{key}"] = value
    return out


def check_run_config(saved: dict, current: dict, path: Path, scheduler_source: str) -> List[str]:
    """Raise :class:`CheckpointError` listing every mismatch (both values); return notes to print.

    ``scheduler_source``: ``"match"`` (default: the schedule flags must be equal), ``"override"``
    (this run's schedule wins) or ``"checkpoint"`` (the checkpoint's schedule wins).
    """
    def flag(name):
        return "--" + name.replace("_", "-")

    mismatches, schedule = [], []
    for name in FIXED_FLAGS:
        if saved.get(name) != current.get(name):
            mismatches.append(f"{flag(name)}: checkpoint {saved.get(name)!r}, this run {current.get(name)!r}")
    saved_model, model = saved.get("model_config", {}), current["model_config"]
    for key in sorted(set(saved_model) | set(model)):
        if saved_model.get(key) != model.get(key):
            mismatches.append(f"model config {key}: checkpoint {saved_model.get(key)!r}, "
                              f"this run {model.get(key)!r}")
    for name in SCHEDULE_FLAGS:
        if saved.get(name) != current.get(name):
            schedule.append(f"{flag(name)}: checkpoint {saved.get(name)!r}, this run {current.get(name)!r}")
    if scheduler_source == "match":
        mismatches += schedule
    if mismatches:
        hint = (" (pass --override-opt_param-scheduler to train on with this run's LR schedule, or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's)" if scheduler_source == "match"
                and schedule else "")
        raise CheckpointError(f"cannot resume from {path}: this run differs from the checkpoint's: "
                              + "; ".join(mismatches) + hint)
    notes = []
    if schedule:
        winner = "this run's" if scheduler_source == "override" else "the checkpoint's"
        notes.append(f" > LR schedule: {winner} ({'; '.join(schedule)})")
    if saved.get("orch") != current["orch"]:
        changed = sorted(k for k in set(saved.get("orch", {})) | set(current["orch"])
                         if saved.get("orch", {}).get(k) != current["orch"].get(k))
        notes.append(f" > --orch-* flags differ from the checkpoint's ({', '.join(flag(k) for k in changed)}): "
                     "each step trains on the same examples; only which rank computes which one changes")
    return notes


def _parallel_ranks() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_rank(),
            "pp": parallel_state.get_pipeline_model_parallel_rank(),
            "dp": parallel_state.get_data_parallel_rank()}


def _parallel_sizes() -> dict:
    return {"tp": parallel_state.get_tensor_model_parallel_world_size(),
            "pp": parallel_state.get_pipeline_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size()}


def _iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _rank_file(root: str, iteration: int) -> Path:
    r = _parallel_ranks()
    return _iteration_dir(root, iteration) / f"mp_rank_{r['tp']:02d}_{r['pp']:03d}_dp_{r['dp']:03d}.pt"


def _distributed_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def distributed_optimizer_shards(optimizer) -> list:
    """This rank's shard of every distributed optimizer's parameter state (main params, moments, step)."""
    return [opt.get_parameter_state_dp_reshardable() for opt in _distributed_optimizers(optimizer)]


def load_distributed_optimizer_shards(optimizer, shards: list) -> None:
    """Restore :func:`distributed_optimizer_shards` (after ``optimizer.load_state_dict``)."""
    for opt, shard in zip(_distributed_optimizers(optimizer), shards, strict=True):
        # DistributedOptimizer.load_state_dict gives every parameter's torch-Adam state the SAME
        # "step" tensor (megatron-core 0.16 without Apex/TE); Adam then increments it once per
        # parameter and step, corrupting the bias correction. Give each parameter its own.
        for param_state in opt.optimizer.state.values():
            if "step" in param_state:
                param_state["step"] = param_state["step"].clone()
        # The loader skips bucket padding entries by a 'padding' flag that only megatron-core's
        # sharded (dist-checkpointing) save adds; every entry of a per-rank shard is a real parameter.
        for key, dtype_state in shard.items():
            if isinstance(key, int):
                for buckets in dtype_state.values():
                    for bucket in buckets:
                        for entry in bucket:
                            entry.setdefault("padding", False)
        with torch.no_grad():  # fp32 main params are views of the (leaf) model params
            opt.load_parameter_state_from_dp_reshardable(shard)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
             "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomically(path: Path, write: Callable) -> None:
    """``write(handle)`` into a temporary file beside ``path``, fsync it, rename it to ``path``, fsync
    the folder: ``path`` is either absent, its old content, or complete -- never partly written."""
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def save_checkpoint(root: str, state: TrainState, model: list, optimizer, scheduler,
                    use_distributed_optimizer: bool, config: Optional[dict] = None) -> None:
    """Every rank writes its file atomically; once all have (agreed, so a rank that could not write
    raises on every rank with its path), rank 0 points the marker at this iteration, atomically too."""
    path, error = _rank_file(root, state.iteration), None
    try:  # gathering the state runs no collective (the distributed optimizer's shard is this rank's own)
        payload = {
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "parallel_sizes": _parallel_sizes(),
            "model": [chunk.state_dict() for chunk in model],
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "distributed_optimizer": distributed_optimizer_shards(optimizer) if use_distributed_optimizer else None,
            "run_config": config,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda handle: torch.save(payload, handle))
    except Exception as err:  # noqa: BLE001 -- every rank must learn of it
        error = CheckpointError(f"cannot write checkpoint file {path}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"saving checkpoint iteration {state.iteration}")
    if dist.get_rank() == 0:
        tracker = Path(root) / TRACKER_FILENAME
        try:
            write_atomically(tracker, lambda handle: handle.write(f"{state.iteration}\n".encode()))
        except Exception as err:  # noqa: BLE001
            error = CheckpointError(f"cannot write the checkpoint marker {tracker}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"saving checkpoint iteration {state.iteration}")


def latest_iteration(root: str) -> Optional[int]:
    tracker = Path(root) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def _interrupted_saves(root: str, latest: Optional[int]) -> List[str]:
    """``iter_*`` folders newer than the marker's iteration: saves that never completed."""
    found = []
    for folder in sorted(Path(root).glob("iter_*")):
        number = folder.name[len("iter_"):]
        if number.isdigit() and (latest is None or int(number) > latest):
            found.append(folder.name)
    return found


def _read_rank_file(path: Path) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 -- torch.load raises many kinds on a damaged file
        raise CheckpointError(f"cannot read checkpoint file {path} (truncated or corrupt?): {describe(err)}") from err
    if not isinstance(payload, dict) or "model" not in payload:
        raise CheckpointError(f"checkpoint file {path} does not hold a megatron-orch checkpoint")
    return payload


def load_checkpoint(root: str, model: list, optimizer, scheduler, use_distributed_optimizer: bool,
                    config: Optional[dict] = None, scheduler_source: str = "match") -> TrainState:
    """Restore the latest complete checkpoint under ``root``; a fresh :class:`TrainState` if there is none.

    Every rank reads and checks its own file (present, readable, same parallel layout, same run
    config -- see :func:`check_run_config`) before any collective; then all ranks agree, so a problem
    on one rank raises on every rank with that rank's message. ``TrainState.notes`` says what the
    load decided (an interrupted save skipped, which LR schedule applies).
    """
    error, payload, notes = None, None, []
    try:
        iteration = latest_iteration(root)
        skipped = _interrupted_saves(root, iteration)
        if skipped:
            notes.append(f" > skipping {', '.join(skipped)} under {root}: newer than the last complete "
                         f"checkpoint ({TRACKER_FILENAME}: {iteration}), an interrupted save")
        if iteration is None:
            notes.append(f" > no complete checkpoint under {root} ({TRACKER_FILENAME} missing): "
                         "training starts from iteration 0")
        else:
            path = _rank_file(root, iteration)
            if not path.is_file():
                raise CheckpointError(f"checkpoint file {path} is missing (iteration {iteration} under {root}); "
                                      f"was it saved with these parallel sizes {_parallel_sizes()}?")
            payload = _read_rank_file(path)
            if payload["parallel_sizes"] != _parallel_sizes():
                raise CheckpointError(f"{path} was saved with parallel sizes {payload['parallel_sizes']}, this run "
                                      f"has {_parallel_sizes()}; resume with the same "
                                      "--tensor/--pipeline-model-parallel-size and data-parallel size")
            if config is not None:
                if payload.get("run_config") is None:
                    raise CheckpointError(f"{path} holds no run config to check this run against "
                                          "(saved by an older version)")
                notes += check_run_config(payload["run_config"], config, path.parent, scheduler_source)
    except Exception as err:  # noqa: BLE001 -- every rank must learn of it
        error = err
    raise_if_any_rank_failed(error, what=f"loading the checkpoint under {root}")
    if payload is None:
        return TrainState(notes=notes)
    try:
        for chunk, chunk_state in zip(model, payload["model"], strict=True):
            chunk.load_state_dict(chunk_state, strict=True)
        optimizer.load_state_dict(payload["optimizer"])
        if use_distributed_optimizer:
            load_distributed_optimizer_shards(optimizer, payload["distributed_optimizer"])
        if scheduler_source == "checkpoint" and payload.get("run_config"):
            # The warm-up's start is not in megatron-core's scheduler state; set it before the state's
            # step count recomputes the learning rate.
            scheduler.init_lr = payload["run_config"]["lr_warmup_init"]
        scheduler.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"])
    except Exception as err:  # noqa: BLE001
        error = CheckpointError(f"cannot restore {_rank_file(root, iteration)}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"loading the checkpoint under {root}")
    return TrainState(iteration=payload["iteration"], consumed_samples=payload["consumed_samples"], notes=notes)
