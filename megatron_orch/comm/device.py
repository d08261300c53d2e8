"""The device a process group's collectives take their tensors on: the one place that decides it, and
the copies between it and the host.

NCCL communicates CUDA tensors on this rank's GPU, gloo CPU tensors. Every tensor the project hands to
a collective (size gather, all-to-alls of inputs, embeddings and gradients, digest checks, metrics)
goes through :func:`communication_device` of its group; nothing else guesses. The device the model
computes on is a separate notion (the encoders' or the loss's device): on a GPU run with NCCL both are
the same GPU and every move here is free, on a CPU run with gloo both are the CPU.

Copies never block the host on the hot path of a step: uploads go through pinned host memory without
blocking (:func:`host_to_device`), and a result the host must read back is copied without blocking and
waited for only when it is read (:class:`HostCopy`: on a GPU, a wait on an event recorded right after
the copy, not on everything queued since).
"""
from __future__ import annotations

from typing import Optional, Sequence

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


def stage_on_host(parts: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                  trailing_shape: tuple) -> torch.Tensor:
    """Host tensors concatenated (along dim 0) in ``dtype``, ready to go to ``device``: in pinned memory
    for a GPU, so that the copy does not block the host (torch's pinned allocator keeps the buffer until
    the copy is done). Any thread may stage (the post-balancing iterator stages in its reading thread).
    ``trailing_shape`` gives the result's shape when ``parts`` is empty."""
    parts = [part.reshape(-1, *trailing_shape) for part in parts]
    staged = torch.empty((sum(part.shape[0] for part in parts), *trailing_shape), dtype=dtype,
                         pin_memory=device.type == "cuda")
    if parts:
        torch.cat(parts, out=staged)
    return staged


def staged_to_device(staged: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A tensor of :func:`stage_on_host` on ``device``: a copy that does not block (none for the CPU)."""
    return staged if device.type == "cpu" else staged.to(device, non_blocking=True)


def host_to_device(parts: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype,
                   trailing_shape: tuple) -> torch.Tensor:
    """Concatenate host tensors onto ``device`` (:func:`stage_on_host`, then :func:`staged_to_device`)."""
    return staged_to_device(stage_on_host(parts, device, dtype, trailing_shape), device)


class HostCopy:
    """A tensor copied to the host without blocking; :meth:`result` waits for that copy only.

    On a GPU the copy lands in pinned memory and an event recorded right after it tells when it is
    done, so the host waits for the work queued before the copy (the collective that produced the
    tensor), not for what it queued later (encoder kernels). On the CPU the tensor itself is the copy.
    """

    def __init__(self, tensor: torch.Tensor):
        self._ready: Optional[torch.cuda.Event] = None
        if tensor.device.type == "cpu":
            self._host = tensor
            return
        self._host = tensor.to("cpu", non_blocking=True)  # pinned by torch for a CUDA source
        if tensor.device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def result(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
            self._ready = None
        return self._host
