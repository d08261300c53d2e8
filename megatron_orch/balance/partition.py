"""Assign the items of one phase to K data-parallel bins, minimising the most-loaded bin.

This is multiway number partitioning (P||Cmax) with an optional per-bin memory cap. Three
constructive methods are built in (registered in :data:`megatron_orch.balance.registry.PARTITIONERS`, where a
user's partitioner registers too), plus a local-search refinement on top:

* ``lpt``: greedy longest-processing-time (each item, largest first, to the least-loaded bin);
* ``kk``: Karmarkar-Karp largest differencing, K-way;
* ``bs_ffd``: binary search on the bin capacity, first-fit decreasing at each capacity;
* ``auto``: where long items set the lower bound above the mean, first-fit decreasing at the bound (kept if it
  places every item: an optimal plan); else each of the three refined (swap sweeps between many bins at once,
  then local search: exchanges out of the most-loaded bin), lpt, then bs_ffd, then kk, until one is within 0.2%
  of the lower bound; the best kept
  (registered partitioners do not take part: they are picked by name).

Variants: :func:`partition_equal_count` (every bin gets exactly n/K items, for fixed micro-batch
sizes), :func:`partition_locality` and :func:`partition_equal_count_locality` (bins are ranks; items
start on a home rank and as few bytes as possible cross nodes, then leave their GPU),
:func:`partition_uniform` (items of one cost) and :func:`partition_groups` (many small partitions in
one compiled call: the packed micro-batches of every rank).

Results are deterministic functions of their inputs (ties go to the smaller item or bin id), so
every rank computes the same plan. Hot loops are compiled with numba and release the GIL.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from megatron_orch.balance import _kernels, _plan_kernels
from megatron_orch.balance.placement import PlacementConfig, place_items
from megatron_orch.balance.plan import exchanged_bytes
from megatron_orch.balance.registry import PARTITIONERS, Entry
from megatron_orch.balance.topology import Topology

_SWAP_SWEEPS = 16           # at most this many swap sweeps before the local search (a sweep: ~1 ms at DP 2560)
_REFINE_PARTNERS = 8         # least-loaded bins tried as move/swap partners of the most-loaded one
_KK_TRUSTED = 0.01           # equal-count KK this close to the bound is refined before the slot greedy is built
_CHEAPEST_SCAN = 1024        # then the batch's cheapest items (outside the most-loaded bin) tried as swaps
_LOCALITY_SWAP_CAPS = (0.0, 0.02, 0.1, math.inf)  # locality refinement: costliest swap across nodes, x the mean
_BS_FFD_REL_TOL = 1e-3       # binary search stops when capacity is known within this fraction
_GOOD_ENOUGH = 1e-4          # this close to a lower bound, refinement stops: nothing to gain
_AUTO_SETTLED = 2e-3         # this close, auto tries no further construction (each costs ~10-30 ms at DP 2560)
_BS_FFD_MAX_ROUNDS = 40


class Outcome(enum.Enum):
    """How a partition was made, as its users decide by it (``Partition.method`` names the algorithm for logs)."""

    BALANCED = "balanced"  # the partitioner's bins
    HOME = "home"          # the home assignment, kept: nothing better (or already within the capacity)
    FALLBACK = "fallback"  # a locality partitioner missed its capacity: the reference's bins (placed exactly unless
    #                        the caller places them itself: ``place_fallback`` False)


@dataclass(frozen=True, eq=False)
class Partition:
    """Assignment of n items to K interchangeable bins (bins are mapped to ranks by comm placement).

    ``lower_bound`` is max(total/K, largest item) (for equal-count partitions a stronger bound that
    accounts for the fixed count). ``baseline_max_cost`` is the max bin cost of the ``home``
    assignment when one was given, else nan. The byte figures are filled when the items' home bins
    and sizes are known: ``moved_bytes`` leave their home bin, ``inter_node_bytes`` also leave their
    node (bin b on node b // gpus_per_node); ``total_bytes`` is the sum over all items.
    """

    bin_of_item: np.ndarray
    num_bins: int
    bin_costs: np.ndarray
    lower_bound: float
    baseline_max_cost: float
    method: str
    bin_memory: Optional[np.ndarray] = None
    moved_bytes: float = math.nan
    inter_node_bytes: float = math.nan
    total_bytes: float = math.nan
    outcome: Outcome = Outcome.BALANCED

    @property
    def num_items(self) -> int:
        return int(self.bin_of_item.size)

    @property
    def max_cost(self) -> float:
        return float(self.bin_costs.max())

    @property
    def max_over_lb(self) -> float:
        return _ratio(self.max_cost, self.lower_bound)

    @property
    def max_over_mean(self) -> float:
        return _ratio(self.max_cost, float(self.bin_costs.sum()) / self.num_bins)

    @property
    def inter_node_bytes_frac(self) -> float:
        return _ratio(self.inter_node_bytes, self.total_bytes, empty=0.0)

    def counts(self) -> np.ndarray:
        """Number of items in each bin."""
        return np.bincount(self.bin_of_item, minlength=self.num_bins)


def _ratio(num: float, den: float, empty: float = 1.0) -> float:
    if math.isnan(num) or math.isnan(den):
        return math.nan
    return num / den if den > 0 else empty


class _Infeasible(ValueError):
    """A method cannot honour the memory cap on this instance."""


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------

def _check_values(values, name: str, n: Optional[int] = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if n is not None and arr.size != n:
        raise ValueError(f"{name} has {arr.size} entries but there are {n} items")
    if arr.size and not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise ValueError(f"{name} must be numbers, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} of item {i} is {arr[i]}; must be finite and >= 0")
    return arr


def _check_num_bins(num_bins) -> int:
    if isinstance(num_bins, (bool, np.bool_)) or not isinstance(num_bins, (int, np.integer)):
        raise ValueError(f"num_bins must be an int, got {num_bins!r}")
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    return int(num_bins)


def _check_memory(memory, memory_cap, n: int):
    """Per-item memory and the per-bin cap; no constraint is zero memory with an infinite cap."""
    if (memory is None) != (memory_cap is None):
        raise ValueError("memory and memory_cap must be given together")
    if memory is None:
        return np.zeros(n), math.inf, False
    memory = _check_values(memory, "memory", n)
    cap = float(memory_cap)
    if not cap > 0:
        raise ValueError(f"memory_cap must be > 0, got {memory_cap}")
    over = memory > cap
    if over.any():
        i = int(np.flatnonzero(over)[0])
        raise ValueError(f"item {i} needs memory {memory[i]}, more than the per-bin cap {cap}")
    return memory, cap, True


def _check_bins(bins, name: str, n: int, num_bins: int) -> np.ndarray:
    arr = np.asarray(bins)
    if arr.ndim != 1 or arr.size != n:
        raise ValueError(f"{name} must be a 1-D array with one bin per item ({n}), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer bin ids, got dtype {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.int64)
    bad = (arr < 0) | (arr >= num_bins)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"{name} puts item {i} in bin {arr[i]}, outside 0..{num_bins - 1}")
    return arr


def _check_gpus_per_node(gpus_per_node) -> int:
    if isinstance(gpus_per_node, (bool, np.bool_)) or not isinstance(gpus_per_node, (int, np.integer)) \
            or gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be an int >= 1, got {gpus_per_node!r}")
    return int(gpus_per_node)


# ----------------------------------------------------------------------------------------------
# Shared pieces
# ----------------------------------------------------------------------------------------------

def _decreasing(costs: np.ndarray) -> np.ndarray:
    """Item ids by decreasing cost, ties by increasing id (checked costs are finite and >= 0:
    :func:`_kernels.decreasing`, a radix sort of their bits)."""
    return _kernels.decreasing(costs)


def _lower_bound(costs: np.ndarray, num_bins: int) -> float:
    return max(float(costs.sum()) / num_bins, float(costs.max())) if costs.size else 0.0


def _max_cost(costs: np.ndarray, bins: np.ndarray, num_bins: int) -> float:
    return float(np.bincount(bins, weights=costs, minlength=num_bins).max())


def _fits_memory(bins: np.ndarray, memory: np.ndarray, cap: float, num_bins: int) -> bool:
    return cap == math.inf or bool(np.bincount(bins, weights=memory, minlength=num_bins).max() <= cap)


def _refine(costs, memory, cap, order, num_bins, bins, *, allow_moves: bool, stop_at: float,
            node_size: int = 0, cross_swap_caps=(math.inf,), settle_at_stop: bool = False) -> None:
    """The local search (:func:`_kernels.refine_caps`) with each of ``cross_swap_caps`` in turn."""
    _kernels.refine_caps(costs, memory, cap, num_bins, bins, allow_moves, stop_at, _REFINE_PARTNERS, node_size,
                         costs.size + num_bins, order, _CHEAPEST_SCAN, np.array(cross_swap_caps, dtype=np.float64),
                         settle_at_stop)


def _locality_swap_caps(mean: float):
    """The locality refinements' costliest swap across nodes, in turn (:data:`_LOCALITY_SWAP_CAPS` x the mean)."""
    return [swap_cap * mean if swap_cap < math.inf else math.inf for swap_cap in _LOCALITY_SWAP_CAPS]


def _nodes(num_bins: int, gpus_per_node: Optional[int]) -> Optional[np.ndarray]:
    """Node of every bin when bins are ranks numbered node by node (None: no nodes given)."""
    return None if gpus_per_node is None else np.arange(num_bins) // gpus_per_node


def _result(bins, num_bins, costs, memory, has_memory, lower_bound, home, method, item_bytes,
            node_of_bin, outcome: Outcome = Outcome.BALANCED) -> Partition:
    """The partition's figures; ``node_of_bin`` (bins are ranks on these nodes) gives the byte figures
    their inter-node part."""
    baseline = _max_cost(costs, home, num_bins) if home is not None else math.nan
    moved = inter = total = math.nan
    if item_bytes is not None:
        total = float(item_bytes.sum())
        if home is not None:
            figures = exchanged_bytes(home, bins, item_bytes, np.arange(num_bins) if node_of_bin is None else node_of_bin,
                                      connections=False)  # (bytes only: a partition has no rank pairs to report)
            moved = figures.off_gpu
            inter = math.nan if node_of_bin is None else figures.inter_node
    return Partition(
        bin_of_item=bins,
        num_bins=num_bins,
        bin_costs=np.bincount(bins, weights=costs, minlength=num_bins),
        lower_bound=lower_bound,
        baseline_max_cost=baseline,
        method=method,
        bin_memory=np.bincount(bins, weights=memory, minlength=num_bins) if has_memory else None,
        moved_bytes=moved,
        inter_node_bytes=inter,
        total_bytes=total,
        outcome=outcome,
    )


def _fallback(name: str, reference: Partition, home, item_bytes, gpus_per_node: int, placed: bool):
    """(bin_of_item, method, outcome) of a locality partitioner ``name`` that missed its capacity: the
    ``reference``'s bins, each on the rank the exact placement gives it (fewest bytes across nodes, then off
    their GPU, items moving from ``home``) if ``placed``; else as they are, for a caller that places them
    itself (the step planner places the plain plan whatever the locality plan gives)."""
    bins = reference.bin_of_item
    if not placed:
        return bins.copy(), f"{name}_fallback:{reference.method}", Outcome.FALLBACK
    rank_of_bin = place_items(bins, home, np.rint(item_bytes).astype(np.int64),
                              Topology.uniform(reference.num_bins, gpus_per_node),
                              PlacementConfig(method="exact", deterministic=True))
    return rank_of_bin[bins], f"{name}_fallback:{reference.method}+exact", Outcome.FALLBACK


# ----------------------------------------------------------------------------------------------
# The three constructive methods, registered in this order (_kernels.CONSTRUCTIONS; ``auto`` tries them in the
# order _kernels.TRIED). Each takes a registered partitioner's arguments (megatron_orch.balance.registry)
# and, from this module, the items by decreasing cost (``order``); returns bin_of_item or raises _Infeasible.
# ----------------------------------------------------------------------------------------------

@PARTITIONERS.register("lpt", _builtin=True)
def _lpt(costs, num_bins, memory, cap, *, order=None):
    """Longest processing time first: each item, largest first, to the least-loaded bin with memory room."""
    order = _decreasing(costs) if order is None else order
    bins = np.empty(costs.size, dtype=np.int64)
    item = _kernels.lpt(costs, memory, cap, order, num_bins, bins)
    if item >= 0:
        raise _Infeasible(_refusal("lpt", item, memory, cap))
    return bins


@PARTITIONERS.register("kk", _builtin=True)
def _kk(costs, num_bins, memory, cap, *, order=None):
    """Karmarkar-Karp largest differencing, K-way (ignores memory: refused where it exceeds the cap)."""
    order = _decreasing(costs) if order is None else order
    bins = np.zeros(costs.size, dtype=np.int64)
    _kernels.kk(costs, order, 1, num_bins, bins)
    if not _fits_memory(bins, memory, cap, num_bins):
        raise _Infeasible(_refusal("kk", 0, memory, cap))
    return bins


@PARTITIONERS.register("bs_ffd", _builtin=True)
def _bs_ffd(costs, num_bins, memory, cap, *, order=None):
    """Binary search on the bin capacity, first-fit decreasing at each capacity.

    The smallest capacity (to a relative tolerance) at which first-fit decreasing places every item
    (:func:`_kernels.bs_ffd`)."""
    order = _decreasing(costs) if order is None else order
    bins = np.zeros(costs.size, dtype=np.int64)
    status = _kernels.bs_ffd(costs, memory, cap, order, num_bins, math.inf, _BS_FFD_REL_TOL, _BS_FFD_MAX_ROUNDS,
                             bins)
    if status >= 0:
        raise _Infeasible(_refusal("bs_ffd", status, memory, cap))
    return bins


def _refusal(method: str, item: int, memory, cap: float) -> str:
    """Why a built-in construction cannot honour the memory cap (``item``: the one lpt or bs_ffd found no
    room for)."""
    if method == "kk":
        return (f"kk ignores memory and its result exceeds the cap {cap} on this instance; "
                "use method='lpt', 'bs_ffd' or 'auto'")
    if method == "lpt":
        return (f"lpt: no bin has memory room for item {item} (memory {memory[item]}, "
                f"cap {cap}); try method='bs_ffd' or a larger cap")
    return (f"bs_ffd: first-fit decreasing finds no bin with memory room for item "
            f"{item} (memory {memory[item]}, cap {cap})")


def _read_only(values: np.ndarray) -> np.ndarray:
    view = values.view()
    view.flags.writeable = False
    return view


def _construct(entry: Entry, costs, memory, cap, order, num_bins):
    """bin_of_item of partitioner ``entry``: a built-in one is given the decreasing ``order``; a
    registered one's result is checked (one bin per item, within the memory cap) and refusals name it."""
    if entry.builtin:
        return entry.function(costs, num_bins, memory, cap, order=order)
    try:
        bins = entry.function(_read_only(costs), num_bins, _read_only(memory), cap)
    except ValueError as err:
        raise _Infeasible(f"partitioner {entry.name!r}: {err}") from None
    bins = _check_bins(bins, f"partitioner {entry.name!r}'s result", costs.size, num_bins)
    if not _fits_memory(bins, memory, cap, num_bins):
        raise _Infeasible(f"partitioner {entry.name!r}: its result exceeds the memory cap {cap}")
    return bins


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------

def _auto(costs, memory, cap, order, num_bins, refine: bool):
    """First-fit at the bound where long items set it, else each built-in construction's result (refined), the
    best kept, until one is within :data:`_AUTO_SETTLED` of the bound (:func:`_kernels.auto`, compiled):
    (bin_of_item, name, max cost)."""
    bins = np.zeros(costs.size, dtype=np.int64)
    refused = np.empty(len(_kernels.CONSTRUCTIONS), dtype=np.int64)
    winner = _kernels.auto(costs, memory, cap, order, num_bins, refine, _GOOD_ENOUGH, _AUTO_SETTLED, _BS_FFD_REL_TOL,
                           _BS_FFD_MAX_ROUNDS, _SWAP_SWEEPS, _REFINE_PARTNERS, _CHEAPEST_SCAN, bins, refused)
    if winner < 0:
        raise ValueError("no method honours the memory cap: " + "; ".join(
            _refusal(_kernels.CONSTRUCTIONS[c], int(refused[c]), memory, cap)
            for c in _kernels.TRIED if refused[c] >= 0))
    return bins, f"auto:{_kernels.CONSTRUCTIONS[winner]}" + ("+refine" if refine else ""), _max_cost(costs, bins, num_bins)


def _home_if_not_worse(bins, name, cost, costs, memory, cap, num_bins, home):
    """``home`` instead of ``bins`` (max cost ``cost``) unless ``bins`` is strictly better; home
    must fit the memory cap. Returns (bin_of_item, method name, max cost, outcome)."""
    if home is not None and _fits_memory(home, memory, cap, num_bins):
        home_cost = _max_cost(costs, home, num_bins)
        if cost >= home_cost:
            return home.copy(), "home", home_cost, Outcome.HOME
    return bins, name, cost, Outcome.BALANCED


def partition(costs, num_bins, *, method: str = "auto", memory=None, memory_cap=None, home=None,
              refine: Optional[bool] = None, item_bytes=None, gpus_per_node=None) -> Partition:
    """Assign every item to one of ``num_bins`` bins, minimising the maximum bin cost.

    ``method``: ``"lpt"``, ``"kk"``, ``"bs_ffd"``, a registered partitioner's name
    (:mod:`megatron_orch.balance.registry`) or ``"auto"``: where long items set the lower bound above the
    mean, first-fit decreasing at it (or within 0.01% of it), kept if it places every item; else each of the
    three that honours the memory cap, refined, lpt, then bs_ffd, then kk, until one is within 0.2% of the
    lower bound, the best kept (ties: the earlier tried). ``refine`` (default: only for
    ``auto``) lowers the maximum by swap sweeps (without a memory cap: many bins at once,
    :func:`_kernels.swap_sweeps`), then by local search out of the fullest bin. Both stop once a
    result is within 0.01% of a lower bound (one tight for equal items): nothing is left to gain.

    ``memory``/``memory_cap``: per-item memory and the per-bin cap every result honours (a method
    that cannot raises ValueError). ``home``: the upstream assignment; the result is never worse:
    if it would not be strictly better, ``home`` is returned (method ``"home"``), provided ``home``
    itself honours the memory cap. ``item_bytes`` (with ``home``) and ``gpus_per_node`` fill the
    moved-byte figures, reading bin b as rank b.
    """
    costs = _check_values(costs, "costs")
    n = costs.size
    num_bins = _check_num_bins(num_bins)
    memory, cap, has_memory = _check_memory(memory, memory_cap, n)
    home = None if home is None else _check_bins(home, "home", n, num_bins)
    item_bytes = None if item_bytes is None else _check_values(item_bytes, "item_bytes", n)
    gpus_per_node = None if gpus_per_node is None else _check_gpus_per_node(gpus_per_node)
    entry = None if method == "auto" else PARTITIONERS.get(method)
    refine = (method == "auto" if refine is None else refine) and n > 0
    order = _decreasing(costs)
    if method == "auto":
        bins, name, cost = _auto(costs, memory, cap, order, num_bins, refine)
    else:
        try:
            bins = _construct(entry, costs, memory, cap, order, num_bins)
        except _Infeasible as err:
            raise ValueError(str(err)) from None
        name = method
        if refine:
            stop_at = (1.0 + _GOOD_ENOUGH) * _kernels.pigeonhole_bound(costs, order, num_bins)
            if cap == math.inf:
                _kernels.swap_sweeps(costs, order, num_bins, bins, stop_at, _SWAP_SWEEPS, num_bins)
            _refine(costs, memory, cap, order, num_bins, bins, allow_moves=True, stop_at=stop_at)
            name += "+refine"
        cost = _max_cost(costs, bins, num_bins)
    bins, name, _, outcome = _home_if_not_worse(bins, name, cost, costs, memory, cap, num_bins, home)
    return _result(bins, num_bins, costs, memory, has_memory, _lower_bound(costs, num_bins), home,
                   name, item_bytes, _nodes(num_bins, gpus_per_node), outcome)


def partition_groups(costs, group, num_bins, *, method: str = "auto") -> np.ndarray:
    """Bin of every item when each group of items is partitioned into ``num_bins`` bins on its own:
    for every g, ``out[group == g]`` equals ``partition(costs[group == g], num_bins,
    method=method).bin_of_item``, computed for all groups in one compiled call that releases the GIL
    (:func:`_kernels.partition_groups`): the packed micro-batches of every rank at once. A registered
    partitioner (not compiled) is called group after group.
    """
    costs = _check_values(costs, "costs")
    group = np.asarray(group)
    if group.shape != costs.shape or (group.size and not np.issubdtype(group.dtype, np.integer)):
        raise ValueError(f"group must hold one integer group id per item ({costs.size}), "
                         f"got {group.dtype} {group.shape}")
    group = np.ascontiguousarray(group, dtype=np.int64)
    if group.size and group.min() < 0:
        raise ValueError(f"group of item {int(np.argmin(group))} is {group.min()}; must be >= 0")
    num_bins = _check_num_bins(num_bins)
    bins = np.zeros(costs.size, dtype=np.int64)
    if method not in _kernels.METHOD_CODES:
        PARTITIONERS.get(method)  # (ValueError naming the choices)
        by_group = np.argsort(group, kind="stable")
        starts = np.flatnonzero(np.diff(group[by_group], prepend=-1))
        for items in np.split(by_group, starts[1:]) if by_group.size else ():
            bins[items] = partition(costs[items], num_bins, method=method).bin_of_item
        return bins
    _kernels.partition_groups(costs, group, int(group.max(initial=-1)) + 1, num_bins,
                              _kernels.METHOD_CODES.index(method), _GOOD_ENOUGH, _AUTO_SETTLED, _BS_FFD_REL_TOL,
                              _BS_FFD_MAX_ROUNDS, _SWAP_SWEEPS, _REFINE_PARTNERS, _CHEAPEST_SCAN, bins)
    return bins


def equal_count_lower_bound(costs, num_bins: int) -> float:
    """Lower bound on the max bin cost when every bin holds exactly m = n/K items.

    The max of the mean and, for every j <= K, the smaller of (a) and (b), where x_1 >= x_2 >= ... are
    the costs: (a) if the j largest items lie in j different bins, those bins hold them and j(m - 1)
    others, at least the j(m - 1) smallest: one of them costs (x_1 + ... + x_j + those) / j or more;
    (b) else two of them share a bin with m - 2 others: x_{j-1} + x_j + the m - 2 smallest. For j = K + 1
    only (b) can happen (two of the K + 1 largest share a bin). j = 1 is the largest item plus the
    m - 1 smallest; larger j see several long items competing for the same short ones.
    """
    costs = np.sort(_check_values(costs, "costs"))
    num_bins = _check_num_bins(num_bins)
    n = costs.size
    if n == 0:
        return 0.0
    per_bin = n // num_bins
    smallest = np.concatenate(([0.0], np.cumsum(costs)))  # smallest[k]: the k smallest
    largest = costs[::-1]
    bound = max(smallest[-1] / num_bins, largest[0] + smallest[per_bin - 1])
    if per_bin >= 2:
        j = np.arange(2, num_bins + 1)
        distinct = (np.cumsum(largest[:num_bins])[1:] + smallest[j * (per_bin - 1)]) / j
        shared = largest[j - 2] + largest[j - 1] + smallest[per_bin - 2]
        bound = max(bound, float(np.minimum(distinct, shared).max(initial=0.0)),
                    largest[num_bins - 1] + largest[num_bins] + smallest[per_bin - 2])
    return float(bound)


def _equal_count_start(method, costs, order, num_bins, per_bin, lower_bound):
    """(max cost, name, bin_of_item) of one equal-count construction: ``kk``, ``slot`` or ``lpt``."""
    n = costs.size
    bins = np.zeros(n, dtype=np.int64)
    if method == "kk":
        _kernels.kk(costs, order, num_bins, num_bins, bins)
    elif method == "slot" and n:  # (no slots to divide by when there are no items)
        _kernels.slot_lpt(costs, order, num_bins, per_bin, lower_bound, bins)
    elif method == "lpt":
        _kernels.lpt(costs, np.ones(n), float(per_bin), order, num_bins, bins)  # a count cap never fails
    return _max_cost(costs, bins, num_bins), f"equal:{method}", bins


def partition_equal_count(costs, num_bins, *, home=None, refine: bool = True, item_bytes=None,
                          gpus_per_node=None) -> Partition:
    """Like :func:`partition`, but every bin gets exactly n/K items (n % K != 0 is an error).

    Constructions: equal-cardinality Karmarkar-Karp (the sorted items form n/K runs of K; largest
    differencing merges whole runs, so every bin receives one item of each run); the greedy by room
    per free slot (:func:`_kernels.slot_lpt`, aimed at :func:`equal_count_lower_bound`), which on a
    heavy tail gives a bin with a long item the short ones (where LPT under a count cap gives it
    mid-sized ones: up to 8% above the bound on the heavy-tailed mixtures); LPT under a count cap of
    n/K. The better of the first two (KK alone when it is within 1% of the bound: no tail to fix, and
    the slot greedy is not built unless needed) is refined (``refine``) by swaps, which keep counts:
    sweeps of swaps between the k-th most- and least-loaded bins first (many bins at once), then the
    local search on the most-loaded bin (:func:`_kernels.refine`: one-for-one and two-for-two swaps
    with partners, then trades with the batch's cheapest items). If that is not within 0.01% of the
    bound, the other start is refined, then LPT's, and the best kept (a fixed amount of work: the same
    plan on every rank). Without ``refine``, the better of the first two. ``home`` (itself
    equal-count) is returned when the result would not be strictly better.
    """
    costs = _check_values(costs, "costs")
    n = costs.size
    num_bins = _check_num_bins(num_bins)
    if n % num_bins:
        raise ValueError(f"equal-count partition needs the number of items ({n}) to be a multiple "
                         f"of num_bins ({num_bins})")
    per_bin = n // num_bins
    item_bytes = None if item_bytes is None else _check_values(item_bytes, "item_bytes", n)
    gpus_per_node = None if gpus_per_node is None else _check_gpus_per_node(gpus_per_node)
    if home is not None:
        home = _check_bins(home, "home", n, num_bins)
        counts = np.bincount(home, minlength=num_bins)
        if (counts != per_bin).any():
            b = int(np.flatnonzero(counts != per_bin)[0])
            raise ValueError(f"home is not equal-count: bin {b} holds {counts[b]} items, expected {per_bin}")
    order = _decreasing(costs)
    lower_bound = equal_count_lower_bound(costs, num_bins)
    good_enough = (1.0 + _GOOD_ENOUGH) * lower_bound
    memory = np.zeros(n)
    starts = [_equal_count_start("kk", costs, order, num_bins, per_bin, lower_bound)]
    if not (refine and starts[0][0] <= (1.0 + _KK_TRUSTED) * lower_bound):
        starts.append(_equal_count_start("slot", costs, order, num_bins, per_bin, lower_bound))
        starts.sort(key=lambda start: start[0])
    bins, name, cost = None, "", math.inf
    for attempt in range(3):  # the better start refined; if that is not good enough, the other, then LPT
        if bins is not None and (not refine or not n or cost <= good_enough):
            break
        if attempt == len(starts):
            starts.append(_equal_count_start("slot" if attempt == 1 else "lpt", costs, order, num_bins, per_bin,
                                             lower_bound))
        trial_cost, trial_name, trial = starts[attempt]
        if refine and n:
            _kernels.swap_sweeps(costs, order, num_bins, trial, good_enough, _SWAP_SWEEPS, num_bins)
            _refine(costs, memory, math.inf, order, num_bins, trial, allow_moves=False, stop_at=good_enough)
            trial_cost, trial_name = _max_cost(costs, trial, num_bins), trial_name + "+refine"
        if trial_cost < cost:
            bins, name, cost = trial, trial_name, trial_cost
    outcome = Outcome.BALANCED
    if home is not None and _max_cost(costs, bins, num_bins) >= _max_cost(costs, home, num_bins):
        bins, name, outcome = home.copy(), "home", Outcome.HOME
    return _result(bins, num_bins, costs, memory, False, lower_bound, home, name, item_bytes,
                   _nodes(num_bins, gpus_per_node), outcome)


def partition_equal_count_locality(costs, home, num_bins, gpus_per_node, *, item_bytes, tolerance: float = 0.0,
                                   reference: Optional[Partition] = None, place_fallback: bool = True) -> Partition:
    """Like :func:`partition_equal_count` (at most ``tolerance`` above its max: by default as well), moving few
    items across nodes.

    Bins are ranks, rank r on node r // gpus_per_node, and ``home`` is equal-count. Balance moves
    work between nodes first and then inside them, so that only what a node has too much of leaves
    it: (1) the nodes, as bins of their ranks' items, are evened out by one-for-one swaps from their
    home contents (:func:`_kernels.swap_sweeps`, then :func:`_kernels.refine`) down to the reference
    plan's max per rank; (2) an item that stayed on its node keeps its home rank, one that arrived
    takes a slot an item left on that node; (3) the ranks of each node are evened out the same way,
    and any rank still above the capacity trades with its node first, then anywhere (swapping only small
    items across nodes as long as that suffices). Counts stay equal throughout; the refinement's trades with the
    batch's cheapest items (after its node's bins) give a rank with a long item the short ones it needs.
    If the capacity ((1 + ``tolerance``) x the max of ``reference``, default ``partition_equal_count(costs,
    num_bins, home=home)``) is not met, the reference bins go to the ranks the exact placement gives them
    (the fewest ``item_bytes`` across nodes, then off their GPU; method
    ``equal_locality_fallback:...+exact``), or stay as they are with ``place_fallback`` False (method
    ``equal_locality_fallback:...``, no byte figures: for a caller that places the reference itself); a home
    assignment within it is returned unchanged (``"home"``).
    """
    costs = _check_values(costs, "costs")
    n = costs.size
    num_bins = _check_num_bins(num_bins)
    gpus_per_node = _check_gpus_per_node(gpus_per_node)
    if num_bins % gpus_per_node:
        raise ValueError(f"num_bins ({num_bins}) must be a multiple of gpus_per_node ({gpus_per_node})")
    home = _check_bins(home, "home", n, num_bins)
    item_bytes = _check_values(item_bytes, "item_bytes", n)
    tolerance = float(tolerance)
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if reference is None:
        reference = partition_equal_count(costs, num_bins, home=home)  # checks that home is equal-count
    elif (np.bincount(home, minlength=num_bins) != n // num_bins).any() or n % num_bins:
        raise ValueError("equal-count locality needs an equal-count home (the same number of items on every rank)")
    capacity = (1.0 + tolerance) * reference.max_cost
    lower_bound = reference.lower_bound
    outcome = Outcome.BALANCED
    if reference.outcome is Outcome.HOME or _max_cost(costs, home, num_bins) <= capacity:
        bins, name, outcome = home.copy(), "home", Outcome.HOME
    else:
        order = _decreasing(costs)
        num_nodes = num_bins // gpus_per_node
        home_node = home // gpus_per_node
        node = home_node.copy()
        node_target = gpus_per_node * reference.max_cost
        _kernels.swap_sweeps(costs, order, num_nodes, node, node_target, _SWAP_SWEEPS, num_nodes)
        no_memory = np.zeros(n)
        _refine(costs, no_memory, math.inf, order, num_nodes, node, allow_moves=False, stop_at=node_target)
        bins = home.copy()
        arrived = np.flatnonzero(node != home_node)
        # those that left, by home rank, take the new arrivals, by node then id: node by node, counts match
        bins[arrived[np.argsort(node[arrived], kind="stable")]] = np.sort(home[arrived])
        _kernels.swap_sweeps(costs, order, num_bins, bins, capacity, _SWAP_SWEEPS, gpus_per_node)
        mean = float(costs.sum()) / num_bins
        # across nodes, swaps of small items first (as partition_locality)
        _refine(costs, no_memory, math.inf, order, num_bins, bins, allow_moves=False, stop_at=capacity,
                node_size=gpus_per_node, cross_swap_caps=_locality_swap_caps(mean))
        name = "equal_locality"
        if _max_cost(costs, bins, num_bins) > capacity:
            bins, name, outcome = _fallback("equal_locality", reference, home, item_bytes, gpus_per_node, place_fallback)
    return _result(bins, num_bins, costs, None, False, lower_bound, home, name,
                   None if outcome is Outcome.FALLBACK and not place_fallback else item_bytes,
                   _nodes(num_bins, gpus_per_node), outcome)


def partition_uniform(costs, home, node_of_bin, *, item_bytes) -> Partition:
    """The exact plan for items of equal cost and equal bytes (every encoder phase of the model:
    image tiles, video frames and audio windows each run one fixed shape).

    Bins are ranks, ``node_of_bin[b]`` the node of rank b. Balance is then a matter of counts: the
    max is optimal iff no bin holds more than ceil(n/K) items. Every bin keeps its own items up to
    that cap (the first ones by id); the rest fill free room on their own node first, then anywhere
    (:func:`_kernels.fill_quotas`). That moves the fewest items off their GPU (the items above the
    cap) and, at the same time, the fewest across nodes (a node's items above its bins' caps).
    ``home`` is returned unchanged (method ``"home"``) if no bin is above the cap.
    """
    costs = _check_values(costs, "costs")
    n = costs.size
    node_of_bin = np.ascontiguousarray(node_of_bin, dtype=np.int64)
    num_bins = _check_num_bins(node_of_bin.size)
    home = _check_bins(home, "home", n, num_bins)
    item_bytes = _check_values(item_bytes, "item_bytes", n)
    if n and (costs.min() != costs.max() or item_bytes.min() != item_bytes.max()):
        raise ValueError("partition_uniform needs items of equal cost and equal bytes "
                         f"(costs {costs.min()}..{costs.max()}, bytes {item_bytes.min()}..{item_bytes.max()})")
    if node_of_bin.min() < 0:
        raise ValueError(f"node_of_bin holds a negative node id {node_of_bin.min()}")
    bins, name = uniform_bins(home, node_of_bin)
    return _result(bins, num_bins, costs, None, False, _lower_bound(costs, num_bins), home, name, item_bytes,
                   node_of_bin, Outcome.HOME if bins is home else Outcome.BALANCED)


def uniform_bins(home: np.ndarray, node_of_bin: np.ndarray):
    """(bin_of_item, method) of :func:`partition_uniform` for valid int64 ``home`` and ``node_of_bin`` (the
    trainer's path: its inputs are checked where they are built, and it needs no figures); ``home`` itself
    where every bin holds at most its share already."""
    n, num_bins = home.size, node_of_bin.size
    cap = -(-n // num_bins)
    if n == 0 or _plan_kernels.counts(home, num_bins).max() <= cap:  # (a compiled count: items come in runs of a rank)
        return home, "home"
    num_nodes = int(node_of_bin.max()) + 1
    bins_by_node = np.argsort(node_of_bin, kind="stable")
    node_start = np.searchsorted(node_of_bin[bins_by_node], np.arange(num_nodes + 1))
    bins = np.empty(n, dtype=np.int64)
    _kernels.fill_quotas(home, np.full(num_bins, cap, dtype=np.int64), node_of_bin, bins_by_node, node_start, bins)
    return bins, "uniform"


def partition_locality(costs, home, num_bins, gpus_per_node, *, item_bytes, memory=None, memory_cap=None,
                       tolerance: float = 0.0, reference: Optional[Partition] = None,
                       place_fallback: bool = True) -> Partition:
    """Balance like ``partition(method='auto')`` (at most ``tolerance`` above its max: by default as well)
    while moving few bytes.

    Bins are ranks here: rank r lives on node r // gpus_per_node and item i starts on ``home[i]``.
    The capacity is (1 + tolerance) x the max cost of ``reference`` (default: ``partition(costs, num_bins,
    home=home, memory=..., memory_cap=...)``, the plain plan). Items go, largest first, to their home
    rank while it stays within the mean load, else to the least-loaded rank of their node if that does,
    else to the least-loaded rank anywhere (:func:`_kernels.lpt_near_home`: a rank keeps its largest
    items, what leaves goes to its node first, and the smallest items, last, even the ranks out as LPT
    does); then refinement takes the most-loaded ranks down to the capacity (each in one exchange where
    one does: ``settle_at_stop``), with the ranks of their own node first (other nodes first for a rank
    whose node holds more than its share), swapping only small items across nodes as long as that suffices (a swap of two long
    items is many bytes on two ranks' links). So bytes cross nodes mostly where a node has too much
    work, and leave their GPU only where a rank has. If the capacity cannot be met, the reference's bins
    go to the ranks the exact placement gives them (method ``locality_fallback:...+exact``), or stay as they are
    with ``place_fallback`` False (method ``locality_fallback:...``, no byte figures: for a caller that places the
    reference itself); a home assignment already within the capacity is returned unchanged (method ``"home"``).
    """
    costs = _check_values(costs, "costs")
    n = costs.size
    num_bins = _check_num_bins(num_bins)
    gpus_per_node = _check_gpus_per_node(gpus_per_node)
    home = _check_bins(home, "home", n, num_bins)
    item_bytes = _check_values(item_bytes, "item_bytes", n)
    tolerance = float(tolerance)
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    memory, cap, has_memory = _check_memory(memory, memory_cap, n)

    order = _decreasing(costs)
    if reference is None:
        bins, name, cost, outcome = _home_if_not_worse(*_auto(costs, memory, cap, order, num_bins, refine=n > 0),
                                                       costs, memory, cap, num_bins, home)
        reference = Partition(bins, num_bins, np.bincount(bins, weights=costs, minlength=num_bins), 0.0, math.nan,
                              name, outcome=outcome)
    capacity = (1.0 + tolerance) * reference.max_cost
    outcome = Outcome.BALANCED
    if reference.outcome is Outcome.HOME or (_fits_memory(home, memory, cap, num_bins)
                                             and _max_cost(costs, home, num_bins) <= capacity):
        bins, name, outcome = home.copy(), "home", Outcome.HOME
    else:
        bins = np.empty(n, dtype=np.int64)
        mean = float(costs.sum()) / num_bins
        failed = _kernels.lpt_near_home(costs, memory, cap, home, order, num_bins, gpus_per_node, mean, bins)
        name = "locality"
        # across nodes, swaps of small items only at first (two long items swapped to even out two ranks are
        # many bytes on two links), then of any
        if failed < 0 and _max_cost(costs, bins, num_bins) > capacity:
            _refine(costs, memory, cap, order, num_bins, bins, allow_moves=True, stop_at=capacity,
                    node_size=gpus_per_node, cross_swap_caps=_locality_swap_caps(mean), settle_at_stop=True)
            name = "locality+refine"
        if failed >= 0 or _max_cost(costs, bins, num_bins) > capacity:
            bins, name, outcome = _fallback("locality", reference, home, item_bytes, gpus_per_node, place_fallback)
    return _result(bins, num_bins, costs, memory, has_memory, _lower_bound(costs, num_bins), home, name,
                   None if outcome is Outcome.FALLBACK and not place_fallback else item_bytes,
                   _nodes(num_bins, gpus_per_node), outcome)
