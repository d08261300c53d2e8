"""Checkpoint save/resume for the compact trainer: one ``torch.save`` file per rank.

Layout (Megatron-LM's legacy naming, plus the DP rank since every rank writes its own file)::

    <dir>/latest_checkpointed_iteration.txt
    <dir>/iter_0000010/mp_rank_<tp>_<pp>_dp_<dp>.pt     model, optimizer, scheduler, progress, RNG

With the distributed optimizer each rank's file also holds its own shard of the optimizer state
(main parameters and moments, megatron-core's "dp_reshardable" per-bucket layout): no gather.

A checkpoint resumes only under the same TP/PP/DP sizes. Resuming restores the RNG streams and the
consumed-sample count (from which the data iterator restarts exactly), so the losses after resuming
are the ones an uninterrupted run produces.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


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


def save_checkpoint(root: str, state: TrainState, model: list, optimizer, scheduler,
                    use_distributed_optimizer: bool) -> None:
    """Every rank writes its file; rank 0 then points the tracker file at this iteration."""
    _iteration_dir(root, state.iteration).mkdir(parents=True, exist_ok=True)
    payload = {
        "iteration": state.iteration,
        "consumed_samples": state.consumed_samples,
        "parallel_sizes": _parallel_sizes(),
        "model": [chunk.state_dict() for chunk in model],
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "distributed_optimizer": distributed_optimizer_shards(optimizer) if use_distributed_optimizer else None,
    }
    torch.save(payload, _rank_file(root, state.iteration))
    dist.barrier()
    if dist.get_rank() == 0:
        (Path(root) / TRACKER_FILENAME).write_text(f"{state.iteration}\n")
    dist.barrier()


def latest_iteration(root: str) -> Optional[int]:
    tracker = Path(root) / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker}: expected an iteration number, found {text!r}")
    return int(text)


def load_checkpoint(root: str, model: list, optimizer, scheduler,
                    use_distributed_optimizer: bool) -> TrainState:
    """Restore the latest checkpoint under ``root``; a fresh :class:`TrainState` if there is none.

    Every rank checks its own file before any collective, so a missing file or a parallel layout
    that differs from the checkpoint's fails on the rank that sees it, with the path in the message.
    """
    iteration = latest_iteration(root)
    if iteration is None:
        return TrainState()
    path = _rank_file(root, iteration)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} is missing (iteration {iteration} under {root}); "
                                f"was it saved with these parallel sizes {_parallel_sizes()}?")
    payload = torch.load(path, map_location="cpu", weights_only=False)
    if payload["parallel_sizes"] != _parallel_sizes():
        raise ValueError(f"{path} was saved with parallel sizes {payload['parallel_sizes']}, this run has "
                         f"{_parallel_sizes()}; resume with the same --tensor/--pipeline-model-parallel-size "
                         "and data-parallel size")
    for chunk, chunk_state in zip(model, payload["model"]):
        chunk.load_state_dict(chunk_state, strict=True)
    optimizer.load_state_dict(payload["optimizer"])
    if use_distributed_optimizer:
        load_distributed_optimizer_shards(optimizer, payload["distributed_optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    set_rng_state(payload["rng"])
    return TrainState(iteration=payload["iteration"], consumed_samples=payload["consumed_samples"])
