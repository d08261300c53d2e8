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
each stage's DP group, as with ``FIRST_STAGE``. :func:`unsupported_layout` names the parallel layouts it does not
run (checked before any collective). :func:`group_traffic` counts what these moves send, for the iteration
line's MB figures.
"""
from __future__ import annotations

from dataclasses import dataclass
import functools
import operator
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

from megatron_orch.balance.plan import Connections, MovedBytes, Peers, Placement, Transfer
from megatron_orch.balance.workload import PhaseItems
from megatron_orch.orchestrator.config import EncoderRanks, OrchestratorConfig
from megatron_orch.orchestrator.step_plan import EncoderChunks, StepMove, StepPlan, step_moves

FLAG = "--orch-encoder-ranks all"
ETP_FLAG = "--orch-encoder-tensor-parallel-size"


@dataclass(frozen=True)
class EncoderRanksDecision:
    """The encoder layout a job runs (``ranks``: ``FIRST_STAGE`` or ``ALL``), what was asked (``asked``) and why
    (``reason``, one clause)."""

    ranks: EncoderRanks
    asked: EncoderRanks
    reason: str

    def line(self) -> str:
        """Rank 0's line at start: which layout runs and why."""
        where = "every rank" if self.ranks is EncoderRanks.ALL else "the first pipeline stage"
        return (f"post-balancing: the encoders on {where} (--orch-encoder-ranks {self.asked.value}"
                f"{'' if self.asked is self.ranks else ': ' + self.ranks.value}): {self.reason}")


def decide_encoder_ranks(config: OrchestratorConfig, *, pipeline_parallel_size: int, tensor_parallel_size: int,
                         unavailable: Optional[str] = None,
                         memory_refusal: Callable[[], Optional[str]] = lambda: None,
                         memory: str = "per-GPU memory not checked") -> EncoderRanksDecision:
    """The layout ``config.encoder_ranks`` runs: as asked where ``FIRST_STAGE`` or ``ALL`` (the entry point refuses
    an ``ALL`` it cannot run); ``AUTO``: ``ALL`` where it differs from ``FIRST_STAGE`` (pipeline parallelism, or the
    encoders at a TP size below the backbone's), the entry point can run it (``unavailable``: why not, one line, e.g.
    :func:`unsupported_layout`'s; None: it can), its moves run flat and the per-GPU memory model says it fits
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
    if config.all_to_all != "flat":
        return first(f"{FLAG} runs its moves flat, not {config.all_to_all}")
    refused = memory_refusal()
    if refused is not None:
        return first(refused)
    replicas = tensor_parallel_size // etp if tensor_parallel_size % etp == 0 else 1
    return EncoderRanksDecision(EncoderRanks.ALL, asked, f"each encoder phase over DP x {pipeline_parallel_size} "
                                f"pipeline stages x {replicas} encoder replica{'s' if replicas > 1 else ''} per TP group "
                                f"instead of the first stage's DP ranks; {memory}")


def unsupported_layout(*, sharded: Optional[str], tensor_parallel_size: int = 1,
                       encoder_tensor_parallel_size: Optional[int] = None) -> Optional[str]:
    """Why the encoders cannot go on every pipeline stage in this layout (None: they can), one line naming the
    setting. ``encoder_tensor_parallel_size`` (None: ``tensor_parallel_size``, the backbone's) must divide the
    backbone's."""
    etp = tensor_parallel_size if encoder_tensor_parallel_size is None else encoder_tensor_parallel_size
    if etp < 1 or tensor_parallel_size % etp:
        return (f"{ETP_FLAG} {etp} does not divide --tensor-model-parallel-size {tensor_parallel_size} (each backbone "
                "TP group must hold whole encoder replicas)")
    if sharded is not None:
        return f"{FLAG} with {sharded} is not supported (each stage's encoders are sharded over DP alone)"
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
    out = []
    for move in step_moves(plan):
        if move.kind == "text":
            out.append(move)
            continue
        encoder = plan.encoders[move.items_of]
        encoded = group.encode[move.items_of]
        if move.kind == "inputs":
            transfer = Transfer(_on_first_stage(encoder.home, group), encoded)
            out.append(StepMove(move.name, move.kind, move.items_of, move.phase, transfer, move.with_gradients))
            continue
        backbone = plan.examples_backbone.expand(encoder.example)
        copies = group.tp_replicas
        if copies == 1:
            transfer = Transfer(encoded, _on_first_stage(backbone, group))
            out.append(StepMove(move.name, move.kind, move.items_of, move.phase, transfer, move.with_gradients))
            continue
        held = encoded.counts()[encoded.rank]  # copy c of an item: slot c * held + its slot, on its encoder rank
        src = Placement._valid(np.tile(encoded.rank, copies),
                               np.concatenate([c * held + encoded.slot for c in range(copies)]), group.num_ranks)
        dst = [_on_first_stage(backbone, group, c) for c in range(copies)]
        dst = Placement._valid(np.concatenate([p.rank for p in dst]), np.concatenate([p.slot for p in dst]),
                               group.num_ranks)
        out.append(CopiedStepMove(move.name, move.kind, move.items_of, move.phase, Transfer(src, dst),
                                  move.with_gradients, copies=copies))
    return out


def group_traffic(plan: StepPlan, group: EncoderGroupPlan, items: Dict[str, PhaseItems],
                  node_of_rank) -> Tuple[Dict[str, MovedBytes], Peers]:
    """What the step's moves over the encoder group send (:func:`group_moves`; ``items``: ``phase_items`` of the
    step, ``node_of_rank``: the node of every encoder-group rank), as ``StepPlan.traffic`` counts the first-stage
    layout's: per move its forward bytes, and an embeddings move's gradients back as ``"<name> gradients"`` (a
    copied move's forward sends every copy, its gradients one). The text counts once, as the first stage's DP
    group at replica 0 moves it (each stage's DP group moves the same). Also each rank's distinct peers over them."""
    traffic = {}
    for move in group_moves(plan, group):
        nbytes = move.bytes_of(items)
        transfer = move.transfer
        if move.kind == "text":
            transfer = Transfer(_on_first_stage(transfer.src, group), _on_first_stage(transfer.dst, group))
        copies = move.copies if isinstance(move, CopiedStepMove) else 1
        traffic[move.name] = transfer.moved_bytes(np.tile(nbytes, copies), node_of_rank)
        if move.with_gradients:
            traffic[f"{move.name} gradients"] = move.gradients().moved_bytes(nbytes, node_of_rank)
    connected = functools.reduce(operator.or_, (moved.connections for moved in traffic.values()),
                                 Connections.none(group.num_ranks))
    return traffic, connected.peers(node_of_rank)
