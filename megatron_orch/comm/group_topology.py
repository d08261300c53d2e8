"""The topology of a live torch.distributed group: which node each of its ranks is on."""
from __future__ import annotations

import os
import socket
from typing import Mapping, Optional

import torch.distributed as dist

from megatron_orch.balance.topology import Topology, gpus_per_node_from_env
from megatron_orch.comm.gather import gather_hostnames


def group_topology(group=None, gpus_per_node: Optional[int] = None,
                   env: Optional[Mapping[str, str]] = None) -> Topology:
    """Topology of ``group`` (default: the world) from ``gpus_per_node``, else torchrun's environment,
    else the ranks' hostnames (the only case with a collective, over ``group``)."""
    global_ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    gpus_per_node = gpus_per_node or gpus_per_node_from_env(os.environ if env is None else env)
    if gpus_per_node:
        return Topology.from_global_ranks(global_ranks, gpus_per_node)
    return Topology.from_hostnames(gather_hostnames(socket.gethostname(), group))
