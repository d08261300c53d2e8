"""The post-balancing data iterator: wraps Megatron's training data iterator, one global batch per step.

Per step it reads the step's micro-batches from the wrapped iterator, gathers per-example sizes over
the DP group (one fixed-shape collective), takes the step's plan (computed on the background thread
while the previous step trained), checks that every rank holds the same plan, and moves:

* the raw items of every encoder phase to their encoder-phase rank (first pipeline stage only: the
  other stages hold no encoders);
* token ids, labels and loss masks to the backbone-phase rank of their example.

It yields a :class:`BalancedStep`: the rank's backbone micro-batches (same number on every DP rank)
and its encoder inputs, with the transfers the modality-aware schedule uses to send encoder outputs
straight to the backbone rank of their example. Then it reads the next step's batch, gathers its
sizes and hands their planning to the background thread.

Devices: everything travels on the DP group's communication device (the GPU under NCCL), staged
through pinned host memory; raw encoder inputs travel in ``input_dtype`` (the encoders' own dtype: they
cast their input to it first, so casting before the move changes nothing and halves the bytes in
bf16); received encoder inputs are handed over on ``compute_device`` (where the
encoders run), text on the host, where the backbone micro-batches are built as the loader builds them.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_orch.balance.plan import Transfer
from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import StepSizes
from megatron_orch.comm.alltoall import ItemLayout, all_to_all_items
from megatron_orch.comm.device import communication_device, host_to_device
from megatron_orch.comm.gather import GroupMismatchError, assert_same_on_all_ranks, gather_item_sizes
from megatron_orch.comm.status import raise_if_any_rank_failed
from megatron_orch.megatron.batch import BatchSpec, Example, MicroBatch, collate, collate_packed
from megatron_orch.orchestrator.background import BackgroundPlanner
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.step_plan import StepPlan, plan_step, warm_up

_OK, _EXHAUSTED = 0, 1  # a rank's status, sent as the size gather's check value
_STATUS_TEXT = "check values: 0 a step read, 1 no more data"


@dataclass(frozen=True)
class StepShape:
    """The micro-batches of one step on every DP rank: ``num_microbatches`` of ``micro_batch_size``
    examples each; ``pad_to``: the fixed row length of every micro-batch (pipeline parallelism sends
    fixed-shape tensors between stages), None for rows as long as their examples."""

    micro_batch_size: int
    num_microbatches: int
    pad_to: Optional[int] = None

    def __post_init__(self):
        for name in ("micro_batch_size", "num_microbatches", "pad_to"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"StepShape.{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True, eq=False)
class ParallelGroups:
    """Where this rank balances: its DP group and that group's topology (nodes), whether this pipeline
    stage holds the encoders, and the group of its TP/PP peers (one DP replica), which must hold the same
    plan."""

    dp_group: ProcessGroup
    topology: Topology
    encoder_stage: bool = True
    peer_group: Optional[ProcessGroup] = None


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
class BalancedStep:
    """Everything one rank computes in one step under the plan."""

    microbatches: List[BalancedMicroBatch]
    inputs: Mapping[str, torch.Tensor]  # this rank's encoder-phase items per phase (encoder stage only)
    plan: StepPlan
    rank: int                        # this rank in the DP group
    num_tokens: np.ndarray           # backbone tokens of every example of the global batch
    rows_per_item: Dict[str, int]    # embedding rows one encoder item sends to the backbone
    timings: Dict[str, float] = field(default_factory=dict)  # seconds: plan, plan_exposed, dispatch

    def output_transfer(self, phase: str) -> Transfer:
        return self.plan.output_transfer(phase)


class PostBalancingDataIterator:
    """Iterator of :class:`BalancedStep` over an iterator of this DP rank's loader micro-batches.

    ``spec``: the model's phases and what its batches hold; ``input_dtype``: the dtype raw encoder items
    travel in (the encoders' own; they cast their input to it first); ``compute_device``: where the
    encoders run. Bad settings (a phase in ``config.phases`` the model lacks, a cost profile of another
    model) raise here, before any collective.
    """

    def __init__(self, source: Iterator[MicroBatch], spec: BatchSpec, config: OrchestratorConfig,
                 step: StepShape, groups: ParallelGroups, *, compute_device: torch.device,
                 input_dtype: torch.dtype = torch.float32):
        if config.microbatching == "packed" and step.pad_to is not None:
            # one packed row carries a micro-batch's token budget
            step = StepShape(step.micro_batch_size, step.num_microbatches, step.pad_to * step.micro_batch_size)
        self.source, self.spec, self.config, self.step, self.groups = source, spec, config, step, groups
        self.compute_device, self.input_dtype = torch.device(compute_device), input_dtype
        self.rank = dist.get_rank(groups.dp_group)
        warm_up(spec.phases, config)  # also checks config.phases and the cost profile against the model
        self.planner = BackgroundPlanner(enabled=config.background)
        self._next: Optional[tuple] = None  # (examples, sizes, sample ids) of the step being planned
        self._exhausted = False

    @property
    def topology(self) -> Topology:
        return self.groups.topology

    def __iter__(self):
        return self

    # -- reading and planning -------------------------------------------------------------------
    def _read_and_submit(self) -> None:
        """Read the next step's examples, gather their sizes, start planning them.

        Whatever happens while reading (a loader error with its manifest line and path, an example
        that does not fit the model, a step cut short) is agreed on by every rank of the job before
        any other collective: all ranks raise, the failing rank with its own error, the others quoting
        it. The status exchange spans the world group, not only the DP group, because the TP/PP peers
        of a failing rank sit in other DP groups and would otherwise wait in the next collective. A
        rank out of data enters the size gather with that status as the check value, so an early
        end on some ranks raises on every rank too.
        """
        problem, batches, examples = None, [], []
        try:
            batches = list(itertools.islice(self.source, self.step.num_microbatches))
            if batches and len(batches) != self.step.num_microbatches:
                raise ValueError(f"DP rank {self.rank}: the data iterator ended inside a step "
                                 f"({len(batches)} of {self.step.num_microbatches} micro-batches)")
            examples = [e for b in batches for e in b.examples()]
            for example in examples:
                self.spec.check(example)
        except Exception as err:  # noqa: BLE001 -- any loader failure must reach the other ranks
            problem = err
        raise_if_any_rank_failed(problem, group=None, what="reading the step's input (post-balancing)")
        status = _OK if batches else _EXHAUSTED
        encoders = self.spec.phases.encoder_names
        columns = 2 + len(encoders)  # sample index, items of each encoder phase, tokens
        local = np.array([[e.sample_index, *(e.num_items(p) for p in encoders), e.num_tokens] for e in examples],
                         dtype=np.int64).reshape(-1, columns)
        try:
            gathered = gather_item_sizes(local, self.groups.dp_group, check=status,
                                         max_count=self.step.micro_batch_size * self.step.num_microbatches)
        except GroupMismatchError as mismatch:
            raise GroupMismatchError(f"DP rank {self.rank}: ranks of the DP group disagree on whether a step is "
                                     f"left or sent bad sizes ({_STATUS_TEXT}): {mismatch}") from None
        if status == _EXHAUSTED:
            self._exhausted = True
            return
        sizes = StepSizes(counts=gathered.counts, num_tokens=gathered.sizes[:, -1],
                          items={p: gathered.sizes[:, 1 + k] for k, p in enumerate(encoders)})
        self._next = (examples, sizes, gathered.sizes[:, 0])
        self.planner.submit(lambda: plan_step(sizes, self.spec.phases, self.config, self.topology,
                                              self.step.micro_batch_size, self.step.num_microbatches))

    def __next__(self) -> BalancedStep:
        if self._next is None and not self._exhausted:
            self._read_and_submit()
        if self._exhausted:
            self.planner.shutdown()
            raise StopIteration
        examples, sizes, sample_ids = self._next
        plan = self.planner.result()
        timings = {"plan": self.planner.last_plan_s, "plan_exposed": self.planner.last_exposed_s}
        # A plan that differs between ranks would make the all-to-alls disagree: fail loudly first.
        assert_same_on_all_ranks(plan.digest, self.groups.dp_group, "post-balancing plan digest (DP group)")
        if self.groups.peer_group is not None:
            assert_same_on_all_ranks(plan.digest, self.groups.peer_group,
                                     "post-balancing plan digest (TP/PP peers)")
        start = time.perf_counter()
        step = self._dispatch(plan, examples, sizes, sample_ids, timings)
        timings["dispatch"] = time.perf_counter() - start
        self._next = None
        self._read_and_submit()  # prefetch: the next plan is computed while this step trains
        return step

    # -- moving data ----------------------------------------------------------------------------
    def _dispatch(self, plan: StepPlan, examples: List[Example], sizes: StepSizes, sample_ids: np.ndarray,
                  timings: Dict[str, float]) -> BalancedStep:
        dp_group = self.groups.dp_group
        device = communication_device(dp_group)
        tokens = sizes.num_tokens
        text_layouts = [ItemLayout(tokens, (2,), torch.long), ItemLayout(tokens, (1,), torch.float32)]
        local_ids = host_to_device([torch.stack([e.tokens, e.labels], dim=1) for e in examples], device,
                                   torch.long, (2,))
        local_mask = host_to_device([e.loss_mask for e in examples], device, torch.float32, (1,))
        ids, mask = all_to_all_items([local_ids, local_mask], text_layouts, plan.text_transfer(), dp_group)
        # A few KB: the micro-batches are collated on the host, like the loader's, and forward_step
        # moves them to the model.
        ids, mask = ids.cpu(), mask.cpu()

        inputs = {}
        for encoder_input in self.spec.inputs if self.groups.encoder_stage else ():
            phase, item_shape = encoder_input.phase, encoder_input.item_shape
            local = host_to_device([e.items.get(phase, self.spec.no_items(phase)) for e in examples], device,
                                   self.input_dtype, item_shape)
            layout = ItemLayout(np.ones(plan.encoders[phase].example.size, dtype=np.int64), item_shape,
                                self.input_dtype)
            moved, = all_to_all_items([local], [layout], plan.input_transfer(phase), dp_group)
            inputs[phase] = moved.to(self.compute_device, non_blocking=True)
        return BalancedStep(microbatches=self._microbatches(plan, ids, mask, sizes, sample_ids), inputs=inputs,
                            plan=plan, rank=self.rank, num_tokens=sizes.num_tokens,
                            rows_per_item={p: self.spec.rows_per_item(p) for p in self.spec.phases.encoder_names},
                            timings=timings)

    def _microbatches(self, plan: StepPlan, ids: torch.Tensor, mask: torch.Tensor, sizes: StepSizes,
                      sample_ids: np.ndarray) -> List[BalancedMicroBatch]:
        mine = plan.examples_llm.items_on(self.rank)  # slot order: micro-batch by micro-batch
        lengths = sizes.num_tokens[mine]
        starts = np.concatenate(([0], np.cumsum(lengths)))
        microbatch = plan.microbatch_of_example[mine]
        build = collate_packed if self.config.microbatching == "packed" else collate
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
            out.append(BalancedMicroBatch(
                batch=build(batch_examples, self.spec, pad_to=self.step.pad_to),
                num_items={p: int(counts[mine[chosen]].sum()) for p, counts in sizes.items.items()}))
        return out
