"""The post-balancing data iterator: wraps Megatron's training data iterator, one global batch per step.

Per step, on the training thread, it does one small collective over the DP group and launches the
step's moves, all asynchronous:

* **one control collective** (:func:`~megatron_orch.comm.gather.gather_item_sizes`): every rank's status
  (the next step read, no more data, or failed), the per-example sizes of the *next* step, and the digest
  of *this* step's plan (computed in the planning thread while the previous step trained), with the
  TP/PP peers' status and digest reduced into it on the device: a plan that differs between ranks, or a
  rank whose loader failed anywhere in the job, raises on every rank before any all-to-all could hang;
* the moves, on a communicator of its own (:class:`ParallelGroups.comm_group`, not the DP group's, on
  which DDP reduces gradients): raw items of every encoder phase to their encoder-phase rank (first
  pipeline stage only: the other stages hold no encoders), token ids, labels and loss masks to the
  backbone-phase rank of their example. Their routes (which row goes where) were built in the planning
  thread and go to the device in one upload.

It yields a :class:`BalancedStep` (in shadow mode, ``config.shadow``, a :class:`ShadowStep`: the step
planned, logged and left as loaded, nothing moved): the rank's backbone micro-batches (same number on
every DP rank), collated on the host when the schedule first asks for them (by then the text has long
arrived: the host waits for that copy only, not for the encoders queued after it), and its encoder inputs, with the
moves the modality-aware schedule uses to send encoder outputs straight to the backbone rank of their
example. Then it hands the next step's sizes to the planning thread and the step after it to the
reading thread, which reads and checks its examples and stages what they send in (pinned) host memory.
So the data of three steps is in flight: the one training, the one planned, the one read.

Devices: everything travels on the DP group's communication device (the GPU under NCCL), staged
through pinned host memory; raw encoder inputs travel in ``input_dtype`` (the encoders' own dtype: they
cast their input to it first, so casting before the move changes nothing and halves the bytes in
bf16); received encoder inputs are handed over on ``compute_device`` (where the
encoders run), text on the host, where the backbone micro-batches are built as the loader builds them.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_orch.balance.plan import Placement, RunPeers, Transfer
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import StepSizes, phase_items
from megatron_orch.comm.alltoall import (ItemLayout, PendingHops, Route, routes_for, start_all_to_all_items,
                                        upload_routes)
from megatron_orch.comm.communicator import dedicated_group
from megatron_orch.comm.device import HostCopy, communication_device, stage_on_host, staged_to_device
from megatron_orch.comm.gather import GroupMismatchError, gather_item_sizes
from megatron_orch.comm.group_topology import group_topology
from megatron_orch.comm.status import raise_if_any_rank_failed
from megatron_orch.megatron.batch import BatchSpec, Example, MicroBatch, collate, collate_packed
from megatron_orch.orchestrator.background import BackgroundPlanner, retain_freed_memory
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.encoder_ranks import (CopiedStepMove, EncoderGroupPlan, OwnEncoderRanks, PlannedStep,
                                                      encode_on_own_ranks, group_moves, group_traffic, own_ranks_moves,
                                                      own_ranks_refusal, read_step_message, spread_over_stages,
                                                      step_message)
from megatron_orch.orchestrator.step_plan import (EncoderChunks, StepMove, StepPlan, plan_step, step_moves,
                                                  warm_up)

_LOGGED: set = set()  # messages logged once per process


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        logging.getLogger("megatron_orch").warning(message)


_OK, _EXHAUSTED = 0, 1  # a rank's step status, one of the control collective's checks
_STATUS = "step status (0 a step read, 1 no more data)"
_DIGEST = "post-balancing plan digest"


@dataclass(frozen=True)
class StepShape:
    """The micro-batches of each step on every DP rank: ``num_microbatches`` of ``micro_batch_size``
    examples each; ``pad_to``: the fixed row length of every micro-batch (pipeline parallelism sends
    fixed-shape tensors between stages), None for rows as long as their examples. ``ramp_up``: a global batch
    that changes from step to step (Megatron's ``--rampup-batch-size``, ``--step-batch-size-schedule``): the
    micro-batches of each of the first steps the iterator reads, ``num_microbatches`` for every step after them
    (:meth:`of_steps` of :func:`~megatron_orch.megatron.any_loop.megatron_core_counts`, read off megatron-core's
    calculator). Each step is planned over the global batch it loaded, and the loop passes the schedule that step's
    count."""

    micro_batch_size: int
    num_microbatches: int
    pad_to: Optional[int] = None
    ramp_up: Tuple[int, ...] = ()

    def __post_init__(self):
        for name, value in (("micro_batch_size", self.micro_batch_size), ("num_microbatches", self.num_microbatches),
                            ("pad_to", self.pad_to), *((f"ramp_up[{i}]", n) for i, n in enumerate(self.ramp_up))):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"StepShape.{name} must be an int >= 1, got {value!r}")

    @classmethod
    def of_steps(cls, micro_batch_size: int, counts: Sequence[int], pad_to: Optional[int] = None) -> "StepShape":
        """The shape of steps of ``counts`` micro-batches each, in order (every later step: the last count)."""
        counts = [int(count) for count in counts]
        if not counts:
            raise ValueError("StepShape.of_steps: no step counts given")
        changes = [i for i in range(1, len(counts)) if counts[i] != counts[i - 1]]
        return cls(micro_batch_size, counts[-1], pad_to, tuple(counts[:changes[-1]]) if changes else ())

    def microbatches_of_step(self, step: int) -> int:
        """The micro-batches of the iterator's ``step``-th step (from 0)."""
        return self.ramp_up[step] if step < len(self.ramp_up) else self.num_microbatches


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """Where this rank balances: its DP group and that group's topology (nodes), whether this pipeline
    stage holds the encoders, the group of its TP/PP peers (one DP replica), which must hold the same
    plan, and the communicator of post-balancing's own collectives: the DP group's ranks on a communicator
    of their own, so that its all-to-alls do not queue behind DDP's gradient reductions on the DP group's
    (None: the iterator creates one, :func:`~megatron_orch.comm.communicator.dedicated_group`).
    ``encoder_group``: with the encoders on every pipeline stage (``EncoderRanks.ALL``), the DP x PP x R encoder
    replicas at this rank's encoder TP rank (``R = tp_replicas``: TP / the encoders' TP), ranked ``(stage * DP + dp)
    * R + j`` (:mod:`~megatron_orch.orchestrator.encoder_ranks`), over which the encoder phases' items and outputs
    move; every stage then holds encoders (``encoder_stage``); ``pipeline_group``: this DP rank's PP x R encoder
    replicas (ranked ``stage * R + j``; the pipeline group where ``R`` is 1), over which the encoders' gradients
    are summed. ``own_encoder_ranks``: the encoders on ranks of their own (MIMO's non-colocated grids, this rank a
    backbone rank of that layout): ``encoder_group`` is then the group of the layout's ranks, ranked as the layout
    ranks them, over which the items, the encoder outputs, their gradients and each step's sizes move
    (:func:`share_planned_step`); a ``comm_group`` given; no ``pipeline_group``."""

    dp_group: ProcessGroup
    topology: Topology
    encoder_stage: bool = True
    peer_group: Optional[ProcessGroup] = None
    comm_group: Optional[ProcessGroup] = None
    encoder_group: Optional[ProcessGroup] = None
    pipeline_group: Optional[ProcessGroup] = None
    tp_replicas: int = 1
    own_encoder_ranks: Optional[OwnEncoderRanks] = None

    def __post_init__(self):
        if self.own_encoder_ranks is not None:
            if (self.encoder_group is None or self.comm_group is None or self.pipeline_group is not None
                    or not self.encoder_stage):
                raise ValueError("ParallelGroups: own_encoder_ranks takes the encoder_group of the layout's ranks, a "
                                 "comm_group (made on every rank of the job, as dedicated_group makes it: the iterator "
                                 "cannot make one without the encoder ranks), encoder_stage=True and no pipeline_group")
            return
        if (self.encoder_group is None) != (self.pipeline_group is None):
            raise ValueError("ParallelGroups: encoder_group and pipeline_group go together (the encoders on every "
                             "pipeline stage) or not at all")
        if self.encoder_group is not None and not self.encoder_stage:
            raise ValueError("ParallelGroups: with an encoder_group every pipeline stage holds encoders "
                             "(encoder_stage=True)")
        if self.tp_replicas < 1 or (self.tp_replicas > 1 and self.encoder_group is None):
            raise ValueError(f"ParallelGroups: tp_replicas {self.tp_replicas} needs an encoder_group (encoder "
                             "replicas on every stage) and must be >= 1")


@dataclass(frozen=True, eq=False)
class BalancedMicroBatch:
    """What ``forward_step`` receives under post-balancing: a backbone micro-batch whose encoder outputs
    come from the step's encoder phases.

    ``batch`` carries text only (no raw items); ``embeds[phase]`` holds the encoder outputs of its
    examples (``num_items[phase]`` items, ``rows_per_item`` rows each, in placeholder order), filled by
    the modality-aware schedule before the backbone runs.
    """

    batch: MicroBatch
    num_items: Mapping[str, int]
    embeds: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class Move:
    """One all-to-all of a step, prepared in the planning thread: which of the step's moves it runs
    (``listed``, of :func:`~megatron_orch.orchestrator.step_plan.step_moves`; ``backward``: the inverse that
    sends its gradients back), what moves where, the all-to-alls that run it (``hops``, ``Transfer.hops``: the
    transfer itself, or a node-wise one's hops) and this rank's routes of every hop
    (:func:`~megatron_orch.comm.alltoall.routes_for`; on the device once the step is dispatched)."""

    listed: StepMove
    transfer: Transfer
    hops: Tuple[Transfer, ...]
    routes: Tuple[Route, ...]
    backward: bool = False

    @property
    def name(self) -> str:
        return self.listed.name

    def send_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (those of this rank's items, in slot order) as this move sends them: a
        :class:`~megatron_orch.orchestrator.encoder_ranks.CopiedStepMove` ``copies`` times, one block after the
        other, and its gradients from the first copy's destination alone (the rows its route holds: all or none)."""
        if not isinstance(self.listed, CopiedStepMove):
            return rows
        if self.backward:
            return rows[:self.routes[0].send.local_rows[0]]
        return rows.repeat(self.listed.copies, *([1] * (rows.dim() - 1)))

    def start(self, tensors: Sequence[torch.Tensor], layouts: Sequence[ItemLayout], group) -> PendingHops:
        per_hop = len(self.routes) // len(self.hops)
        return PendingHops(lambda hop, inputs: start_all_to_all_items(
            inputs, layouts, self.hops[hop], group, self.routes[hop * per_hop:(hop + 1) * per_hop]),
                           len(self.hops), tensors)


@dataclass(frozen=True, eq=False)
class StepMoves:
    """Every all-to-all of one step on this rank (``moves``, in :func:`step_moves`' order, an embeddings move
    followed by its gradients'): the text, and per encoder phase (encoder stage only) the raw inputs, the
    outputs to the backbone ranks and their gradients back."""

    moves: Tuple[Move, ...]
    spread: Optional[EncoderGroupPlan] = None  # the encoders on every pipeline stage: where each item is encoded
    own_encode: Optional[Dict[str, Placement]] = None  # the encoders on ranks of their own: where each item is encoded

    @property
    def text(self) -> Move:
        return next(move for move in self.moves if move.listed.kind == "text")

    @property
    def inputs(self) -> Dict[str, Move]:
        return self._of("inputs", backward=False)

    @property
    def outputs(self) -> Dict[str, Move]:
        return self._of("embeddings", backward=False)

    @property
    def gradients(self) -> Dict[str, Move]:
        return self._of("embeddings", backward=True)

    def _of(self, kind: str, backward: bool) -> Dict[str, Move]:
        return {move.listed.items_of: move for move in self.moves
                if move.listed.kind == kind and move.backward == backward}

    def uploaded(self, device: torch.device) -> "StepMoves":
        """The same moves with every route's indices on ``device``, in one upload."""
        routes = iter(upload_routes([route for move in self.moves for route in move.routes], device))
        return StepMoves(tuple(dataclasses.replace(move, routes=tuple(next(routes) for _ in move.routes))
                               for move in self.moves), self.spread, self.own_encode)


def _text_layouts(num_tokens: np.ndarray) -> List[ItemLayout]:
    return [ItemLayout(num_tokens, (2,), torch.long), ItemLayout(num_tokens, (1,), torch.float32)]


def prepare_moves(plan: StepPlan, num_tokens: np.ndarray, rows_per_item: Mapping[str, int], rank: Optional[int],
                  encoder_stage: bool, all_to_all: str = "flat", node_of_rank=None,
                  spread: Optional[EncoderGroupPlan] = None, group_rank: Optional[int] = None,
                  group_node_of_rank=None,
                  own: Optional[Tuple[OwnEncoderRanks, Dict[str, Placement]]] = None) -> StepMoves:
    """``rank``'s moves of the step (host only: the planning thread calls this after the plan): the routes
    of every move :func:`step_moves` lists, the ones the byte count counts (the encoder phases' on the
    encoder stage only: the other pipeline stages hold no encoders), each run ``all_to_all`` over the nodes of
    ``node_of_rank`` (``Transfer.hops``). With the encoders on every stage (``spread``), the encoder phases'
    moves are :func:`~megatron_orch.orchestrator.encoder_ranks.group_moves`', routed for ``group_rank``, this
    rank's in the encoder group, their hops over the group's nodes (``group_node_of_rank``). With the encoders on
    ranks of their own (``own``: the layout and :func:`~megatron_orch.orchestrator.encoder_ranks.encode_on_own_ranks`'
    placements), :func:`~megatron_orch.orchestrator.encoder_ranks.own_ranks_moves`', flat, routed for ``group_rank``
    (this rank in the layout's group); ``rank`` None: an encoder-only rank, which takes no part in the text's move."""
    out = []
    over_group = spread is not None or own is not None  # the encoder phases' moves: routed for group_rank

    def move(listed: StepMove, transfer: Transfer, layouts, at: int, backward: bool = False) -> Move:
        if own is not None:  # flat (refused otherwise where the layout is set up)
            hops = (transfer,)
        else:
            nodes = node_of_rank if spread is None or listed.kind == "text" else group_node_of_rank
            hops = transfer.hops(all_to_all, nodes)
        return Move(listed, transfer, hops, tuple(route for hop in hops for route in routes_for(hop, at, layouts)),
                    backward)

    if own is not None:
        listed_moves = own_ranks_moves(plan, *own)
    else:
        listed_moves = step_moves(plan) if spread is None else group_moves(plan, spread)
    for listed in listed_moves:
        transfer = listed.transfer
        if listed.kind == "text":
            if rank is not None:
                out.append(move(listed, transfer, _text_layouts(num_tokens), rank))
            continue
        if not encoder_stage:
            continue
        if listed.kind == "inputs":
            item_rows = 1
        elif listed.kind == "embeddings":
            item_rows = rows_per_item[listed.items_of]
        else:
            raise ValueError(f"post-balancing does not run a move of kind {listed.kind!r} ({listed.name})")
        at = group_rank if over_group else rank

        def layouts(of: Transfer) -> List[ItemLayout]:  # one stream: the routes depend on its rows alone
            return [ItemLayout(np.full(of.src.num_items, item_rows, dtype=np.int64), (), torch.float32)]

        out.append(move(listed, transfer, layouts(transfer), at))
        if listed.with_gradients:
            gradients = listed.gradients()
            out.append(move(listed, gradients, layouts(gradients), at, backward=True))
    return StepMoves(tuple(out), spread, None if own is None else own[1])


class _Collated(Sequence):
    """A step's backbone micro-batches, collated on the host on first use (their number is the plan's)."""

    def __init__(self, count: int, collate_all: Callable[[], List[BalancedMicroBatch]]):
        self._count, self._collate_all, self._batches = count, collate_all, None

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if self._batches is None:
            self._batches = self._collate_all()
        return self._batches[index]


class StockScheduleError(RuntimeError):
    """A post-balancing step reached a schedule that does not take one (megatron-core's own)."""


def stock_schedule_error() -> StockScheduleError:
    return StockScheduleError(
        "a post-balancing step reached megatron-core's own schedule (forward_step got the whole step the "
        "PostBalancingDataIterator yields): call the schedule through megatron_orch.megatron.ModalityAwareSchedule "
        "(post_balance() returns it; under megatron.training the patch or the run-time hook installs it)")


class _WholeStep:
    """What a schedule takes whole: reading it as a micro-batch (``batch.tokens``, ``batch["tokens"]``), as a
    stock schedule's ``forward_step`` would, raises :class:`StockScheduleError` instead of an AttributeError."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise stock_schedule_error()

    def __getitem__(self, key):
        raise stock_schedule_error()


@dataclass(frozen=True, eq=False)
class BalancedStep(_WholeStep):
    """Everything one rank computes in one step under the plan; ``moves``: the step's all-to-alls, on
    ``comm_group`` (None for both: a step without encoder phases on this stage); ``home``: the rank's
    micro-batches as loaded, on the step the schedule checks (``config.verify_first_step``), else None;
    ``check_again``: on such a step, marks its phases unchecked again (a check that could not compare)."""

    microbatches: Sequence[BalancedMicroBatch]
    inputs: Mapping[str, torch.Tensor]  # this rank's encoder-phase items per phase (encoder stage only)
    plan: StepPlan
    rank: int                        # this rank in the DP group
    num_tokens: np.ndarray           # backbone tokens of every example of the global batch
    rows_per_item: Dict[str, int]    # embedding rows one encoder item sends to the backbone
    comm_group: Optional[ProcessGroup]
    moves: Optional[StepMoves]
    timings: Dict[str, float] = field(default_factory=dict)  # seconds: plan, plan_exposed, dispatch
    home: Optional[Sequence[MicroBatch]] = None
    encoder_group: Optional[ProcessGroup] = None   # the encoders on every stage: their moves' group
    encoder_rank: Optional[int] = None             # this rank in it
    pipeline_group: Optional[ProcessGroup] = None  # over which the encoders' gradients are summed
    check_again: Optional[Callable[[], None]] = None
    run_peers: Optional[Tuple[int, int]] = None  # this rank's peers over the run so far (on its node, across nodes)

    @property
    def spread(self) -> Optional[EncoderGroupPlan]:
        """Where the encoder group encodes each item (None: the encoders on the first stage, the DP plan's)."""
        return None if self.moves is None else self.moves.spread

    @property
    def encoder_moves_group(self) -> Optional[ProcessGroup]:
        """The group the encoder phases' items and outputs move over."""
        return self.comm_group if self.encoder_group is None else self.encoder_group

    def encoded(self, phase: str) -> Placement:
        """Where every item of encoder phase ``phase`` is encoded, over the ranks of :attr:`encoder_moves_group`."""
        if self.receives_embeddings:
            return self.moves.own_encode[phase]
        spread = self.spread
        return self.plan.encoders[phase].encode if spread is None else spread.encode[phase]

    @property
    def receives_embeddings(self) -> bool:
        """Whether this rank's encoder outputs come from encoder ranks of their own (it encodes nothing)."""
        return self.moves is not None and self.moves.own_encode is not None

    @property
    def encodes_for_other_stages(self) -> bool:
        """Whether this rank's encoders send all their outputs to other ranks' backbones: with the encoders on every
        stage, a rank off the first pipeline stage (whose backbone takes none)."""
        spread = self.spread
        return spread is not None and self.encoder_rank >= spread.data_parallel_size * spread.tp_replicas

    def encoding_rank(self) -> int:
        """This rank in :attr:`encoder_moves_group`."""
        return self.rank if self.encoder_rank is None else self.encoder_rank

    def encoder_chunks(self, phase: str) -> Optional[EncoderChunks]:
        """The chunks every rank of :attr:`encoder_moves_group` runs its items of ``phase`` in."""
        spread = self.spread
        return self.plan.encoders[phase].chunks if spread is None else spread.chunks[phase]


@dataclass(frozen=True, eq=False)
class ShadowStep(_WholeStep):
    """A step of shadow mode: the rank's micro-batches as loaded (``microbatches``, which the schedule runs
    as they are: upstream), and the plan post-balancing would have run them under (its figures are logged)."""

    microbatches: Sequence[MicroBatch]
    plan: StepPlan
    rank: int
    num_tokens: np.ndarray
    timings: Dict[str, float] = field(default_factory=dict)
    run_peers: Optional[Tuple[int, int]] = None  # as BalancedStep's: what the plans so far would have connected


@dataclass(frozen=True, eq=False)
class _Read:
    """One step's input as the reading thread leaves it: its examples, their sizes, what they send
    (staged on the host), or the error that stopped the read."""

    examples: List[Example]
    local_sizes: np.ndarray        # [examples, sample index + items per encoder phase + tokens]
    staged: Dict[str, torch.Tensor]
    num_microbatches: int          # the step's (StepShape.microbatches_of_step)
    problem: Optional[BaseException] = None
    batches: List[MicroBatch] = field(default_factory=list)  # as loaded

    @property
    def status(self) -> int:
        return _OK if self.examples or self.problem is not None else _EXHAUSTED


@dataclass(frozen=True, eq=False)
class _Planned:
    """A step whose sizes every rank has: what it read, and the sizes of the whole DP group."""

    read: _Read
    sizes: StepSizes
    sample_ids: np.ndarray


class CheckedSteps:
    """Which steps the checked first step (:func:`~megatron_orch.megatron.first_step.checked_step`) runs on:
    the first step, and after it the first step whose global batch holds items of an encoder phase that no
    checked step held (an encoder whose mistake shows only with its own items is checked when they first
    come). So it costs one extra step at most per phase. The global item counts decide, the same on every
    rank of the job."""

    def __init__(self, encoder_phases: Sequence[str]):
        self.first = True
        self.unchecked = set(encoder_phases)
        self.phases = tuple(encoder_phases)

    def due(self, items: Mapping[str, np.ndarray]) -> bool:
        """Whether the step with ``items`` (per encoder phase, the count of every example of the global batch)
        is checked; records its phases as checked if so."""
        present = {phase for phase in self.unchecked if int(np.sum(items[phase])) > 0}
        if not (self.first or present):
            return False
        self.first = False
        self.unchecked -= present
        return True

    def again(self, items: Mapping[str, np.ndarray]) -> None:
        """The checked step with ``items`` could not compare (its loss or gradients not finite in both layouts):
        the next step is checked, and its phases stay unchecked until a step with their items is."""
        self.first = True
        self.unchecked |= {phase for phase in self.phases if int(np.sum(items[phase])) > 0}


def share_planned_step(step: Optional[PlannedStep], phases: Sequence[str], group: ProcessGroup,
                       layout: OwnEncoderRanks) -> Optional[PlannedStep]:
    """The step every rank of ``group`` (encoder ranks of their own: the layout's ranks) plans next, as the first
    backbone rank has it (``step`` there, None: the data ended; ignored elsewhere), in two broadcasts from it (the
    message's length, then the message: :func:`~megatron_orch.orchestrator.encoder_ranks.step_message`)."""
    phases = tuple(phases)
    src = dist.get_global_rank(group, layout.backbone_ranks[0][0])
    device = communication_device(group)
    length = torch.zeros(1, dtype=torch.int64)
    if dist.get_rank() == src:
        message = torch.from_numpy(step_message(step, phases))
        length[0] = message.numel()
    length = length.to(device)
    dist.broadcast(length, src=src, group=group)
    message = (message if dist.get_rank() == src else torch.zeros(int(length.cpu()[0]), dtype=torch.int64)).to(device)
    if message.numel():
        dist.broadcast(message, src=src, group=group)
    return read_step_message(message.cpu().numpy(), phases)


def resolve_microbatching(spec: BatchSpec, config: OrchestratorConfig,
                          step: StepShape) -> Tuple[OrchestratorConfig, Optional[str]]:
    """``config`` with ``--orch-microbatching auto`` decided for the model (packed where ``spec.takes_packed_rows``
    unless fixed-length rows, ``step.pad_to``, speak against it), and why ``auto`` did not become packed (None:
    it did, or was not asked). ``packed`` where it cannot be raises ValueError naming the reason; no
    collective runs here, so every entry point refuses before its first one."""
    cannot_pack = spec.why_not_packed()
    if cannot_pack is None and step.pad_to is not None and config.microbatching == "auto":
        cannot_pack = (f"rows of a fixed length ({step.pad_to} tokens, as pipeline parallelism sends them) do "
                       "not bound a packed row's length")
    resolved = config.resolve_microbatching(cannot_pack)
    return resolved, cannot_pack if resolved.microbatching != config.microbatching else None


class PostBalancingDataIterator:
    """Iterator of :class:`BalancedStep` over an iterator of this DP rank's loader micro-batches.

    ``spec``: the model's phases and what its batches hold; ``input_dtype``: the dtype raw encoder items
    travel in (the encoders' own; they cast their input to it first); ``compute_device``: where the
    encoders run. Bad settings (a phase in ``config.phases`` the model lacks, a cost profile of another
    model, packed micro-batches for a backbone that cannot take them) raise here, before any collective.
    ``--orch-microbatching auto`` becomes packed where the model takes packed rows (``spec.takes_packed_rows``)
    unless fixed-length rows (``step.pad_to``) speak against it; else DP rank 0 logs the reason once. The iterator reads ``source`` from
    its reading thread only.
    """

    def __init__(self, source: Iterator[MicroBatch], spec: BatchSpec, config: OrchestratorConfig,
                 step: StepShape, groups: ParallelGroups, *, compute_device: torch.device,
                 input_dtype: torch.dtype = torch.float32):
        resolved, why_not_packed = resolve_microbatching(spec, config, step)
        if why_not_packed is not None and dist.get_rank(groups.dp_group) == 0:
            _log_once(f"post-balancing: equal-count backbone micro-batches (--orch-microbatching auto): "
                      f"{why_not_packed}")
        config = resolved
        if config.microbatching == "packed" and step.pad_to is not None:
            # one packed row carries a micro-batch's token budget
            step = dataclasses.replace(step, pad_to=step.pad_to * step.micro_batch_size)
        refused = None if groups.own_encoder_ranks is None else own_ranks_refusal(config)
        if refused is not None:
            raise ValueError(f"post-balancing: {refused}")
        self.source, self.spec, self.config, self.step, self.groups = source, spec, config, step, groups
        self.compute_device, self.input_dtype = torch.device(compute_device), input_dtype
        self.rank = dist.get_rank(groups.dp_group)
        self.pipeline_size, self.stage, self.replica, self.encoder_rank = 1, 0, 0, None
        self.encoder_nodes = None  # the node of every encoder-group rank (the encoders on every stage)
        own = groups.own_encoder_ranks
        if own is not None:  # encoder ranks of their own: the backbone's TP rank 0 sends the raw items
            self.encoder_rank = dist.get_rank(groups.encoder_group)
            where = np.argwhere(np.asarray(own.backbone_ranks) == self.encoder_rank)
            size = dist.get_world_size(groups.encoder_group)
            if size != own.num_ranks or len(where) != 1 or where[0][0] != self.rank:
                raise ValueError(f"rank {self.encoder_rank} of the encoder group of {size} ranks, DP rank {self.rank}, "
                                 f"is not a backbone rank of DP rank {self.rank} in the layout {own}")
            self.replica = int(where[0][1])
        elif groups.encoder_group is not None:  # the encoders on every stage: ranks (stage * DP + dp) * R + j
            dp_size, replicas = dist.get_world_size(groups.dp_group), groups.tp_replicas
            self.encoder_rank = dist.get_rank(groups.encoder_group)
            self.pipeline_size = dist.get_world_size(groups.pipeline_group) // replicas
            self.stage, self.replica = divmod(dist.get_rank(groups.pipeline_group), replicas)
            if (dist.get_world_size(groups.encoder_group) != dp_size * self.pipeline_size * replicas
                    or self.encoder_rank != (self.stage * dp_size + self.rank) * replicas + self.replica):
                raise ValueError(f"the encoder group ranks this rank {self.encoder_rank} of "
                                 f"{dist.get_world_size(groups.encoder_group)}, not (stage * DP + dp) * R + j = "
                                 f"({self.stage} * {dp_size} + {self.rank}) * {replicas} + {self.replica} (its DP x "
                                 "PP x R encoder replicas in megatron-core's order)")
            self.encoder_nodes = group_topology(groups.encoder_group, gpus_per_node=config.gpus_per_node).node_of_rank
        # also checks config.phases and the cost profile against the model; rank 0 says so if numba compiles
        warm_up(spec.phases, config, announce=_log_once if dist.get_rank() == 0 else None)
        self.comm_group = groups.comm_group if groups.comm_group is not None else dedicated_group(groups.dp_group)
        self.device = communication_device(self.comm_group)
        self.rows_per_item = {p: spec.rows_per_item(p) for p in spec.phases.encoder_names}
        self.planner = BackgroundPlanner(enabled=config.background)
        self.reader = BackgroundPlanner(enabled=config.background)  # reads and stages the step after next
        retained = retain_freed_memory()
        if retained is not None and dist.get_rank() == 0:
            _log_once(retained)
        self._planned: Optional[_Planned] = None  # the step being planned
        self._exhausted = False  # no rank has a step left after the one being planned
        self._steps_read = 0  # by the reading thread, one step at a time: the next one's micro-batches
        self._checked = (CheckedSteps(spec.phases.encoder_names) if config.verify_first_step and not config.shadow
                         else None)
        # this rank's peers over the run's plans (what its communicator keeps connected): the planning thread's
        self._run_peers = (RunPeers(self.rank, groups.topology.node_of_rank)
                           if groups.encoder_group is None or own is not None
                           else RunPeers(self.encoder_rank, self.encoder_nodes))  # the encoder group's moves
        self._end_shared = False  # the encoder-only ranks were told that the data ended

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    @property
    def _sends_inputs(self) -> bool:
        """Whether this rank sends the raw encoder items it loads (the encoders' stage; with encoders on every
        stage, the first stage's ranks of encoder replica 0; with encoder ranks of their own, TP rank 0)."""
        return self.groups.encoder_stage and self.stage == 0 and self.replica == 0

    def __iter__(self):
        return self

    def __next__(self) -> Union[BalancedStep, ShadowStep]:
        if self._planned is None and not self._exhausted:  # the first step
            self.reader.submit(self._read)
            self._planned = self._agree(self.reader.result(), digest=None)
            if self._planned is not None:
                self._start_planning()
        if self._planned is None:
            self._share(None)
            self._shutdown()
            raise StopIteration
        current = self._planned
        plan, moves, run_peers = self.planner.result()
        timings = {"plan": self.planner.last_plan_s, "plan_exposed": self.planner.last_exposed_s}
        # The next step's sizes and this plan's digest in one collective: a plan that differs between
        # ranks would make the all-to-alls disagree, so it fails loudly here, before any of them.
        self._planned = self._agree(self.reader.result(), digest=plan.digest)
        self._exhausted = self._planned is None
        self._share(PlannedStep(current.sizes, current.read.num_microbatches, self.topology, self.config.packed,
                                plan.digest))
        start = time.perf_counter()
        step = self._dispatch(plan, moves, current, timings, run_peers)
        timings["dispatch"] = time.perf_counter() - start
        if self._planned is not None:
            self._start_planning()  # planned and read while this step trains
        return step

    def _share(self, step: Optional[PlannedStep]) -> None:
        """With encoder ranks of their own: the step about to be dispatched (None: the data ended, told once), to
        every rank of the encoder group, which the encoder-only ranks plan from (:func:`share_planned_step`)."""
        if self.groups.own_encoder_ranks is None or self._end_shared:
            return
        self._end_shared = step is None
        share_planned_step(step, self.spec.phases.encoder_names, self.groups.encoder_group,
                           self.groups.own_encoder_ranks)

    def _shutdown(self) -> None:
        self._exhausted = True
        self.planner.shutdown()
        self.reader.shutdown()

    # -- reading and planning -------------------------------------------------------------------
    def _read(self) -> _Read:
        """Read one step's examples, check them against the spec and stage what they send (reading thread).
        Whatever goes wrong (a loader error with its manifest line and path, an example that does not fit
        the model, a step cut short) is returned, for every rank to agree on (:meth:`_agree`)."""
        encoders = self.spec.phases.encoder_names
        columns = 2 + len(encoders)  # sample index, items of each encoder phase, tokens
        count = self.step.microbatches_of_step(self._steps_read)  # every rank reads the same step
        self._steps_read += 1
        try:
            batches = list(itertools.islice(self.source, count))
            if batches and len(batches) != count:
                raise ValueError(f"DP rank {self.rank}: the data iterator ended inside a step "
                                 f"({len(batches)} of {count} micro-batches)")
            examples = [e for b in batches for e in b.examples()]
            for example in examples:
                self.spec.check(example)
            local = np.array([[e.sample_index, *(e.num_items(p) for p in encoders), e.num_tokens]
                              for e in examples], dtype=np.int64).reshape(-1, columns)
            if self.config.shadow:  # nothing moves
                return _Read(examples, local, {}, count, batches=batches)
            staged = {"ids": stage_on_host([torch.stack([e.tokens, e.labels], dim=1) for e in examples],
                                           self.device, torch.long, (2,)),
                      "mask": stage_on_host([e.loss_mask for e in examples], self.device, torch.float32, (1,))}
            for encoder_input in self.spec.inputs if self._sends_inputs else ():
                phase = encoder_input.phase
                staged[phase] = stage_on_host([e.items.get(phase, self.spec.no_items(phase)) for e in examples],
                                              self.device, self.input_dtype, encoder_input.item_shape)
            return _Read(examples, local, staged, count, batches=batches)
        except Exception as err:  # noqa: BLE001 -- any loader failure must reach the other ranks
            return _Read([], np.zeros((0, columns), dtype=np.int64), {}, count, problem=err)

    def _agree(self, read: _Read, digest: Optional[int]) -> Optional[_Planned]:
        """The control collective (module docstring): ``read``'s status and sizes, ``digest`` (the plan of
        the step being dispatched; None before the first). Every rank of the job raises alike when any
        rank failed to read (the failing rank its own error, the others quoting it) or when ranks disagree;
        None when no rank has data left."""
        checks = {_STATUS: read.status} if digest is None else {_STATUS: read.status, _DIGEST: digest}
        peers = self.groups.peer_group
        try:
            gathered = gather_item_sizes(read.local_sizes, self.comm_group, checks=checks,
                                         failed=read.problem is not None, peer_group=peers,
                                         max_count=self.step.micro_batch_size * read.num_microbatches)
        except GroupMismatchError as mismatch:
            raise GroupMismatchError(f"DP rank {self.rank}: ranks of the DP group or their TP/PP peers disagree "
                                     f"on whether a step is left, on the plan or on the sizes: {mismatch}") from None
        if gathered.failed:  # every rank of the job knows; the messages travel over the world group
            raise_if_any_rank_failed(read.problem, group=None, what="reading the step's input (post-balancing)")
        if read.status == _EXHAUSTED:
            return None
        encoders = self.spec.phases.encoder_names
        sizes = StepSizes(counts=gathered.counts, num_tokens=gathered.sizes[:, -1],
                          items={p: gathered.sizes[:, 1 + k] for k, p in enumerate(encoders)})
        return _Planned(read, sizes, gathered.sizes[:, 0])

    def _start_planning(self) -> None:
        sizes, num_microbatches = self._planned.sizes, self._planned.read.num_microbatches

        def plan_and_prepare():  # over the global batch this step loaded, in its micro-batches
            plan = plan_step(sizes, self.spec.phases, self.config, self.topology, self.step.micro_batch_size,
                             num_microbatches)
            if self.config.shadow:
                return plan, None, self._run_peers.add(plan.connections)  # steps are planned one at a time, in order
            spread, own = None, None
            if self.groups.own_encoder_ranks is not None:
                layout = self.groups.own_encoder_ranks
                own = (layout, encode_on_own_ranks(plan, layout))
            elif self.groups.encoder_group is not None:  # the log's MB and peers: the moves that run
                spread = spread_over_stages(plan, self.pipeline_size, self.groups.tp_replicas)
                traffic, peers = group_traffic(plan, spread, phase_items(sizes, self.spec.phases), self.encoder_nodes,
                                               self.config.all_to_all, self.topology.node_of_rank)
                connections = functools.reduce(operator.or_, (moved.connections for moved in traffic.values()))
                plan = dataclasses.replace(plan, traffic=traffic, peers=peers, connections=connections)
            run_peers = self._run_peers.add(plan.connections)  # steps are planned one at a time, in order
            return plan, prepare_moves(plan, sizes.num_tokens, self.rows_per_item, self.rank,
                                       self.groups.encoder_stage, self.config.all_to_all, self.topology.node_of_rank,
                                       spread, self.encoder_rank, self.encoder_nodes, own), run_peers

        self.planner.submit(plan_and_prepare)
        self.reader.submit(self._read)

    # -- moving data ----------------------------------------------------------------------------
    def _dispatch(self, plan: StepPlan, moves: Optional[StepMoves], step: _Planned, timings: Dict[str, float],
                  run_peers: Tuple[int, int]) -> Union[BalancedStep, ShadowStep]:
        if moves is None:  # shadow mode
            return ShadowStep(microbatches=step.read.batches, plan=plan, rank=self.rank,
                              num_tokens=step.sizes.num_tokens, timings=timings, run_peers=run_peers)
        moves = moves.uploaded(self.device)
        staged = step.read.staged
        text = moves.text.start([staged_to_device(staged["ids"], self.device),
                                 staged_to_device(staged["mask"], self.device)],
                                _text_layouts(step.sizes.num_tokens), self.comm_group)
        pending = {}
        group = self.comm_group if self.groups.encoder_group is None else self.groups.encoder_group
        for encoder_input in self.spec.inputs if self.groups.encoder_stage else ():
            phase = encoder_input.phase
            layout = ItemLayout(np.ones(plan.encoders[phase].example.size, dtype=np.int64), encoder_input.item_shape,
                                self.input_dtype)
            sent = (staged_to_device(staged[phase], self.device) if self._sends_inputs
                    else torch.empty((0, *encoder_input.item_shape), dtype=self.input_dtype, device=self.device))
            pending[phase] = moves.inputs[phase].start([sent], [layout], group)
        # A few KB, read on the host when the micro-batches are first used: they are collated there, like
        # the loader's, and forward_step moves them to the model.
        ids, mask = (HostCopy(tensor) for tensor in text.wait())
        inputs = {phase: move.wait()[0].to(self.compute_device, non_blocking=True) for phase, move in pending.items()}
        microbatches = _Collated(plan.num_microbatches,
                                 lambda: self._microbatches(plan, ids.result(), mask.result(), step))
        due = self._checked is not None and self._checked.due(step.sizes.items)
        home = step.read.batches if due else None
        check_again = functools.partial(self._checked.again, step.sizes.items) if due else None
        return BalancedStep(microbatches=microbatches, inputs=inputs, plan=plan, rank=self.rank,
                            num_tokens=step.sizes.num_tokens, rows_per_item=dict(self.rows_per_item),
                            comm_group=self.comm_group, moves=moves, timings=timings, home=home,
                            check_again=check_again, run_peers=run_peers,
                            encoder_group=self.groups.encoder_group, encoder_rank=self.encoder_rank,
                            pipeline_group=self.groups.pipeline_group)

    def _microbatches(self, plan: StepPlan, ids: torch.Tensor, mask: torch.Tensor,
                      step: _Planned) -> List[BalancedMicroBatch]:
        sizes, sample_ids = step.sizes, step.sample_ids
        mine = plan.examples_backbone.items_on(self.rank)  # slot order: micro-batch by micro-batch
        lengths = sizes.num_tokens[mine]
        starts = np.concatenate(([0], np.cumsum(lengths)))
        microbatch = plan.microbatch_of_example[mine]
        build = collate_packed if self.config.packed else collate
        pin = self.compute_device.type == "cuda"  # so that forward_step's copies do not block
        out = []
        for m in range(plan.num_microbatches):
            chosen = np.flatnonzero(microbatch == m)
            batch_examples = [Example(sample_index=int(sample_ids[mine[j]]),
                                      tokens=ids[starts[j]:starts[j + 1], 0], labels=ids[starts[j]:starts[j + 1], 1],
                                      loss_mask=mask[starts[j]:starts[j + 1], 0])
                              for j in chosen]
            if not batch_examples:  # packed mode: a rank with fewer examples than micro-batches
                one = torch.full((1,), self.spec.pad_token_id, dtype=torch.long)
                batch_examples = [Example(sample_index=-1, tokens=one, labels=one, loss_mask=torch.zeros(1))]
            batch = build(batch_examples, self.spec, pad_to=self.step.pad_to)
            out.append(BalancedMicroBatch(
                batch=batch.pin_memory() if pin else batch,
                num_items={p: int(counts[mine[chosen]].sum()) for p, counts in sizes.items.items()}))
        return out
