"""Activation memory of one training step, upstream and balanced: the bytes autograd saves for backward.

    python -m megatron_orch.bench.memory --model mllm_10b --dp 64 --per-rank 16 --json memory.json
    python -m megatron_orch.bench.memory --model mllm_10b --layers 4,4,4 --ranks 8      # quicker
    python -m megatron_orch.bench.memory --per-gpu --model mllm_84b --dp 80 --tensor-parallel 8 --pipeline-stages 4

``--per-gpu``: parameters, gradients, optimizer state and activations of the busiest GPU with the encoders on
the first pipeline stage and on every GPU (and at encoder TP 1), by the model of
:mod:`megatron_orch.orchestrator.gpu_memory` (torch-free, no tensor built) on the planner's plan of a drawn
batch (:func:`per_gpu`).

Draws a global batch of ``dp * per_rank`` examples from the traces (DP rank r loads the r-th block, one
example per micro-batch, as the other benchmarks), plans it with ``plan_step`` under the trainer's
settings (``--variants``), and runs every DP rank's share of the step, one rank after the other, in one
process: upstream (Megatron's schedule over the rank's loader micro-batches, each one encoding its own
items) and balanced (the modality-aware schedule over the rank's planned items and micro-batches). The
modules are the trainer's (:class:`~megatron_orch.mllm.model.MLLMModel`, megatron-core's layers, bf16,
dropout 0) at the model's widths, and the schedules are the trainer's; only the tensors are on PyTorch's
``meta`` device: shapes and dtypes without values, so a rank of mllm_10b at full depth costs seconds and
no memory, and what autograd saves is exactly what it saves on a device. Three things are stood in, each
only for meta tensors: the all-to-alls of the balanced step (the schedule's ``_start_move``) give the rank
the rows it would receive; the collectives over a group of one (the vocabulary-parallel cross-entropy's
all-reduce) return their input; and the core attention saves what a fused (flash) kernel saves (query,
key, value, output and the fp32 log-sum-exp), since PyTorch runs attention on meta tensors through its
math path, which keeps the [s, s] probabilities no GPU kernel keeps. The placeholder positions, which
need values, are found at collate time, on the host, as in training.

Every tensor autograd saves is counted once per storage (tensors that share one, such as a layer's input
saved by two operations, count once), from the moment it is saved until autograd frees it; parameters
(saved by every linear layer) are model state, not activations, and are left out. Each saved tensor is
booked to the phase whose module saved it (an encoder, or the backbone). Figures per rank: the peak of
the live total, the peak of each phase's own live bytes, and the encoder share of the live total at its
peak. The step's figure is the busiest rank's (it sets the memory a job needs). Not counted: tensors
the schedules hold outside autograd (the balanced step's encoder inputs, the received embeddings and
their gradients, a few hundred MB at mllm_10b), weights, gradients and optimizer state.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import sys
import time
from typing import Dict, Iterator, List, Tuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_orch.balance.topology import Topology
from megatron_orch.balance.workload import phase_items
from megatron_orch.bench.common import (add_trace_args, draw_sizes, effective_layers, parse_layers, report,
                                        trace_specs, with_layers)
from megatron_orch.bench.mfu import world_of_one
from megatron_orch.megatron.batch import Example, MicroBatch, collate
from megatron_orch.megatron.contract import loss_func
from megatron_orch.megatron.post_balancing import BalancedMicroBatch, BalancedStep
from megatron_orch.megatron.schedule import ModalityAwareSchedule
from megatron_orch.mllm import attention as attention_module
from megatron_orch.mllm.config import BOS_TOKEN_ID, MLLMConfig
from megatron_orch.mllm.examples import assemble_example
from megatron_orch.mllm.model import MLLMModel, ModelParallelSettings
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.encoder_ranks import spread_over_stages
from megatron_orch.orchestrator.gpu_memory import (GB, ParallelLayout, busiest, in_flight, padded_in_flight_tokens,
                                                   stage_memory)
from megatron_orch.orchestrator.step_plan import StepPlan, plan_step

META = torch.device("meta")

# The balanced step under the trainer's settings: name -> (its flags, OrchestratorConfig fields).
VARIANTS = {
    "balanced": ("the defaults: encoder memory capped at upstream's peak", {}),
    "recompute": ("--orch-encoder-recompute", {"encoder_recompute": True}),
    "uncapped": ("--orch-encoder-memory-cap inf: every encoder activation kept", {"encoder_memory_cap": math.inf}),
}


# -- counting saved tensors ---------------------------------------------------------------------------
class SavedBytes:
    """Live bytes of the tensors autograd saves, per phase, with their peaks (install with :meth:`saving`).

    A saved tensor counts once per storage while autograd holds it: its pack hook books the storage's
    bytes to the current phase and returns a handle whose release (autograd freeing the saved tensor)
    takes them off again."""

    def __init__(self, excluded_storages: set, encoders: Tuple[str, ...]):
        self.excluded = excluded_storages
        self.encoders = encoders  # phases whose live bytes are also added up (the encoders')
        self.phase = "other"
        self.refs: Dict[int, list] = {}  # storage -> [handles alive, bytes, phase]
        self.live: Dict[str, int] = {}
        self.total = 0
        self.peak_total = 0
        self.at_peak: Dict[str, int] = {}
        self.peak: Dict[str, int] = {}
        self.live_encoders = 0
        self.peak_encoders = 0

    def reset_peaks(self) -> None:
        self.peak_total, self.at_peak, self.peak, self.peak_encoders = 0, {}, {}, 0

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        key = storage._cdata  # the storage itself (meta storages have no data pointer)
        if key in self.excluded:
            return tensor
        entry = self.refs.get(key)
        if entry is None:
            entry = self.refs[key] = [0, storage.nbytes(), self.phase]
            self._add(entry[2], entry[1])
        entry[0] += 1
        return _Handle(self, key, tensor)

    def _release(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.refs[key]
            self._add(entry[2], -entry[1])

    def _add(self, phase: str, nbytes: int) -> None:
        self.live[phase] = self.live.get(phase, 0) + nbytes
        self.total += nbytes
        if phase in self.encoders:
            self.live_encoders += nbytes
            self.peak_encoders = max(self.peak_encoders, self.live_encoders)
        if nbytes > 0:
            self.peak[phase] = max(self.peak.get(phase, 0), self.live[phase])
            if self.total > self.peak_total:
                self.peak_total, self.at_peak = self.total, dict(self.live)

    @contextlib.contextmanager
    def saving(self):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def booking(self, module: torch.nn.Module, phase: str) -> None:
        """Book what ``module`` saves to ``phase`` (forward hooks; an encoder recomputed in the backward
        books to its phase again)."""
        stack = []

        def enter(*_):
            stack.append(self.phase)
            self.phase = phase

        def leave(*_):
            self.phase = stack.pop()

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)


def _unpack(packed):
    return packed.tensor if isinstance(packed, _Handle) else packed


class _Handle:
    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner: SavedBytes, key: int, tensor: torch.Tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        self.owner._release(self.key)


# -- stand-ins for meta tensors -------------------------------------------------------------------------
class _FlashSaved(torch.autograd.Function):
    """Attention on meta tensors that saves what a fused (flash) kernel saves: q, k, v, the output and the
    fp32 log-sum-exp per query and head; the output is ``[b, heads, s, d]`` like SDPA's."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = torch.empty_like(query)
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)


def _attention(stock):
    @functools.wraps(stock)
    def sdpa(query, key, value, *args, **kwargs):
        if query.is_meta:
            return _FlashSaved.apply(query, key, value)
        return stock(query, key, value, *args, **kwargs)
    return sdpa


def _identity_for_meta(stock):
    @functools.wraps(stock)
    def collective(tensor, *args, **kwargs):
        if isinstance(tensor, torch.Tensor) and tensor.is_meta:
            return None  # a group of one: the input is already the result
        return stock(tensor, *args, **kwargs)
    return collective


@contextlib.contextmanager
def meta_stand_ins():
    """The stand-ins of the module docstring, for the duration of the block."""
    patches = [(attention_module.F, "scaled_dot_product_attention", _attention),
               (dist, "all_reduce", _identity_for_meta)]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, wrap in patches:
        setattr(owner, name, wrap(getattr(owner, name)))
    try:
        yield
    finally:
        for owner, name, stock in saved:
            setattr(owner, name, stock)


def forward_step(data_iterator: Iterator, model: MLLMModel):
    """``contract.forward_step`` on meta tensors: the loss token count stays on the host (the schedule adds
    it up)."""
    item = next(data_iterator)
    batch, embeds = (item.batch, item.embeds) if isinstance(item, BalancedMicroBatch) else (item, None)
    if embeds is None:
        embeds = {phase: model.encode(phase, items.to(META)) for phase, items in batch.items.items()}
    output = model(batch.to(META), embeds=embeds)
    return output, functools.partial(_loss, batch.loss_mask)


def _loss(loss_mask: torch.Tensor, output: torch.Tensor):
    loss, _, report = loss_func(loss_mask.to(META), output)
    return loss, loss_mask.sum().to(torch.int), report


class MetaSchedule(ModalityAwareSchedule):
    """The modality-aware schedule with its all-to-alls stood in: a rank gets the embedding rows its
    backbone micro-batches take, and back the gradient rows of the items it encoded. The first step's
    encoder checks are left out: they compare values, which meta tensors do not have."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._encoder_checks.pending = set()

    def _start_move(self, step: BalancedStep, phase: str, rows: torch.Tensor, inverse: bool = False):
        if inverse:
            count = step.inputs[phase].shape[0]
        else:
            count = sum(mb.num_items[phase] for mb in step.microbatches)
        moved = torch.zeros(count * step.rows_per_item[phase], *rows.shape[1:], dtype=rows.dtype, device=META)
        return lambda: moved


# -- the step of one rank -------------------------------------------------------------------------------
def _examples(sizes, ids: np.ndarray, spec, with_items: bool) -> List[Example]:
    """The examples ``ids`` of the global batch laid out as the data pipeline lays them out (ids: BOS,
    placeholders, text; raw items on meta)."""
    out = []
    for i in ids.tolist():
        counts = {p: int(sizes.items[p][i]) for p in spec.phases.encoder_names}
        placeholders = sum(counts[p] * spec.rows_per_item(p) for p in counts)
        answer = [BOS_TOKEN_ID] * (int(sizes.num_tokens[i]) - 1 - placeholders)
        items = {p: torch.empty(n, *spec.input(p).item_shape, device=META) for p, n in counts.items()}
        example = assemble_example(i, [], answer, items, spec)
        out.append(example if with_items else dataclasses.replace(example, items={}))
    return out


def upstream_microbatches(sizes, rank: int, spec, micro_batch_size: int) -> List[MicroBatch]:
    """The loader's micro-batches of ``rank``: its examples in order, ``micro_batch_size`` each."""
    mine = np.flatnonzero(sizes.home == rank)
    return [collate(_examples(sizes, mine[k:k + micro_batch_size], spec, with_items=True), spec)
            for k in range(0, mine.size, micro_batch_size)]


def balanced_step(plan: StepPlan, sizes, rank: int, spec) -> BalancedStep:
    """What the post-balancing iterator yields on ``rank`` under ``plan``, with meta encoder inputs."""
    mine = plan.examples_backbone.items_on(rank)
    microbatch = plan.microbatch_of_example[mine]
    mbs = []
    for m in range(plan.num_microbatches):
        chosen = mine[microbatch == m]
        mbs.append(BalancedMicroBatch(batch=collate(_examples(sizes, chosen, spec, with_items=False), spec),
                                      num_items={p: int(sizes.items[p][chosen].sum()) for p in sizes.items}))
    inputs = {p: torch.empty(int(plan.encoders[p].encode.items_on(rank).size), *spec.input(p).item_shape,
                             device=META) for p in spec.phases.encoder_names}
    return BalancedStep(microbatches=mbs, inputs=inputs, plan=plan, rank=rank, num_tokens=sizes.num_tokens,
                        rows_per_item={p: spec.rows_per_item(p) for p in spec.phases.encoder_names},
                        comm_group=None, moves=None)


def run_rank(model: MLLMModel, counter: SavedBytes, schedule, data_iterator, num_microbatches: int,
             seq_length: int) -> dict:
    """One rank's step under ``schedule`` (Megatron's or the modality-aware one): its saved-bytes figures."""
    for p in model.parameters():
        p.grad = None
    counter.reset_peaks()
    with counter.saving():
        schedule(forward_step_func=forward_step, data_iterator=data_iterator, model=model,
                 num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=1, forward_only=False)
    if counter.total:
        raise RuntimeError(f"{counter.total} saved bytes still held after the step (a graph was not freed)")
    return {"peak": counter.peak_total, "at_peak": dict(counter.at_peak), "phase_peak": dict(counter.peak),
            "encoder_peak": counter.peak_encoders}


# -- the benchmark --------------------------------------------------------------------------------------
def build_model(config: MLLMConfig) -> MLLMModel:
    settings = ModelParallelSettings(bf16=True)
    with torch.device(META):
        return MLLMModel(config, settings, config.backbone.max_position_embeddings, pre_process=True,
                        post_process=True).bfloat16()


def measure(config: MLLMConfig, sizes, plans: Dict[str, Tuple[StepPlan, bool]], ranks: List[int],
            progress=None) -> dict:
    """Saved-bytes figures of every rank in ``ranks``, upstream and under each (plan, encoder recompute)."""
    model = build_model(config)
    spec = model.spec
    counter = SavedBytes({p.untyped_storage()._cdata for p in model.parameters()}, spec.phases.encoder_names)
    for phase, encoder in model.phase_encoders().items():
        counter.booking(encoder, phase)
    counter.booking(model.backbone, spec.phases.backbone.name)
    megatron_schedule = get_forward_backward_func()
    out = {"upstream": {}, **{name: {} for name in plans}}
    with meta_stand_ins():
        for rank in ranks:
            start = time.perf_counter()
            loader = upstream_microbatches(sizes, rank, spec, 1)
            out["upstream"][rank] = run_rank(model, counter, megatron_schedule, iter(loader), len(loader),
                                             spec.seq_length)
            for name, (plan, recompute) in plans.items():
                schedule = MetaSchedule(megatron_schedule, dp_group=None, encoder_recompute=recompute)
                out[name][rank] = run_rank(model, counter, schedule, iter([balanced_step(plan, sizes, rank, spec)]),
                                           plan.num_microbatches, spec.seq_length)
            if progress:
                progress(f"rank {rank}: {time.perf_counter() - start:.1f} s")
    return out


def summarise(per_rank: dict, phases, plans: Dict[str, StepPlan]) -> dict:
    """Per step (the busiest rank of each figure): the peak of all saved bytes, of the encoders' and of each
    phase's, the encoders' share at the total's peak, the ratios to upstream; and the planner's modeled
    peak (``StepPlan.memory``, over the measured ranks) beside it."""
    out = {}
    for method, ranks in per_rank.items():
        peak_rank = max(ranks, key=lambda r: ranks[r]["peak"])
        plan = plans[method if method in plans else next(iter(plans))]
        modeled = plan.memory.upstream_peak if method == "upstream" else plan.memory.peak
        out[method] = {
            "peak_gb": ranks[peak_rank]["peak"] / GB,
            "peak_rank": peak_rank,
            "encoders_at_peak_gb": sum(ranks[peak_rank]["at_peak"].get(p, 0) for p in phases.encoder_names) / GB,
            "encoder_peak_gb": max(r["encoder_peak"] for r in ranks.values()) / GB,
            "phase_peak_gb": {p: max(r["phase_peak"].get(p, 0) for r in ranks.values()) / GB for p in phases.names},
            "modeled_peak_gb": float(modeled[list(ranks)].max()) / GB,
        }
    up = out["upstream"]
    for figures in out.values():
        figures["peak_vs_upstream"] = figures["peak_gb"] / up["peak_gb"]
        figures["encoder_peak_vs_upstream"] = figures["encoder_peak_gb"] / up["encoder_peak_gb"]
        figures["modeled_vs_upstream"] = figures["modeled_peak_gb"] / up["modeled_peak_gb"]
    return out


def format_tables(result: dict) -> str:
    phases = result["phases"]
    lines = [f"saved-tensor bytes of one step (GB), {result['model']} (layers {result['layers']}), DP {result['dp']}, "
             f"{result['per_rank']} examples per rank (one per micro-batch), ranks: {result['ranks_label']}",
             f"{'step':<11}{'peak':>7}{'x up':>6}{'encoders':>10}{'x up':>6}{'at peak':>9}"
             + "".join(f"{p:>8}" for p in phases) + f"{'modeled':>9}{'x up':>6}"]
    for method, f in result["summary"].items():
        lines.append(f"{method:<11}{f['peak_gb']:>7.2f}{f['peak_vs_upstream']:>6.2f}{f['encoder_peak_gb']:>10.2f}"
                     f"{f['encoder_peak_vs_upstream']:>6.2f}{f['encoders_at_peak_gb']:>9.2f}"
                     + "".join(f"{f['phase_peak_gb'][p]:>8.2f}" for p in phases)
                     + f"{f['modeled_peak_gb']:>9.2f}{f['modeled_vs_upstream']:>6.2f}")
    lines.append("peak: all saved tensors alive at once; encoders: the encoder phases' (the peak of their sum); "
                 "at peak: the encoders' share of the peak; per phase: each phase's own peak; modeled: the "
                 "planner's StepPlan.memory peak")
    return "\n".join(lines)


def encoder_kept_bytes(plan: StepPlan, items, layout: ParallelLayout) -> float:
    """Encoder activation bytes the busiest encoder group keeps through the backbone under ``plan``: each rank's
    kept chunks (``EncoderChunks.kept``, every item where the plan keeps no chunks), the DP plan's on the first
    stage; with the encoders on every GPU the trainer's split over the stages
    (:func:`~megatron_orch.orchestrator.encoder_ranks.spread_over_stages`), and at an encoder TP below the
    backbone's each stage's items over its ``TP / encoder TP`` groups as evenly as they go."""
    dp = plan.examples_home.num_ranks
    if layout.encoder_ranks == "all":
        group = spread_over_stages(plan, layout.pipeline_stages)
        placements, chunks, ranks = group.encode, group.chunks, group.num_ranks
    else:
        placements = {p: e.encode for p, e in plan.encoders.items()}
        chunks, ranks = {p: e.chunks for p, e in plan.encoders.items()}, dp
    split = layout.tensor_parallel // layout.encoder_tp if layout.encoder_ranks == "all" else 1
    kept = np.zeros(ranks)
    for phase, placement in placements.items():
        count = placement.counts() if chunks[phase] is None else np.asarray(chunks[phase].kept)
        per_item = float(items[phase].memory[0]) if len(items[phase]) else 0.0
        kept += -(-count // split) * per_item
    return float(kept.max(initial=0.0))


def own_in_flight_tokens(plan: StepPlan, num_tokens: np.ndarray, layout: ParallelLayout) -> List[float]:
    """Every stage's in-flight backbone tokens with micro-batches of their own lengths (Megatron-LM's
    ``variable_seq_lengths``, what the simulator times): the busiest replica's most tokens in any
    :func:`~megatron_orch.orchestrator.gpu_memory.in_flight` consecutive micro-batches of its running order."""
    m = plan.num_microbatches
    dp = plan.examples_home.num_ranks
    cell = plan.examples_backbone.rank * m + plan.microbatch_of_example
    tokens = np.bincount(cell, weights=num_tokens, minlength=dp * m).reshape(dp, m)
    out = []
    for stage in range(layout.pipeline_stages):
        window = in_flight(stage, layout.pipeline_stages, m)
        sums = np.cumsum(np.pad(tokens, ((0, 0), (1, 0))), axis=1)
        out.append(float((sums[:, window:] - sums[:, :-window]).max(initial=0.0)))
    return out


def per_gpu(config: MLLMConfig, sizes, layouts: List[ParallelLayout], seq_length: int, num_microbatches: int,
            gpus_per_node: int) -> List[dict]:
    """The busiest GPU of every layout (parameters, gradients, optimizer, activations: :func:`stage_memory`),
    the backbone's micro-batches padded to ``seq_length`` (the compact trainer) and of their own lengths
    (Megatron-LM's variable lengths), the encoders' kept activations from the defaults' plan of ``sizes``."""
    phases, parameters = config.phases(), config.num_parameters()
    items = phase_items(sizes, phases)
    out = []
    for layout in layouts:
        microbatching = "equal_count" if layout.pipeline_stages > 1 else "auto"  # 1F1B: fixed-shape micro-batches
        plan = plan_step(sizes, phases, OrchestratorConfig(background=False, verify_first_step=False,
                                                           microbatching=microbatching),
                         Topology.uniform(layout.data_parallel, max(1, gpus_per_node // layout.tensor_parallel)),
                         micro_batch_size=1, num_microbatches=num_microbatches)
        encoders = encoder_kept_bytes(plan, items, layout)
        for backbone, tokens in (("padded", padded_in_flight_tokens(layout, seq_length, 1, num_microbatches)),
                                 ("own lengths", own_in_flight_tokens(plan, sizes.num_tokens, layout))):
            stages = stage_memory(layout, parameters, phases, tokens, encoders)
            stage = busiest(stages)
            out.append({"layout": dataclasses.asdict(layout), "backbone_microbatches": backbone, "stage": stage,
                        **{k: v / GB for k, v in dataclasses.asdict(stages[stage]).items()},
                        "total": stages[stage].total / GB, "stages_total": [m.total / GB for m in stages]})
    return out


def format_per_gpu(result: dict) -> str:
    lines = [f"per-GPU memory (GB) of the busiest GPU, {result['model']}, DP {result['dp']} x TP {result['tp']} x PP "
             f"{result['pp']}, {result['per_rank']} micro-batches of one example, bf16 parameters, fp32 gradients, "
             f"Adam over DP (distributed optimizer), sequence parallel, no recompute", "",
             "| encoders on | encoder TP | backbone micro-batches | busiest stage | parameters | gradients | "
             f"optimizer | backbone act. | encoder act. | total | other stages' most | fits {result['gpu_memory_gb']:g} "
             "GB |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in result["rows"]:
        layout = row["layout"]
        lines.append(f"| {layout['encoder_ranks']} | {layout['encoder_tensor_parallel'] or layout['tensor_parallel']}"
                     f" | {row['backbone_microbatches']} | {row['stage']} | {row['parameters']:.1f} | "
                     f"{row['gradients']:.1f} | {row['optimizer']:.2f} | {row['backbone_activations']:.1f} | "
                     f"{row['encoder_activations']:.2f} | {row['total']:.1f} | "
                     f"{max((t for s, t in enumerate(row['stages_total']) if s != row['stage']), default=0.0):.1f} | "
                     f"{'yes' if row['total'] <= result['gpu_memory_gb'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m megatron_orch.bench.memory", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_trace_args(parser)
    parser.add_argument("--model", default="mllm_10b", help="model config name or YAML (default mllm_10b)")
    parser.add_argument("--layers", default=None, metavar="V,A,B",
                        help="layers of each phase's stack (default: the model's; meta tensors make full depth cheap)")
    parser.add_argument("--dp", type=int, default=64, help="data-parallel size (default 64)")
    parser.add_argument("--per-rank", type=int, default=16, help="examples (= micro-batches) per rank (default 16)")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--ranks", type=int, default=None,
                        help="measure only this many ranks: the ones of largest modeled peak (StepPlan.memory) "
                             "upstream and under each plan (default: every rank)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="balanced steps to measure: " + "; ".join(f"{k}: {v[0]}" for k, v in VARIANTS.items()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-gpu", action="store_true",
                        help="the per-GPU table (parameters, gradients, optimizer, activations) of each encoder layout "
                             "instead of measuring saved tensors")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="--per-gpu: TP size (default 1)")
    parser.add_argument("--pipeline-stages", type=int, default=1, help="--per-gpu: pipeline stages (default 1)")
    parser.add_argument("--gpu-memory-gb", type=float, default=80.0,
                        help="--per-gpu: the memory the fits column compares with (default 80: an H100)")
    parser.add_argument("--json", default=None, metavar="OUT")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {sorted(VARIANTS)}")
    try:
        model_config, _, sizes = draw_sizes(trace_specs(args), args.dp, args.per_rank, args.model, args.seed,
                                            args.traces_dir, args.seq_length)
    except ValueError as err:  # e.g. an example longer than --seq-length: refused, as training refuses it
        parser.error(str(err))
    model_config = with_layers(model_config, parse_layers(parser, args.layers))
    if args.per_gpu:
        try:
            layouts = [ParallelLayout(args.dp, args.tensor_parallel, args.pipeline_stages, ranks, etp)
                       for ranks, etp in (("first-stage", None), ("all", None), ("all", 1))
                       if etp is None or args.tensor_parallel > 1]
        except ValueError as err:
            parser.error(str(err))
        seq_length = args.seq_length or model_config.backbone.max_position_embeddings
        result = {"model": model_config.name, "dp": args.dp, "tp": args.tensor_parallel, "pp": args.pipeline_stages,
                  "per_rank": args.per_rank, "seq_length": seq_length, "gpu_memory_gb": args.gpu_memory_gb,
                  "rows": per_gpu(model_config, sizes, layouts, seq_length, args.per_rank, args.gpus_per_node)}
        return report(result, format_per_gpu, args.json)
    phases = model_config.phases()
    topology = Topology.uniform(args.dp, args.gpus_per_node)
    plans = {}
    for name in variants:
        # the checked first step compares values, which meta tensors lack (the shipped configs train without it)
        config = OrchestratorConfig(background=False, verify_first_step=False, **VARIANTS[name][1])
        plans[name] = (plan_step(sizes, phases, config, topology, micro_batch_size=1, num_microbatches=args.per_rank),
                       config.encoder_recompute)
    ranks = list(range(args.dp)) if args.ranks is None else _busiest([p for p, _ in plans.values()], args.ranks)
    with world_of_one(torch.device("cpu")):  # on the CPU harness: meta tensors need no device
        per_rank = measure(model_config, sizes, plans, ranks, progress=lambda line: print(line, file=sys.stderr))
    result = {"model": model_config.name, "layers": list(effective_layers(model_config)), "dp": args.dp,
              "per_rank": args.per_rank, "ranks": ranks,
              "ranks_label": "all" if args.ranks is None else f"{len(ranks)}, the {args.ranks} of largest modeled peak "
                                                               f"of each step",
              "phases": list(phases.names),
              "summary": summarise(per_rank, phases, {name: plan for name, (plan, _) in plans.items()}),
              "per_rank_figures": {m: {str(r): f for r, f in v.items()} for m, v in per_rank.items()}}
    return report(result, format_tables, args.json)


def _busiest(plans: List[StepPlan], count: int) -> List[int]:
    """The ``count`` ranks of largest modeled peak upstream and under each plan (``StepPlan.memory``)."""
    chosen = set()
    for peak in [plans[0].memory.upstream_peak] + [plan.memory.peak for plan in plans]:
        chosen.update(int(r) for r in np.argsort(-peak, kind="stable")[:count])
    return sorted(chosen)


if __name__ == "__main__":
    main()
