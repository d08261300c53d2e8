"""Variable-length all-to-all of items along a :class:`Transfer`.

A *stream* is one packed tensor per rank holding that rank's items back to back, in slot order:
item i is ``layout.rows[i]`` rows of shape ``layout.trailing_shape`` (e.g. encoder outputs: one
row per token). ``rows`` is known for every item on every rank (from the gathered sizes), so every rank
computes all send and receive split sizes from the plan alone, with no extra communication.

Streams of one dtype share one flat buffer and one ``all_to_all_single``: the segment for a peer
holds stream 0's rows for that peer, then stream 1's, ...; inside a stream, items in the transfer's
wire order. Gradients go back along ``transfer.inverse()``: moving items is a permutation, whose
adjoint is its inverse (the modality-aware schedule does this itself, after the backbone's backward).

Memory: besides the caller's input and output, at most one flat buffer of one dtype group exists
at a time: the packed send buffer lives until the collective returns, the receive buffer until it
is unpacked into slot order, and the next dtype group starts after that. Packing is skipped (the input
is sent as is) when the wire order already is the input's order, and unpacking is skipped (the output
is a view of the receive buffer) when the received order already is slot order.

Inputs must be on the group's communication device (:func:`~megatron_orch.comm.device.communication_device`:
the GPU for NCCL, the CPU for gloo); outputs come back there. Every rank must call this with the same
layouts and transfer and enter every collective, also with zero rows to send or receive. Outputs are
not part of the autograd graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_orch.balance.plan import Placement, Transfer
from megatron_orch.comm.device import communication_device


@dataclass(frozen=True, eq=False)
class ItemLayout:
    """Shape of one stream: item i is ``rows[i]`` rows of ``trailing_shape`` and ``dtype`` (same on all ranks)."""

    rows: np.ndarray
    trailing_shape: Tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self):
        rows = np.asarray(self.rows)
        if rows.ndim != 1 or (rows.size and (not np.issubdtype(rows.dtype, np.integer) or rows.min() < 0)):
            raise ValueError(f"rows must be a 1-D array of non-negative integers, got {rows[:8]!r}")
        shape = tuple(int(d) for d in self.trailing_shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"trailing_shape must be non-negative, got {shape}")
        object.__setattr__(self, "rows", rows.astype(np.int64, copy=False))
        object.__setattr__(self, "trailing_shape", shape)

    @property
    def row_numel(self) -> int:
        return int(np.prod(self.trailing_shape, dtype=np.int64))

    def local_rows(self, placement: Placement, rank: int) -> int:
        """Rows of the packed tensor ``rank`` holds under ``placement``."""
        return int(self.rows[placement.rank == rank].sum())


def all_to_all_items(tensors: Sequence[torch.Tensor], layouts: Sequence[ItemLayout], transfer: Transfer,
                     group=None) -> Tuple[torch.Tensor, ...]:
    """Move every item of every stream from ``transfer.src`` to ``transfer.dst``; returns the packed
    tensors this rank holds afterwards, in destination slot order (one per stream)."""
    rank = dist.get_rank(group)
    device = communication_device(group)
    _check_inputs(tensors, layouts, transfer, rank, dist.get_world_size(group), device)
    routes = [_Route.build(transfer, rank, layouts, streams, device)
              for streams in _dtype_groups(layouts)]
    with torch.no_grad():
        return tuple(_exchange(routes, tensors, layouts, group, device))


@dataclass(frozen=True, eq=False)
class _Block:
    """Rows ``rows`` of stream ``stream`` (local packed order) occupy the buffer from element ``offset``."""

    stream: int
    offset: int
    rows: torch.Tensor
    contiguous_from_zero: bool  # rows == 0..n-1


@dataclass(frozen=True, eq=False)
class _Route:
    """One dtype group's exchange on this rank: what goes where in the send and receive buffers."""

    streams: Tuple[int, ...]
    send_blocks: Tuple[_Block, ...]
    recv_blocks: Tuple[_Block, ...]
    send_splits: Tuple[int, ...]   # elements to each peer
    recv_splits: Tuple[int, ...]   # elements from each peer
    send_rows: Tuple[int, ...]     # rows of each stream's packed tensor before the exchange
    recv_rows: Tuple[int, ...]     # ... and after

    @classmethod
    def build(cls, transfer: Transfer, rank: int, layouts, streams, device) -> "_Route":
        send = transfer.send_items(rank)
        recv = transfer.recv_items(rank)
        send_blocks, send_splits, send_rows = _blocks(
            send, transfer.dst.rank[send], transfer.src.items_on(rank), layouts, streams, transfer.num_ranks,
            device)
        recv_blocks, recv_splits, recv_rows = _blocks(
            recv, transfer.src.rank[recv], transfer.dst.items_on(rank), layouts, streams, transfer.num_ranks,
            device)
        return cls(tuple(streams), send_blocks, recv_blocks, send_splits, recv_splits, send_rows, recv_rows)


def _blocks(wire_items, peer_of_item, local_items, layouts, streams, num_ranks, device):
    """Buffer blocks of items in wire order (grouped by peer); split sizes per peer; local rows per stream."""
    per_peer = np.bincount(peer_of_item, minlength=num_ranks)
    peer_end = np.cumsum(per_peer)
    elements = np.zeros((len(streams), num_ranks), dtype=np.int64)
    starts, local_rows = [], []
    for s, k in enumerate(streams):
        rows, numel = layouts[k].rows, layouts[k].row_numel
        elements[s] = np.bincount(peer_of_item, weights=rows[wire_items] * numel, minlength=num_ranks)
        start = np.zeros(rows.size, dtype=np.int64)
        start[local_items] = np.cumsum(rows[local_items]) - rows[local_items]
        starts.append(start)
        local_rows.append(int(rows[local_items].sum()))
    splits = elements.sum(axis=0)
    offsets = np.cumsum(splits) - splits
    blocks = []  # (stream, offset, row index) in buffer order, adjacent ones of one stream merged
    for peer in np.flatnonzero(per_peer):
        items = wire_items[peer_end[peer] - per_peer[peer]:peer_end[peer]]
        offset = int(offsets[peer])
        for s, k in enumerate(streams):
            if elements[s, peer]:
                index = _row_index(starts[s][items], layouts[k].rows[items])
                last = blocks[-1] if blocks else None
                if last and last[0] == k and last[1] + last[2].size * layouts[k].row_numel == offset:
                    blocks[-1] = (k, last[1], np.concatenate([last[2], index]))
                else:
                    blocks.append((k, offset, index))
                offset += int(elements[s, peer])
    return (tuple(_Block(k, off, torch.from_numpy(index).to(device),
                         bool(np.array_equal(index, np.arange(index.size)))) for k, off, index in blocks),
            tuple(int(v) for v in splits), tuple(local_rows))


def _row_index(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``starts[j] .. starts[j] + counts[j] - 1``."""
    total = int(counts.sum())
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total, dtype=np.int64)


def _exchange(routes, tensors, layouts, group, device) -> List[torch.Tensor]:
    """Run the routes' all-to-alls one dtype group at a time; packed outputs in stream order (None for
    streams of no route)."""
    outputs = [None] * len(layouts)
    for route in routes:
        dtype = layouts[route.streams[0]].dtype
        send = _pack(route, tensors, layouts, dtype, device)
        recv = torch.empty(sum(route.recv_splits), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send, output_split_sizes=list(route.recv_splits),
                               input_split_sizes=list(route.send_splits), group=group)
        del send  # free the send buffer before the unpacked outputs are allocated
        for stream, out in zip(route.streams, _unpack(route, recv, layouts, device)):
            outputs[stream] = out
        del recv  # free it (unless the outputs are views of it) before the next dtype group
    return outputs


def _pack(route: _Route, tensors, layouts, dtype, device) -> torch.Tensor:
    total = sum(route.send_splits)
    if _whole_buffer_in_order(route.send_blocks, layouts, total):
        return tensors[route.send_blocks[0].stream].contiguous().view(-1)  # wire order already: no copy
    send = torch.empty(total, dtype=dtype, device=device)
    for block in route.send_blocks:
        layout = layouts[block.stream]
        size = block.rows.numel() * layout.row_numel
        torch.index_select(tensors[block.stream], 0, block.rows,
                           out=send[block.offset:block.offset + size].view(-1, *layout.trailing_shape))
    return send


def _unpack(route: _Route, recv: torch.Tensor, layouts, device) -> List[torch.Tensor]:
    if _whole_buffer_in_order(route.recv_blocks, layouts, recv.numel()):
        # Slot order already: the output is the receive buffer (streams without rows come out empty).
        stream = route.recv_blocks[0].stream
        return [recv.view(-1, *layouts[s].trailing_shape) if s == stream else
                torch.empty((0, *layouts[s].trailing_shape), dtype=layouts[s].dtype, device=device)
                for s in route.streams]
    outputs = []
    for stream, rows in zip(route.streams, route.recv_rows):
        layout = layouts[stream]
        out = torch.empty((rows, *layout.trailing_shape), dtype=layout.dtype, device=device)
        for block in (b for b in route.recv_blocks if b.stream == stream):
            size = block.rows.numel() * layout.row_numel
            out.index_copy_(0, block.rows, recv[block.offset:block.offset + size].view(-1, *layout.trailing_shape))
        outputs.append(out)
    return outputs


def _whole_buffer_in_order(blocks, layouts, total: int) -> bool:
    """One block, holding a whole stream's rows in order, fills the buffer (so no copy is needed)."""
    return (len(blocks) == 1 and blocks[0].contiguous_from_zero
            and blocks[0].rows.numel() * layouts[blocks[0].stream].row_numel == total)


def _dtype_groups(layouts: Sequence[ItemLayout]) -> List[Tuple[int, ...]]:
    """Stream indices grouped by dtype, groups in order of first appearance (same on every rank)."""
    groups = {}
    for k, layout in enumerate(layouts):
        groups.setdefault(layout.dtype, []).append(k)
    return [tuple(streams) for streams in groups.values()]


def _check_inputs(tensors, layouts, transfer: Transfer, rank: int, world: int, device) -> None:
    """Local checks, before any collective: what is wrong, on which rank, in which stream."""
    if transfer.num_ranks != world:
        raise ValueError(f"rank {rank}: the transfer spans {transfer.num_ranks} ranks but the group has {world}")
    if not layouts or len(tensors) != len(layouts):
        raise ValueError(f"rank {rank}: got {len(tensors)} tensors for {len(layouts)} layouts (need >= 1, equal)")
    for k, (tensor, layout) in enumerate(zip(tensors, layouts)):
        where = f"rank {rank}, stream {k}"
        if layout.rows.size != transfer.src.num_items:
            raise ValueError(f"{where}: layout has rows for {layout.rows.size} items, the transfer moves "
                             f"{transfer.src.num_items}")
        if tensor.dtype != layout.dtype:
            raise ValueError(f"{where}: tensor dtype {tensor.dtype}, layout says {layout.dtype}")
        if tensor.dim() == 0 or tuple(tensor.shape[1:]) != layout.trailing_shape:
            raise ValueError(f"{where}: tensor shape {tuple(tensor.shape)}, layout says "
                             f"[rows, {', '.join(map(str, layout.trailing_shape))}]")
        expected = layout.local_rows(transfer.src, rank)
        if tensor.shape[0] != expected:
            raise ValueError(f"{where}: tensor has {tensor.shape[0]} rows, but the {int(transfer.src.counts()[rank])} "
                             f"items this rank holds have {expected}")
        if tensor.device != device:
            raise ValueError(f"{where}: tensor is on {tensor.device}, the group communicates on {device}")
