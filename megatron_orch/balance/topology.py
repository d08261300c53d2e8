"""Which node each rank of a process group lives on (the slow links are the ones between nodes).

Megatron's data-parallel group of one TP/PP coordinate is not a block of consecutive global ranks
(e.g. with TP=2 the DP ranks are 0, 2, 4, ...), so the map goes group rank -> global rank -> node.
The node of a global rank comes, in this order of preference, from an explicit ``gpus_per_node``,
from torchrun's ``LOCAL_WORLD_SIZE`` (torchrun numbers ranks node by node), or from the hostnames of
the group's ranks gathered once (any launcher, uneven nodes:
:func:`megatron_orch.comm.group_topology.group_topology` reads a live process group).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import numpy as np


@dataclass(frozen=True, eq=False)
class Topology:
    """``node_of_rank[r]`` is the node (0..num_nodes-1, numbered by first appearance) of group rank r."""

    node_of_rank: np.ndarray

    def __post_init__(self):
        nodes = np.asarray(self.node_of_rank)
        if nodes.ndim != 1 or nodes.size == 0:
            raise ValueError(f"node_of_rank must be a non-empty 1-D array, got shape {nodes.shape}")
        if not np.issubdtype(nodes.dtype, np.integer) or nodes.min() < 0:
            raise ValueError(f"node_of_rank must hold non-negative integers, got {nodes[:16].tolist()}")
        # Renumber nodes 0..num_nodes-1 in order of first appearance, so equal maps compare equal.
        _, first, inverse = np.unique(nodes, return_index=True, return_inverse=True)
        renumber = np.empty(first.size, dtype=np.int64)
        renumber[np.argsort(first, kind="stable")] = np.arange(first.size)
        dense = renumber[inverse.reshape(-1)]
        dense.setflags(write=False)
        object.__setattr__(self, "node_of_rank", dense)

    @classmethod
    def uniform(cls, num_ranks: int, gpus_per_node: int) -> "Topology":
        """Consecutive ranks fill nodes of ``gpus_per_node`` GPUs (the last node may be partial)."""
        return cls.from_global_ranks(np.arange(num_ranks), gpus_per_node)

    @classmethod
    def from_global_ranks(cls, global_ranks: Sequence[int], gpus_per_node: int) -> "Topology":
        """Topology of a group whose rank i is global rank ``global_ranks[i]``, nodes filled in rank order."""
        if gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
        ranks = np.asarray(global_ranks, dtype=np.int64)
        if ranks.size and ranks.min() < 0:
            raise ValueError(f"global ranks must be non-negative, got {ranks[:16].tolist()}")
        if np.unique(ranks).size != ranks.size:
            raise ValueError(f"global ranks of a group must be distinct, got {ranks[:16].tolist()}")
        return cls(ranks // gpus_per_node)

    @classmethod
    def from_hostnames(cls, hostnames: Sequence[str]) -> "Topology":
        """Ranks that share a hostname share a node."""
        _, inverse = np.unique(np.asarray(list(hostnames)), return_inverse=True)
        return cls(inverse.reshape(-1))

    @property
    def num_ranks(self) -> int:
        return int(self.node_of_rank.size)

    @property
    def num_nodes(self) -> int:
        return int(self.node_of_rank.max()) + 1

    def ranks_per_node(self) -> np.ndarray:
        """Number of group ranks on each node."""
        return np.bincount(self.node_of_rank, minlength=self.num_nodes)

    def ranks_on(self, node: int) -> np.ndarray:
        """Group ranks on ``node``, ascending."""
        return np.flatnonzero(self.node_of_rank == node)


def gpus_per_node_from_env(env: Mapping[str, str]) -> Optional[int]:
    """GPUs per node from torchrun's environment, or None when the launcher did not say.

    torchrun sets ``LOCAL_WORLD_SIZE`` and numbers global ranks node by node, so node = rank //
    LOCAL_WORLD_SIZE when every node runs the same number of processes (``WORLD_SIZE`` divisible by it,
    and equal to ``LOCAL_WORLD_SIZE * GROUP_WORLD_SIZE`` where torchrun gives the node count).
    """
    local = env.get("LOCAL_WORLD_SIZE")
    world = env.get("WORLD_SIZE")
    if not local or not world:
        return None
    local, world = int(local), int(world)
    if local < 1 or world % local:
        return None
    nodes = env.get("GROUP_WORLD_SIZE")
    if nodes and int(nodes) * local != world:
        return None
    return local
