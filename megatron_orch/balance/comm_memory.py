"""Modeled device memory of the point-to-point connections a communicator keeps (torch-free).

NCCL sets up a peer's connection (its buffers on every channel it uses for that peer) at the first send to or
receive from it and keeps it for the communicator's life, so an all-to-all's memory grows with the distinct
peers a rank has exchanged with over the run (:class:`~megatron_orch.balance.plan.Connections`), not with one
step's. The model counts, per connected peer, a send and a receive connection on each of the peer's channels,
each holding the Simple protocol's buffer of ``chunk x steps`` bytes. Its figures are the stated assumptions'
consequence, not a measurement (``scripts/gpu_check.sh`` measures one GPU's); the communicator's ring and tree
buffers of its collectives are left out (the same whichever peers the all-to-all reaches).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megatron_orch.balance.plan import Peers

MIB = float(1 << 20)


@dataclass(frozen=True)
class CommunicatorMemory:
    """The assumptions of the model (module docstring), NCCL's defaults:

    ``nvlink_chunk_bytes``: a point-to-point chunk between GPUs of a node (``NCCL_P2P_NVL_CHUNKSIZE``, 512 KiB);
    ``net_chunk_bytes``: one across nodes (``NCCL_P2P_NET_CHUNKSIZE``, 128 KiB); ``steps``: chunks a connection's
    buffer holds (NCCL's ``NCCL_STEPS``, 8); ``channels_per_net_peer``: channels NCCL uses per peer across nodes
    (``NCCL_NCHANNELS_PER_NET_PEER``, 2); ``channels_per_nvlink_peer``: per peer on the node (NCCL derives it
    from its point-to-point channels and the node's ranks; 2 assumed); ``connections_per_peer``: a send and a
    receive connection, both counted on the rank (2).
    """

    nvlink_chunk_bytes: int = 512 << 10
    net_chunk_bytes: int = 128 << 10
    steps: int = 8
    channels_per_nvlink_peer: int = 2
    channels_per_net_peer: int = 2
    connections_per_peer: int = 2

    def __post_init__(self):
        for name in ("nvlink_chunk_bytes", "net_chunk_bytes", "steps", "channels_per_nvlink_peer",
                     "channels_per_net_peer", "connections_per_peer"):
            if getattr(self, name) < 1:
                raise ValueError(f"CommunicatorMemory.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def nvlink_peer_bytes(self) -> int:
        """Bytes one connected peer on the rank's node costs."""
        return self.connections_per_peer * self.channels_per_nvlink_peer * self.steps * self.nvlink_chunk_bytes

    @property
    def net_peer_bytes(self) -> int:
        """Bytes one connected peer on another node costs."""
        return self.connections_per_peer * self.channels_per_net_peer * self.steps * self.net_chunk_bytes

    def per_rank_mib(self, peers: Peers) -> np.ndarray:
        """Modeled MiB of every rank's connections."""
        return (peers.intra_node * self.nvlink_peer_bytes + peers.inter_node * self.net_peer_bytes) / MIB
