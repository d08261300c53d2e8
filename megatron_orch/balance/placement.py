"""Topology-aware placement: which rank gets which balanced bin.

Balanced bins are interchangeable (any rank can compute any bin), so after partitioning we choose the
bin -> rank map that moves the fewest bytes over slow links. A bin placed on rank r pulls its items'
bytes from their home ranks: bytes from another node cross the inter-node network, bytes from another
GPU of the same node cross NVLink, bytes already on r stay put.

Methods (one bin per rank), registered in :data:`megatron_orch.balance.registry.PLACEMENTS` (where a user's
placement method registers too):

- ``identity``: bin b on rank b.
- ``greedy``: largest same-node byte counts first, then largest same-GPU byte counts inside each
  node; never worse than identity (it returns identity when that is better).
- ``exact``: minimum total inter-node bytes. Bins -> nodes is a transportation problem (a min-cost
  flow: a bin links to the nodes it has bytes on, plus a hub standing for "any other node"), solved
  exactly by a compiled successive-shortest-path solver that releases the GIL
  (:mod:`megatron_orch.balance._transport`) and certifies its optimum by LP duality; then bins ->
  GPUs inside each node is, node by node, an assignment problem minimising bytes that leave a GPU
  given those nodes (Hungarian algorithm). :func:`exact_min_cost_flow` solves the same two problems
  with OR-Tools (min-cost flow, linear sum assignment): the tests' oracle, and the fallback should
  a solution ever fail its certificate.
- ``minmax``: minimum inter-node bytes of the busiest node (a node's load is the larger of what it
  receives from and sends to other nodes: links are full duplex), then minimum total inter-node bytes
  at that maximum. A CP-SAT model warm-started from the best of exact, greedy and identity; large
  instances consider only each bin's ``candidate_nodes`` best nodes plus its hint and home nodes.
  Within the time limit the result is never worse than that hint.

Without OR-Tools, ``minmax`` falls back to ``exact`` and says so in ``solver``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import numpy as np

try:
    from ortools.graph.python import linear_sum_assignment, min_cost_flow
    from ortools.sat.python import cp_model
except ImportError:  # OR-Tools is optional at run time: only the min-max placement (and the oracle) need it.
    cp_model = linear_sum_assignment = min_cost_flow = None

from megatron_orch.balance import _transport
from megatron_orch.balance.plan import as_index_array, moved_bytes
from megatron_orch.balance.registry import PLACEMENTS
from megatron_orch.balance.topology import Topology


@dataclass(frozen=True, eq=False)
class BinTraffic:
    """Bytes each bin pulls from each source rank: sparse ``(bin, rank, nbytes)`` triples, nbytes > 0.

    Entries are unique per (bin, rank) and sorted by ``bin * num_ranks + rank``.
    """

    bin: np.ndarray
    rank: np.ndarray
    nbytes: np.ndarray
    num_bins: int
    num_ranks: int

    @classmethod
    def from_items(cls, bin_of_item, home_rank, item_bytes, num_bins: int, num_ranks: int) -> "BinTraffic":
        """Traffic of moving item i from ``home_rank[i]`` to the rank of bin ``bin_of_item[i]``."""
        bins, ranks, nbytes = _checked_items(bin_of_item, home_rank, item_bytes, num_bins, num_ranks)
        row_start, rank, total = _transport.merge_pairs(bins, ranks, nbytes, int(num_bins), int(num_ranks))
        return cls(bin=np.repeat(np.arange(int(num_bins), dtype=np.int64), np.diff(row_start)), rank=rank,
                   nbytes=total, num_bins=int(num_bins), num_ranks=int(num_ranks))

    @classmethod
    def from_matrix(cls, matrix) -> "BinTraffic":
        """From a dense ``[bin, source rank]`` byte matrix."""
        matrix = np.asarray(matrix)
        if matrix.ndim != 2:
            raise ValueError(f"traffic matrix must be 2-D [bin, rank], got shape {matrix.shape}")
        if matrix.size and (not np.issubdtype(matrix.dtype, np.integer) or matrix.min() < 0):
            raise ValueError("traffic matrix must hold non-negative integers")
        keys = np.flatnonzero(matrix)
        return cls._from_keys(keys, matrix.reshape(-1)[keys].astype(np.int64), *matrix.shape)

    @classmethod
    def _from_keys(cls, keys, nbytes, num_bins, num_ranks) -> "BinTraffic":
        keep = nbytes > 0
        keys = keys[keep]
        return cls(bin=keys // num_ranks, rank=keys % num_ranks, nbytes=nbytes[keep],
                   num_bins=int(num_bins), num_ranks=int(num_ranks))

    def matrix(self) -> np.ndarray:
        """Dense ``[bin, source rank]`` bytes."""
        out = np.zeros((self.num_bins, self.num_ranks), dtype=np.int64)
        out[self.bin, self.rank] = self.nbytes
        return out

    def bin_totals(self) -> np.ndarray:
        return np.bincount(self.bin, weights=self.nbytes, minlength=self.num_bins).astype(np.int64)


@dataclass(frozen=True)
class PlacementConfig:
    """How to place bins.

    ``time_limit_s`` bounds the min-max solve, counted from the start of :func:`place_bins` (wall
    clock), so the result can differ between ranks and runs; with ``deterministic`` it is CP-SAT's
    deterministic time instead (one worker, no wall clock), and every rank computes the same result.
    """

    method: str = "exact"
    time_limit_s: float = 1.0
    deterministic: bool = False
    num_workers: int = 4
    candidate_nodes: int = 8
    max_full_model: int = 10_000

    def __post_init__(self):
        PLACEMENTS.get(self.method)  # (ValueError naming the choices)
        if self.time_limit_s < 0 or self.num_workers < 1 or self.candidate_nodes < 1:
            raise ValueError(f"invalid placement config {self}")


@dataclass(frozen=True, eq=False)
class BinPlacement:
    """Bin b runs on rank ``rank_of_bin[b]``; the bytes that moves, and who computed it how fast."""

    rank_of_bin: np.ndarray
    solver: str
    inter_node_bytes: int
    max_node_inter_bytes: int
    off_gpu_bytes: int
    solve_ms: float


@dataclass(frozen=True)
class PlacementCost:
    inter_node_bytes: int
    max_node_inter_bytes: int
    off_gpu_bytes: int


def placement_cost(traffic: BinTraffic, topology: Topology, rank_of_bin) -> PlacementCost:
    """Bytes crossing nodes, the busiest node's max(received, sent) across nodes, bytes leaving GPUs."""
    rank_of_bin = np.ascontiguousarray(rank_of_bin, dtype=np.int64)
    if rank_of_bin.shape != (traffic.num_bins,):
        raise ValueError(f"rank_of_bin has shape {rank_of_bin.shape}, expected ({traffic.num_bins},)")
    _check_range(rank_of_bin, topology.num_ranks, "rank_of_bin")
    moved = moved_bytes(traffic.rank, rank_of_bin[traffic.bin], traffic.nbytes, topology.node_of_rank)
    received = np.bincount(topology.node_of_rank, weights=moved.received_inter, minlength=topology.num_nodes)
    sent = np.bincount(topology.node_of_rank, weights=moved.sent_inter, minlength=topology.num_nodes)
    return PlacementCost(inter_node_bytes=int(moved.inter_node),
                         max_node_inter_bytes=int(max(received.max(), sent.max())), off_gpu_bytes=int(moved.off_gpu))


def place_bins(traffic: BinTraffic, topology: Topology,
               config: Optional[PlacementConfig] = None) -> BinPlacement:
    """Choose a rank for every bin (a permutation) by ``config.method`` (default: ``PlacementConfig()``); see the
    module docstring."""
    start = time.perf_counter()
    config = PlacementConfig() if config is None else config
    if traffic.num_bins != traffic.num_ranks or topology.num_ranks != traffic.num_ranks:
        raise ValueError(f"placement needs one bin per rank: {traffic.num_bins} bins, traffic over "
                         f"{traffic.num_ranks} ranks, topology of {topology.num_ranks} ranks")
    entry = PLACEMENTS.get(config.method)
    result = entry.function(traffic, topology, config)
    rank_of_bin, solver = result if isinstance(result, tuple) else (result, entry.name)
    if not entry.builtin:
        rank_of_bin = np.asarray(rank_of_bin)
        if rank_of_bin.shape != (traffic.num_bins,) or not np.issubdtype(rank_of_bin.dtype, np.integer) or \
                not np.array_equal(np.sort(rank_of_bin), np.arange(traffic.num_bins)):
            raise ValueError(f"placement method {entry.name!r} must give every bin its own rank (a permutation of "
                             f"0..{traffic.num_bins - 1}), got {rank_of_bin!r}")
    cost = placement_cost(traffic, topology, rank_of_bin)
    return BinPlacement(rank_of_bin=np.asarray(rank_of_bin, dtype=np.int64), solver=solver,
                        inter_node_bytes=cost.inter_node_bytes,
                        max_node_inter_bytes=cost.max_node_inter_bytes,
                        off_gpu_bytes=cost.off_gpu_bytes,
                        solve_ms=(time.perf_counter() - start) * 1e3)


def place_items(bin_of_item, home_rank, item_bytes, topology: Topology,
                config: Optional[PlacementConfig] = None) -> np.ndarray:
    """Rank of every bin for the traffic of items (item i moves ``item_bytes[i]`` from
    ``home_rank[i]`` to the rank of bin ``bin_of_item[i]``; one bin per rank): the rank_of_bin of
    ``place_bins(BinTraffic.from_items(...), topology, config)``, without merging the items per
    (bin, rank) first where the method does not need it (``identity``, ``exact``): the trainer's path.
    """
    config = PlacementConfig() if config is None else config
    num_ranks = topology.num_ranks
    bins, ranks, nbytes = _checked_items(bin_of_item, home_rank, item_bytes, num_ranks, num_ranks)
    if config.method == "identity":
        return np.arange(num_ranks, dtype=np.int64)
    if config.method != "exact":
        return place_bins(BinTraffic.from_items(bins, ranks, nbytes, num_ranks, num_ranks), topology, config).rank_of_bin
    items = (np.ascontiguousarray(bins), np.ascontiguousarray(ranks), np.ascontiguousarray(nbytes))
    rank_of_bin, _ = _exact(items, num_ranks, topology,
                            lambda: BinTraffic.from_items(bins, ranks, nbytes, num_ranks, num_ranks))
    return rank_of_bin


class _Problem:
    """Per-node views of the traffic shared by the solvers."""

    def __init__(self, traffic: BinTraffic, topology: Topology):
        self.traffic = traffic
        self.topology = topology
        self.num_bins = traffic.num_bins
        self.num_nodes = topology.num_nodes
        self.capacity = topology.ranks_per_node()
        self.bin_total = traffic.bin_totals()
        # Bytes each bin pulls from each node: sparse (bin, node, bytes), sorted by bin then node.
        keys, inverse = np.unique(traffic.bin * self.num_nodes + topology.node_of_rank[traffic.rank],
                                  return_inverse=True)
        self.pair_bin = keys // self.num_nodes
        self.pair_node = keys % self.num_nodes
        self.pair_bytes = np.bincount(inverse.reshape(-1), weights=traffic.nbytes,
                                      minlength=keys.size).astype(np.int64)
        self.node_sent = np.bincount(self.pair_node, weights=self.pair_bytes,
                                     minlength=self.num_nodes).astype(np.int64)
        self.assign_seconds = 0.0  # how long the in-node assignment took (time to keep for it)

    def node_cost(self, node_of_bin: np.ndarray):
        """(busiest node's inter-node bytes, total inter-node bytes) of a bins -> nodes map."""
        local = np.where(node_of_bin[self.pair_bin] == self.pair_node, self.pair_bytes, 0)
        kept_per_node = np.bincount(self.pair_node, weights=local, minlength=self.num_nodes)
        received = np.bincount(node_of_bin, weights=self.bin_total, minlength=self.num_nodes) - kept_per_node
        sent = self.node_sent - kept_per_node
        return int(max(received.max(), sent.max())), int(received.sum())

    def ranks_for_nodes(self, node_of_bin: np.ndarray) -> np.ndarray:
        """Assign bins to the GPUs of their nodes, minimising bytes that leave a GPU (exact)."""
        start = time.perf_counter()
        rank_of_bin = _ranks_for_nodes(self.traffic, self.topology, node_of_bin)
        self.assign_seconds = max(self.assign_seconds, time.perf_counter() - start)
        return rank_of_bin

    def greedy_ranks_for_nodes(self, node_of_bin: np.ndarray) -> np.ndarray:
        """Bins to GPUs of their nodes, largest same-GPU byte counts first."""
        left, right = self._same_node_pairs(node_of_bin)
        # Every bin has an arc to every GPU of its node, so the greedy matching is perfect.
        return _greedy_match(left, right, self._bytes_at(left, right),
                             np.ones(self.num_bins, dtype=np.int64), self.num_bins)

    def _same_node_pairs(self, node_of_bin):
        """Every (bin, rank) pair with the rank on the bin's node."""
        node_of_rank = self.topology.node_of_rank
        ranks_by_node = np.argsort(node_of_rank, kind="stable")
        first = np.concatenate(([0], np.cumsum(self.capacity)[:-1]))
        per_bin = self.capacity[node_of_bin]
        left = np.repeat(np.arange(self.num_bins), per_bin)
        within = np.arange(left.size) - np.repeat(np.cumsum(per_bin) - per_bin, per_bin)
        right = ranks_by_node[np.repeat(first[node_of_bin], per_bin) + within]
        return left, right

    def _bytes_at(self, bins, ranks):
        keys = self.traffic.bin * self.traffic.num_ranks + self.traffic.rank
        return _lookup(keys, self.traffic.nbytes, bins * self.traffic.num_ranks + ranks)


@PLACEMENTS.register("identity", _builtin=True)
def _identity(traffic: BinTraffic, topology: Topology, config: PlacementConfig):
    """Bin b on rank b."""
    return np.arange(traffic.num_bins), "identity"


@PLACEMENTS.register("greedy", _builtin=True)
def _greedy_placement(traffic: BinTraffic, topology: Topology, config: PlacementConfig):
    """Largest same-node, then same-GPU byte counts first; never worse than identity."""
    return _greedy(_Problem(traffic, topology))


@PLACEMENTS.register("exact", _builtin=True)
def _exact_placement(traffic: BinTraffic, topology: Topology, config: PlacementConfig):
    """Minimum total inter-node bytes (a certified transportation solve), then the fewest bytes off their GPU."""
    return _exact((traffic.bin, traffic.rank, traffic.nbytes), traffic.num_bins, topology, lambda: traffic)


@PLACEMENTS.register("minmax", _builtin=True)
def _minmax_placement(traffic: BinTraffic, topology: Topology, config: PlacementConfig):
    """Minimum inter-node bytes of the busiest node (CP-SAT, from exact's; without OR-Tools: exact)."""
    start = time.perf_counter()
    rank_of_bin, solver = _exact_placement(traffic, topology, config)
    if cp_model is None:
        return rank_of_bin, solver + " (OR-Tools not installed: no min-max)"
    return _minmax(_Problem(traffic, topology), rank_of_bin, solver, config, start)


def _identity_or(problem: _Problem, rank_of_bin, solver: str):
    """``rank_of_bin`` unless the identity moves fewer inter-node (then off-GPU) bytes."""
    identity = np.arange(problem.num_bins)
    ours = placement_cost(problem.traffic, problem.topology, rank_of_bin)
    base = placement_cost(problem.traffic, problem.topology, identity)
    if (base.inter_node_bytes, base.off_gpu_bytes) < (ours.inter_node_bytes, ours.off_gpu_bytes):
        return identity, "identity (better than " + solver + ")"
    return rank_of_bin, solver


def _greedy(problem: _Problem):
    node_of_bin = _greedy_match(problem.pair_bin, problem.pair_node, problem.pair_bytes,
                                problem.capacity, problem.num_bins)
    return _identity_or(problem, problem.greedy_ranks_for_nodes(node_of_bin), "greedy")


def _greedy_match(left, right, weight, capacity, num_left):
    """Match every left node to a right node, heaviest pairs first, within right capacities.

    Left nodes still unmatched after the pairs take the lowest right node with room.
    """
    capacity = np.array(capacity, dtype=np.int64)
    match = np.full(num_left, -1, dtype=np.int64)
    unmatched = num_left
    for j in np.argsort(-weight, kind="stable"):
        b, n = left[j], right[j]
        if match[b] < 0 and capacity[n] > 0:
            match[b] = n
            capacity[n] -= 1
            unmatched -= 1
            if not unmatched:
                return match
    for b in np.flatnonzero(match < 0):
        n = int(np.flatnonzero(capacity > 0)[0])
        match[b] = n
        capacity[n] -= 1
    return match


def _ranks_for_nodes(traffic: BinTraffic, topology: Topology, node_of_bin: np.ndarray) -> np.ndarray:
    """Bins to the GPUs of their nodes, most bytes kept on their GPU (exact, node by node)."""
    return _transport.assign_in_nodes(traffic.bin, traffic.rank, traffic.nbytes,
                                      np.ascontiguousarray(node_of_bin, dtype=np.int64),
                                      topology.node_of_rank, topology.num_nodes)


def _exact(items, num_bins: int, topology: Topology, traffic_fn):
    """Min total inter-node bytes (compiled transportation solver, certified), then exact in-node
    assignment, for ``items`` = (bin, source rank, bytes) int64 arrays (merged or not). Falls back to
    OR-Tools (or greedy) on ``traffic_fn()``, the merged traffic, only if the certificate fails."""
    bins, ranks, nbytes = items
    node_of_rank = topology.node_of_rank
    row_start, node, weight = _transport.merge_pairs(bins, node_of_rank[ranks], nbytes, num_bins, topology.num_nodes)
    capacity = topology.ranks_per_node().astype(np.int64)
    node_of_bin, potential = _transport.transport(row_start, node, weight, capacity)
    if _transport.dual_gap(row_start, node, weight, capacity, node_of_bin, potential) != 0:
        if min_cost_flow is None:
            rank_of_bin, solver = _greedy(_Problem(traffic_fn(), topology))
            return rank_of_bin, solver + " (transport solver not certified, OR-Tools not installed)"
        rank_of_bin, solver = exact_min_cost_flow(traffic_fn(), topology)
        return rank_of_bin, solver + " (transport solver not certified)"
    rank_of_bin = _transport.assign_in_nodes(bins, ranks, nbytes, node_of_bin, node_of_rank, topology.num_nodes)
    return rank_of_bin, "transport (certified optimal)"


def exact_min_cost_flow(traffic: BinTraffic, topology: Topology):
    """The ``exact`` placement by OR-Tools: sparse min-cost flow bins -> nodes, then one linear sum
    assignment bins -> GPUs of their nodes. Returns (rank_of_bin, solver)."""
    if min_cost_flow is None:
        raise RuntimeError("exact_min_cost_flow needs OR-Tools (pip install ortools)")
    problem = _Problem(traffic, topology)
    num_bins, num_nodes = problem.num_bins, problem.num_nodes
    hub = num_bins + num_nodes
    # Cost = minus the bytes a bin finds on the node; the hub arc means "a node where it has nothing".
    tails = np.concatenate([problem.pair_bin, np.arange(num_bins), np.full(num_nodes, hub)])
    heads = np.concatenate([num_bins + problem.pair_node, np.full(num_bins, hub),
                            num_bins + np.arange(num_nodes)])
    caps = np.concatenate([np.ones(problem.pair_bin.size + num_bins, dtype=np.int64), problem.capacity])
    costs = np.concatenate([-problem.pair_bytes, np.zeros(num_bins + num_nodes, dtype=np.int64)])
    flow = min_cost_flow.SimpleMinCostFlow()
    arcs = flow.add_arcs_with_capacity_and_unit_cost(tails, heads, caps, costs)
    supplies = np.concatenate([np.ones(num_bins, dtype=np.int64), -problem.capacity, [0]])
    flow.set_nodes_supplies(np.arange(hub + 1), supplies)
    status = flow.solve()
    if status != flow.OPTIMAL:
        rank_of_bin, solver = _greedy(problem)
        return rank_of_bin, f"{solver} (min-cost flow status {status})"
    flows = flow.flows(arcs)
    node_of_bin = np.full(num_bins, -1, dtype=np.int64)
    direct = flows[:problem.pair_bin.size] > 0
    node_of_bin[problem.pair_bin[direct]] = problem.pair_node[direct]
    via_hub = np.flatnonzero(node_of_bin < 0)
    node_of_bin[via_hub] = np.repeat(np.arange(num_nodes), flows[-num_nodes:])
    left, right = problem._same_node_pairs(node_of_bin)
    assignment = linear_sum_assignment.SimpleLinearSumAssignment()
    assignment.add_arcs_with_cost(left, right, -problem._bytes_at(left, right))
    if assignment.solve() != assignment.OPTIMAL:  # costs too large for its integer arithmetic
        return problem.greedy_ranks_for_nodes(node_of_bin), "min-cost-flow (OR-Tools), greedy in nodes"
    return (np.array([assignment.right_mate(b) for b in range(num_bins)], dtype=np.int64),
            "min-cost-flow (OR-Tools)")


def _minmax(problem: _Problem, exact_rank_of_bin, exact_solver: str, config: PlacementConfig,
            start: float):
    """Min busiest-node inter-node bytes (CP-SAT), then min total bytes at that maximum."""
    deterministic_spent = [0.0]  # CP-SAT's deterministic time used so far (deterministic mode)

    def time_left() -> float:
        """Seconds left for CP-SAT, keeping time for what follows it (reading its solution, the in-node
        assignment, the costs: about twice the assignment alone)."""
        if config.deterministic:
            return config.time_limit_s - deterministic_spent[0]
        return config.time_limit_s - (time.perf_counter() - start + 2 * problem.assign_seconds)

    node = problem.topology.node_of_rank
    hints = [(exact_rank_of_bin, exact_solver), (np.arange(problem.num_bins), "identity")]
    if time_left() > 0:
        hints.append(_greedy(problem))
    hint_rank_of_bin, hint_solver = min(hints, key=lambda h: problem.node_cost(node[h[0]]))
    hint_nodes = node[hint_rank_of_bin]
    hint_cost = problem.node_cost(hint_nodes)
    if time_left() <= 0:
        return hint_rank_of_bin, f"{hint_solver} (min-max time limit reached before CP-SAT)"
    pair_bin, pair_node, pair_bytes, restricted = _candidate_pairs(problem, hint_nodes, config)
    received_cost = (problem.bin_total[pair_bin] - pair_bytes).tolist()
    model = cp_model.CpModel()
    x = [model.new_bool_var("") for _ in range(pair_bin.size)]
    x_index = np.array([v.index for v in x], dtype=np.int64)
    busiest = model.new_int_var(0, hint_cost[0], "busiest")
    for group in _groups(pair_bin, problem.num_bins):
        model.add_exactly_one([x[j] for j in group])
    for n, group in enumerate(_groups(pair_node, problem.num_nodes)):
        members = [x[j] for j in group]
        model.add(sum(members) == int(problem.capacity[n]))
        model.add(cp_model.LinearExpr.weighted_sum(members, [received_cost[j] for j in group]) <= busiest)
        kept = group[pair_bytes[group] > 0]
        model.add(cp_model.LinearExpr.weighted_sum([x[j] for j in kept], pair_bytes[kept].tolist())
                  >= int(problem.node_sent[n]) - busiest)
    model.minimize(busiest)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1 if config.deterministic else config.num_workers
    solver.parameters.cp_model_probing_level = 0  # probing 20k+ Booleans costs more than it saves here

    def solve(hint: np.ndarray, max_bound: int):
        """Solve within the time left from ``hint`` (0/1 per pair); (status, 0/1 per pair)."""
        model.clear_hints()
        model.proto.solution_hint.vars.extend(x_index.tolist() + [busiest.index])
        model.proto.solution_hint.values.extend(hint.tolist() + [int(max_bound)])
        left = time_left()
        if left <= 0:
            return cp_model.UNKNOWN, hint
        if config.deterministic:
            solver.parameters.max_deterministic_time = left
        else:
            # 10% kept back: CP-SAT overruns its limit a little (presolve is not interruptible).
            solver.parameters.max_time_in_seconds = 0.9 * left
        status = solver.solve(model)
        deterministic_spent[0] += solver.response_proto.deterministic_time
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return status, hint
        solution = np.asarray(solver.response_proto.solution, dtype=np.int64)
        return status, solution[x_index]

    status, chosen = solve((hint_nodes[pair_bin] == pair_node).astype(np.int64), hint_cost[0])
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return hint_rank_of_bin, f"{hint_solver} (CP-SAT found nothing within the min-max time limit)"
    if status == cp_model.OPTIMAL:
        # Second phase: cheapest total inter-node bytes at that busiest-node load, in the time left.
        best_max = int(solver.value(busiest))
        model.add(busiest <= best_max)
        model.minimize(cp_model.LinearExpr.weighted_sum(x, received_cost))
        second, second_chosen = solve(chosen, best_max)
        if second in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            chosen = second_chosen
        status = second
    node_of_bin = np.empty(problem.num_bins, dtype=np.int64)
    node_of_bin[pair_bin[chosen > 0]] = pair_node[chosen > 0]
    if problem.node_cost(node_of_bin) > hint_cost:
        return hint_rank_of_bin, f"{hint_solver} (better than CP-SAT within the min-max time limit)"
    label = "cp-sat " + ("optimal" if status == cp_model.OPTIMAL else "feasible (time limit)")
    if restricted:
        label += f", {config.candidate_nodes} candidate nodes per bin"
    return problem.ranks_for_nodes(node_of_bin), label


def _groups(keys: np.ndarray, num_groups: int):
    """Indices of ``keys`` equal to 0, 1, ..., num_groups - 1 (one array per group)."""
    order = np.argsort(keys, kind="stable")
    return np.split(order, np.cumsum(np.bincount(keys, minlength=num_groups))[:-1])


def _candidate_pairs(problem: _Problem, hint_nodes, config: PlacementConfig):
    """(bin, node, bytes) pairs the min-max model may use; all pairs when the model is small enough."""
    num_bins, num_nodes = problem.num_bins, problem.num_nodes
    if num_bins * num_nodes <= config.max_full_model:
        pair_bin = np.repeat(np.arange(num_bins), num_nodes)
        pair_node = np.tile(np.arange(num_nodes), num_bins)
        dense = np.zeros(num_bins * num_nodes, dtype=np.int64)
        dense[problem.pair_bin * num_nodes + problem.pair_node] = problem.pair_bytes
        return pair_bin, pair_node, dense, False
    # Each bin's heaviest nodes, plus its hint node and the node of its own rank.
    pairs_per_bin = np.bincount(problem.pair_bin, minlength=num_bins)
    order = np.lexsort((-problem.pair_bytes, problem.pair_bin))
    position = np.arange(order.size) - np.repeat(np.cumsum(pairs_per_bin) - pairs_per_bin, pairs_per_bin)
    top = order[position < config.candidate_nodes]
    keys = np.unique(np.concatenate([problem.pair_bin[top] * num_nodes + problem.pair_node[top],
                                     np.arange(num_bins) * num_nodes + hint_nodes,
                                     np.arange(num_bins) * num_nodes + problem.topology.node_of_rank]))
    pair_bytes = _lookup(problem.pair_bin * num_nodes + problem.pair_node, problem.pair_bytes, keys)
    return keys // num_nodes, keys % num_nodes, pair_bytes, True


def _lookup(keys: np.ndarray, values: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """``values`` at ``wanted`` keys of the sorted unique ``keys``; 0 where absent."""
    if keys.size == 0:
        return np.zeros(wanted.shape, dtype=np.int64)
    at = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return np.where(keys[at] == wanted, values[at], 0).astype(np.int64)


def _checked_items(bin_of_item, home_rank, item_bytes, num_bins: int, num_ranks: int):
    """The (bin, home rank, bytes) int64 arrays of items, checked: equal lengths, in range, bytes >= 0."""
    bins = as_index_array(bin_of_item, "bin_of_item")
    ranks = as_index_array(home_rank, "home_rank")
    nbytes = as_index_array(item_bytes, "item_bytes")
    if not bins.shape == ranks.shape == nbytes.shape:
        raise ValueError(f"bin_of_item, home_rank and item_bytes differ in length: "
                         f"{bins.size}, {ranks.size}, {nbytes.size}")
    _check_range(bins, num_bins, "bin_of_item")
    _check_range(ranks, num_ranks, "home_rank")
    if nbytes.size and nbytes.min() < 0:
        raise ValueError(f"item {int(np.argmin(nbytes))} has negative bytes {nbytes.min()}")
    return bins, ranks, nbytes


def _check_range(values: np.ndarray, bound: int, name: str) -> None:
    if values.size and (values.min() < 0 or values.max() >= bound):
        bad = int(np.flatnonzero((values < 0) | (values >= bound))[0])
        raise ValueError(f"{name}[{bad}] = {values[bad]} is outside 0..{bound - 1}")
