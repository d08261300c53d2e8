"""The device a process group's collectives take their tensors on: the one place that decides it.

NCCL communicates CUDA tensors on this rank's GPU, gloo CPU tensors. Every tensor the project hands to
a collective (size gather, all-to-alls of inputs, embeddings and gradients, digest checks, metrics)
goes through :func:`communication_device` of its group; nothing else guesses. The device the model
computes on is a separate notion (the encoders' or the loss's device): on a GPU run with NCCL both are
the same GPU and every move here is free, on a CPU run with gloo both are the CPU.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist


def communication_device(group=None) -> torch.device:
    """Device the collectives of ``group`` (default: the world) need their tensors on."""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_communication_device(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``tensor`` on ``group``'s communication device (itself when it is there already)."""
    return tensor.to(communication_device(group), non_blocking=True)


def host_to_device(parts: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                   trailing_shape: tuple) -> torch.Tensor:
    """Concatenate host tensors (along dim 0) onto ``device``.

    For a GPU the concatenation is written into pinned host memory and copied without blocking the
    host (torch's pinned allocator keeps the buffer until the copy is done); for the CPU it is a plain
    concatenation. ``trailing_shape`` gives the result's shape when ``parts`` is empty.
    """
    parts = [part.reshape(-1, *trailing_shape) for part in parts]
    if device.type != "cuda":
        host = torch.cat(parts).to(dtype) if parts else torch.empty((0, *trailing_shape), dtype=dtype)
        return host.to(device)
    staging = torch.empty((sum(part.shape[0] for part in parts), *trailing_shape), dtype=dtype, pin_memory=True)
    if parts:
        torch.cat(parts, out=staging)
    return staging.to(device, non_blocking=True)
