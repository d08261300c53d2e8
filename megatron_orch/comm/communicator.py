"""A communicator of its own for post-balancing's collectives.

Collectives of one process group run in order on one communicator (under NCCL: one stream), so an
all-to-all issued on the DP group's communicator waits behind every gradient-bucket reduction DDP has
queued there (``--overlap-grad-reduce``), and DDP's next reduction waits behind the all-to-all.
Post-balancing therefore moves its data over a group of the same ranks on a communicator of its own,
which runs beside DDP's.
"""
from __future__ import annotations

from datetime import timedelta
from typing import List, Optional, Sequence, Tuple

import torch.distributed as dist
from torch.distributed import ProcessGroup


def dedicated_group(group: ProcessGroup, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """A new group of ``group``'s ranks on the same backend, a different communicator.

    Created as Megatron creates its groups: every rank of the job calls this once, each with its own DP
    group, after ``initialize_model_parallel``; the DP groups are gathered over the world and every rank
    creates each of them, in one order, keeping its own. (A group made by its members alone,
    ``use_local_synchronization``, is named after the groups each process already holds, which differ
    between ranks once a job has re-initialized its model-parallel groups: the members then wait for each
    other under different names until the store times out.) DP groups that overlap are refused on every
    rank. Under NCCL the communicator itself is set up at its first collective. ``timeout``: that of the
    job's groups (the backend's default when None).
    """
    return _create_each(_dp_groups(group), tuple(dist.get_process_group_ranks(group)), group, timeout)


def replica_group(group: ProcessGroup, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """The group of this rank's DP replica: the ranks that sit where this one sits in every DP group (its TP,
    CP and PP peers, which hold the same examples), created as :func:`dedicated_group` creates groups."""
    replicas = dp_replicas(_dp_groups(group))
    mine = next(r for r in replicas if dist.get_rank() in r)
    return _create_each(replicas, mine, group, timeout)


def dp_replicas(dp_groups: Sequence[Sequence[int]]) -> List[Tuple[int, ...]]:
    """The job's DP replicas given its DP groups (equal sizes): the ranks at one place in every DP group, each
    sorted, in order."""
    return sorted({tuple(sorted(g[i] for g in dp_groups)) for i in range(len(dp_groups[0]))})


def _dp_groups(group: ProcessGroup) -> list:
    """Every rank's DP group (``group`` on each), gathered over the world, in one order; overlapping or unequal
    ones are refused on every rank."""
    ranks = tuple(dist.get_process_group_ranks(group))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, ranks)
    groups = sorted(set(gathered))
    members = [rank for g in groups for rank in g]
    if len(members) != len(set(members)) or len({len(g) for g in groups}) != 1:
        raise ValueError(f"post-balancing needs disjoint DP groups, one per rank; the ranks gave {groups}")
    return groups


def _create_each(groups, mine, like: ProcessGroup, timeout: Optional[timedelta]) -> ProcessGroup:
    extra = {} if timeout is None else {"timeout": timeout}
    created = {g: dist.new_group(list(g), backend=dist.get_backend(like), **extra) for g in groups}
    return created[mine]
