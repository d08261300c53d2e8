"""Encoders on every pipeline stage (``EncoderRanks.ALL``): which rank of the encoder group encodes each item, and
the step's moves that follow from it. Torch-free, the same on every rank.

The encoders run at their own tensor-parallel size (encoder TP, default the backbone's TP), so each backbone TP
group holds ``R = TP / encoder TP`` encoder replicas: TP rank ``t`` is encoder TP rank ``t % encoder TP`` of
replica ``j = t // encoder TP``. The encoder group is the job's DP x PP x R encoder replicas at one encoder TP rank
(and CP rank); its rank ``g = (stage * DP + dp) * R + j`` (the order of the global ranks in megatron-core's
``tp-cp-dp-pp`` layout). The step's plan balances each encoder phase over DP
(:func:`~megatron_orch.orchestrator.step_plan.plan_step`); :func:`spread_over_stages` then splits each DP rank's
items of a phase over its ``PP x R`` replicas, consecutive slots per replica (replica ``q = stage * R + j``). Every
item of a phase costs the same (one fixed shape), so the split by count is exact: ``ceil(ceil(n / DP) / (PP R))
= ceil(n / (DP x PP x R))`` items on the busiest rank, the bound over the whole group. The replicas that get one
item more rotate with the phase, so that no replica gets every phase's extra item.

The moves (:func:`group_moves`): raw inputs from the first-stage rank of replica 0 that loaded their example (only
it stages what it loads) to their encoder rank, and the encoder outputs from there straight to every replica of
the first-stage TP group that runs their example's first backbone layers (each of its TP ranks needs them: ``R``
copies, :class:`CopiedStepMove`), in one all-to-all over the encoder group; their gradients back by the inverse
from replica 0 alone (every TP rank of the backbone holds the same embedding gradient). The text moves within
each stage's DP group, as with ``FIRST_STAGE``. Either runs flat or node-wise (``OrchestratorConfig.all_to_all``:
the group's moves as two hops over the encoder group's nodes, the text's over its DP group's).
:func:`unsupported_layout` names the parallel layouts it does not run (checked before any collective). :func:`group_traffic` counts what these moves send, for the iteration
line's MB figures.

Encoder GPUs of their own (:class:`OwnEncoderRanks`: megatron-core MIMO's non-colocated grids, the encoders on ranks
that hold no backbone): :func:`encode_on_own_ranks` balances each phase's items over the encoder ranks,
:func:`own_ranks_moves` moves the raw inputs there from the backbone rank that loaded each example, the outputs to
every TP rank of the backbone DP rank that runs it and the gradients back, in all-to-alls over the encoder and
backbone ranks together. The encoder-only ranks load nothing: each step the backbone's first rank sends them the
step's sizes and node layout (:func:`step_message`, read back by :func:`read_step_message`), from which they plan the
same step.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import operator
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron_orch.balance.plan import Connections, MovedBytes, Peers, Placement, Transfer
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import PhaseItems, StepSizes
from megatron_orch.orchestrator.config import EncoderRanks, OrchestratorConfig, SettingNaming, config_setting
from megatron_orch.orchestrator.step_plan import EncoderChunks, StepMove, StepPlan, step_moves

@dataclass(frozen=True)
class EncoderRanksDecision:
    """The encoder layout a job runs (``ranks``: ``FIRST_STAGE`` or ``ALL``), what was asked (``asked``) and why
    (``reason``, one clause)."""

    ranks: EncoderRanks
    asked: EncoderRanks
    reason: str

    def line(self, naming: SettingNaming = config_setting) -> str:
        """Rank 0's line at start: which layout runs and why (the setting as ``naming`` names it: a command line
        passes its flags')."""
        where = "every rank" if self.ranks is EncoderRanks.ALL else "the first pipeline stage"
        return (f"post-balancing: the encoders on {where} ({naming('encoder_ranks', self.asked.value)}"
                f"{'' if self.asked is self.ranks else ': ' + self.ranks.value}): {self.reason}")


def decide_encoder_ranks(config: OrchestratorConfig, *, pipeline_parallel_size: int, tensor_parallel_size: int,
                         unavailable: Optional[str] = None,
                         memory_refusal: Callable[[], Optional[str]] = lambda: None,
                         memory: str = "per-GPU memory not checked") -> EncoderRanksDecision:
    """The layout ``config.encoder_ranks`` runs: as asked where ``FIRST_STAGE`` or ``ALL`` (the entry point refuses
    an ``ALL`` it cannot run); ``AUTO``: ``ALL`` where it differs from ``FIRST_STAGE`` (pipeline parallelism, or the
    encoders at a TP size below the backbone's), the entry point can run it (``unavailable``: why not, one line, e.g.
    :func:`unsupported_layout`'s; None: it can) and the per-GPU memory model says it fits
    (``memory_refusal()``: why not, asked last; None: it fits or nothing to check; ``memory``: what was checked, for
    the reason), else ``FIRST_STAGE``. Shadow mode trains as loaded (``FIRST_STAGE``)."""
    asked = config.encoder_ranks
    if asked is not EncoderRanks.AUTO:
        return EncoderRanksDecision(asked, asked, "as asked")
    first = functools.partial(EncoderRanksDecision, EncoderRanks.FIRST_STAGE, asked)
    if config.shadow:
        return first("shadow mode trains on the loader's layout")
    etp = config.encoder_tensor_parallel_size or tensor_parallel_size
    if pipeline_parallel_size == 1 and etp == tensor_parallel_size:
        return first("one pipeline stage, the encoders at the backbone's tensor-parallel size: the same ranks encode "
                     "in either layout")
    if unavailable is not None:
        return first(unavailable)
    refused = memory_refusal()
    if refused is not None:
        return first(refused)
    replicas = tensor_parallel_size // etp if tensor_parallel_size % etp == 0 else 1
    return EncoderRanksDecision(EncoderRanks.ALL, asked, f"each encoder phase over DP x {pipeline_parallel_size} "
                                f"pipeline stages x {replicas} encoder replica{'s' if replicas > 1 else ''} per TP group "
                                f"instead of the first stage's DP ranks; {memory}")


def unsupported_layout(*, sharded: Optional[str], tensor_parallel_size: int = 1,
                       encoder_tensor_parallel_size: Optional[int] = None,
                       naming: SettingNaming = config_setting) -> Optional[str]:
    """Why the encoders cannot go on every pipeline stage in this layout (None: they can), one line naming the
    setting as ``naming`` does. ``encoder_tensor_parallel_size`` (None: ``tensor_parallel_size``, the backbone's)
    must divide the backbone's; ``sharded``: the sharded data parallelism the job runs (None: none)."""
    etp = tensor_parallel_size if encoder_tensor_parallel_size is None else encoder_tensor_parallel_size
    if etp < 1 or tensor_parallel_size % etp:
        return (f"{naming('encoder_tensor_parallel_size', str(etp))} does not divide the backbone's tensor-parallel "
                f"size {tensor_parallel_size} (each backbone TP group must hold whole encoder replicas)")
    if sharded is not None:
        return (f"{naming('encoder_ranks', EncoderRanks.ALL.value)} with {sharded} is not supported (each stage's "
                "encoders are sharded over DP alone)")
    return None


@dataclass(frozen=True, eq=False)
class EncoderGroupPlan:
    """Where every encoder phase's items are encoded over the encoder group (``encode``, ranks ``(stage * DP +
    dp) * R + j``, slots in the order of the DP plan's; ``tp_replicas``: ``R``, the encoder replicas in one
    backbone TP group) and in which chunks (``chunks``: the DP plan's chunk size, each rank keeping at most what
    its DP rank's plan keeps; None where the DP plan has none)."""

    data_parallel_size: int
    pipeline_size: int
    encode: Dict[str, Placement]
    chunks: Dict[str, Optional[EncoderChunks]]
    tp_replicas: int = 1

    @property
    def num_ranks(self) -> int:
        return self.data_parallel_size * self.pipeline_size * self.tp_replicas

    def group_rank(self, stage, dp_rank, replica=0):
        """The encoder-group rank of pipeline stage ``stage`` of DP rank ``dp_rank``, encoder replica
        ``replica`` of its TP group (ints or arrays)."""
        return (stage * self.data_parallel_size + dp_rank) * self.tp_replicas + replica

    def counts(self, phase: str) -> np.ndarray:
        """Items of ``phase`` each encoder-group rank encodes."""
        return self.encode[phase].counts()


@dataclass(frozen=True, eq=False, kw_only=True)
class CopiedStepMove(StepMove):
    """A step's move whose items go to ``copies`` destinations each (the encoder outputs to every encoder replica
    of the backbone's TP group): item ``i`` of the original ``n`` travels as items ``i, n + i, ...``, the sender
    sending its rows ``copies`` times, one block after the other. Their gradients come back from the first copy's
    destination alone."""

    copies: int

    def gradients(self) -> Transfer:
        if not self.with_gradients:
            raise ValueError(f"{self.name}: no gradients come back")
        first = self.transfer.src.num_items // self.copies
        src, dst = (Placement._valid(p.rank[:first], p.slot[:first], p.num_ranks)  # copy 0 of a valid placement
                    for p in (self.transfer.src, self.transfer.dst))
        return Transfer(dst, src)


def stage_of_items(encode: Placement, pipeline_size: int, rotation: int = 0) -> np.ndarray:
    """The pipeline stage (encoder replica) of every item placed by ``encode`` (over DP ranks): each DP rank's
    items in slot order, split into ``pipeline_size`` runs of consecutive slots whose sizes differ by one at most;
    the longer runs go to stages ``rotation, rotation + 1, ...`` (mod ``pipeline_size``)."""
    if pipeline_size < 1:
        raise ValueError(f"pipeline_size must be >= 1, got {pipeline_size}")
    count = encode.counts()[encode.rank]  # items on the item's DP rank
    base, extra = count // pipeline_size, count % pipeline_size
    stage = np.zeros(encode.num_items, dtype=np.int64)
    end = np.zeros(encode.num_items, dtype=np.int64)
    for s in range(pipeline_size - 1):  # the item lies past the end of stage s's run: a later stage
        end += base + (((s - rotation) % pipeline_size) < extra)
        stage += encode.slot >= end
    return stage


def spread_over_stages(plan: StepPlan, pipeline_size: int, tp_replicas: int = 1) -> EncoderGroupPlan:
    """Every encoder phase of ``plan`` spread over the encoder group of ``pipeline_size`` stages x ``tp_replicas``
    encoder replicas per TP group (module docstring); phase ``k`` gives its extra items to the replicas from ``k``
    on."""
    dp = plan.examples_home.num_ranks
    group = EncoderGroupPlan(dp, pipeline_size, {}, {}, tp_replicas)
    for k, (phase, encoder) in enumerate(plan.encoders.items()):
        replica = stage_of_items(encoder.encode, pipeline_size * tp_replicas, rotation=k)  # stage * R + j
        ranks = group.group_rank(replica // tp_replicas, encoder.encode.rank, replica % tp_replicas)
        placement = Placement.from_ranks(ranks, group.num_ranks, key=encoder.encode.slot)
        group.encode[phase] = placement
        dp_chunks = encoder.chunks
        group.chunks[phase] = None if dp_chunks is None else EncoderChunks(
            dp_chunks.items, np.minimum(placement.counts(),
                                        np.repeat(np.tile(np.asarray(dp_chunks.kept), pipeline_size), tp_replicas)))
    return group


def _on_first_stage(placement: Placement, group: EncoderGroupPlan, replica: int = 0) -> Placement:
    """``placement`` (over DP ranks) as a placement over the encoder group: the same DP ranks of the first stage,
    encoder replica ``replica``."""
    return Placement._valid(group.group_rank(0, placement.rank, replica), placement.slot, group.num_ranks)


def group_moves(plan: StepPlan, group: EncoderGroupPlan) -> List[StepMove]:
    """The step's moves (:func:`~megatron_orch.orchestrator.step_plan.step_moves`, in its order and names) with
    every encoder phase's raw inputs and embeddings moving over the encoder group (module docstring); with
    several encoder replicas per TP group the embeddings are a :class:`CopiedStepMove`."""
    return _encoder_moves(plan, group.encode, lambda placement, replica: _on_first_stage(placement, group, replica),
                          group.tp_replicas)


def _encoder_moves(plan: StepPlan, encode: Dict[str, Placement], backbone_at, copies: int) -> List[StepMove]:
    """The step's moves with each encoder phase's items encoded where ``encode`` places them: raw inputs from copy 0
    of the rank that loaded their example, outputs to all ``copies`` of the rank that runs it (``backbone_at(
    placement over DP ranks, copy)``: that placement over the moves' group), gradients back from copy 0."""
    out = []
    for move in step_moves(plan):
        if move.kind == "text":
            out.append(move)
            continue
        encoder = plan.encoders[move.items_of]
        encoded = encode[move.items_of]
        if move.kind == "inputs":
            transfer = Transfer(backbone_at(encoder.home, 0), encoded)
            out.append(StepMove(move.name, move.kind, move.items_of, move.phase, transfer, move.with_gradients))
            continue
        backbone = plan.examples_backbone.expand(encoder.example)
        if copies == 1:
            transfer = Transfer(encoded, backbone_at(backbone, 0))
            out.append(StepMove(move.name, move.kind, move.items_of, move.phase, transfer, move.with_gradients))
            continue
        held = encoded.counts()[encoded.rank]  # copy c of an item: slot c * held + its slot, on its encoder rank
        src = Placement._valid(np.tile(encoded.rank, copies),
                               np.concatenate([c * held + encoded.slot for c in range(copies)]), encoded.num_ranks)
        dst = [backbone_at(backbone, c) for c in range(copies)]
        dst = Placement._valid(np.concatenate([p.rank for p in dst]), np.concatenate([p.slot for p in dst]),
                               encoded.num_ranks)
        out.append(CopiedStepMove(move.name, move.kind, move.items_of, move.phase, Transfer(src, dst),
                                  move.with_gradients, copies=copies))
    return out


@dataclass(frozen=True)
class OwnEncoderRanks:
    """Encoder GPUs of their own (megatron-core MIMO's non-colocated ``module_to_grid_map``): the ranks, in the group
    the moves run over (the world's ranks where that is the world), of every encoder DP rank (``encoder_ranks``, at
    encoder TP 1) and of every backbone TP rank of every backbone DP rank (``backbone_ranks[dp][tp]``); disjoint."""

    encoder_ranks: Tuple[int, ...]
    backbone_ranks: Tuple[Tuple[int, ...], ...]
    num_ranks: int

    def __post_init__(self):
        sizes = {len(tp_group) for tp_group in self.backbone_ranks}
        if not self.encoder_ranks or len(sizes) != 1 or 0 in sizes:
            raise ValueError(f"OwnEncoderRanks: needs encoder ranks and backbone ranks [DP][TP] of one TP size, got "
                             f"{self.encoder_ranks} and {self.backbone_ranks}")
        ranks = np.concatenate([np.asarray(self.encoder_ranks, dtype=np.int64),
                                np.asarray(self.backbone_ranks, dtype=np.int64).ravel()])
        if ranks.min() < 0 or ranks.max() >= self.num_ranks or np.unique(ranks).size != ranks.size:
            raise ValueError(f"OwnEncoderRanks: encoder ranks {self.encoder_ranks} and backbone ranks "
                             f"{self.backbone_ranks} must be distinct ranks of 0..{self.num_ranks - 1}")

    @property
    def tensor_parallel_size(self) -> int:
        """The backbone's TP size: each encoder output goes to that many ranks."""
        return len(self.backbone_ranks[0])

    def backbone_at(self, placement: Placement, tp_rank: int) -> Placement:
        """``placement`` (over backbone DP ranks) over the moves' group, at backbone TP rank ``tp_rank``."""
        ranks = np.asarray(self.backbone_ranks, dtype=np.int64)[:, tp_rank]
        return Placement._valid(ranks[placement.rank], placement.slot, self.num_ranks)


def own_ranks_refusal(config: OrchestratorConfig) -> Optional[str]:
    """Why encoder ranks of their own cannot run ``config`` (None: they can), one line naming the settings: shadow
    mode and the checked first step run the model as loaded (its encoders on the backbone ranks), and the moves run
    flat."""
    if config.shadow or config.verify_first_step:
        return ("encoder ranks of their own run neither shadow mode nor the checked first step (both run the model as "
                "loaded, with its encoders on the backbone ranks): set shadow=False and verify_first_step=False")
    if config.all_to_all != "flat":
        return f"encoder ranks of their own run their moves flat, not {config.all_to_all}: set all_to_all='flat'"
    return None


def encode_on_own_ranks(plan: StepPlan, layout: OwnEncoderRanks) -> Dict[str, Placement]:
    """Where every encoder phase's items are encoded on encoder GPUs of their own (over ``layout.num_ranks``): each
    phase's items in the DP plan's order (DP rank, then slot) split into runs of consecutive items, one per encoder
    rank, whose sizes differ by one at most (every item of a phase costs the same: ``ceil(n / E)`` on the busiest,
    the bound); phase ``k`` gives its extra items to the encoder ranks from ``k`` on."""
    encoders = np.asarray(layout.encoder_ranks, dtype=np.int64)
    out = {}
    for k, (phase, encoder) in enumerate(plan.encoders.items()):
        order = np.lexsort((encoder.encode.slot, encoder.encode.rank))
        position = np.empty(order.size, dtype=np.int64)
        position[order] = np.arange(order.size, dtype=np.int64)
        run = stage_of_items(Placement._valid(np.zeros_like(position), position, 1), encoders.size, rotation=k)
        out[phase] = Placement.from_ranks(encoders[run], layout.num_ranks, key=position)
    return out


@dataclass(frozen=True)
class PlannedStep:
    """What the encoder-only ranks plan one step from (:func:`~megatron_orch.orchestrator.step_plan.plan_step`'s
    inputs that the backbone ranks know and they do not): the global batch's sizes, its micro-batches per DP rank,
    the backbone DP group's nodes, whether the backbone takes packed rows (``--orch-microbatching auto`` as the
    backbone resolved it), and the backbone ranks' plan's digest, which theirs must equal."""

    sizes: StepSizes
    num_microbatches: int
    topology: Topology
    packed: bool
    digest: int


_HEADER = 5  # step_message's numbers before the nodes


def step_message(step: Optional[PlannedStep], phases: Tuple[str, ...]) -> np.ndarray:
    """``step`` (None: the data ended) as one int64 array for the encoder-only ranks: ``[DP, examples,
    micro-batches, packed, digest, node of every DP rank, examples of every DP rank, then per example its item count
    of each of ``phases`` and its tokens]``; empty where the data ended."""
    if step is None:
        return np.zeros(0, dtype=np.int64)
    sizes = step.sizes
    counts = np.asarray(sizes.counts, dtype=np.int64)
    columns = np.stack([*(np.asarray(sizes.items[p], dtype=np.int64) for p in phases),
                        np.asarray(sizes.num_tokens, dtype=np.int64)], axis=1).reshape(-1)
    header = [counts.size, int(counts.sum()), step.num_microbatches, int(step.packed), step.digest]
    return np.concatenate([header,
                           np.asarray(step.topology.node_of_rank, dtype=np.int64), counts, columns]).astype(np.int64)


def read_step_message(message: np.ndarray, phases: Tuple[str, ...]) -> Optional[PlannedStep]:
    """The step :func:`step_message` wrote (None: the data ended); a message of another length or of other phases'
    columns raises, naming both."""
    message = np.asarray(message, dtype=np.int64)
    if message.size == 0:
        return None
    dp, n, num_microbatches, packed, digest = (int(v) for v in message[:_HEADER])
    expected = _HEADER + 2 * dp + n * (len(phases) + 1)
    if message.size != expected:
        raise ValueError(f"step message of {message.size} numbers, expected {expected} for DP {dp}, {n} examples and "
                         f"phases {list(phases)} (do the encoder-only ranks hold the backbone ranks' phases?)")
    nodes, counts = message[_HEADER:_HEADER + dp], message[_HEADER + dp:_HEADER + 2 * dp]
    columns = message[_HEADER + 2 * dp:].reshape(n, len(phases) + 1)
    sizes = StepSizes(counts=counts, items={p: columns[:, k] for k, p in enumerate(phases)},
                      num_tokens=columns[:, -1])
    return PlannedStep(sizes, num_microbatches, Topology(nodes), bool(packed), digest)


def own_ranks_moves(plan: StepPlan, layout: OwnEncoderRanks, encode: Dict[str, Placement]) -> List[StepMove]:
    """The step's moves with the encoders on ranks of their own (``encode``: :func:`encode_on_own_ranks`), in
    :func:`~megatron_orch.orchestrator.step_plan.step_moves`' order and names, over ``layout``'s group: raw inputs
    from backbone TP rank 0 of the DP rank that loaded their example to their encoder rank, outputs to every TP rank
    of the DP rank that runs it (a :class:`CopiedStepMove` at TP > 1), gradients back from its TP rank 0 (every TP
    rank holds the same embedding gradient); the text within the backbone's DP ranks, as the plan moves it."""
    return _encoder_moves(plan, encode, layout.backbone_at, layout.tensor_parallel_size)


def group_traffic(plan: StepPlan, group: EncoderGroupPlan, items: Dict[str, PhaseItems], node_of_rank,
                  all_to_all: str = "flat", dp_node_of_rank=None) -> Tuple[Dict[str, MovedBytes], Peers]:
    """What the step's moves over the encoder group send (:func:`group_moves`; ``items``: ``phase_items`` of the
    step, ``node_of_rank``: the node of every encoder-group rank), as ``StepPlan.traffic`` counts the first-stage
    layout's: per move its forward bytes, and an embeddings move's gradients back as ``"<name> gradients"`` (a
    copied move's forward sends every copy, its gradients one), each run ``all_to_all``. The text counts once, as
    the first stage's DP group at replica 0 moves it (each stage's DP group moves the same; node-wise, its hops are
    over that group's nodes, ``dp_node_of_rank``). Also each rank's distinct peers over them."""
    traffic = {}
    for move in group_moves(plan, group):
        nbytes = move.bytes_of(items)
        if move.kind == "text":
            if all_to_all != "flat" and dp_node_of_rank is None:
                raise ValueError(f"group_traffic: a {all_to_all} text move needs its DP group's nodes "
                                 "(dp_node_of_rank)")
            hops = move.transfer.hops(all_to_all, dp_node_of_rank)
            counted = [Transfer(_on_first_stage(hop.src, group), _on_first_stage(hop.dst, group)).moved_bytes(
                nbytes, node_of_rank) for hop in hops]
            traffic[move.name] = counted[0] if all_to_all == "flat" else MovedBytes.of_hops(counted)
            continue
        copies = move.copies if isinstance(move, CopiedStepMove) else 1
        traffic[move.name] = move.transfer.moved_bytes(np.tile(nbytes, copies), node_of_rank, all_to_all)
        if move.with_gradients:
            traffic[f"{move.name} gradients"] = move.gradients().moved_bytes(nbytes, node_of_rank, all_to_all)
    connected = functools.reduce(operator.or_, (moved.connections for moved in traffic.values()),
                                 Connections.none(group.num_ranks))
    return traffic, connected.peers(node_of_rank)
