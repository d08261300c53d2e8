"""Checkpoint save/resume for the compact trainer: one ``torch.save`` file per rank, verified before it is read.

Layout (Megatron-LM's legacy naming, plus the DP rank since every rank writes its own file)::

    <dir>/latest_checkpointed_iteration.txt
    <dir>/megatron_orch.lock                        the run that saves here: host, pid (while it lives)
    <dir>/iter_0000010/mp_rank_<tp>_<pp>_dp_<dp>.pt  model, optimizer, scheduler, progress, RNG, run config, run id,
                                                     this rank's own state (``TrainState.rank_state``)
    <dir>/iter_0000010/checksums.json                run id, parallel sizes, sha256 of every rank file, and a digest
                                                     of all that keyed with the run id

Saving is atomic: each rank writes a temporary file (a new random name, created exclusively: never
through a file or link already there), fsyncs it and renames it into place; once every
rank has (agreed over the world group), rank 0 writes ``checksums.json`` and then the marker
``latest_checkpointed_iteration.txt``, the same way. So the marker only ever names a complete,
verifiable iteration; an ``iter_*`` folder newer than the marker without ``checksums.json`` is an
interrupted save, which ``--load`` skips (and says so). A full disk is reported as the operating
system's "No space left on device" with the file's path (torch's serializer would say "unexpected pos
..."). With ``--keep-last-checkpoints K`` rank 0 then deletes all but the last K complete iterations.

Loading runs nothing from the folder: ``checksums.json`` is JSON, checked against its own keyed digest
(an edit that does not recompute it, e.g. a rank file's sha256 replaced by hand, is refused); a rank
file is hashed and compared with it before it is read, and read with ``torch.load(weights_only=True)``
(tensors, numbers, strings and containers, plus the classes the caller allows by name), so a planted
pickle is refused unread. The run id and the parallel sizes come from ``checksums.json``, never from an
unverified file. A damaged file is named, with the previous complete iteration to resume from with
``--ckpt-step``. Then the parallel sizes and the run config are checked and all ranks learn whether
any failed (the failing rank's message is raised on every rank) before anything is restored or
reported. After restoring, the ranks of each DP group compare a hash of what they must hold alike: the
parameters, and the optimizer state (its replicated part under the distributed optimizer), the LR
schedule and the progress counters. Replicas that differ are refused before the first step. The keyed
digest is no signature (its key, the run id, is in the folder: a writer of the folder can edit a file and
recompute it); this comparison is the check behind it, and it cannot see an edit made alike in every
replica. The checksums detect damage, not tampering.

Saved work is never replaced by accident: complete iterations under ``--load`` without a marker, or
complete iterations of the marker's run newer than the marker, are refused with the iterations and
the ``--ckpt-step`` choices; a run whose ``--save`` holds complete checkpoints of another run is
refused unless ``--allow-overwrite-checkpoints`` (:func:`check_save_folder`).

One run per ``--save`` folder: rank 0 holds :class:`SaveFolderLock` while the run lives; a second run
is refused with the holder's host and pid. A lock whose process is gone (same host) or that was not
refreshed for :data:`LOCK_STALE_S` seconds (its holder refreshes it every :data:`LOCK_HEARTBEAT_S`) is
stale and taken over. Holding the lock, rank 0 removes the temporary files of interrupted saves.

Resuming checks the run against the checkpoint's (Megatron-LM's ``check_checkpoint_args`` and
``OptimizerParamScheduler`` checks, extended): the model (and its backbone's megatron-core class:
``GPTModel`` before 0.19, ``HybridModel`` from 0.19), sequence length, seed, data path (and the
manifest's content, unless ``--allow-changed-data``), precision and optimizer layout must match; the
LR/weight-decay schedule and what defines it (``--train-iters``, ``--global-batch-size``, the ``--lr*``
flags, ``--weight-decay``) must match unless ``--override-opt_param-scheduler`` (this run's schedule)
or ``--use-checkpoint-opt_param-scheduler`` (the checkpoint's schedule) says which one wins. Every
mismatch is reported with both values.

With the distributed optimizer each rank's file also holds its own shard of the optimizer state
(main parameters and moments, megatron-core's "dp_reshardable" per-bucket layout): no gather.

A checkpoint resumes only under the same TP/PP/DP sizes and virtual pipeline stages. Resuming restores
the RNG streams, the consumed-sample count (from which the data iterator restarts exactly; an Energon
loader from its own state, saved in each rank's file as plain types) and the counts of skipped bad
examples and truncated answers, so the losses after resuming are the ones an uninterrupted run produces.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import re
import os
import pickle
import random
import shutil
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_orch.comm.gather import all_gather_to_host
from megatron_orch.comm.status import describe, raise_if_any_rank_failed

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
CHECKSUMS_FILENAME = "checksums.json"
LOCK_FILENAME = "megatron_orch.lock"
FORMAT = 2  # of rank files and checksums.json: rank files read with weights_only, checksums.json keyed
LOCK_HEARTBEAT_S = 30.0  # the holder refreshes the lock's modification time this often
LOCK_STALE_S = 300.0     # a lock not refreshed for this long is stale (its holder stopped or died)

# Flags a resumed run must share with the checkpoint, whatever the scheduler flags say.
FIXED_FLAGS = ("seq_length", "seed", "data_path", "make_vocab_size_divisible_by", "bf16",
               "use_distributed_optimizer", "transformer_impl")
# Flags that define the LR / weight-decay schedule (megatron-core counts its steps in samples, so the
# global batch size is one of them): equal, or --override-opt_param-scheduler /
# --use-checkpoint-opt_param-scheduler.
SCHEDULE_FLAGS = ("train_iters", "global_batch_size", "lr", "min_lr", "lr_decay_style", "lr_decay_iters",
                  "lr_warmup_iters", "lr_warmup_init", "weight_decay")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, read or resumed from; the message names the file or flags."""


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    run_id: str = ""              # one per run, kept across resumes; in every checkpoint file
    bad_examples: int = 0         # skipped so far (--max-bad-examples)
    truncated_answers: int = 0    # answers cut to --seq-length so far
    notes: List[str] = field(default_factory=list)  # what loading decided that the user should read
    # This rank's own state, saved in its file and restored by name (e.g. a data loader's position): tensors,
    # numbers, strings and containers of them, or classes passed to load_checkpoint's ``safe_types``.
    rank_state: Dict[str, object] = field(default_factory=dict)


def run_config(args, task) -> dict:
    """What a resumed run is checked against: the fixed and schedule flags, the model and the data (as the
    :class:`~megatron_orch.trainer.task.TrainingTask` identifies them), the --orch-* flags."""
    config = {name: getattr(args, name, None) for name in FIXED_FLAGS + SCHEDULE_FLAGS}
    config["data_identity"] = task.data_identity(args)
    config["model_config"] = task.model_identity(args)
    config["orch"] = {name: value for name, value in sorted(vars(args).items())
                      if name.startswith("orch_") and name != "orch_config"}
    return config


def _describe_identity(identity: Optional[dict]) -> str:
    if identity is None:
        return "not recorded"
    return ", ".join(f"{key} {str(value)[:16]}" for key, value in identity.items())


def check_run_config(saved: dict, current: dict, path: Path, scheduler_source: str,
                     allow_changed_data: bool = False) -> List[str]:
    """Raise :class:`CheckpointError` listing every mismatch (both values); return notes to print.

    ``scheduler_source``: ``"match"`` (default: the schedule flags must be equal), ``"override"``
    (this run's schedule wins) or ``"checkpoint"`` (the checkpoint's schedule wins). A manifest whose
    content changed under the same ``--data-path`` is a mismatch unless ``allow_changed_data``.
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
    changed_data = saved.get("data_path") == current.get("data_path") and \
        saved.get("data_identity") != current.get("data_identity")
    if changed_data:
        change = (f"--data-path {current.get('data_path')}: the manifest changed since the checkpoint (checkpoint "
                  f"{_describe_identity(saved.get('data_identity'))}; now "
                  f"{_describe_identity(current.get('data_identity'))}), so the run's sample positions name other "
                  "examples")
        if not allow_changed_data:
            mismatches.append(change + " (pass --allow-changed-data to train on regardless)")
    if mismatches:
        hint = (" (pass --override-opt_param-scheduler to train on with this run's LR schedule, or "
                "--use-checkpoint-opt_param-scheduler to keep the checkpoint's)" if scheduler_source == "match"
                and schedule else "")
        raise CheckpointError(f"cannot resume from {path}: this run differs from the checkpoint's: "
                              + "; ".join(mismatches) + hint)
    notes = [f" > {change}: training on (--allow-changed-data)"] if changed_data else []
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
    sizes = {"tp": parallel_state.get_tensor_model_parallel_world_size(),
             "pp": parallel_state.get_pipeline_model_parallel_world_size(),
             "dp": parallel_state.get_data_parallel_world_size()}
    virtual = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    if virtual is not None:  # model chunks per pipeline rank, recorded where there are several
        sizes["vpp"] = virtual
    return sizes


def _iteration_dir(root: str, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def _rank_file_name(tp: int, pp: int, dp: int) -> str:
    return f"mp_rank_{tp:02d}_{pp:03d}_dp_{dp:03d}.pt"


def _rank_file(root: str, iteration: int) -> Path:
    r = _parallel_ranks()
    return _iteration_dir(root, iteration) / _rank_file_name(r["tp"], r["pp"], r["dp"])


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
    """Every RNG stream of this rank, as tensors, numbers and containers (what ``weights_only`` loads)."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
             "torch": torch.get_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["name"], numpy_state["keys"].numpy().astype(np.uint32),
                         numpy_state["position"], numpy_state["has_gauss"], numpy_state["cached_gaussian"]))
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


def _os_error_behind(error: BaseException, path: Path) -> Optional[OSError]:
    """The operating system's error behind ``error`` (torch's serializer reports a failed write, e.g. a
    full disk, as "unexpected pos ..."), with ``path`` as its file name; None if there is none."""
    cause: Optional[BaseException] = error
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is None or cause.errno is None:
        return None
    return OSError(cause.errno, cause.strerror or os.strerror(cause.errno), str(path))


def _create_temporary(path: Path) -> tuple[Path, int]:
    """A new temporary file beside ``path`` (``.<name>.tmp-<pid>-<random>``) and its descriptor, created
    exclusively: never through a file or link already at that name (a planted symlink is not followed)."""
    while True:
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            return temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)
        except FileExistsError:
            continue


def write_atomically(path: Path, write: Callable) -> None:
    """``write(handle)`` into a temporary file beside ``path`` (created exclusively), fsync it, rename it to
    ``path``, fsync the folder: ``path`` is either absent, its old content, or complete -- never partly
    written. A failed write raises the operating system's error (e.g. ``[Errno 28] No space left on
    device``) naming ``path``."""
    temporary, descriptor = _create_temporary(path)
    try:
        with open(descriptor, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except Exception as err:  # noqa: BLE001 -- re-raised, as the OS error behind it where there is one
        os_error = _os_error_behind(err, path)
        if os_error is None:
            raise
        raise os_error from err
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(path.parent)


def _is_temporary(path: Path) -> bool:
    """A temporary file of :func:`write_atomically` (``.<name>.tmp-<pid>-<random>``)."""
    return path.name.startswith(".") and ".tmp-" in path.name


def file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def new_run_id() -> str:
    """A run id for a run that starts from scratch: rank 0's, on every rank (collective over the world)."""
    mine = torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8)
    return bytes(all_gather_to_host(mine)[0].tolist()).hex()


def _gather_digests(digest: str) -> Dict[str, str]:
    """``{rank file name: sha256}`` of every rank (collective over the world)."""
    r = _parallel_ranks()
    row = torch.tensor([r["tp"], r["pp"], r["dp"], *bytes.fromhex(digest)], dtype=torch.int64)
    return {_rank_file_name(*row[:3]): bytes(row[3:]).hex() for row in all_gather_to_host(row).tolist()}


def checksums_digest(checksums: dict) -> str:
    """HMAC-SHA256, keyed with the run id, of everything in ``checksums`` but its ``digest``: an edit of
    ``checksums.json`` that does not recompute it is refused. No signature (the scheme is public)."""
    content = json.dumps({k: v for k, v in checksums.items() if k != "digest"}, sort_keys=True).encode()
    return hmac.new(str(checksums.get("run_id")).encode(), content, hashlib.sha256).hexdigest()


def _complete_iterations(root: str) -> List[int]:
    """Iterations under ``root`` whose ``checksums.json`` was written (every rank file saved), ascending."""
    found = []
    for folder in Path(root).glob("iter_*"):
        number = folder.name[len("iter_"):]
        if number.isdigit() and (folder / CHECKSUMS_FILENAME).is_file():
            found.append(int(number))
    return sorted(found)


def _runs_of_complete_iterations(root: str) -> Dict[int, Optional[str]]:
    """``{complete iteration: its run id}`` under ``root``; None where ``checksums.json`` does not verify."""
    runs = {}
    for iteration in _complete_iterations(root):
        try:
            runs[iteration] = _read_checksums(root, iteration)["run_id"]
        except CheckpointError:
            runs[iteration] = None
    return runs


def _describe_runs(runs: Dict[int, Optional[str]]) -> str:
    """``iterations 2, 4 of run 3f2a...`` per run (``of no verifiable run`` where checksums.json does not verify)."""
    by_run: Dict[Optional[str], List[int]] = {}
    for iteration, run in sorted(runs.items()):
        by_run.setdefault(run, []).append(iteration)
    return "; ".join(f"iteration{'s' if len(its) > 1 else ''} {', '.join(map(str, its))} "
                     + (f"of run {run[:12]}..." if run else "whose checksums.json does not verify")
                     for run, its in by_run.items())


def _prune(root: str, iteration: int, keep: int) -> None:
    """Delete complete iterations up to ``iteration`` but the last ``keep`` of them."""
    older = [i for i in _complete_iterations(root) if i <= iteration]
    for old in older[:-keep]:
        shutil.rmtree(_iteration_dir(root, old))


def save_checkpoint(root: str, state: TrainState, model: list, optimizer, scheduler,
                    use_distributed_optimizer: bool, config: Optional[dict] = None,
                    lock: Optional["SaveFolderLock"] = None, keep_last: Optional[int] = None) -> None:
    """Every rank writes its file atomically; once all have (agreed, so a rank that could not write
    raises on every rank with its path), rank 0 writes the iteration's checksums, points the marker at
    it (atomically too) and prunes to the last ``keep_last`` iterations. ``lock``: rank 0's
    :class:`SaveFolderLock`, verified first (a run that lost it must not overwrite the new holder's files)."""
    path, error, digest = _rank_file(root, state.iteration), None, None
    try:
        if lock is not None:
            lock.verify()
    except CheckpointError as err:
        error = err
    raise_if_any_rank_failed(error, what=f"saving checkpoint iteration {state.iteration}")
    try:  # gathering the state runs no collective (the distributed optimizer's shard is this rank's own)
        payload = {
            "format": FORMAT,
            "run_id": state.run_id,
            "iteration": state.iteration,
            "consumed_samples": state.consumed_samples,
            "bad_examples": state.bad_examples,
            "truncated_answers": state.truncated_answers,
            "parallel_sizes": _parallel_sizes(),
            "model": [chunk.state_dict() for chunk in model],
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "rng": rng_state(),
            "distributed_optimizer": distributed_optimizer_shards(optimizer) if use_distributed_optimizer else None,
            "run_config": config,
            "rank_state": state.rank_state,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda handle: torch.save(payload, handle))
        digest = file_sha256(path)
    except Exception as err:  # noqa: BLE001 -- every rank must learn of it
        error = CheckpointError(f"cannot write checkpoint file {path}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"saving checkpoint iteration {state.iteration}")
    digests = _gather_digests(digest)
    if dist.get_rank() == 0:
        checksums = {"format": FORMAT, "run_id": state.run_id, "iteration": state.iteration,
                     "parallel_sizes": _parallel_sizes(), "sha256": digests}
        checksums["digest"] = checksums_digest(checksums)
        contents = ((path.parent / CHECKSUMS_FILENAME, json.dumps(checksums, indent=1).encode()),
                    (Path(root) / TRACKER_FILENAME, f"{state.iteration}\n".encode()))
        try:
            for target, content in contents:  # the marker last: it names only verifiable iterations
                write_atomically(target, lambda handle, content=content: handle.write(content))
        except Exception as err:  # noqa: BLE001
            error = CheckpointError(f"cannot write {target} (checkpoint iteration {state.iteration}): {describe(err)}")
        if error is None and keep_last is not None:
            try:
                _prune(root, state.iteration, keep_last)
            except OSError as err:
                error = CheckpointError(f"cannot delete old iterations under {root} (--keep-last-checkpoints "
                                        f"{keep_last}): {describe(err)}")
    raise_if_any_rank_failed(error, what=f"saving checkpoint iteration {state.iteration}")


def latest_iteration(root: str) -> Optional[int]:
    tracker = Path(root) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    raw = tracker.read_bytes()
    try:
        text = raw.decode("ascii").strip()
    except UnicodeDecodeError:
        raise CheckpointError(f"{tracker}: expected an iteration number, found {len(raw)} bytes that are not text "
                              f"(damaged?; resume from a complete iteration with --ckpt-step N)") from None
    if not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def _interrupted_saves(root: str, latest: Optional[int]) -> List[str]:
    """``iter_*`` folders newer than the marker's iteration without ``checksums.json``: saves that never
    completed."""
    found = []
    for folder in sorted(Path(root).glob("iter_*")):
        number = folder.name[len("iter_"):]
        if number.isdigit() and (latest is None or int(number) > latest) \
                and not (folder / CHECKSUMS_FILENAME).is_file():
            found.append(folder.name)
    return found


def _read_checksums(root: str, iteration: int) -> dict:
    """``iter_N/checksums.json``, verified against its keyed digest (JSON: reading it runs nothing)."""
    path = _iteration_dir(root, iteration) / CHECKSUMS_FILENAME
    if not path.is_file():
        complete = _complete_iterations(root)
        raise CheckpointError(f"{path} is missing: iteration {iteration} under {root} is not a complete checkpoint "
                              f"(complete iterations: {complete or 'none'})")
    try:
        checksums = json.loads(path.read_text())
        checksums["run_id"], checksums["parallel_sizes"], checksums["sha256"]  # noqa: B018 -- present
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot read {path} (damaged?): {describe(err)}") from None
    if checksums.get("format") != FORMAT:
        raise CheckpointError(f"{path} is of checkpoint format {checksums.get('format', 1)}, this version reads "
                              f"format {FORMAT} (rank files it can verify before reading them)")
    if not hmac.compare_digest(str(checksums.get("digest")), checksums_digest(checksums)):
        raise CheckpointError(f"{path} was edited or damaged since it was written (its digest does not match its "
                              f"content); {_previous_complete(root, iteration)}")
    if checksums.get("iteration") != iteration:
        raise CheckpointError(f"{path} is the checksums file of iteration {checksums.get('iteration')}, not of "
                              f"{iteration} (copied from another folder?)")
    return checksums


def _previous_complete(root: str, iteration: int) -> str:
    earlier = [i for i in _complete_iterations(root) if i < iteration]
    if not earlier:
        return "no earlier complete iteration is kept"
    return f"the previous complete iteration is {earlier[-1]}: resume from it with --ckpt-step {earlier[-1]}"


def _weights_only_refusal(error: BaseException) -> str:
    """torch's many-line refusal of an unsafe pickle, as the line that names what the file holds."""
    text = str(error)
    found = re.search(r"Unsupported (?:global: GLOBAL|operand) \S+", text)
    return found.group(0) if found else text.strip().splitlines()[0] if text.strip() else type(error).__name__


def _verified_rank_file(root: str, iteration: int, checksums: dict, safe_types: Sequence = ()) -> dict:
    """This rank's payload of ``iteration``: hashed and compared with ``checksums`` first, then read with
    ``weights_only`` (tensors, numbers, strings, containers, and ``safe_types``), so that nothing in an
    unverified or planted file runs."""
    path = _rank_file(root, iteration)
    if checksums["parallel_sizes"] != _parallel_sizes():
        raise CheckpointError(f"iteration {iteration} under {root} was saved with parallel sizes "
                              f"{checksums['parallel_sizes']}, this run has {_parallel_sizes()}; resume with the same "
                              "--tensor/--pipeline-model-parallel-size, virtual pipeline stages and data-parallel size")
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (iteration {iteration} under {root}); "
                              f"{_previous_complete(root, iteration)}")
    expected = checksums["sha256"].get(path.name)
    try:
        with open(path, "rb") as handle:  # one handle: what was hashed is what is read
            found = hashlib.file_digest(handle, "sha256").hexdigest()
            if found != expected:
                raise CheckpointError(
                    f"checkpoint file {path} does not match its checksum in {CHECKSUMS_FILENAME} (sha256 "
                    f"{found[:16]}..., saved {str(expected)[:16]}...): damaged since it was written, or a file of "
                    f"another run or iteration (not read); {_previous_complete(root, iteration)}")
            handle.seek(0)
            with torch.serialization.safe_globals(list(safe_types)):
                payload = torch.load(handle, map_location="cpu", weights_only=True)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"checkpoint file {path} holds objects other than tensors, numbers, strings and "
                              f"containers ({_weights_only_refusal(err)}): not read") from None
    except Exception as err:  # noqa: BLE001 -- torch.load raises many kinds on a damaged file
        raise CheckpointError(f"cannot read checkpoint file {path} (truncated or corrupt?): {describe(err)}") from err
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or "model" not in payload:
        raise CheckpointError(f"checkpoint file {path} does not hold a megatron-orch checkpoint of format {FORMAT}")
    return payload


def parameters_digest(model: list) -> int:
    """A 63-bit hash of every parameter's bytes (equal on the replicas of a DP group)."""
    digest = hashlib.sha256()
    for chunk in model:
        for name, param in chunk.named_parameters():
            digest.update(name.encode())
            _update_digest(digest, param.detach())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def _update_digest(digest, value) -> None:
    """Hash ``value`` (tensors, containers, scalars) into ``digest``, the same on every rank that holds it."""
    if isinstance(value, torch.Tensor):
        digest.update(f"tensor {value.dtype} {tuple(value.shape)}:".encode())
        digest.update(value.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            digest.update(repr(key).encode() + b":")
            _update_digest(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[")
        for item in value:
            _update_digest(digest, item)
        digest.update(b"]")
    else:
        digest.update(repr(value).encode() + b",")


def replicated_state_digest(optimizer, scheduler, progress: dict) -> int:
    """A 63-bit hash of the state every replica of a DP group holds alike besides the parameters: the
    optimizer's (under the distributed optimizer its replicated part, without this rank's shard), the LR
    schedule's and the progress counters."""
    digest = hashlib.sha256()
    _update_digest(digest, [optimizer.state_dict(), scheduler.state_dict(), progress])
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def _check_replicas_agree(model: list, optimizer, scheduler, progress: dict, path: Path, root: str,
                          iteration: int) -> None:
    """Raise :class:`CheckpointError` on every rank of the DP group unless its parameters, optimizer state,
    schedule and progress are equal (:func:`replicated_state_digest`)."""
    group = parallel_state.get_data_parallel_group()
    mine = torch.tensor([parameters_digest(model), replicated_state_digest(optimizer, scheduler, progress)],
                        dtype=torch.int64)
    digests = all_gather_to_host(mine, group)
    ranks = dist.get_process_group_ranks(group)
    for column, what in ((0, "the parameters"), (1, "the optimizer state, LR schedule or progress counters")):
        if (digests[:, column] != digests[0, column]).any():
            hashes = [hex(int(d)) for d in digests[:, column]]
            raise CheckpointError(f"after loading {path.parent}, {what} differ over the DP group (global ranks "
                                  f"{ranks}, hash per rank {hashes}): its rank files hold replicas that diverged; "
                                  f"{_previous_complete(root, iteration)}")


def _iteration_to_load(root: str, step: Optional[int], notes: List[str]) -> Optional[int]:
    """The iteration ``--load root`` resumes from (``step``: ``--ckpt-step``), or None for none at all.
    Refuses to pass over saved work: complete iterations and no marker, or complete iterations of the
    marker's run newer than the marker."""
    latest = latest_iteration(root)
    skipped = _interrupted_saves(root, latest)
    if skipped:
        notes.append(f" > skipping {', '.join(skipped)} under {root}: newer than the last complete "
                     f"checkpoint ({TRACKER_FILENAME}: {latest}), an interrupted save")
    if step is not None:
        return step
    runs = _runs_of_complete_iterations(root)
    if latest is None:
        if runs:
            raise CheckpointError(
                f"--load {root} holds complete checkpoints ({_describe_runs(runs)}) but no {TRACKER_FILENAME}, "
                f"which names the one to resume from (deleted?): resume from the newest with --ckpt-step "
                f"{max(runs)}, or start a new run without --load (--allow-overwrite-checkpoints lets it save "
                "into that folder)")
        notes.append(f" > no checkpoint under {root} ({TRACKER_FILENAME} missing): training starts from iteration 0")
        return None
    newer = {i: run for i, run in runs.items() if i > latest}
    owner = runs.get(latest)
    mine = {i: run for i, run in newer.items() if run is None or run == owner}
    if mine:
        raise CheckpointError(
            f"--load {root}: {_describe_runs(mine)} newer than {TRACKER_FILENAME}'s iteration {latest} (of the same "
            f"run, or unverifiable): resume from the newest with --ckpt-step {max(mine)}, or from the marker's with "
            f"--ckpt-step {latest}")
    if newer:
        notes.append(f" > skipping {_describe_runs(newer)} under {root}: complete checkpoints of another run, "
                     f"newer than {TRACKER_FILENAME}'s iteration {latest} (a run saved here with "
                     "--allow-overwrite-checkpoints)")
    return latest


def load_checkpoint(root: str, model: list, optimizer, scheduler, use_distributed_optimizer: bool,
                    config: Optional[dict] = None, scheduler_source: str = "match", step: Optional[int] = None,
                    allow_changed_data: bool = False, safe_types: Sequence = ()) -> TrainState:
    """Restore the latest complete checkpoint under ``root`` (``step``: that iteration instead); a fresh
    :class:`TrainState` if there is none (saved work that no marker names is refused: see the module
    docstring).

    Every rank verifies and reads its own file (``checksums.json`` against its digest, the file against
    ``checksums.json``, then ``torch.load(weights_only=True)`` with ``safe_types`` -- classes a
    ``TrainState.rank_state`` holds -- allowed), checks the parallel layout and the run config (see
    :func:`check_run_config`) before any collective; then all ranks agree, so a problem on one rank
    raises on every rank with that rank's message. After restoring, each DP group compares its
    parameters, optimizer state, schedule and progress. ``TrainState.notes`` says what the load decided
    (an interrupted save skipped, which LR schedule applies).
    """
    error, payload, notes, checksums, iteration = None, None, [], None, None
    try:
        iteration = _iteration_to_load(root, step, notes)
        if iteration is not None:
            checksums = _read_checksums(root, iteration)
            payload = _verified_rank_file(root, iteration, checksums, safe_types)
            if config is not None:
                if payload.get("run_config") is None:
                    raise CheckpointError(f"{_rank_file(root, iteration)} holds no run config to check this run "
                                          "against")
                # the iteration's folder, not the rank file: every rank's refusal reads the same
                notes += check_run_config(payload["run_config"], config, _rank_file(root, iteration).parent,
                                          scheduler_source, allow_changed_data)
    except Exception as err:  # noqa: BLE001 -- every rank must learn of it
        error = err
    raise_if_any_rank_failed(error, what=f"loading the checkpoint under {root}")
    if payload is None:
        return TrainState(notes=notes)
    path = _rank_file(root, iteration)
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
        error = CheckpointError(f"cannot restore {path}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"loading the checkpoint under {root}")
    progress = {name: payload[name] for name in ("iteration", "consumed_samples", "bad_examples", "truncated_answers")}
    try:
        _check_replicas_agree(model, optimizer, scheduler, progress, path, root, iteration)
    except CheckpointError as err:
        error = err
    raise_if_any_rank_failed(error, what=f"loading the checkpoint under {root}")
    return TrainState(iteration=payload["iteration"], consumed_samples=payload["consumed_samples"],
                      run_id=checksums["run_id"], bad_examples=payload["bad_examples"],
                      truncated_answers=payload["truncated_answers"], notes=notes,
                      rank_state=payload["rank_state"])


def check_save_folder(root: str, run_id: str, allow_overwrite: bool) -> List[str]:
    """Refuse, on every rank, a run whose ``--save root`` holds complete checkpoints of another run (unless
    ``allow_overwrite``: ``--allow-overwrite-checkpoints``); returns notes to print. A folder whose marker
    names an iteration of this run is this run's (other runs' iterations in it were allowed before)."""
    notes, error = [], None
    if dist.get_rank() == 0:
        try:
            runs = _runs_of_complete_iterations(root)
            latest = latest_iteration(root)
            others = {i: run for i, run in runs.items() if run != run_id}
            if others and (latest is None or runs.get(latest) != run_id):
                if not allow_overwrite:
                    resume = f"--load {root}" + ("" if latest is not None else f" --ckpt-step {max(others)}")
                    raise CheckpointError(
                        f"--save {root} holds complete checkpoints of another run ({_describe_runs(others)}): resume "
                        f"that run with {resume}, or pass --allow-overwrite-checkpoints to save this run there (its "
                        "saves replace the iterations of the same number and the marker)")
                notes.append(f" > --save {root}: this run saves over the complete checkpoints of another run "
                             f"({_describe_runs(others)}) (--allow-overwrite-checkpoints)")
        except Exception as err:  # noqa: BLE001 -- every rank must learn of it
            error = err if isinstance(err, CheckpointError) else CheckpointError(f"--save {root}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"checking --save {root}")
    return notes


class SaveFolderLock:
    """``<save>/megatron_orch.lock``, held by one run's rank 0 while it lives: its host, pid and a token.

    Taken with an exclusive create; refreshed (modification time) every :data:`LOCK_HEARTBEAT_S` by a
    daemon thread; removed by :meth:`release`. A lock is stale when its process is gone (holder on this
    host) or it was not refreshed for :data:`LOCK_STALE_S` seconds (a holder on another host that died
    or hangs); a stale lock is taken over, and the run says so.
    """

    def __init__(self, root: str):
        self.path = Path(root) / LOCK_FILENAME
        self.content = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(),
                        "token": uuid.uuid4().hex}
        self._stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None

    @classmethod
    def acquire(cls, root: str) -> tuple["SaveFolderLock", List[str]]:
        """The lock of ``root`` and notes to print, or :class:`CheckpointError` naming the holder."""
        lock, notes = cls(root), []
        lock.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                with open(lock.path, "x") as handle:
                    json.dump(lock.content, handle)
                    handle.flush()
                    os.fsync(handle.fileno())
            except FileExistsError:
                holder, age = _lock_holder(lock.path)
                reason = _stale_reason(holder, age)
                if reason is None:
                    raise CheckpointError(
                        f"--save {root} is in use by another run: host {holder.get('host')}, pid {holder.get('pid')} "
                        f"(since {_clock(holder.get('since'))}; {lock.path} refreshed {age:.0f} s ago). One run per "
                        f"save folder: stop that run or choose another --save; a lock whose run died is taken over "
                        f"once its process is gone (same host) or it is {LOCK_STALE_S:.0f} s old") from None
                # Renamed away first, so that of two runs taking over the same stale lock one wins the create.
                with contextlib.suppress(FileNotFoundError):
                    os.replace(lock.path, lock.path.with_name(f".{LOCK_FILENAME}.stale-{lock.content['token']}"))
                    os.unlink(lock.path.with_name(f".{LOCK_FILENAME}.stale-{lock.content['token']}"))
                notes.append(f" > took over the stale lock {lock.path} of host {holder.get('host')}, pid "
                             f"{holder.get('pid')}: {reason}")
                continue
            lock._heartbeat = threading.Thread(target=lock._refresh, name="save-folder-lock", daemon=True)
            lock._heartbeat.start()
            return lock, notes
        raise CheckpointError(f"could not take the lock {lock.path}: another run took it over at the same time")

    def _refresh(self) -> None:
        while not self._stop.wait(LOCK_HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def verify(self) -> None:
        """Raise :class:`CheckpointError` unless this run still holds the lock."""
        holder, _ = _lock_holder(self.path)
        if holder.get("token") != self.content["token"]:
            raise CheckpointError(f"this run lost the lock {self.path} of its --save folder to host "
                                  f"{holder.get('host')}, pid {holder.get('pid')} (it was stale: not refreshed for "
                                  f"{LOCK_STALE_S:.0f} s); not saving over that run's checkpoints")

    def release(self) -> None:
        self._stop.set()
        holder, _ = _lock_holder(self.path)
        if holder.get("token") == self.content["token"]:
            self.path.unlink(missing_ok=True)


def _lock_holder(path: Path) -> tuple[dict, float]:
    """(content, seconds since last refreshed) of a lock file; an unreadable one reads as {}."""
    try:
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return {}, 0.0
    try:
        content = json.loads(path.read_text())
    except (OSError, ValueError):  # half written by a holder that died at once, or removed meanwhile
        return {}, age
    return (content if isinstance(content, dict) else {}), age


def _stale_reason(holder: dict, age: float) -> Optional[str]:
    if age > LOCK_STALE_S:
        return f"not refreshed for {age:.0f} s (its run stopped)"
    if holder.get("host") == socket.gethostname() and isinstance(holder.get("pid"), int):
        try:
            os.kill(holder["pid"], 0)
        except ProcessLookupError:
            return f"process {holder['pid']} is gone"
        except PermissionError:  # alive, another user's
            return None
    return None


def _clock(timestamp) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp)) if isinstance(timestamp, (int, float)) \
        else "an unknown time"


def lock_save_folder(root: str) -> tuple[Optional[SaveFolderLock], List[str]]:
    """Rank 0 takes ``root``'s :class:`SaveFolderLock` and removes the temporary files of interrupted
    saves; agreed, so a held lock raises on every rank with the holder's host and pid. Returns the lock
    (rank 0; None elsewhere) and notes to print."""
    lock, notes, error = None, [], None
    if dist.get_rank() == 0:
        try:
            lock, notes = SaveFolderLock.acquire(root)
            leftovers = [p for p in Path(root).glob("**/.*") if p.is_file() and _is_temporary(p)]
            for leftover in leftovers:
                leftover.unlink()
            if leftovers:
                notes.append(f" > removed {len(leftovers)} temporary file(s) of interrupted saves under {root}: "
                             + ", ".join(str(p.relative_to(root)) for p in leftovers[:4]))
        except Exception as err:  # noqa: BLE001 -- every rank must learn of it
            error = err if isinstance(err, CheckpointError) else CheckpointError(f"--save {root}: {describe(err)}")
    raise_if_any_rank_failed(error, what=f"taking the lock of --save {root}")
    return lock, notes
