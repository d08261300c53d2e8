"""Variable-length all-to-all of items along a :class:`Transfer`.

A *stream* is one packed tensor per rank holding that rank's items back to back, in slot order:
item i is ``layout.rows[i]`` rows of shape ``layout.trailing_shape`` (e.g. encoder outputs: one
row per token). ``rows`` is known for every item on every rank (from the gathered sizes), so every rank
computes all send and receive split sizes from the plan alone, with no extra communication.

Streams of one dtype share one flat buffer and one ``all_to_all_single``: the segment for a peer
holds stream 0's rows for that peer, then stream 1's, ...; inside a stream, items in the transfer's
wire order. Gradients go back along ``transfer.inverse()``: moving items is a permutation, whose
adjoint is its inverse (the modality-aware schedule does this itself, after the backbone's backward).

A :class:`Route` says, for one dtype group on one rank, which rows go where: numpy only, so it is built
off the training thread (the post-balancing iterator builds a step's routes in its planning thread)
and its row indices reach the device in one pinned, non-blocking upload (:func:`upload_routes`); a route
does not depend on the rows' width or dtype, so one route serves any tensors of those item rows.

:func:`start_all_to_all_items` launches the exchange asynchronously and returns a
:class:`PendingAllToAll`; its :meth:`~PendingAllToAll.wait` gives the outputs, so the caller can compute
(another encoder) while the bytes travel. :func:`all_to_all_items` is both in one call. A transfer run in hops
(:meth:`~megatron_orch.balance.plan.Transfer.node_wise`: within nodes, then between rail peers) is
:func:`start_all_to_all_hops`: each hop one such exchange of the previous hop's outputs. Until the wait
the inputs must not change, and every dtype group's send and receive buffers exist at once; packing is
skipped (the input is sent as is) when the wire order already is the input's order, and unpacking is
skipped (the output is a view of the receive buffer) when the received order already is slot order.

Inputs must be on the group's communication device (:func:`~megatron_orch.comm.device.communication_device`:
the GPU for NCCL, the CPU for gloo); outputs come back there. Every rank must call this with the same
layouts and transfer and enter every collective, also with zero rows to send or receive. Outputs are
not part of the autograd graph.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from megatron_orch.balance.plan import Placement, Transfer
from megatron_orch.comm.device import communication_device, host_to_device


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
                     group=None, routes: Optional[Sequence["Route"]] = None) -> Tuple[torch.Tensor, ...]:
    """Move every item of every stream from ``transfer.src`` to ``transfer.dst``; returns the packed
    tensors this rank holds afterwards, in destination slot order (one per stream)."""
    return start_all_to_all_items(tensors, layouts, transfer, group, routes).wait()


def start_all_to_all_items(tensors: Sequence[torch.Tensor], layouts: Sequence[ItemLayout], transfer: Transfer,
                           group=None, routes: Optional[Sequence["Route"]] = None) -> "PendingAllToAll":
    """Launch :func:`all_to_all_items` without waiting for it. ``routes``: this rank's routes of the
    transfer, one per dtype group of ``layouts`` (:func:`routes_for`, uploaded); None builds them here."""
    rank = dist.get_rank(group)
    device = communication_device(group)
    _check_inputs(tensors, layouts, transfer, rank, dist.get_world_size(group), device)
    groups = _dtype_groups(layouts)
    if routes is None:
        routes = upload_routes([Route.build(transfer, rank, [layouts[k].rows for k in streams])
                                for streams in groups], device)
    _check_routes(routes, groups, tensors, rank)
    exchanges = []
    with torch.no_grad():
        for streams, route in zip(groups, routes):
            stream_layouts = [layouts[k] for k in streams]
            numel = np.array([layout.row_numel for layout in stream_layouts], dtype=np.int64)
            send_splits, recv_splits = route.send.splits(numel), route.recv.splits(numel)
            send = _pack(route.send, [tensors[k] for k in streams], stream_layouts, numel, sum(send_splits), device)
            recv = torch.empty(sum(recv_splits), dtype=stream_layouts[0].dtype, device=device)
            work = dist.all_to_all_single(recv, send, output_split_sizes=recv_splits, input_split_sizes=send_splits,
                                          group=group, async_op=True)
            exchanges.append((streams, route, stream_layouts, numel, send, recv, work))
    return PendingAllToAll(exchanges, len(layouts), device)


def start_all_to_all_hops(tensors: Sequence[torch.Tensor], layouts: Sequence[ItemLayout], hops: Sequence[Transfer],
                          group=None, routes: Optional[Sequence["Route"]] = None) -> "PendingHops":
    """Launch a transfer run in ``hops`` (``Transfer.hops``: one flat all-to-all, or a node-wise one's hops),
    each an :func:`start_all_to_all_items` of the previous hop's outputs. ``routes``: this rank's routes of every
    hop in order, one per dtype group of ``layouts`` each (None builds them here)."""
    per_hop = len(_dtype_groups(layouts))
    if routes is not None and len(routes) != per_hop * len(hops):
        raise ValueError(f"rank {dist.get_rank(group)}: got {len(routes)} routes for {len(hops)} hops of "
                         f"{per_hop} dtype groups")

    def launch(hop: int, inputs: Sequence[torch.Tensor]) -> "PendingAllToAll":
        hop_routes = None if routes is None else routes[hop * per_hop:(hop + 1) * per_hop]
        return start_all_to_all_items(inputs, layouts, hops[hop], group, hop_routes)

    return PendingHops(launch, len(hops), tensors)


class PendingHops:
    """A transfer in flight hop by hop: the first hop is launched here; :meth:`wait` (once) waits for each hop
    and launches the next on its outputs, then returns the last one's (``launch(hop, inputs)`` starts a hop)."""

    def __init__(self, launch: Callable[[int, Sequence[torch.Tensor]], "PendingAllToAll"], num_hops: int,
                 tensors: Sequence[torch.Tensor]):
        self._launch, self._num_hops = launch, num_hops
        self._first: Optional[PendingAllToAll] = launch(0, tensors)

    def wait(self) -> Tuple[torch.Tensor, ...]:
        if self._first is None:
            raise RuntimeError("wait() was already called on this all-to-all")
        first, self._first = self._first, None
        outputs = first.wait()
        for hop in range(1, self._num_hops):
            outputs = self._launch(hop, outputs).wait()
        return outputs


class PendingAllToAll:
    """An all-to-all in flight; :meth:`wait` (once) returns the packed outputs, in stream order. On a GPU
    the wait makes the current stream wait for the collective (the host does not block); on gloo the host
    waits for the exchange."""

    def __init__(self, exchanges, num_streams: int, device: torch.device):
        self._exchanges, self._num_streams, self._device = exchanges, num_streams, device

    def wait(self) -> Tuple[torch.Tensor, ...]:
        if self._exchanges is None:
            raise RuntimeError("wait() was already called on this all-to-all")
        outputs = [None] * self._num_streams
        exchanges, self._exchanges = self._exchanges, None
        with torch.no_grad():
            for streams, route, layouts, numel, send, recv, work in exchanges:
                work.wait()
                del send  # the send buffer can go once the collective is done
                for stream, out in zip(streams, _unpack(route.recv, recv, layouts, numel, self._device)):
                    outputs[stream] = out
        return tuple(outputs)


@dataclass(frozen=True, eq=False)
class _Block:
    """Rows ``rows`` of the ``stream``-th stream's local packed tensor, next in buffer order; ``index``
    holds them on the device once uploaded."""

    stream: int
    rows: np.ndarray
    index: Optional[torch.Tensor] = None


@dataclass(frozen=True, eq=False)
class _Side:
    """The send (or receive) half of a route: the buffer's blocks in order, the rows of each stream per
    peer, and each stream's local rows before the exchange (or after)."""

    blocks: Tuple[_Block, ...]
    peer_rows: np.ndarray          # [streams, ranks]
    local_rows: Tuple[int, ...]    # per stream

    @property
    def in_order(self) -> bool:
        """One block holding one stream's local rows in order fills the buffer: no copy is needed."""
        return (len(self.blocks) == 1 and self.blocks[0].rows.size == sum(self.local_rows)
                and bool(np.array_equal(self.blocks[0].rows, np.arange(self.blocks[0].rows.size))))

    def splits(self, numel: np.ndarray) -> List[int]:
        """Elements to (from) each peer for streams of ``numel`` elements per row."""
        return (self.peer_rows * numel[:, None]).sum(axis=0).tolist()

    def offsets(self, numel: np.ndarray) -> np.ndarray:
        """Element offset of each block in the buffer (blocks tile it in order)."""
        sizes = np.array([block.rows.size * numel[block.stream] for block in self.blocks], dtype=np.int64)
        return np.cumsum(sizes) - sizes

    def needs_upload(self) -> bool:
        return not self.in_order


@dataclass(frozen=True, eq=False)
class Route:
    """One dtype group's exchange on one rank (module docstring): what goes where in the send and the
    receive buffer, for any row width."""

    send: _Side
    recv: _Side

    @property
    def num_streams(self) -> int:
        return len(self.send.local_rows)

    @classmethod
    def build(cls, transfer: Transfer, rank: int, rows: Sequence[np.ndarray]) -> "Route":
        """The route of ``rank`` for streams whose item ``i`` has ``rows[s][i]`` rows (host only)."""
        send = transfer.send_items(rank)
        recv = transfer.recv_items(rank)
        return cls(_side(send, transfer.dst.rank[send], transfer.src.items_on(rank), rows, transfer.num_ranks),
                   _side(recv, transfer.src.rank[recv], transfer.dst.items_on(rank), rows, transfer.num_ranks))


def routes_for(transfer: Transfer, rank: int, layouts: Sequence[ItemLayout]) -> List[Route]:
    """``rank``'s routes of ``transfer`` for streams of ``layouts``, one per dtype group (host only)."""
    return [Route.build(transfer, rank, [layouts[k].rows for k in streams]) for streams in _dtype_groups(layouts)]


def upload_routes(routes: Sequence[Route], device: torch.device) -> List[Route]:
    """``routes`` with their row indices on ``device``: one staging buffer, one copy that does not block
    (on the CPU, views of the host arrays)."""
    blocks = [block for route in routes for side in (route.send, route.recv) if side.needs_upload()
              for block in side.blocks]
    flat = host_to_device([torch.from_numpy(block.rows) for block in blocks], device, torch.int64, ())
    starts = np.cumsum([0] + [block.rows.size for block in blocks])
    uploaded = {id(block): flat[starts[j]:starts[j + 1]] for j, block in enumerate(blocks)}

    def on_device(side: _Side) -> _Side:
        return dataclasses.replace(side, blocks=tuple(dataclasses.replace(b, index=uploaded.get(id(b)))
                                                      for b in side.blocks))

    return [Route(on_device(route.send), on_device(route.recv)) for route in routes]


def _side(wire_items, peer_of_item, local_items, rows, num_ranks) -> _Side:
    """Buffer blocks of items in wire order (grouped by peer); rows per stream and peer; local rows."""
    per_peer = np.bincount(peer_of_item, minlength=num_ranks)
    peer_end = np.cumsum(per_peer)
    peer_rows = np.zeros((len(rows), num_ranks), dtype=np.int64)
    starts, local_rows = [], []
    for s, stream_rows in enumerate(rows):
        stream_rows = np.asarray(stream_rows, dtype=np.int64)
        peer_rows[s] = np.bincount(peer_of_item, weights=stream_rows[wire_items], minlength=num_ranks)
        start = np.zeros(stream_rows.size, dtype=np.int64)
        start[local_items] = np.cumsum(stream_rows[local_items]) - stream_rows[local_items]
        starts.append(start)
        local_rows.append(int(stream_rows[local_items].sum()))
    blocks = []  # (stream, row index) in buffer order, consecutive ones of one stream merged
    for peer in np.flatnonzero(per_peer):
        items = wire_items[peer_end[peer] - per_peer[peer]:peer_end[peer]]
        for s, stream_rows in enumerate(rows):
            if peer_rows[s, peer]:
                index = _row_index(starts[s][items], np.asarray(stream_rows, dtype=np.int64)[items])
                if blocks and blocks[-1][0] == s:
                    blocks[-1] = (s, np.concatenate([blocks[-1][1], index]))
                else:
                    blocks.append((s, index))
    return _Side(tuple(_Block(s, index) for s, index in blocks), peer_rows, tuple(local_rows))


def _row_index(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Concatenated ranges ``starts[j] .. starts[j] + counts[j] - 1``."""
    total = int(counts.sum())
    return np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(total, dtype=np.int64)


def _pack(side: _Side, tensors, layouts, numel, total: int, device) -> torch.Tensor:
    if side.in_order:
        return tensors[side.blocks[0].stream].contiguous().view(-1)  # wire order already: no copy
    send = torch.empty(total, dtype=layouts[0].dtype, device=device)
    for block, offset in zip(side.blocks, side.offsets(numel).tolist()):
        layout = layouts[block.stream]
        size = block.rows.size * int(numel[block.stream])
        torch.index_select(tensors[block.stream], 0, block.index,
                           out=send[offset:offset + size].view(-1, *layout.trailing_shape))
    return send


def _unpack(side: _Side, recv: torch.Tensor, layouts, numel, device) -> List[torch.Tensor]:
    if side.in_order:
        # Slot order already: the output is the receive buffer (streams without rows come out empty).
        stream = side.blocks[0].stream
        return [recv.view(-1, *layout.trailing_shape) if s == stream else
                torch.empty((0, *layout.trailing_shape), dtype=layout.dtype, device=device)
                for s, layout in enumerate(layouts)]
    outputs = [torch.empty((rows, *layout.trailing_shape), dtype=layout.dtype, device=device)
               for rows, layout in zip(side.local_rows, layouts)]
    for block, offset in zip(side.blocks, side.offsets(numel).tolist()):
        layout = layouts[block.stream]
        size = block.rows.size * int(numel[block.stream])
        outputs[block.stream].index_copy_(0, block.index, recv[offset:offset + size].view(-1, *layout.trailing_shape))
    return outputs


def _check_routes(routes: Sequence[Route], groups, tensors, rank: int) -> None:
    """Routes made for these streams: one per dtype group, with the streams' rows on this rank."""
    if len(routes) != len(groups):
        raise ValueError(f"rank {rank}: got {len(routes)} routes for {len(groups)} dtype groups of the layouts")
    for streams, route in zip(groups, routes):
        rows = tuple(int(tensors[k].shape[0]) for k in streams)
        if route.send.local_rows != rows:
            raise ValueError(f"rank {rank}: a route for local rows {route.send.local_rows} was given streams "
                             f"{list(streams)} of {rows} rows (routes of another transfer or layouts?)")
        if any(route.send.needs_upload() and b.index is None for b in route.send.blocks) or \
                any(route.recv.needs_upload() and b.index is None for b in route.recv.blocks):
            raise ValueError(f"rank {rank}: a route whose indices were not uploaded (upload_routes)")


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
