"""The modality-aware schedule: wraps megatron-core's ``get_forward_backward_func()``.

On the pipeline stage that holds the encoders, before the backbone schedule of a step it runs every
encoder phase over the rank's balanced items (the model's ``encode``: :mod:`~megatron_orch.megatron.contract`)
and sends the outputs, in one all-to-all per phase, straight to the backbone rank of their example.
The all-to-alls are asynchronous, on post-balancing's own communicator: a phase's outputs travel while
the next phase encodes, and its gradients travel back while an earlier phase runs its backward.
The backbone micro-batches get those embeddings as
leaves that require grad, and Megatron's own schedule (no pipelining, 1F1B, interleaved) runs the
backbone unchanged. Just before gradients are reduced (the DP all-reduce: ``grad_sync_func`` or
``finalize_model_grads_func`` of the model config, whichever comes first), the embedding gradients
go back by the inverse all-to-all and the encoders run their backward, so encoder and backbone
gradients are reduced together, exactly once.

Virtual pipeline stages (the interleaved schedule, several model chunks per pipeline rank): the encoders
are in the first chunk (virtual stage 0) of the first pipeline stage; every chunk reads the step's
balanced micro-batches, each through its own iterator as megatron-core's interleaved schedule takes them
(the first chunk uses their embeddings, the last their labels). The first chunk's backward ends last, so
only its ``grad_sync_func`` (and ``finalize_model_grads_func``) runs the encoders' backward, under its
``no_sync_func``: the encoder parameters are that chunk's. The interleaved schedule with a
``grad_sync_func`` (``--overlap-grad-reduce``) runs every backward under ``no_sync`` and then syncs the chunk
explicitly; so does the encoders' backward it triggers.

Encoder memory: each phase runs in the plan's chunks (:mod:`~megatron_orch.megatron.encoder_chunks`); the
chunks the plan keeps hold their activations through the backbone, the others are recomputed for their
backward, one at a time, after the kept ones have freed theirs. Every chunk's backward but a phase's last
runs under the model's ``no_sync_func``, so Megatron DDP counts each encoder gradient once per step (as
it counts a parameter's micro-batches).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config
from torch.distributed import ProcessGroup

from megatron_orch.comm.alltoall import ItemLayout
from megatron_orch.comm.device import to_communication_device
from megatron_orch.megatron.contract import BalanceableModel
from megatron_orch.megatron.encoder_chunks import backward_chunk, encode_in_chunks
from megatron_orch.megatron.post_balancing import BalancedMicroBatch, BalancedStep

# The model config's callbacks that reduce gradients, which the encoders' backward must precede:
# grad_sync_func fires first where it is set (--overlap-grad-reduce: 1F1B on later pipeline stages,
# the interleaved schedule), finalize_model_grads_func always ends the schedule.
_GRAD_CALLBACKS = ("grad_sync_func", "finalize_model_grads_func")


def _unwrap(model) -> BalanceableModel:
    """The model inside Megatron's wrappers (DDP, Float16Module), which must meet the contract."""
    module = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(module, "module"):
        module = module.module
    if not isinstance(module, BalanceableModel):
        raise TypeError(f"post-balancing needs a model that meets megatron_orch.megatron.BalanceableModel "
                        f"(phase_encoders, encode, forward(batch, embeds)); {type(module).__name__} does not")
    return module


class ModalityAwareSchedule:
    """Callable with the signature of a megatron-core forward-backward function.

    ``data_iterator`` must be a :class:`~megatron_orch.megatron.post_balancing.PostBalancingDataIterator`;
    ``num_microbatches`` is taken from the step (equal on every DP rank by construction).
    The encoders run in the chunks of the step's plan; ``encoder_recompute`` keeps none of them (only the
    encoder inputs stay through the backbone schedule, every chunk is recomputed right before its backward).
    """

    def __init__(self, forward_backward_func: Callable, dp_group: ProcessGroup, encoder_recompute: bool = False):
        self.forward_backward_func = forward_backward_func
        self.dp_group = dp_group
        self.encoder_recompute = encoder_recompute
        self.last_step: Optional[BalancedStep] = None
        self.timings: Dict[str, float] = {}

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                 **kwargs):
        step: BalancedStep = next(_step_iterator(data_iterator))
        self.last_step = step
        if num_microbatches != len(step.microbatches):
            raise ValueError(f"the schedule was asked for {num_microbatches} micro-batches but the "
                             f"post-balancing step holds {len(step.microbatches)}")
        module = _unwrap(model)
        self.timings = {}
        pending = []  # (phase, encoder inputs, their chunks, moved outputs)
        microbatches = step.microbatches
        encoders = module.phase_encoders()
        if set(encoders) != set(step.inputs):
            raise ValueError(f"this pipeline stage holds the encoders of {sorted(encoders)} but the "
                             f"post-balancing step brings items of {sorted(step.inputs)} (is the iterator's "
                             "encoder_stage that of the model?)")
        if encoders:
            start = time.perf_counter()
            moving = []  # each phase's outputs travel while the next phase encodes
            for phase, inputs in step.inputs.items():
                chunk_items, kept_items = self._chunking(step, phase, inputs)
                outputs, chunks = encode_in_chunks(functools.partial(module.encode, phase), inputs, chunk_items,
                                                   kept_items, grad=not forward_only)
                moving.append((phase, inputs, chunks, self._start_move(step, phase, outputs)))
            embeds = {}
            for phase, inputs, chunks, move in moving:
                leaf = move().requires_grad_(not forward_only)
                embeds[phase] = leaf
                pending.append((phase, inputs, chunks, leaf))
            microbatches = _attach(step, embeds)
            self.timings["encoders_forward"] = time.perf_counter() - start

        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        config = get_model_config(chunks[0])
        callbacks = {name: getattr(config, name) for name in _GRAD_CALLBACKS}
        backward_done = []

        def encoders_backward_once(synced: bool = True):
            if not backward_done:
                backward_done.append(True)
                self._encoders_backward(step, module, pending, _no_sync(config), synced)

        def after_encoders_backward(callback, synced: bool = True):
            def call(*args, **kw):
                encoders_backward_once(synced)
                return callback(*args, **kw)
            return call

        if not forward_only:  # whichever callback reduces gradients first runs the encoders' backward
            for name, callback in callbacks.items():
                if name == "grad_sync_func" and callback is not None and len(chunks) > 1 and not isinstance(
                        callback, list):
                    callback = [callback] * len(chunks)  # as the interleaved schedule spreads it over the chunks
                if isinstance(callback, list):  # one per model chunk: the first chunk's (the encoders')
                    # the interleaved schedule syncs a chunk by its grad_sync_func alone, after running every
                    # backward of the chunk under no_sync: so do the encoders' backward then
                    synced = not (name == "grad_sync_func" and len(chunks) > 1)
                    setattr(config, name, [after_encoders_backward(callback[0], synced), *callback[1:]])
                elif callback is not None:
                    setattr(config, name, after_encoders_backward(callback))
        try:
            result = self.forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterators(microbatches, chunks), model=model,
                num_microbatches=len(microbatches), forward_only=forward_only, **kwargs)
        finally:
            for name, callback in callbacks.items():
                setattr(config, name, callback)
        if not forward_only:
            encoders_backward_once()  # no callback set (or none called): after the backbone schedule
        return result

    def _start_move(self, step: BalancedStep, phase: str, rows: torch.Tensor,
                    inverse: bool = False) -> Callable[[], torch.Tensor]:
        """Launch the all-to-all of encoder outputs (item by item, in slot order) to the backbone ranks, or
        of their gradients back, on the step's communicator (not the DP group's, where DDP reduces); the
        returned function waits for it and gives the rows on the device of ``rows``."""
        group = step.comm_group
        if self.dp_group is not None and dist.get_process_group_ranks(group) != dist.get_process_group_ranks(
                self.dp_group):
            raise ValueError("the post-balancing step moves its data over a group of other ranks than this "
                             "schedule's DP group (iterator and schedule of different groups?)")
        move = (step.moves.gradients if inverse else step.moves.outputs)[phase]
        layout = ItemLayout(np.full(move.transfer.src.num_items, step.rows_per_item[phase], dtype=np.int64),
                            tuple(rows.shape[1:]), rows.dtype)
        pending = move.start([to_communication_device(rows, group)], [layout], group)
        return lambda: pending.wait()[0].to(rows.device, non_blocking=True)

    def _chunking(self, step: BalancedStep, phase: str, inputs: torch.Tensor):
        """(items per chunk, items kept) of this rank's items of ``phase`` under the step's plan."""
        chunks = step.plan.encoders[phase].chunks
        count = inputs.shape[0]
        if chunks is None:  # a plan without a memory model: one chunk
            return max(count, 1), 0 if self.encoder_recompute else count
        kept = int(chunks.kept[step.rank])
        if kept > count:
            raise ValueError(f"DP rank {step.rank}: the plan keeps {kept} {phase} items but the step brings {count}")
        return chunks.items, 0 if self.encoder_recompute else kept

    def _encoders_backward(self, step: BalancedStep, module: BalanceableModel, pending, no_sync,
                           synced: bool) -> None:
        """Every encoder chunk's backward; a phase's last one (and an idle encoder's zero gradients) outside
        ``no_sync`` where ``synced`` (Megatron DDP then counts them, as it counts the backbone's last micro-batch),
        all of them under it where not (the interleaved schedule's explicit grad sync follows)."""
        start = time.perf_counter()
        # Every phase's gradients start back at once; the first chunks' backward hides the later transfers.
        returning = {phase: self._start_move(step, phase, leaf.grad if leaf.grad is not None else torch.zeros_like(leaf),
                                             inverse=True) for phase, _, _, leaf in pending}
        grads = {}
        # kept chunks first, of every phase: their activations are freed before any chunk is recomputed
        order = [(phase, inputs, chunk) for kept in (True, False) for phase, inputs, chunks, _ in pending
                 for chunk in chunks if chunk.kept == kept]
        last = {phase: i for i, (phase, _, _) in enumerate(order)}
        for i, (phase, inputs, chunk) in enumerate(order):
            if phase not in grads:
                grads[phase] = returning[phase]()
            rows = step.rows_per_item[phase]
            with contextlib.nullcontext() if synced and last[phase] == i else no_sync():
                backward_chunk(functools.partial(module.encode, phase), inputs, chunk,
                               grads[phase][chunk.start * rows:chunk.stop * rows])
        for phase, _, chunks, _ in pending:
            if phase not in grads:  # a phase without chunks: its (empty) transfer still completes
                returning[phase]()
            if not chunks:  # no items of this phase on this rank in this step
                with contextlib.nullcontext() if synced else no_sync():
                    _zero_gradients(module.phase_encoders()[phase])
        self.timings["encoders_backward"] = time.perf_counter() - start


def _step_iterator(data_iterator) -> Iterator[BalancedStep]:
    """The iterator of post-balancing steps: ``data_iterator``, or, given one iterator per model chunk
    (``megatron.training`` with virtual pipeline stages), the first chunk's; the step feeds every chunk, so
    the others must be None (checked before the step's collectives)."""
    if not isinstance(data_iterator, (list, tuple)):
        return data_iterator
    if not data_iterator or any(it is not None for it in data_iterator[1:]):
        raise ValueError(f"post-balancing with {len(data_iterator)} model chunks takes its steps from the first "
                         "chunk's data iterator and gives every chunk its micro-batches: the data provider must "
                         "return the post-balancing iterator for vp_stage 0 and None for the others "
                         "(megatron_orch.megatron.megatron_lm.external_data_provider does)")
    return data_iterator[0]


def data_iterators(microbatches: List, model: List[torch.nn.Module]):
    """The data iterator(s) megatron-core's schedule takes for one step's ``microbatches``: one iterator, or
    with several model chunks (the interleaved schedule) one per chunk over the same micro-batches."""
    if len(model) == 1:
        return iter(microbatches)
    return [iter(microbatches) for _ in model]


def _no_sync(config) -> Callable[[], contextlib.AbstractContextManager]:
    """The model config's ``no_sync_func`` (one per model chunk: the first chunk's, which holds the encoders),
    as Megatron's schedules take it; none (also a config without the field, as a stage's stand-in config may
    be): gradients sync as usual."""
    no_sync = getattr(config, "no_sync_func", None)
    if no_sync is None:
        return contextlib.nullcontext
    return no_sync[0] if isinstance(no_sync, list) else no_sync


def _zero_gradients(encoder: torch.nn.Module) -> None:
    """A zero gradient for every parameter of an encoder that had no items: every encoder parameter then
    reports a gradient exactly once per step, which Megatron DDP's ``--overlap-grad-reduce`` needs (it
    launches a bucket's reduction once each of its parameters has reported as often as in the first step,
    and asserts that every parameter reported in the first step)."""
    params = [p for p in encoder.parameters() if p.requires_grad]
    if params:
        torch.autograd.backward(torch.stack([p.sum() for p in params]).sum() * 0.0)


def _attach(step: BalancedStep, embeds: Dict[str, torch.Tensor]) -> List[BalancedMicroBatch]:
    """Give each micro-batch its slice of the received embeddings (slot order = micro-batch order)."""
    out, offsets = [], {phase: 0 for phase in embeds}
    for mb in step.microbatches:
        parts = {}
        for phase, tensor in embeds.items():
            rows = mb.num_items[phase] * step.rows_per_item[phase]
            parts[phase] = tensor[offsets[phase]:offsets[phase] + rows]
            offsets[phase] += rows
        out.append(dataclasses.replace(mb, embeds=parts))
    return out
