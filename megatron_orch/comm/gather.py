"""Gather per-item sizes over a process group with fixed-shape collectives (no object pickling).

Every rank contributes an int64 ``[count, F]`` array (F size fields per item: patches, frames,
tokens, ...). Each rank's contribution travels with a small header: its count and F, an ``error`` flag
for a local problem (negative sizes, more items than the static maximum), a ``failed`` flag (the rank
could not even produce its sizes: the caller then learns that some rank failed and agrees on the
messages, :func:`~megatron_orch.comm.status.raise_if_any_rank_failed`), and named ``checks``: integers
every rank must agree on (a step status, a plan digest). Every rank receives every header, so all
ranks raise the same error together instead of some of them hanging in the next collective.

With ``peer_group`` (a rank's TP/PP peers, which sit in other DP groups) the failed flag and the checks
are first reduced over the peers, on the device, and travel in the same header: a rank learns that a
peer failed or disagrees from the one size collective, so a failure anywhere in the job reaches every
rank (its peer in this DP group reports it) without a world-wide collective, and the host reads one
tensor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_orch.balance.plan import Placement
from megatron_orch.comm.device import communication_device, host_to_device, to_communication_device

_COUNT, _FIELDS, _ERROR, _FAILED, _PEERS_DISAGREE = range(5)
_HEADER = 5  # then one column per check
_OK, _NEGATIVE, _OVER_MAX = 0, 1, 2
_ERROR_TEXT = {_NEGATIVE: "has negative sizes", _OVER_MAX: "has more items than max_count"}


class GroupMismatchError(ValueError):
    """Ranks of a group passed inconsistent inputs; raised on every rank of the group alike."""


@dataclass(frozen=True, eq=False)
class GatheredSizes:
    """Sizes of every item of the group: rank 0's items first, then rank 1's, ... (loader order).
    ``failed``: some rank of the group, or a TP/PP peer of one, passed ``failed=True`` (sizes are then
    not meaningful; the same on every rank)."""

    sizes: np.ndarray   # [num_items, F] int64
    counts: np.ndarray  # [group size] items contributed by each rank
    failed: bool = False

    @property
    def home_rank(self) -> np.ndarray:
        """Rank that contributed (holds) each item."""
        return np.repeat(np.arange(self.counts.size, dtype=np.int64), self.counts)

    def placement(self) -> Placement:
        """Where the items are now: rank r holds its own items in the order it passed them."""
        return Placement.from_counts(self.counts)


def gather_item_sizes(local_sizes, group=None, *, max_count: Optional[int] = None,
                      checks: Optional[Mapping[str, int]] = None, failed: bool = False,
                      peer_group=None) -> GatheredSizes:
    """All-gather every rank's ``[count, F]`` int64 item sizes; identical result on every rank.

    Without ``max_count``: two collectives (headers, then sizes padded to the group's largest count).
    With ``max_count`` (a static bound every rank passes alike): one collective, each rank padded to
    ``max_count`` rows; F must then be the same on every rank by contract. Raises
    :class:`GroupMismatchError` on every rank when ranks (or their ``peer_group``) disagree on a check or
    F, or when any rank's sizes are negative or over ``max_count``; returns ``failed=True`` instead when a
    rank or a peer of one passed ``failed``. Every rank must pass the same check names.
    """
    checks = dict(checks or {})
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
    header = np.zeros(_HEADER + len(checks), dtype=np.int64)
    header[[_COUNT, _FIELDS, _ERROR, _FAILED]] = count, fields, error, int(failed)
    header[_HEADER:] = [int(value) for value in checks.values()]
    world = dist.get_world_size(group)

    if max_count is None:
        headers = all_gather_to_host(_with_peers(header, len(checks), group, peer_group), group).numpy()
        if _verdict(headers, list(checks)):
            return GatheredSizes(np.zeros((0, 0), dtype=np.int64), headers[:, _COUNT].copy(), failed=True)
        rows = int(headers[:, _COUNT].max())
        payload = np.zeros((rows, fields), dtype=np.int64)
        payload[:count] = sizes
        gathered = all_gather_to_host(torch.from_numpy(payload.reshape(-1)), group)
        gathered = gathered.numpy().reshape(world, rows, fields)
    else:
        payload = np.zeros(header.size + max_count * fields, dtype=np.int64)
        if error == _OK:
            payload[header.size:header.size + sizes.size] = sizes.reshape(-1)
        payload[:header.size] = header
        gathered = all_gather_to_host(_with_peers(payload, len(checks), group, peer_group), group).numpy()
        headers = gathered[:, :header.size]
        if _verdict(headers, list(checks)):
            return GatheredSizes(np.zeros((0, fields), dtype=np.int64), headers[:, _COUNT].copy(), failed=True)
        gathered = gathered[:, header.size:].reshape(world, max_count, fields)
    counts = headers[:, _COUNT].copy()
    mask = np.arange(gathered.shape[1])[None, :] < counts[:, None]
    return GatheredSizes(sizes=gathered[mask], counts=counts)


def _with_peers(payload: np.ndarray, num_checks: int, group, peer_group) -> torch.Tensor:
    """``payload`` (header first) on ``group``'s communication device, with its failed flag and a bit per
    check the peers disagree on reduced over ``peer_group`` there (no host round trip)."""
    device = communication_device(group)
    local = host_to_device([torch.from_numpy(payload)], device, torch.int64, ())
    if peer_group is None or dist.get_world_size(peer_group) == 1:
        return local
    checks = torch.from_numpy(payload[_HEADER:_HEADER + num_checks])
    # MAX of (failed, checks, -checks): the peers agree on check k iff max(c_k) == -max(-c_k).
    reduced = host_to_device([torch.from_numpy(payload[[_FAILED]]), checks, -checks],
                             communication_device(peer_group), torch.int64, ())
    dist.all_reduce(reduced, op=dist.ReduceOp.MAX, group=peer_group)
    reduced = reduced.to(device, non_blocking=True)
    disagree = (reduced[1:1 + num_checks] + reduced[1 + num_checks:]) != 0
    bits = (disagree.to(torch.int64) << torch.arange(num_checks, dtype=torch.int64, device=device)).sum()
    return torch.cat([local[:_FAILED], reduced[:1], bits.reshape(1), local[_HEADER:]])


def _verdict(headers: np.ndarray, check_names: List[str]) -> bool:
    """Whether some rank (or a peer of one) failed; else raise :class:`GroupMismatchError` on a
    disagreement. The same verdict on every rank: every rank checks the same gathered headers."""
    if headers[:, _FAILED].any():
        return True
    problems = []
    for rank, row in enumerate(headers):
        if row[_ERROR] != _OK:
            problems.append(f"rank {rank} {_ERROR_TEXT[int(row[_ERROR])]}")
        if row[_FIELDS] != headers[0, _FIELDS]:
            problems.append(f"rank {rank} has {row[_FIELDS]} size fields, rank 0 has {headers[0, _FIELDS]}")
    for k, name in enumerate(check_names):
        values = headers[:, _HEADER + k]
        if (values != values[0]).any():
            problems.append(f"ranks disagree on the {name}: per rank {values.tolist()[:64]}")
        disagreeing = np.flatnonzero((headers[:, _PEERS_DISAGREE] >> k) & 1)
        if disagreeing.size:
            problems.append(f"ranks disagree on the {name} (TP/PP peers): the peers of rank(s) "
                            f"{disagreeing.tolist()[:64]} of this group")
    if problems:
        raise GroupMismatchError("size gather failed: " + "; ".join(problems[:16]))
    return False


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
    """``[group size, *tensor.shape]`` stack of every rank's equally shaped tensor, on the host: one
    gather into one buffer (not one tensor per rank) and one read back.

    The tensor travels on the group's communication device (copied there if it is elsewhere).
    """
    local = to_communication_device(tensor, group).contiguous()
    world = dist.get_world_size(group)
    out = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) all_gather_single; torch >= 2.6 is supported.
    gather_into_one_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather_into_one_tensor(out, local.view(-1), group=group)
    return out.view(world, *local.shape).cpu()
