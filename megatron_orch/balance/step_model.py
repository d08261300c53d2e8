"""The modeled time of a training step on a cluster: the cluster simulator's model, and what locality-aware
planning compares plans by (torch-free).

**Links** (:class:`LinkModel`): an all-to-all takes its busiest rank's ``max(NVLink bytes / NVLink bandwidth,
NIC bytes / NIC bandwidth)`` (a rank's bytes on a link: the larger of what it sends and what it receives
there, as the byte accountant :class:`~megatron_orch.balance.plan.MovedBytes` splits them) plus one latency
(the NIC's if anything crosses nodes, else NVLink's); a node-wise all-to-all
(:meth:`~megatron_orch.balance.plan.Transfer.node_wise`) sends its NVLink bytes, then its NIC bytes, each hop
with its latency. A ring reduction over ``n`` ranks sends
``2 (n - 1) / n`` of its bytes through every rank's slowest link.

**A step** (:class:`StepModel`, :meth:`StepModel.step`) of one DP replica (``tensor_parallel x
pipeline_stages`` GPUs; its compute split evenly over them, at ``tflops`` achieved per GPU for costs in
FLOPs), as the modality-aware schedule runs it:

1. the encoder phases, in order, on the first pipeline stage (the other stages wait; ``encoder_ranks="all"``:
   on every GPU of the job, the items balanced over all of them): forward (a third of each phase's training
   cost); each phase's outputs travel to the backbone ranks while the next phase
   encodes (one communicator: transfers run one after the other); the backbone waits for the last;
2. the backbone, pipelined: the slowest replica's micro-batches through Megatron's 1F1B or interleaved
   schedule, one by one (:class:`~megatron_orch.balance.pipeline_schedule.PipelineSchedule`,
   :meth:`StepModel.pipelined`; equal micro-batches of a load: ``cost / stages * (1 + (stages - 1) /
   (virtual_stages * microbatches))``, :meth:`StepModel.pipelined_even`);
3. every phase's embedding gradients start back at once, after the backbone; each encoder phase runs
   its backward (two thirds of its cost) once its gradients are in;
4. the gradient reduction over the DP group (``grad_bytes``; reduce-scatter and all-gather of the
   distributed optimizer, ``2 (n - 1) / n`` of the bytes, NIC-bound where the group spans nodes):
   overlapped with the backward except the encoders' gradients (reduced after the deferred encoder
   backward) and one ``bucket_bytes`` bucket (Megatron's ``--overlap-grad-reduce`` /
   ``--overlap-param-gather``); with ``fsdp`` the parameters are gathered for the forward and again for
   the backward and the gradients reduce-scattered (1.5 times those bytes), behind the compute except what
   exceeds it and the first bucket's gather;
5. raw encoder inputs and text travel during the previous step (the iterator's prefetch): exposed only
   beyond that step's own time.

With ``overlap=False`` every transfer is exposed (the simulator's former model).

**Encoder GPUs of their own** (``encoder_gpus`` > 0, :meth:`StepModel.own_encoder_step`): the encoder phases run
on that many GPUs beside the replicas' (groups of the encoders' TP size), which encode the next batch while the
replicas train this one: the step is the slower side (the encoders' forward and backward and the last bucket of
their gradient reduction over their groups, or the backbone and the last bucket of its reduction over DP), plus
every embedding all-to-all and its gradients' (exposed: the backbone waits for its embeddings, the encoders for
their gradients). It assumes the encoders' forward of the next batch may run ahead of this batch's encoder
update (one step of encoder weight staleness, as asynchronous pipelines take it; a synchronous schedule that
streams micro-batches to the backbone pays its fill and drain instead, which the model leaves out).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Sequence, Tuple

import numpy as np

from megatron_orch.balance.pipeline_schedule import PipelineSchedule
from megatron_orch.balance.plan import MovedBytes

DEFAULT_TFLOPS = 400.0  # assumed achieved bf16 TFLOP/s per GPU for costs in FLOPs
# Where the encoder phases run: on each replica's first pipeline stage (its TP group), or on every GPU of the
# job (each stage's GPUs, at the encoders' own TP size), balanced over all of them.
ENCODER_RANKS = ("first-stage", "all")


@dataclass(frozen=True)
class LinkModel:
    """Bandwidths and latencies per GPU. Defaults: 8-GPU H100/H200 nodes, NVLink 4 (450 GB/s per GPU and
    direction), one 400 Gb/s NIC per GPU."""

    gpus_per_node: int = 8
    nvlink_gbytes_per_s: float = 450.0
    nic_gbits_per_s: float = 400.0
    nvlink_latency_us: float = 5.0
    nic_latency_us: float = 20.0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not (value >= 0 if f.name.endswith("latency_us") else value > 0):
                raise ValueError(f"link model: {f.name} must be {'>=' if 'latency' in f.name else '>'} 0, got {value}")

    def alltoall_seconds(self, moved: MovedBytes) -> float:
        """Time of one all-to-all that sends ``moved`` (``Transfer.moved_bytes`` over the nodes)."""
        return Busiest.of(moved).seconds(self)

    def ring_seconds(self, nbytes: float, num_ranks: int, crosses_nodes: bool) -> float:
        """A ring reduction (or gather) of ``nbytes`` per rank over ``num_ranks`` ranks."""
        if num_ranks <= 1 or nbytes <= 0:
            return 0.0
        volume = 2.0 * (num_ranks - 1) / num_ranks * nbytes
        if crosses_nodes:
            return volume / (self.nic_gbits_per_s * 1e9 / 8) + self.nic_latency_us * 1e-6
        return volume / (self.nvlink_gbytes_per_s * 1e9) + self.nvlink_latency_us * 1e-6


@dataclass(frozen=True)
class Busiest:
    """One all-to-all as the link model sees it: the busiest rank's NVLink and NIC bytes (each the larger of
    a rank's sends and receives on that link), whether anything moves within nodes, across them, and whether
    the two run one after the other (``sequential``: a node-wise all-to-all's hops, each with its latency)
    instead of at once."""

    nvlink_bytes: float
    nic_bytes: float
    within: bool
    across: bool
    sequential: bool = False

    @classmethod
    def of(cls, moved: MovedBytes) -> "Busiest":
        nvlink = np.maximum(moved.sent_intra, moved.received_intra).max(initial=0.0)
        nic = np.maximum(moved.sent_inter, moved.received_inter).max(initial=0.0)
        return cls(float(nvlink), float(nic), bool(moved.intra_node > 0), bool(moved.inter_node > 0),
                   moved.node_wise)

    def seconds(self, link: LinkModel) -> float:
        nvlink = self.nvlink_bytes / (link.nvlink_gbytes_per_s * 1e9)
        nic = self.nic_bytes / (link.nic_gbits_per_s * 1e9 / 8)
        if self.sequential:
            return (nvlink + link.nvlink_latency_us * 1e-6 * self.within
                    + nic + link.nic_latency_us * 1e-6 * self.across)
        latency = link.nic_latency_us if self.across else (link.nvlink_latency_us if self.within else 0.0)
        return max(nvlink, nic) + latency * 1e-6

    def nic_breakpoint(self, link: LinkModel) -> Optional[float]:
        """The NIC bandwidth (Gb/s) below which this all-to-all is NIC-bound (None: no such point, nothing
        crosses nodes or the hops run one after the other)."""
        if self.nic_bytes <= 0 or self.sequential:
            return None
        if self.nvlink_bytes <= 0:
            return np.inf
        return self.nic_bytes * 8 / 1e9 / (self.nvlink_bytes / (link.nvlink_gbytes_per_s * 1e9))


@dataclass(frozen=True)
class PipelinedBackbone:
    """The backbone of a step as the pipeline schedule runs it: the slowest replica's seconds, and how many of
    them its stages wait beyond their share of its work (``bubble``)."""

    seconds: float
    bubble: float


@dataclass(frozen=True)
class StepModel:
    """How a step is modeled (module docstring): the links, the achieved FLOP rate, the model-parallel
    layout of a DP replica, the gradient bytes it reduces, and whether transfers overlap as the
    schedule overlaps them."""

    link: LinkModel = LinkModel()
    tflops: float = DEFAULT_TFLOPS
    tensor_parallel: int = 1
    pipeline_stages: int = 1
    virtual_stages: int = 1
    grad_bytes: float = 0.0          # gradient bytes one GPU reduces per step (0: not modeled)
    encoder_grad_bytes: float = 0.0  # of which the encoders' (reduced after their deferred backward)
    bucket_bytes: float = 80e6       # Megatron DDP's bucket: 40M bf16 parameters
    fsdp: bool = False
    overlap: bool = True
    lowest_nic_gbits_per_s: float = 1.0  # locality-aware plans: never slower from here to the link's bandwidth
    encoder_ranks: str = "first-stage"    # where the encoder phases run (ENCODER_RANKS)
    encoder_tensor_parallel: Optional[int] = None  # the encoders' TP size under "all" (None: tensor_parallel)
    encoder_gpus: int = 0  # encoder GPUs of their own, beside the replicas' (0: the encoders on the replicas' GPUs)

    def __post_init__(self):
        if not self.tflops > 0:
            raise ValueError(f"step model: tflops must be > 0, got {self.tflops}")
        for name in ("tensor_parallel", "pipeline_stages", "virtual_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"step model: {name} must be >= 1, got {getattr(self, name)}")
        if self.virtual_stages > 1 and self.pipeline_stages == 1:
            raise ValueError("step model: virtual pipeline stages need pipeline_stages > 1")
        if self.encoder_ranks not in ENCODER_RANKS:
            raise ValueError(f"step model: encoder_ranks must be one of {ENCODER_RANKS}, got {self.encoder_ranks!r}")
        etp = self.encoder_tensor_parallel
        own = self.encoder_gpus > 0
        if etp is not None and not (1 <= etp and self.tensor_parallel % etp == 0 and (self.encoder_ranks == "all"
                                                                                       or own)):
            raise ValueError(f"step model: encoder_tensor_parallel {etp} must divide tensor_parallel "
                             f"{self.tensor_parallel}, with encoder_ranks 'all' or encoder GPUs of their own")
        if self.encoder_gpus < 0 or (own and self.encoder_gpus % (etp or self.tensor_parallel)):
            raise ValueError(f"step model: encoder_gpus {self.encoder_gpus} must be >= 0 and a multiple of the "
                             f"encoders' TP size {etp or self.tensor_parallel}")
        if own and self.fsdp:
            raise ValueError("step model: encoder GPUs of their own (encoder_gpus) with fsdp are not modeled")
        if own and self.encoder_ranks == "all":
            raise ValueError("step model: encoder GPUs of their own (encoder_gpus) and encoder_ranks 'all' exclude "
                             "each other")

    @property
    def encoder_groups_per_replica(self) -> int:
        """How many encoder groups (of ``encoder_tensor_parallel`` GPUs) one replica's GPUs hold: one (its first
        stage's TP group) under ``first-stage``, every stage's TP groups split to the encoders' TP under ``all``."""
        if self.encoder_ranks == "first-stage":
            return 1
        return self.pipeline_stages * self.tensor_parallel // (self.encoder_tensor_parallel or self.tensor_parallel)

    def encoder_groups(self, dp: int) -> int:
        """Encoder groups (of the encoders' TP size) the job's encoder items are balanced over: ``dp`` x
        :attr:`encoder_groups_per_replica`, or the encoder GPUs' own groups."""
        if self.encoder_gpus:
            return self.encoder_gpus // (self.encoder_tensor_parallel or self.tensor_parallel)
        return dp * self.encoder_groups_per_replica

    def with_nic(self, nic_gbits_per_s: float) -> "StepModel":
        return dataclasses.replace(self, link=dataclasses.replace(self.link, nic_gbits_per_s=nic_gbits_per_s))

    @property
    def schedule(self) -> PipelineSchedule:
        """A replica's pipeline schedule (stages and model chunks)."""
        return PipelineSchedule(self.pipeline_stages, self.virtual_stages)

    def pipelined(self, microbatch_seconds, first_forward=None, first_backward=None) -> PipelinedBackbone:
        """The backbone of the slowest replica: ``microbatch_seconds`` ``(replicas, M)``, each micro-batch's
        training seconds on its replica (in running order); ``first_forward`` / ``first_backward``: seconds
        each micro-batch adds to its first stage (upstream's encoders inside the micro-batch)."""
        costs = np.atleast_2d(np.asarray(microbatch_seconds, dtype=np.float64))
        if costs.size == 0:
            return PipelinedBackbone(0.0, 0.0)
        steps = self.schedule.replica_seconds(costs, first_forward, first_backward)
        r = int(np.argmax(steps))
        extras = [np.asarray(e, dtype=np.float64).reshape(costs.shape)[r].sum()
                  for e in (first_forward, first_backward) if e is not None]
        work = costs[r].sum() / self.pipeline_stages + sum(extras)  # the busiest stage's: the first
        return PipelinedBackbone(float(steps[r]), float(steps[r] - work))

    def pipelined_even(self, seconds: float, microbatches: int) -> PipelinedBackbone:
        """The backbone of a replica whose ``seconds`` of training split into ``microbatches`` equal ones."""
        return self.pipelined(np.full((1, max(microbatches, 1)), seconds / max(microbatches, 1)))

    def compute_seconds(self, cost: float, in_seconds: bool) -> float:
        """Seconds of one replica's ``cost`` (training FLOPs, or seconds measured on one GPU) on its GPUs."""
        seconds = cost if in_seconds else cost / (self.tflops * 1e12)
        return seconds / self.tensor_parallel

    def step(self, encoders: Sequence[Tuple[str, float]], backbone: PipelinedBackbone,
             embeddings: Mapping[str, Busiest], prefetched: Sequence[Busiest] = (),
             dp: int = 1, replicas_per_node: int = 1, other_compute: float = 0.0) -> Dict[str, float]:
        """The parts of a step (seconds) and their sum, ``"step"``.

        ``encoders``: (phase, training seconds of the slowest rank, already on the replica's TP group) in the
        order the phases run; ``backbone_seconds``: the slowest rank's backbone training seconds on its TP
        group (all stages' layers); ``embeddings``: each encoder phase's output all-to-all (its gradients
        travel back by the inverse one, the same bytes); ``prefetched``: raw inputs and text, moved during
        the previous step; ``dp``, ``replicas_per_node``: for the gradient reduction's ring;
        ``other_compute``: seconds of compute outside this schedule (upstream's end-to-end examples)."""
        link = self.link
        seconds = {name: b.seconds(link) for name, b in embeddings.items()}
        forward = [cost / 3.0 for _, cost in encoders]
        backward = [2.0 * cost / 3.0 for _, cost in encoders]
        names = [name for name, _ in encoders]
        moves = [seconds.get(name, 0.0) for name in names]
        if self.overlap:
            t, link_free = 0.0, 0.0  # forward: a phase's outputs travel while the next one encodes
            for f, m in zip(forward, moves):
                t += f
                link_free = max(link_free, t) + m
            encoders_forward = max(t, link_free)
            t, arrived = 0.0, 0.0  # backward: every gradient transfer starts at once, one after the other
            for b, m in zip(backward, moves):
                arrived += m
                t = max(t, arrived) + b
            encoders_backward = t
        else:
            encoders_forward = sum(forward) + sum(moves)
            encoders_backward = sum(backward) + sum(moves)
        compute = sum(forward) + sum(backward) + backbone.seconds + other_compute
        crosses = dp > replicas_per_node
        grads = 0.0
        if self.grad_bytes > 0 and dp > 1:
            # reduce-scatter + all-gather: one ring's 2 (n - 1) / n; FSDP gathers the parameters for the
            # forward and again for the backward and reduce-scatters the gradients: 1.5 times that
            whole = link.ring_seconds(self.grad_bytes, dp, crosses) * (1.5 if self.fsdp else 1.0)
            if not self.overlap:
                grads = whole
            elif self.fsdp:  # behind the compute, but for what exceeds it and the first bucket's gather
                grads = max(0.0, whole - compute) + link.ring_seconds(self.bucket_bytes, dp, crosses) / 2
            else:  # behind the backward, but for the encoders' gradients and the last bucket
                tail = min(self.grad_bytes, self.encoder_grad_bytes + self.bucket_bytes)
                grads = link.ring_seconds(tail, dp, crosses)
        step = encoders_forward + backbone.seconds + encoders_backward + other_compute + grads
        prefetch = sum(b.seconds(link) for b in prefetched)
        exposed_prefetch = max(0.0, prefetch - step) if self.overlap else prefetch
        return {"encoders_forward": encoders_forward, "backbone": backbone.seconds,
                "pipeline_bubble": backbone.bubble, "encoders_backward": encoders_backward, "grad_reduce": grads,
                "prefetched_moves": prefetch, "exposed_prefetch": exposed_prefetch,
                "exposed_moves": encoders_forward + encoders_backward - sum(forward) - sum(backward) + exposed_prefetch,
                "compute": compute, "step": step + exposed_prefetch}

    def own_encoder_step(self, encoders: Sequence[Tuple[str, float]], backbone: PipelinedBackbone,
                         embeddings: Mapping[str, Busiest], prefetched: Sequence[Busiest] = (), dp: int = 1,
                         replicas_per_node: int = 1) -> Dict[str, float]:
        """The parts of a step with the encoders on GPUs of their own (``encoder_gpus``), as :meth:`step` gives
        them. The encoder GPUs encode the next batch while the replicas train this one, so the step is the
        slower side (the encoders' forward and backward with their gradient reduction, or the backbone with its
        own), plus every embedding all-to-all and its gradients' (exposed: the backbone waits for its
        embeddings, the encoders for their gradients); raw inputs and text during the previous step.
        ``encoders``: (phase, training seconds of the busiest encoder group, on its GPUs)."""
        link = self.link
        encoder_compute = sum(cost for _, cost in encoders)
        moves = 2.0 * sum(b.seconds(link) for b in embeddings.values())  # outputs there, gradients back
        groups = self.encoder_groups(dp)
        etp = self.encoder_tensor_parallel or self.tensor_parallel
        backbone_grads = max(self.grad_bytes - self.encoder_grad_bytes, 0.0)
        sides = []
        for nbytes, ranks, crosses in ((self.encoder_grad_bytes, groups, groups > link.gpus_per_node // etp),
                                       (backbone_grads, dp, dp > replicas_per_node)):
            whole = link.ring_seconds(nbytes, ranks, crosses)
            sides.append(whole if not self.overlap else link.ring_seconds(min(nbytes, self.bucket_bytes), ranks,
                                                                          crosses))
        encoder_side, backbone_side = encoder_compute + sides[0], backbone.seconds + sides[1]
        compute, grads = (encoder_compute, sides[0]) if encoder_side > backbone_side else (backbone.seconds, sides[1])
        step = compute + grads + moves
        prefetch = sum(b.seconds(link) for b in prefetched)
        exposed_prefetch = max(0.0, prefetch - step) if self.overlap else prefetch
        return {"encoders_forward": encoder_compute / 3.0, "backbone": backbone.seconds,
                "pipeline_bubble": backbone.bubble, "encoders_backward": 2.0 * encoder_compute / 3.0,
                "grad_reduce": grads, "prefetched_moves": prefetch, "exposed_prefetch": exposed_prefetch,
                "exposed_moves": moves + exposed_prefetch, "compute": compute, "encoder_gpus_seconds": encoder_side,
                "backbone_gpus_seconds": backbone_side, "step": step + exposed_prefetch}

    def nic_breakpoints(self, moves: Sequence[Busiest], lowest: float) -> np.ndarray:
        """NIC bandwidths (Gb/s) between ``lowest`` and the link's where a step's time can bend: where an
        all-to-all turns NIC-bound, and a log grid between (exposure bends at compute-dependent points)."""
        highest = self.link.nic_gbits_per_s
        points = [lowest, highest] + [p for b in moves for p in [b.nic_breakpoint(self.link)]
                                      if p is not None and lowest < p < highest]
        points += list(np.geomspace(lowest, highest, 25))
        return np.unique(np.asarray(points, dtype=np.float64))
