"""Repair a locality-aware backbone plan until the step model cannot find it slower than the plain plan.

A locality plan (:func:`~megatron_orch.balance.partition.partition_locality`,
:func:`~megatron_orch.balance.partition.partition_equal_count_locality`) sends few bytes across nodes, but a
few of its ranks can carry more on their NIC (or NVLink) than the plain plan's busiest rank does in the same
all-to-all: a near tie the step model resolves against the locality plan at some bandwidth. The step's
modeled time (:class:`~megatron_orch.balance.step_model.StepModel`) grows with each all-to-all's busiest
rank's NIC and NVLink bytes and with the busiest rank's compute, so a plan whose busiest rank is, move by
move, no busier than the plain plan's on either link (NVLink counted as the time it takes beside the plain
plan's NIC time at the link's full bandwidth) and whose compute is within the plain plan's max is never
slower at any NIC bandwidth.

:func:`repair_locality` moves examples (packed micro-batches) or swaps pairs of them (equal-count) between
ranks to bring every rank within those limits: each step takes the rank furthest over a limit (or over the
compute capacity) and tries the examples it holds (or whose bytes it sends) on the ranks of the nodes
their bytes come from, keeping every rank within the capacity; it keeps the action that lowers the total
excess most (then the fewest bytes across nodes), and stops when nothing is over, or nothing lowers it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance import _kernels, _plan_kernels

_MAX_ROUNDS = 400        # actions applied at most
_CANDIDATES = 6          # examples tried per over-limit rank
_PARTNERS = 3            # swap partners tried per (example, target rank)
_TARGET_NODES = 2        # nodes tried per example: those its bytes come from most
_TOL = 1e-9              # relative: an excess below this is none
_SPREAD = 8              # least-busy ranks of the over-limit link tried as targets too
_WORST = 16              # over-limit (kind, move, rank)s considered per kind, worst first


@dataclass
class _Move:
    """One all-to-all's sources, grouped by the example they go to: (source rank, bytes) of entries
    ``start[e]:start[e+1]`` of example e; ``by_src``: the examples of the entries each rank sends, and how many of
    the sources' entries each stands for (a run of them, with ``merge``: :func:`_group`)."""
    src: np.ndarray
    nbytes: np.ndarray
    start: np.ndarray
    by_src_start: np.ndarray
    by_src_example: np.ndarray
    by_src_count: np.ndarray


def _group(example: np.ndarray, src: np.ndarray, nbytes: np.ndarray, n: int, num_ranks: int,
           merge: bool = False) -> _Move:
    if not example.ndim == 1 or src.shape != example.shape or nbytes.shape != example.shape:
        raise ValueError(f"an all-to-all's sources are three 1-D arrays of one length (example, source rank, bytes), "
                         f"got shapes {example.shape}, {src.shape}, {nbytes.shape}")
    for name, values, bound in (("example", example, n), ("source rank", src, num_ranks)):
        if values.size and (values.min() < 0 or values.max() >= bound):
            i = int(np.flatnonzero((values < 0) | (values >= bound))[0])
            raise ValueError(f"entry {i} of an all-to-all's sources has {name} {values[i]}, not in 0..{bound - 1}")
    if merge:  # (the caller checked that the bytes' sums are exact)
        example, src, nbytes, entries = _plan_kernels.runs(example, src, np.asarray(nbytes, dtype=np.int64))
    else:
        entries = np.ones(example.size, dtype=np.int64)
    return _Move(*_kernels.group_entries(example, src, nbytes, entries, n, num_ranks))


class _State:
    """The ranks, loads and per-link bytes of a plan (``links``: per move, sent/received on the node, across nodes),
    the moves' entries flat for the kernels (``flat``: :func:`_flat`)."""

    def __init__(self, moves: List[_Move], flat, node: np.ndarray, rank: np.ndarray, costs: np.ndarray,
                 num_ranks: int):
        self.moves, self.node, self.rank, self.costs = moves, node, rank, costs
        self.src, self.nbytes, self.offset = flat
        self.load = np.bincount(rank, weights=costs, minlength=num_ranks)
        self.links = np.zeros((len(moves), 4, num_ranks))
        _kernels.example_link_bytes(self.links, node, self.src, self.nbytes, self.offset, rank)


def _flat(moves: List[_Move], n: int):
    """The moves' entries one after another: (source ranks, bytes, ``offset``: move m's of example e at
    ``offset[m, e]:offset[m, e + 1]``), shared by the plans the repair compares."""
    src = np.concatenate([move.src for move in moves]) if moves else np.zeros(0, dtype=np.int64)
    nbytes = np.concatenate([move.nbytes for move in moves]) if moves else np.zeros(0)
    bases = np.cumsum([0] + [move.src.size for move in moves[:-1]])
    offset = np.array([move.start + base for move, base in zip(moves, bases)], dtype=np.int64).reshape(len(moves),
                                                                                                        n + 1)
    return src, nbytes, offset


def _repair_start(bin_of_item, reference, costs, sources, node_of_rank, nvlink_over_nic, capacity,
                  state_class=_State, merge=False):
    """What the repair starts from (the compiled one and the tests' Python reference): the moves, the nodes, the
    plan's state, the capacity (default: the reference's max) and each move's (NIC limit, NVLink limit, NIC scale,
    NVLink scale), the reference's busiest links (an NVLink byte costing ``nvlink_over_nic`` less). ``merge``: each
    run of consecutive entries of one example and one source rank held as one (``_Move.by_src_count``), where every
    sum of bytes is exact (integer bytes >= 0, all of them together below 2**53): the same sums and choices from a
    fraction of the entries (~800k encoder items, ~100k runs at DP 10240)."""
    rank = np.array(bin_of_item, dtype=np.int64)
    reference = np.asarray(reference, dtype=np.int64)
    costs = np.asarray(costs, dtype=np.float64)
    node = np.asarray(node_of_rank, dtype=np.int64)
    n, num_ranks = rank.size, node.size
    sources = [(np.asarray(e, dtype=np.int64), np.asarray(s, dtype=np.int64), np.asarray(b)) for e, s, b in sources]
    merge = merge and all(b.dtype.kind in "iu" and (not b.size or b.min() >= 0) for _, _, b in sources) and sum(
        int(b.max(initial=0)) * b.size for _, _, b in sources) < 2 ** 53
    moves = [_group(e, s, b, n, num_ranks, merge) for e, s, b in sources]
    flat = _flat(moves, n)
    plain = state_class(moves, flat, node, reference.copy(), costs, num_ranks)
    if capacity is None:
        capacity = float(plain.load.max(initial=0.0))
    nic_limit = np.maximum(plain.links[:, 2], plain.links[:, 3]).max(axis=1)
    nvl_limit = np.maximum(np.maximum(plain.links[:, 0], plain.links[:, 1]).max(axis=1), nic_limit * nvlink_over_nic)
    limits = np.stack([nic_limit, nvl_limit, np.maximum(nic_limit, 1.0), np.maximum(nvl_limit, 1.0)], axis=1)
    return moves, node, state_class(moves, flat, node, rank, costs, num_ranks), float(capacity), limits


def repair_locality(bin_of_item: np.ndarray, reference: np.ndarray, costs: np.ndarray,
                    sources: Sequence[Tuple[np.ndarray, np.ndarray, np.ndarray]], node_of_rank: np.ndarray,
                    nvlink_over_nic: float, *, swaps_only: bool, capacity: Optional[float] = None,
                    max_rounds: int = _MAX_ROUNDS) -> Tuple[np.ndarray, int]:
    """``bin_of_item`` (the locality plan's backbone rank of every example) repaired against ``reference``
    (the plain plan's): (new ranks, actions taken). ``sources``: every all-to-all the backbone ranks decide,
    as (example, source rank, bytes) arrays (its text from the loaders, each encoder phase's embeddings);
    ``nvlink_over_nic``: NVLink bandwidth over the NIC's highest (an NVLink byte costs this much less);
    ``capacity``: the most compute a rank may hold (default: the reference's max); ``swaps_only``: keep
    every rank's count (equal-count micro-batches). Compiled (:func:`_kernels.repair_locality`, GIL released)."""
    moves, node, state, capacity, limits = _repair_start(bin_of_item, reference, costs, sources, node_of_rank,
                                                         nvlink_over_nic, capacity, merge=True)
    num_ranks = node.size
    by_src_base = np.cumsum([0] + [move.by_src_example.size for move in moves[:-1]])
    by_src_start = np.array([move.by_src_start + base for move, base in zip(moves, by_src_base)],
                            dtype=np.int64).reshape(len(moves), num_ranks + 1)
    by_src_example, by_src_count = ((np.concatenate([move.by_src_example for move in moves]),
                                     np.concatenate([move.by_src_count for move in moves])) if moves
                                    else (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)))
    actions = _kernels.repair_locality(state.links, node, state.src, state.nbytes, state.offset, by_src_start,
                                       by_src_example, by_src_count, state.rank, state.load, state.costs, limits,
                                       capacity, max(capacity, 1e-300), bool(swaps_only), int(max_rounds),
                                       _CANDIDATES, _PARTNERS, _TARGET_NODES, _TOL, _SPREAD, _WORST)
    return state.rank, int(actions)


def localize(bin_of_item: np.ndarray, costs: np.ndarray, want_node: np.ndarray, node_of_rank: np.ndarray,
             capacity: Optional[float] = None, *, swaps_only: bool,
             item_bytes: Optional[np.ndarray] = None) -> Tuple[np.ndarray, int]:
    """The plain plan's backbone ranks ``bin_of_item`` with examples swapped onto the node they want
    (``want_node``: where most of their bytes are) while every rank stays within ``capacity`` (default: the
    plan's max): (new ranks, examples brought home). An example on the wrong node swaps with one on the node
    it wants, the closest in cost that fits the two ranks' room among those whose swap sends the fewest
    ``item_bytes`` (default: one each) across nodes: one wanting the first one's node (both go home), one
    wanting a third node (nothing lost), or one at home there with fewer bytes than it (a light example
    leaves for a heavy one); with ``swaps_only`` False (packed micro-batches) it may also just move to the
    least-loaded rank of that node if that has room for it. Where no partner fits the two ranks, a swap that
    leaves the heavier one over the capacity is kept if one exchange inside that rank's node (a swap, or with
    ``swaps_only`` False a move) takes the excess to another rank of the node with room for it: nothing
    more crosses nodes, and a node's room counts, not one rank's (plain plans leave every rank within about
    1e-4 of the max, so a single rank's room rarely fits the cost gap of two long examples). Every rank keeps
    its count under swaps and its load within the capacity, so the balance stays the plain plan's; what
    still crosses nodes is what no such exchange could bring home. Compiled (:func:`_kernels.localize`,
    GIL released)."""
    rank = np.array(bin_of_item, dtype=np.int64)
    if max(rank.size, len(node_of_rank)) >= _LOCALIZE_IDS:
        raise ValueError(f"localize takes fewer than {_LOCALIZE_IDS} examples and ranks, got {rank.size} examples "
                         f"and {len(node_of_rank)} ranks")
    costs = np.ascontiguousarray(costs, dtype=np.float64)
    if costs.size and not (costs.min() >= 0 and costs.max() < np.inf):  # (the kernel sorts them by their bits)
        i = int(np.flatnonzero(~((costs >= 0) & (costs < np.inf)))[0])
        raise ValueError(f"cost of example {i} is {costs[i]}: costs are finite and >= 0")
    node = np.ascontiguousarray(node_of_rank, dtype=np.int64)
    want = np.ascontiguousarray(want_node, dtype=np.int64)
    if want.size and (want.min() < 0 or want.max() > node.max(initial=-1)):
        i = int(np.flatnonzero((want < 0) | (want > node.max(initial=-1)))[0])
        raise ValueError(f"want_node of example {i} is {want[i]}, not a node of node_of_rank (0..{node.max()})")
    if capacity is None:
        capacity = float(np.bincount(rank, weights=costs, minlength=node.size).max(initial=0.0))
    weight = np.ones(rank.size) if item_bytes is None else np.ascontiguousarray(item_bytes, dtype=np.float64)
    if weight.size and not weight.min() >= 0:
        i = int(np.flatnonzero(~(weight >= 0))[0])
        raise ValueError(f"item_bytes of example {i} is {weight[i]}: bytes are >= 0")
    brought = _kernels.localize(rank, costs, want, node, float(capacity), bool(swaps_only), weight, _LOCALIZE_SCAN,
                                _LOCALIZE_PASSES, _SETTLE_TRIES)
    return rank, int(brought)


_LOCALIZE_SCAN = 64  # swap partners looked at on either side of an example's cost
_LOCALIZE_PASSES = 6
_SETTLE_TRIES = 4    # swaps that overfill a rank tried per example, the best first
_LOCALIZE_IDS = 2**31  # the kernel holds examples' ids, ranks and nodes in 32 bits
