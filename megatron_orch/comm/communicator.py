"""A communicator of its own for post-balancing's collectives.

Collectives of one process group run in order on one communicator (under NCCL: one stream), so an
all-to-all issued on the DP group's communicator waits behind every gradient-bucket reduction DDP has
queued there (``--overlap-grad-reduce``), and DDP's next reduction waits behind the all-to-all.
Post-balancing therefore moves its data over a group of the same ranks on a communicator of its own,
which runs beside DDP's.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup


def dedicated_group(group: ProcessGroup, timeout: Optional[timedelta] = None) -> ProcessGroup:
    """A new group of ``group``'s ranks on the same backend, a different communicator.

    Only ``group``'s members take part (every one of them must call this, in the same order as their
    other group creations): each DP group creates its own, every rank of the job belongs to exactly one,
    so calling this on every rank after ``initialize_model_parallel`` creates all of them. Under NCCL the
    communicator itself is set up at its first collective. ``timeout``: that of the job's groups (the
    backend's default when None).
    """
    extra = {} if timeout is None else {"timeout": timeout}
    return dist.new_group(dist.get_process_group_ranks(group), backend=dist.get_backend(group),
                          use_local_synchronization=True, **extra)
