"""Gather per-item sizes over a process group with fixed-shape collectives (no object pickling).

Every rank contributes an int64 ``[count, F]`` array (F size fields per item: patches, frames,
tokens, ...). Each rank's contribution travels with a small header ``(count, F, check, error)``:
``check`` is an integer every rank must agree on (a plan hash, a step number), ``error`` flags a local
problem (negative sizes, more items than the static maximum). Every rank receives every header, so
all ranks raise the same error together instead of some of them hanging in the next collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_orch.balance.plan import Placement
from megatron_orch.comm.device import to_communication_device

_HEADER = 4  # count, fields, check, error
_OK, _NEGATIVE, _OVER_MAX = 0, 1, 2
_ERROR_TEXT = {_NEGATIVE: "has negative sizes", _OVER_MAX: "has more items than max_count"}


class GroupMismatchError(ValueError):
    """Ranks of a group passed inconsistent inputs; raised on every rank of the group alike."""


@dataclass(frozen=True, eq=False)
class GatheredSizes:
    """Sizes of every item of the group: rank 0's items first, then rank 1's, ... (loader order)."""

    sizes: np.ndarray   # [num_items, F] int64
    counts: np.ndarray  # [group size] items contributed by each rank

    @property
    def home_rank(self) -> np.ndarray:
        """Rank that contributed (holds) each item."""
        return np.repeat(np.arange(self.counts.size, dtype=np.int64), self.counts)

    def placement(self) -> Placement:
        """Where the items are now: rank r holds its own items in the order it passed them."""
        return Placement.from_counts(self.counts)


def gather_item_sizes(local_sizes, group=None, *, max_count: Optional[int] = None,
                      check: int = 0) -> GatheredSizes:
    """All-gather every rank's ``[count, F]`` int64 item sizes; identical result on every rank.

    Without ``max_count``: two collectives (headers, then sizes padded to the group's largest count).
    With ``max_count`` (a static bound every rank passes alike): one collective, each rank padded to
    ``max_count`` rows; F must then be the same on every rank by contract. Raises
    :class:`GroupMismatchError` on every rank when ranks disagree on ``check`` or F, or when any rank's
    sizes are negative or over ``max_count``.
    """
    sizes = np.asarray(local_sizes)
    if sizes.ndim != 2 or sizes.shape[1] < 1:
        raise ValueError(f"local sizes must be a [count, F>=1] array, got shape {sizes.shape}")
    if sizes.size and not np.issubdtype(sizes.dtype, np.integer):
        raise ValueError(f"local sizes must be integers, got dtype {sizes.dtype}")
    if max_count is not None and max_count < 0:
        raise ValueError(f"max_count must be >= 0, got {max_count}")
    sizes = sizes.astype(np.int64, copy=False)
    count, fields = sizes.shape
    error = _OK
    if sizes.size and sizes.min() < 0:
        error = _NEGATIVE
    elif max_count is not None and count > max_count:
        error = _OVER_MAX
    header = np.array([count, fields, int(check), error], dtype=np.int64)
    world = dist.get_world_size(group)

    if max_count is None:
        headers = all_gather_to_host(torch.from_numpy(header), group).numpy()
        _raise_on_mismatch(headers)
        rows = int(headers[:, 0].max())
        payload = np.zeros((rows, fields), dtype=np.int64)
        payload[:count] = sizes
        gathered = all_gather_to_host(torch.from_numpy(payload.reshape(-1)), group)
        gathered = gathered.numpy().reshape(world, rows, fields)
    else:
        payload = np.zeros(_HEADER + max_count * fields, dtype=np.int64)
        payload[:_HEADER] = header
        if error == _OK:
            payload[_HEADER:_HEADER + sizes.size] = sizes.reshape(-1)
        gathered = all_gather_to_host(torch.from_numpy(payload), group).numpy()
        headers = gathered[:, :_HEADER]
        _raise_on_mismatch(headers)
        gathered = gathered[:, _HEADER:].reshape(world, max_count, fields)
    counts = headers[:, 0].copy()
    mask = np.arange(gathered.shape[1])[None, :] < counts[:, None]
    return GatheredSizes(sizes=gathered[mask], counts=counts)


def assert_same_on_all_ranks(value: int, group=None, what: str = "value") -> None:
    """Raise :class:`GroupMismatchError` on every rank unless all ranks passed the same integer."""
    values = all_gather_to_host(torch.tensor([int(value)], dtype=torch.int64), group).numpy().reshape(-1)
    if (values != values[0]).any():
        raise GroupMismatchError(f"ranks disagree on the {what}: per rank {values.tolist()[:64]}")


def gather_hostnames(hostname: str, group=None, max_bytes: int = 255) -> List[str]:
    """Hostname of every rank of the group, in group rank order (fixed-size byte collective)."""
    encoded = hostname.encode("utf-8")
    if len(encoded) > max_bytes:
        raise ValueError(f"hostname {hostname!r} is longer than {max_bytes} bytes")
    buffer = torch.zeros(max_bytes + 1, dtype=torch.uint8)
    buffer[0] = len(encoded)
    buffer[1:1 + len(encoded)] = torch.frombuffer(bytearray(encoded), dtype=torch.uint8)
    rows = all_gather_to_host(buffer, group)
    return [bytes(row[1:1 + int(row[0])].tolist()).decode("utf-8") for row in rows]


def all_gather_to_host(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """``[group size, *tensor.shape]`` stack of every rank's equally shaped tensor, on the host.

    The tensor travels on the group's communication device (copied there if it is elsewhere).
    """
    local = to_communication_device(tensor, group).contiguous()
    out = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, local, group=group)
    return torch.stack(out).cpu()


def _raise_on_mismatch(headers: np.ndarray) -> None:
    """Same verdict on every rank: every rank checks the same gathered headers."""
    problems = []
    for rank, (_, fields, _, error) in enumerate(headers):
        if error != _OK:
            problems.append(f"rank {rank} {_ERROR_TEXT[int(error)]}")
        if fields != headers[0, 1]:
            problems.append(f"rank {rank} has {fields} size fields, rank 0 has {headers[0, 1]}")
    checks = headers[:, 2]
    if (checks != checks[0]).any():
        problems.append(f"ranks disagree on the check value: per rank {checks.tolist()[:64]}")
    if problems:
        raise GroupMismatchError("size gather failed: " + "; ".join(problems[:16]))
