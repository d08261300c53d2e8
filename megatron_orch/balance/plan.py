"""Placements of items on ranks, and transfers between placements (the plans an all-to-all executes).

An *item* is one independent unit of a phase (an image tile, an audio window, one example for the
backbone), identified by its index ``0..n-1`` in the global batch of that phase. A :class:`Placement`
says, for every item, which rank holds it and at which position (slot) in that rank's local order.
A :class:`Transfer` moves every item from one placement to another; its algebra (inverse,
composition) is what lets encoder outputs go straight from their encoder rank to the backbone rank of
their example in one all-to-all, and their gradients come back by the inverse one.

Everything here is a deterministic function of integer arrays, so every rank computes the same
send/receive orders and split sizes from the same sizes without extra communication.
"""
from __future__ import annotations

import functools
import operator
import zlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance import _plan_kernels


ALL_TO_ALL = ("flat", "node-wise")  # how a transfer runs: one all-to-all, or Transfer.node_wise's two hops


def as_index_array(values, name: str) -> np.ndarray:
    """``values`` as a 1-D int64 array; ValueError naming ``name`` otherwise."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


def _first_outside(rank: np.ndarray, num_ranks: int) -> int:
    """The first item whose rank lies outside ``0..num_ranks - 1`` (-1: none)."""
    if rank.size and (rank.min() < 0 or rank.max() >= num_ranks):
        return int(np.flatnonzero((rank < 0) | (rank >= num_ranks))[0])
    return -1


_COUNTING_SORT_SPAN = 1 << 24  # integer keys spanning at most this sort by counting (compiled, O(n))


def _slots_by_key(rank: np.ndarray, num_ranks: int, key: np.ndarray) -> np.ndarray:
    """Slot of each item on its rank when a rank's items are ordered by ``key`` (ties by item id)."""
    rank = np.ascontiguousarray(rank, dtype=np.int64)
    key = np.asarray(key)
    if key.size and np.issubdtype(key.dtype, np.integer):
        low, high = int(key.min()), int(key.max())
        if high - low < max(_COUNTING_SORT_SPAN, 4 * key.size):
            shifted = np.ascontiguousarray(key, dtype=np.int64) - low
            return _plan_kernels.slots_by_key(rank, shifted, high - low + 1, int(num_ranks))
    order = np.lexsort((np.arange(rank.size), key, rank))
    counts = np.bincount(rank, minlength=num_ranks)
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    slot = np.empty(rank.size, dtype=np.int64)
    slot[order] = np.arange(rank.size, dtype=np.int64) - np.repeat(starts, counts)
    return slot


@dataclass(frozen=True, eq=False)
class Placement:
    """Where every item lives: ``rank[i]`` holds item ``i`` at position ``slot[i]`` of its local list."""

    rank: np.ndarray
    slot: np.ndarray
    num_ranks: int

    def __post_init__(self):
        rank = as_index_array(self.rank, "rank")
        slot = as_index_array(self.slot, "slot")
        if self.num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {self.num_ranks}")
        if rank.shape != slot.shape:
            raise ValueError(f"rank and slot differ in length: {rank.size} vs {slot.size}")
        bad = _first_outside(rank, self.num_ranks)
        if bad >= 0:
            raise ValueError(f"item {bad} is placed on rank {rank[bad]}, outside 0..{self.num_ranks - 1}")
        counts = np.bincount(rank, minlength=self.num_ranks)
        expected = _slots_by_key(rank, self.num_ranks, slot)
        if not np.array_equal(expected, slot) or (slot.size and slot.min() < 0):
            raise ValueError("slots must be a permutation of 0..count-1 on every rank "
                             f"(counts per rank: {counts.tolist()[:16]}...)")
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "slot", slot)

    @classmethod
    def from_ranks(cls, rank, num_ranks: int, key: Optional[np.ndarray] = None) -> "Placement":
        """Place item i on ``rank[i]``; a rank's items are ordered by ``key`` (default: item id)."""
        rank = np.ascontiguousarray(as_index_array(rank, "rank"))
        if key is None:  # (the ranks checked in the slots' pass)
            slot, bad = _plan_kernels.slots_in_id_order(rank, max(int(num_ranks), 0))
        else:
            bad = _first_outside(rank, num_ranks)
        if bad >= 0:
            raise ValueError(f"item {bad} is placed on rank {rank[bad]}, outside 0..{num_ranks - 1}")
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        if key is not None:
            key = np.asarray(key)
            if key.shape != rank.shape:
                raise ValueError(f"key has shape {key.shape}, expected {rank.shape}")
            slot = _slots_by_key(rank, num_ranks, key)
        return cls._valid(rank, slot, int(num_ranks))

    @classmethod
    def _valid(cls, rank: np.ndarray, slot: np.ndarray, num_ranks: int) -> "Placement":
        """A placement whose int64 ranks and slots are valid by construction (no re-check)."""
        placement = object.__new__(cls)
        object.__setattr__(placement, "rank", rank)
        object.__setattr__(placement, "slot", slot)
        object.__setattr__(placement, "num_ranks", num_ranks)
        return placement

    @classmethod
    def from_counts(cls, counts) -> "Placement":
        """The loader's placement: rank r holds the next ``counts[r]`` items, in item order."""
        counts = as_index_array(counts, "counts")
        if counts.size == 0 or counts.min() < 0:
            raise ValueError(f"counts must be a non-empty list of non-negative ints, got {counts.tolist()}")
        rank = np.repeat(np.arange(counts.size, dtype=np.int64), counts)
        return cls.from_ranks(rank, int(counts.size))

    @property
    def num_items(self) -> int:
        return int(self.rank.size)

    def counts(self) -> np.ndarray:
        """Number of items on each rank (one compiled pass: a rank's items come in runs)."""
        return _plan_kernels.counts(np.ascontiguousarray(self.rank, dtype=np.int64), self.num_ranks)

    def items_on(self, rank: int) -> np.ndarray:
        """Item ids held by ``rank``, in slot order."""
        ids = np.flatnonzero(self.rank == rank)
        return ids[np.argsort(self.slot[ids], kind="stable")]

    def expand(self, parent) -> "Placement":
        """Placement of child items that live with their parent (e.g. an example's encoder outputs).

        Child ``j`` goes to the rank of item ``parent[j]``; on a rank, children are ordered by their
        parent's slot, then by child id. The ranks are gathered here, the slots on first use: the bytes a
        transfer moves are counted from its ranks alone (a step's embeddings, ~800k items at DP 10240, whose
        slots only the trainer's routes read).
        """
        parent = np.ascontiguousarray(as_index_array(parent, "parent"))
        rank, bad = _plan_kernels.gather(np.ascontiguousarray(self.rank), parent)
        if bad >= 0:  # (checked in the gather's pass)
            raise ValueError(f"parent ids must lie in 0..{self.num_items - 1}")
        children = object.__new__(Placement)
        object.__setattr__(children, "rank", rank)
        object.__setattr__(children, "num_ranks", self.num_ranks)
        object.__setattr__(children, "_parents", (self, parent))
        return children

    def __getattr__(self, name):
        """The slots of a placement :meth:`expand` made, computed on first use (called only for an attribute
        not found: any other is missing)."""
        parents = self.__dict__.get("_parents")
        if name != "slot" or parents is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        placement, parent = parents
        slot = _plan_kernels.expand_slots(np.ascontiguousarray(placement.rank), np.ascontiguousarray(placement.slot),
                                          placement.num_ranks, parent)
        object.__setattr__(self, "slot", slot)
        return slot

    def same_as(self, other: "Placement") -> bool:
        return (self.num_ranks == other.num_ranks and np.array_equal(self.rank, other.rank)
                and np.array_equal(self.slot, other.slot))


@dataclass(frozen=True, eq=False)
class Transfer:
    """Move every item from placement ``src`` to placement ``dst`` (one all-to-all).

    Wire order, identical on every rank: a sender packs the items for destination rank d in the order
    of their slots on d, destinations in rank order; a receiver therefore gets, from each source rank
    in turn, items in increasing destination slot, and reorders them into slot order.
    """

    src: Placement
    dst: Placement

    def __post_init__(self):
        if self.src.num_items != self.dst.num_items:
            raise ValueError(f"src holds {self.src.num_items} items but dst holds {self.dst.num_items}")
        if self.src.num_ranks != self.dst.num_ranks:
            raise ValueError(f"src spans {self.src.num_ranks} ranks but dst spans {self.dst.num_ranks}")

    @property
    def num_ranks(self) -> int:
        return self.src.num_ranks

    def send_items(self, rank: int) -> np.ndarray:
        """Items ``rank`` sends, in wire order (by destination rank, then destination slot)."""
        ids = np.flatnonzero(self.src.rank == rank)
        return ids[np.lexsort((self.dst.slot[ids], self.dst.rank[ids]))]

    def recv_items(self, rank: int) -> np.ndarray:
        """Items ``rank`` receives, in wire order (by source rank, then destination slot)."""
        ids = np.flatnonzero(self.dst.rank == rank)
        return ids[np.lexsort((self.dst.slot[ids], self.src.rank[ids]))]

    def send_counts(self, rank: int) -> np.ndarray:
        """Number of items ``rank`` sends to each destination rank."""
        return np.bincount(self.dst.rank[self.src.rank == rank], minlength=self.num_ranks)

    def recv_counts(self, rank: int) -> np.ndarray:
        """Number of items ``rank`` receives from each source rank."""
        return np.bincount(self.src.rank[self.dst.rank == rank], minlength=self.num_ranks)

    def traffic_matrix(self) -> np.ndarray:
        """``[src, dst]`` number of items moved between rank pairs (bytes: :meth:`moved_bytes`)."""
        flat = self.src.rank * self.num_ranks + self.dst.rank
        return np.bincount(flat, minlength=self.num_ranks * self.num_ranks).reshape(self.num_ranks, self.num_ranks)

    def moved_bytes(self, item_bytes, node_of_rank, all_to_all: str = "flat") -> MovedBytes:
        """What this transfer sends when item i weighs ``item_bytes[i]`` (:func:`moved_bytes`), run as one
        ``flat`` all-to-all or ``node-wise`` (:meth:`node_wise`: its two hops' bytes and connections, the first
        hop's on the nodes, the second's across them)."""
        nbytes = _item_bytes(item_bytes, self.src.num_items)
        node_of_rank = as_index_array(node_of_rank, "node_of_rank")
        if node_of_rank.size != self.num_ranks:
            raise ValueError(f"node_of_rank has {node_of_rank.size} ranks, the transfer spans {self.num_ranks}")
        # (the placements' ranks are valid by construction: counted without checking them again)
        return _exchanged(self.src.rank, self.dst.rank, nbytes, node_of_rank, all_to_all)

    def hops(self, all_to_all: str, node_of_rank) -> Tuple["Transfer", ...]:
        """The all-to-alls that run this transfer: itself (``flat``), or :meth:`node_wise`'s hops."""
        if all_to_all == "flat":
            return (self,)
        if all_to_all == "node-wise":
            return self.node_wise(node_of_rank)
        raise ValueError(f"unknown all-to-all {all_to_all!r}; choose one of {ALL_TO_ALL}")

    def inverse(self) -> "Transfer":
        """The transfer that brings every item back (gradients of a forward move)."""
        return Transfer(src=self.dst, dst=self.src)

    def node_wise(self, node_of_rank) -> Tuple["Transfer", ...]:
        """This transfer as two hops that bound each rank's peers (``node_of_rank[r]``: rank r's node; every node
        the same number of ranks, a rank's local index its position among its node's ranks): first within the
        source's node, to the rank there at the destination's local index; then across nodes, between ranks of
        one local index (rail peers), to the destination. A rank so exchanges with at most
        ``ranks_per_node - 1 + nodes - 1`` others, and an item crosses nodes at most once, as in the flat
        transfer (so the same bytes cross nodes; items changing both node and local index also hop once on
        their node). The third hop of a hierarchical all-to-all (within the destination's node) is empty here:
        the first hop already lands each item on its destination's rail. The hops' composition is this transfer
        (``first.then(second)``); their gradients go back by ``second.inverse()``, then ``first.inverse()``. A hop
        that would move no item off its rank is left out (one hop: the transfer itself)."""
        node_of_rank = as_index_array(node_of_rank, "node_of_rank")
        if node_of_rank.size != self.num_ranks:
            raise ValueError(f"node_of_rank has {node_of_rank.size} ranks, the transfer spans {self.num_ranks}")
        relay = relay_ranks(self.src.rank, self.dst.rank, node_of_rank)
        if relay is None:
            return (self,)
        middle = Placement.from_ranks(relay, self.num_ranks)
        return Transfer(self.src, middle), Transfer(middle, self.dst)

    def then(self, following: "Transfer") -> "Transfer":
        """One transfer equal to ``self`` followed by ``following`` (``following.src`` must be ``self.dst``)."""
        if not self.dst.same_as(following.src):
            raise ValueError("cannot compose: the second transfer does not start where the first ends")
        return Transfer(src=self.src, dst=following.dst)


@dataclass(frozen=True, eq=False)
class MovedBytes:
    """What one move of items (each from a source rank to a destination rank) sends: the project's one
    byte accountant, used by the partitioners' figures, placement, the step plan's report, the benchmarks
    and the simulator alike.

    ``total``: every item's bytes, moved or not; ``intra_node``: those that leave their GPU and stay on
    their node (NVLink); ``inter_node``: those that cross nodes (the network). Per rank, ``sent_intra`` /
    ``received_intra`` on its node and ``sent_inter`` / ``received_inter`` across nodes. ``connections``: the
    rank pairs the move sends bytes between (what a communicator connects, :class:`Connections`; none where
    counted without them, :func:`exchanged_bytes`). ``node_wise``: the move runs as :meth:`Transfer.node_wise`'s
    two hops, its bytes on the nodes first, then those across nodes (one after the other; a flat move sends both
    at once).
    """

    total: float
    intra_node: float
    inter_node: float
    sent_intra: np.ndarray
    received_intra: np.ndarray
    sent_inter: np.ndarray
    received_inter: np.ndarray
    connections: "Connections"
    node_wise: bool = False

    @property
    def off_gpu(self) -> float:
        """Bytes that leave their GPU."""
        return self.intra_node + self.inter_node

    def times(self, count: int) -> "MovedBytes":
        """The bytes of ``count`` such moves (an all-to-all forward and its inverse for the gradients: 2)."""
        return MovedBytes(count * self.total, count * self.intra_node, count * self.inter_node,
                          count * self.sent_intra, count * self.received_intra, count * self.sent_inter,
                          count * self.received_inter, self.connections, self.node_wise)

    @classmethod
    def of_hops(cls, hops: Sequence["MovedBytes"]) -> "MovedBytes":
        """What a transfer run as ``hops`` (its :meth:`Transfer.node_wise` hops, each counted flat) sends: every
        item's bytes once, each hop's moved bytes and connections."""
        return cls(hops[0].total, *(sum(getattr(hop, name) for hop in hops) for name in (
            "intra_node", "inter_node", "sent_intra", "received_intra", "sent_inter", "received_inter")),
                   functools.reduce(operator.or_, (hop.connections for hop in hops)), node_wise=True)


@dataclass(frozen=True, eq=False)
class Connections:
    """The distinct rank pairs that exchange bytes (either way): what a communicator keeps connected once
    they have (NCCL sets up a peer's buffers at the first send to or receive from it and keeps them for the
    communicator's life). ``pairs``: sorted ``low * num_ranks + high`` of each pair, low < high. The union
    (``|``) of a step's moves is the step's; of a run's steps, the run's (cumulative)."""

    num_ranks: int
    pairs: np.ndarray

    @classmethod
    def none(cls, num_ranks: int) -> "Connections":
        return cls(int(num_ranks), np.zeros(0, dtype=np.int64))

    def __or__(self, other: "Connections") -> "Connections":
        if self.num_ranks != other.num_ranks:
            raise ValueError(f"cannot join connections of {self.num_ranks} and {other.num_ranks} ranks")
        return Connections(self.num_ranks, _plan_kernels.sorted_union(self.pairs, other.pairs))

    def peers(self, node_of_rank) -> "Peers":
        """Each rank's distinct peers, on its node and across nodes (rank r on node ``node_of_rank[r]``)."""
        node_of_rank = as_index_array(node_of_rank, "node_of_rank")
        if node_of_rank.size != self.num_ranks:
            raise ValueError(f"node_of_rank has {node_of_rank.size} ranks, the connections {self.num_ranks}")
        intra, inter = _plan_kernels.peer_counts(np.ascontiguousarray(self.pairs, dtype=np.int64),
                                                 np.ascontiguousarray(node_of_rank))
        return Peers(intra_node=intra, inter_node=inter)


@dataclass(frozen=True, eq=False)
class Peers:
    """Per rank, how many distinct ranks it exchanges bytes with on its node (``intra_node``) and on other
    nodes (``inter_node``)."""

    intra_node: np.ndarray
    inter_node: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.intra_node + self.inter_node

    def busiest(self) -> Tuple[int, int, int]:
        """The most peers of any rank: (all, on its node, across nodes), each its own maximum."""
        return tuple(int(a.max(initial=0)) for a in (self.total, self.intra_node, self.inter_node))


class RunPeers:
    """One rank's distinct peers over a run: every rank it exchanged bytes with in any step so far (a union of the
    steps' :class:`Connections`, what its communicator keeps connected), on its node and across nodes. Kept per
    rank (a flag per rank of the group): a step costs a pass over its pairs, where the union of a whole run's pairs
    (millions at DP 2560) would cost a pass over all of them every step."""

    def __init__(self, rank: int, node_of_rank):
        self.rank = int(rank)
        self.node_of_rank = as_index_array(node_of_rank, "node_of_rank")
        if not 0 <= self.rank < self.node_of_rank.size:
            raise ValueError(f"rank {rank} is outside 0..{self.node_of_rank.size - 1}")
        self.partner = np.zeros(self.node_of_rank.size, dtype=bool)

    def add(self, step: Connections) -> Tuple[int, int]:
        """Join ``step``'s connections; this rank's peers over the run so far: (on its node, across nodes)."""
        if step.num_ranks != self.node_of_rank.size:
            raise ValueError(f"connections of {step.num_ranks} ranks, the run's {self.node_of_rank.size}")
        low, high = np.divmod(step.pairs, step.num_ranks)
        self.partner[high[low == self.rank]] = True
        self.partner[low[high == self.rank]] = True
        on_node = int(np.count_nonzero(self.partner & (self.node_of_rank == self.node_of_rank[self.rank])))
        return on_node, int(np.count_nonzero(self.partner)) - on_node


def relay_ranks(src_rank: np.ndarray, dst_rank: np.ndarray, node_of_rank: np.ndarray) -> Optional[np.ndarray]:
    """Where a node-wise all-to-all (:meth:`Transfer.node_wise`) lands item i after its first hop: the rank on
    ``src_rank[i]``'s node at ``dst_rank[i]``'s local index; None where that hop or the second would move no
    item off its rank (one hop: the flat transfer)."""
    per_node = np.bincount(node_of_rank)
    if per_node.min() != per_node.max():
        raise ValueError(f"a node-wise all-to-all needs the same number of ranks on every node, got "
                         f"{per_node.tolist()}")
    order = np.argsort(node_of_rank, kind="stable")
    rank_at = order.reshape(per_node.size, per_node[0])  # [node, local index] -> rank
    local = np.empty(node_of_rank.size, dtype=np.int64)
    local[order] = np.tile(np.arange(per_node[0]), per_node.size)
    relay = rank_at[node_of_rank[src_rank], local[dst_rank]]
    if np.array_equal(relay, src_rank) or np.array_equal(relay, dst_rank):
        return None
    return relay


def exchanged_bytes(src_rank, dst_rank, item_bytes, node_of_rank, all_to_all: str = "flat", *,
                    connections: bool = True) -> MovedBytes:
    """What moving item i (``item_bytes[i]``) from rank ``src_rank[i]`` to ``dst_rank[i]`` sends, run as one
    ``flat`` all-to-all (:func:`moved_bytes`) or ``node-wise`` (:meth:`Transfer.node_wise`'s hops, through
    :func:`relay_ranks`: their bytes and connections summed, the first hop's on the nodes, the second's across
    them): what :meth:`Transfer.moved_bytes` counts, from the ranks alone (the planner judges candidate plans by
    it before it builds their placements). ``connections`` False: the bytes alone, its ``connections`` none (the
    planner's step model reads only the bytes; finding the pairs takes most of the count's time)."""
    return _exchanged(*_checked(src_rank, dst_rank, item_bytes, node_of_rank), all_to_all, connections)


def _exchanged(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, node_of_rank: np.ndarray,
               all_to_all: str, connections: bool = True) -> MovedBytes:
    """:func:`exchanged_bytes` of checked arrays."""
    if all_to_all == "flat":
        return _counted(src, dst, nbytes, node_of_rank, connections)
    if all_to_all != "node-wise":
        raise ValueError(f"unknown all-to-all {all_to_all!r}; choose one of {ALL_TO_ALL}")
    relay = relay_ranks(src, dst, node_of_rank)
    return MovedBytes.of_hops([_counted(a, b, nbytes, node_of_rank, connections)
                               for a, b in ([(src, dst)] if relay is None else [(src, relay), (relay, dst)])])


def moved_bytes(src_rank, dst_rank, item_bytes, node_of_rank) -> MovedBytes:
    """The bytes item i sends moving from rank ``src_rank[i]`` to ``dst_rank[i]``, rank r on node
    ``node_of_rank[r]`` (see :class:`MovedBytes`)."""
    return _counted(*_checked(src_rank, dst_rank, item_bytes, node_of_rank))


def _checked(src_rank, dst_rank, item_bytes, node_of_rank):
    """The accountant's inputs as arrays, each checked (ValueError naming what is wrong)."""
    src = as_index_array(src_rank, "src_rank")
    dst = as_index_array(dst_rank, "dst_rank")
    node_of_rank = as_index_array(node_of_rank, "node_of_rank")
    if src.shape != dst.shape:
        raise ValueError(f"src_rank and dst_rank differ in shape: {src.shape}, {dst.shape}")
    nbytes = _item_bytes(item_bytes, src.size)
    for name, ranks in (("src_rank", src), ("dst_rank", dst)):
        if ranks.size and (ranks.min() < 0 or ranks.max() >= node_of_rank.size):
            raise ValueError(f"{name} holds ranks outside 0..{node_of_rank.size - 1}")
    return src, dst, nbytes, node_of_rank


def _item_bytes(item_bytes, num_items: int) -> np.ndarray:
    """``item_bytes`` as a 1-D int64 or float64 array of ``num_items`` (the accountant sums either as float64,
    so an int64 array is not copied, nor a strided one: an encoder phase's bytes are one value, ``phase_items``)."""
    nbytes = np.asarray(item_bytes)
    if nbytes.dtype not in (np.int64, np.float64):
        nbytes = nbytes.astype(np.float64)
    if nbytes.shape != (num_items,):
        raise ValueError(f"item_bytes has shape {nbytes.shape}, expected ({num_items},): one figure per item")
    return nbytes


def _counted(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, node_of_rank: np.ndarray,
             connections: bool = True) -> MovedBytes:
    """:func:`moved_bytes` of checked arrays (ranks within ``node_of_rank``, one byte figure per item); its
    connections none unless ``connections``."""
    total, intra, inter, per_rank, pairs = _plan_kernels.moved_bytes(
        np.ascontiguousarray(src), np.ascontiguousarray(dst), np.ascontiguousarray(node_of_rank), nbytes,
        bool(connections))
    return MovedBytes(float(total), float(intra), float(inter), *per_rank,
                      Connections(int(node_of_rank.size), pairs))


def checksum(*arrays) -> int:
    """Deterministic 32-bit check value of integer arrays (shape-sensitive): a plan's digest, which ranks
    compare instead of the plan itself (each array's shape and its 64-bit fingerprint, CRC-32'd)."""
    arrays = [np.ascontiguousarray(array, dtype=np.int64) for array in arrays]
    prints = [0] * len(arrays)
    by_size = sorted(range(len(arrays)), key=lambda k: -arrays[k].size)  # fingerprinted two at a time, alike in size
    for a, b in zip(by_size[0::2], by_size[1::2]):
        prints[a], prints[b] = _plan_kernels.fingerprint_pair(arrays[a].reshape(-1), arrays[b].reshape(-1))
    if len(arrays) % 2:
        prints[by_size[-1]] = _plan_kernels.fingerprint(arrays[by_size[-1]].reshape(-1))
    value = 0
    for array, fingerprint in zip(arrays, prints):
        value = zlib.crc32(np.asarray(array.shape, dtype=np.int64).tobytes(), value)
        value = zlib.crc32(np.uint64(fingerprint).tobytes(), value)
    return value
