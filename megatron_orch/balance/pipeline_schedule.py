"""Megatron's pipeline schedules, timed micro-batch by micro-batch (torch-free): the one model of a pipelined
replica's backbone step that the planner, its lower bound, ``bench.balance`` and the simulator share.

A replica of ``stages`` pipeline stages (each holding ``virtual_stages`` model chunks; the layers split evenly
over the ``stages * virtual_stages`` virtual stages) runs ``M`` micro-batches in megatron-core's order
(``schedules.py``):

* one chunk per stage (``forward_backward_pipelining_without_interleaving``): stage ``s`` runs
  ``min(stages - s - 1, M)`` forwards (warm-up), then one forward and one backward at a time (steady state),
  then the remaining backwards (cool-down); one stage is ``forward_backward_no_pipelining`` (F, B, F, B, ...);
* interleaved (``forward_backward_pipelining_with_interleaving``): the virtual micro-batches follow
  ``get_schedule_table`` (groups of ``group_size`` micro-batches, default ``stages``, through every chunk in
  turn; backwards through the chunks in reverse), with ``2 (stages - s - 1) + (virtual_stages - 1) group_size``
  warm-up forwards.

An operation starts when its stage has finished the one before it and its input is there: a forward of
virtual stage ``k`` takes virtual stage ``k - 1``'s output of the same micro-batch, a backward takes ``k +
1``'s gradient (the last virtual stage's, its own forward's loss). Micro-batch ``m``'s training cost ``c_m``
(the sum of its examples' costs) runs ``c_m / 3`` forward and ``2 c_m / 3`` backward, split evenly over the
virtual stages. Assumed: stage-to-stage transfers take no time and never block their sender (Megatron's
P2P sends are asynchronous; their time is the same for every plan), and a stage's layers cost the same per
token (no embedding or loss layer of its own).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from megatron_orch.balance._kernels import pipeline as _pipeline

FORWARD_SHARE = 1.0 / 3.0  # of a training cost: forward 1, backward 2 (training FLOPs = 3x forward)
FORWARD, BACKWARD = 0, 1


@dataclass(frozen=True)
class ScheduleOps:
    """A schedule's operations in a topological order: ``stage``, ``kind`` (FORWARD / BACKWARD),
    ``virtual_stage`` (``chunk * stages + stage``), ``microbatch``; ``prev``: the operation before it on its
    stage, ``dep``: the one whose output it takes (-1: none); ``slot``: its duration's index in a replica's
    ``(kind, virtual_stage, microbatch)`` durations."""

    stage: np.ndarray
    kind: np.ndarray
    virtual_stage: np.ndarray
    microbatch: np.ndarray
    prev: np.ndarray
    dep: np.ndarray
    slot: np.ndarray


@dataclass(frozen=True)
class PipelineSchedule:
    """The pipeline layout of one replica (module docstring): ``stages`` (``--pipeline-model-parallel-size``),
    ``virtual_stages`` (model chunks per stage, the interleaved schedule), ``group_size`` (interleaved:
    Megatron's ``microbatch_group_size_per_vp_stage``; None: ``stages``)."""

    stages: int = 1
    virtual_stages: int = 1
    group_size: Optional[int] = None

    def __post_init__(self):
        for name in ("stages", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"PipelineSchedule.{name} must be an int >= 1, got {value!r}")
        if self.virtual_stages > 1 and self.stages == 1:
            raise ValueError("PipelineSchedule: virtual stages need stages > 1")
        if self.group_size is not None and (self.virtual_stages == 1 or self.group_size < self.stages):
            raise ValueError(f"PipelineSchedule.group_size {self.group_size}: only for virtual stages, and at least "
                             f"the stages ({self.stages})")

    @property
    def num_virtual(self) -> int:
        return self.stages * self.virtual_stages

    def check_microbatches(self, num_microbatches: int) -> None:
        """ValueError unless megatron-core runs this schedule with ``num_microbatches`` (interleaved: at least
        ``group_size`` of them, and a last group of none or at least ``stages``)."""
        if num_microbatches < 1:
            raise ValueError(f"a pipelined step needs at least one micro-batch, got {num_microbatches}")
        if self.virtual_stages > 1:
            group = self.group_size or self.stages
            if group > num_microbatches or 0 < num_microbatches % group < self.stages:
                raise ValueError(f"the interleaved schedule ({self.stages} stages, groups of {group}) cannot run "
                                 f"{num_microbatches} micro-batches")

    def stage_order(self, stage: int, num_microbatches: int) -> List[Tuple[int, int, int]]:
        """The operations of ``stage`` in the order megatron-core runs them: (kind, chunk, micro-batch)."""
        return _stage_order(self, stage, num_microbatches)

    def ops(self, num_microbatches: int) -> ScheduleOps:
        """Every operation of a step of ``num_microbatches``, in a topological order (cached)."""
        self.check_microbatches(num_microbatches)
        return _ops(self, num_microbatches)

    def durations(self, microbatch_costs) -> np.ndarray:
        """Each (kind, virtual stage, micro-batch) duration of every replica, ``(replicas, 2 * V * M)``, from
        ``microbatch_costs`` ``(replicas, M)``: each micro-batch's training cost (seconds) split evenly."""
        costs = np.asarray(microbatch_costs, dtype=np.float64)
        forward = np.repeat(costs[:, None, :] * (FORWARD_SHARE / self.num_virtual), self.num_virtual, axis=1)
        backward = forward * ((1.0 - FORWARD_SHARE) / FORWARD_SHARE)
        return np.concatenate([forward, backward], axis=1).reshape(costs.shape[0], -1)

    def replica_seconds(self, microbatch_costs, first_forward=None, first_backward=None) -> np.ndarray:
        """Modeled step seconds of every replica (the last operation's end on any stage).

        Args:
            microbatch_costs: ``(replicas, M)`` training seconds of each micro-batch's backbone (all layers), in
                the order the micro-batches run.
            first_forward, first_backward: ``(replicas, M)`` seconds added to the first virtual stage's forward
                and backward of each micro-batch (upstream's encoders, run inside the micro-batch).
        """
        costs = np.atleast_2d(np.asarray(microbatch_costs, dtype=np.float64))
        if costs.ndim != 2 or not np.isfinite(costs).all() or (costs < 0).any():
            raise ValueError(f"micro-batch costs must be finite, >= 0, one row per replica, got shape {costs.shape}")
        ops = self.ops(costs.shape[1])
        durations = self.durations(costs)
        m = costs.shape[1]
        for kind, extra in ((FORWARD, first_forward), (BACKWARD, first_backward)):
            if extra is not None:
                durations[:, kind * self.num_virtual * m:kind * self.num_virtual * m + m] += np.asarray(
                    extra, dtype=np.float64).reshape(costs.shape)
        return _pipeline.replica_seconds(np.ascontiguousarray(durations), ops.slot, ops.prev, ops.dep)

    def bound(self, load: float, smallest: float) -> float:
        """A lower bound on the step of a replica that runs ``load`` training seconds in micro-batches of at
        least ``smallest`` each: the last stage works ``load / stages``, cannot start before the smallest
        micro-batch's forward crossed the ``stages - 1`` stages before it and must leave its last backward
        that long to cross them back: ``load / stages + (stages - 1) smallest / (stages virtual_stages)``."""
        p = self.stages
        return load / p + (p - 1) * smallest / (p * self.virtual_stages)

    def lower_bound(self, costs, num_replicas: int, every_microbatch_holds_one: bool = False) -> float:
        """A lower bound on the slowest replica's step over every plan of examples of training ``costs`` on
        ``num_replicas`` replicas: the largest example's micro-batch runs forward and backward through every
        stage one after the other (at least its cost), and some replica holds the mean load
        (:meth:`bound`, its smallest micro-batch at least the smallest example where
        ``every_microbatch_holds_one``, else empty)."""
        costs = np.asarray(costs, dtype=np.float64)
        if costs.size == 0:
            return 0.0
        smallest = float(costs.min()) if every_microbatch_holds_one else 0.0
        return max(float(costs.max()), self.bound(float(costs.sum()) / num_replicas, smallest))

    def plan(self, costs, bin_of_item, num_bins: int, num_microbatches: int, *, rows: Optional[int] = None,
             max_rounds: int = 100_000) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pipeline-aware local search from a plan ``bin_of_item`` (each bin a replica): moves (packed rows,
        ``rows`` None) or swaps (``rows`` examples per micro-batch, every replica's count kept) of one example
        between the slowest replica and the two fastest (swaps only where no move helps), while the slowest's
        modeled step falls; each replica's
        examples packed longest first (onto the lightest micro-batch, or ``rows`` at a time) and its micro-batches
        ordered as runs fastest (:func:`_kernels.pipeline.pipeline_local_search`).

        Returns:
            (bin of every example, its micro-batch on its replica in running order, every replica's step).
        """
        self.check_microbatches(num_microbatches)
        costs = np.ascontiguousarray(costs, dtype=np.float64)
        bins = np.array(bin_of_item, dtype=np.int64)
        microbatch = np.zeros(costs.size, dtype=np.int64)
        ops = self.ops(num_microbatches)
        mode = _pipeline.PACK_LONGEST_FIRST if rows is None else _pipeline.PACK_EQUAL_COUNT
        seconds = _pipeline.pipeline_local_search(costs, bins, num_bins, num_microbatches, mode, rows or 1,
                                                  FORWARD_SHARE, self.stages, self.num_virtual, ops.slot, ops.prev,
                                                  ops.dep,
                                                  max_rounds, microbatch)
        return bins, microbatch, seconds

    def plan_seconds(self, costs, bin_of_item, microbatch_of_item, num_bins: int, num_microbatches: int) -> np.ndarray:
        """Modeled step of every replica of a plan: ``bin_of_item`` replicas, ``microbatch_of_item`` the
        micro-batch (running order) of every example on its replica."""
        costs = np.asarray(costs, dtype=np.float64)
        per_microbatch = np.bincount(np.asarray(bin_of_item) * num_microbatches + np.asarray(microbatch_of_item),
                                     weights=costs, minlength=num_bins * num_microbatches)
        return self.replica_seconds(per_microbatch.reshape(num_bins, num_microbatches))


def schedule_table(num_microbatches: int, chunks: int, group: int) -> List[Tuple[int, int]]:
    """megatron-core's ``get_schedule_table``: (micro-batch, chunk) of every virtual micro-batch."""
    table = []
    for first in range(0, num_microbatches, group):
        last = num_microbatches if first + group >= num_microbatches else first + group
        table += [(m, c) for c in range(chunks) for m in range(first, last)]
    return table


@functools.lru_cache(maxsize=256)
def _stage_order(schedule: PipelineSchedule, stage: int, num_microbatches: int) -> List[Tuple[int, int, int]]:
    p, v, m = schedule.stages, schedule.virtual_stages, num_microbatches
    if v == 1:
        warmup = min(p - stage - 1, m)
        forwards = [(FORWARD, 0, k) for k in range(m)]
        backwards = [(BACKWARD, 0, k) for k in range(m)]
    else:
        table = schedule_table(m, v, schedule.group_size or p)
        warmup = min(2 * (p - stage - 1) + (v - 1) * (schedule.group_size or p), m * v)
        forwards = [(FORWARD, c, k) for k, c in table]
        backwards = [(BACKWARD, v - 1 - c, k) for k, c in table]
    order = forwards[:warmup]
    for k in range(len(forwards) - warmup):
        order += [forwards[warmup + k], backwards[k]]
    return order + backwards[len(forwards) - warmup:]


@functools.lru_cache(maxsize=256)
def _ops(schedule: PipelineSchedule, num_microbatches: int) -> ScheduleOps:
    p, m, nv = schedule.stages, num_microbatches, schedule.num_virtual
    orders = [_stage_order(schedule, s, m) for s in range(p)]
    index = {}  # (kind, virtual stage, micro-batch) -> position in the topological order
    rows: List[Tuple[int, int, int, int, int]] = []  # (stage, kind, virtual stage, micro-batch, dep)
    position = [0] * p
    while len(rows) < 2 * nv * m:
        progressed = False
        for s in range(p):
            while position[s] < len(orders[s]):
                kind, chunk, mb = orders[s][position[s]]
                k = chunk * p + s
                if kind == FORWARD:
                    needs = (FORWARD, k - 1, mb) if k > 0 else None
                else:
                    needs = (BACKWARD, k + 1, mb) if k < nv - 1 else (FORWARD, k, mb)
                if needs is not None and needs not in index:
                    break
                index[(kind, k, mb)] = len(rows)
                rows.append((s, kind, k, mb, -1 if needs is None else index[needs]))
                position[s] += 1
                progressed = True
        if not progressed:
            raise RuntimeError(f"pipeline schedule {schedule} with {m} micro-batches deadlocks (a bug)")
    last_on_stage = [-1] * p
    stage, kind, vstage, mb, dep, prev = (np.empty(len(rows), dtype=np.int64) for _ in range(6))
    for i, (s, kd, k, b, d) in enumerate(rows):
        stage[i], kind[i], vstage[i], mb[i], dep[i] = s, kd, k, b, d
        prev[i], last_on_stage[s] = last_on_stage[s], i
    slot = (kind * nv + vstage) * m + mb
    for a in (stage, kind, vstage, mb, dep, prev, slot):
        a.setflags(write=False)
    return ScheduleOps(stage=stage, kind=kind, virtual_stage=vstage, microbatch=mb, prev=prev, dep=dep, slot=slot)
