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
gradients are reduced together, exactly once. With the encoders on every pipeline stage their backward runs
under ``no_sync``, its gradients are summed over the stages, and only then does each report ready to Megatron
DDP: its overlapped reduction (``--overlap-grad-reduce``), all-reduce or the distributed optimizer's
reduce-scatter, starts on the sum.

Virtual pipeline stages (the interleaved schedule, several model chunks per pipeline rank): the encoders
are in the first chunk (virtual stage 0) of the first pipeline stage (of every stage with the encoders on every
stage); every chunk reads the step's
balanced micro-batches, each through its own iterator as megatron-core's interleaved schedule takes them
(the first chunk uses their embeddings, the last their labels). The first chunk's backward ends last, so
only its ``grad_sync_func`` (and ``finalize_model_grads_func``) runs the encoders' backward, under its
``no_sync_func``: the encoder parameters are that chunk's. A schedule with a ``grad_sync_func``
(``--overlap-grad-reduce``: the interleaved schedule, 1F1B's later pipeline stages) runs every backward of a chunk
under ``no_sync`` and then syncs the chunk explicitly; so does the encoders' backward it triggers.

Encoder ranks of their own (MIMO's non-colocated grids, ``BalancedStep.receives_embeddings``): a backbone rank
encodes nothing; each phase's outputs arrive from the encoder ranks (which run
:class:`~megatron_orch.megatron.own_encoder_ranks.OwnEncoderRanksLoop`), and just before the backbone's gradients
are reduced their gradients go back, divided by the step's loss tokens over DP (the per-token normalisation
``finalize_model_grads`` applies to the backbone's: the encoder ranks have no token count of their own).

Before the first step and on it, the schedule checks the model (:mod:`~megatron_orch.megatron.first_step`:
the contract, per-token loss, item-by-item encoders, their parameters, and with ``verify_first_step`` the
loader's against the balanced layout of the first batch, every model chunk fed as above). A shadow mode
step (:class:`~megatron_orch.megatron.post_balancing.ShadowStep`) runs as loaded, through Megatron's
schedule alone.

Encoder memory: each phase runs in the plan's chunks (:mod:`~megatron_orch.megatron.encoder_chunks`); the
chunks the plan keeps hold their activations through the backbone, the others are recomputed for their
backward, one at a time, after the kept ones have freed theirs. Every chunk's backward but a phase's last
runs under the model's ``no_sync_func``, so Megatron DDP counts each encoder gradient once per step (as
it counts a parameter's micro-batches). With parameters sharded over DP (torch FSDP2, Megatron-FSDP) every
rank runs the same chunks, phase after phase (:mod:`~megatron_orch.megatron.sharding`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.utils import get_model_config
from torch.distributed import ProcessGroup

from megatron_orch.comm.alltoall import ItemLayout
from megatron_orch.comm.device import to_communication_device
from megatron_orch.comm.status import raise_if_any_rank_failed
from megatron_orch.megatron import first_step
from megatron_orch.megatron.contract import BalanceableModel, check_model, record_non_finite_gradients
from megatron_orch.megatron.encoder_chunks import ChunkBounds, backward_chunk, chunk_bounds, encode_in_chunks
from megatron_orch.megatron.post_balancing import BalancedMicroBatch, BalancedStep, ShadowStep, StepMoves
from megatron_orch.megatron.sharding import aligned_chunks, pad_items, sharded_encode, sharding_of
from megatron_orch.orchestrator.encoder_ranks import unsupported_layout

# The model config's callbacks that reduce gradients, which the encoders' backward must precede:
# grad_sync_func fires first where it is set (--overlap-grad-reduce: 1F1B on later pipeline stages,
# the interleaved schedule), finalize_model_grads_func always ends the schedule.
_GRAD_CALLBACKS = ("grad_sync_func", "finalize_model_grads_func")


class ModalityAwareSchedule:
    """Callable with the signature of a megatron-core forward-backward function.

    ``data_iterator`` must be a :class:`~megatron_orch.megatron.post_balancing.PostBalancingDataIterator`;
    ``num_microbatches`` is the step's (it may change from step to step: ``StepShape.ramp_up``; equal on every
    DP rank by construction).
    The encoders run in the chunks of the step's plan; ``encoder_recompute`` keeps none of them (only the
    encoder inputs stay through the backbone schedule, every chunk is recomputed right before its backward).
    ``encoders_on_every_stage``: every pipeline stage holds the encoders (``EncoderRanks.ALL``: their gradients
    are summed over the stages, :func:`sum_encoder_gradients`; the layouts it does not run are refused on the first
    call, before any collective). ``announce`` gets the checked steps' lines (default: printed on global rank 0; ``first_step_check`` then
    holds the latest one's figures) and, in shadow mode, one line per step with what the plan would do
    (:func:`shadow_line`; ``shadow_figures`` then holds that step's ``StepPlan.report()``).
    """

    def __init__(self, forward_backward_func: Callable, dp_group: ProcessGroup, encoder_recompute: bool = False,
                 announce: Callable[[str], None] = first_step.print_on_rank_0, encoders_on_every_stage: bool = False):
        self.forward_backward_func = forward_backward_func
        self.encoders_on_every_stage = encoders_on_every_stage
        self.dp_group = dp_group
        self.encoder_recompute = encoder_recompute
        self.announce = announce
        self.last_step: Optional[BalancedStep] = None
        self.timings: Dict[str, float] = {}
        self.first_step_check: Optional[dict] = None
        self.shadow_figures: Optional[Dict[str, float]] = None
        self._model_checked = False
        self._encoder_checks = first_step.EncoderChecks()

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                 **kwargs):
        if not self._model_checked:  # before the first step's collectives
            first_step.check_model_and_config(model)
            if self.encoders_on_every_stage:
                chunk = model_chunks(model)[0]
                if not check_model(model).phase_encoders():
                    raise ValueError("--orch-encoder-ranks all: this pipeline stage's model holds no encoders; build "
                                     "every stage's with them (MLLMModel(encoders=True)) and give them the first "
                                     "stage's parameters (share_encoders) before building the optimizer")
                refused = unsupported_layout(sharded=sharding_of(chunk))
                if refused is not None:
                    raise ValueError(refused)
            self._model_checked = True
        step: BalancedStep = next(_step_iterator(data_iterator))
        self.last_step = step
        if num_microbatches != len(step.microbatches):
            raise ValueError(f"the schedule was asked for {num_microbatches} micro-batches but the "
                             f"post-balancing step holds {len(step.microbatches)}: a step's micro-batches are "
                             "the ones it loaded (StepShape.microbatches_of_step: num_microbatches, or the step's "
                             "count of StepShape.ramp_up), so the loop must pass that count; a loop that re-packs "
                             "steps (Megatron-LM's --sequence-packing-scheduler) is not supported")
        if isinstance(step, ShadowStep):  # planned, not moved: the micro-batches as loaded, upstream
            self.shadow_figures = step.plan.report()
            self.announce(shadow_line(self.shadow_figures))
            return self.forward_backward_func(forward_step_func=forward_step_func,
                                              data_iterator=data_iterators(step.microbatches, model_chunks(model)),
                                              model=model, num_microbatches=num_microbatches,
                                              forward_only=forward_only, **kwargs)
        module = check_model(model)
        if step.receives_embeddings:  # encoder ranks of their own check and run the encoders
            return self._run_receiving(step, module, forward_step_func, model, forward_only, kwargs)
        model_chunk = model_chunks(model)[0]  # the encoders' chunk
        if sharding_of(model_chunk) is None:
            checked = self._encoder_checks.run(module, step)
        else:  # every rank, through the wrapper
            checked = self._encoder_checks.run(module, step, lambda phase: sharded_encode(
                model_chunk, functools.partial(module.encode, phase)))
        run = functools.partial(self._run, step, module, forward_step_func, model, forward_only, kwargs,
                                watched=checked)
        if step.home is not None and not forward_only:
            chunks = model_chunks(model)
            home = functools.partial(self.forward_backward_func, forward_step_func=forward_step_func,
                                     data_iterator=data_iterators(step.home, chunks), model=model,
                                     num_microbatches=len(step.home), forward_only=False, **kwargs)
            if step.pipeline_group is not None:
                home = functools.partial(_with_first_replicas_encoder_gradients, home, module, chunks,
                                         step.pipeline_group)
            result, self.first_step_check = first_step.checked_step(home, run, step, module, chunks, self.dp_group,
                                                                    self.announce)
            return result
        return run()

    def _run(self, step: BalancedStep, module: BalanceableModel, forward_step_func, model, forward_only: bool,
             kwargs: dict, captured: Optional[dict] = None, watched: Sequence[str] = ()):
        """The balanced step: encoders, their outputs to the backbone ranks, Megatron's schedule, the encoders'
        backward; ``captured`` (the checked first step) gets each phase's received outputs; ``watched``: the
        phases whose embeds ``forward`` must read (:func:`~megatron_orch.megatron.first_step.check_embeds_read`,
        on the first step with items of each; every rank agrees on the outcome)."""
        model_chunk = model_chunks(model)[0]  # the encoders' chunk
        sharded = sharding_of(model_chunk) is not None
        self.timings = {}
        pending = []  # (phase, encode, encoder inputs, their chunks, moved outputs)
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
                bounds = self._chunking(step, phase, inputs, sharded)
                encode = functools.partial(module.encode, phase)
                if sharded:  # every rank runs the same chunks, through the wrapper's hooks
                    encode, inputs = sharded_encode(model_chunk, encode), pad_items(inputs, bounds)
                outputs, chunks = encode_in_chunks(encode, inputs, bounds, grad=not forward_only)
                rows = step.inputs[phase].shape[0] * step.rows_per_item[phase]  # a padding chunk's rows go nowhere
                moving.append((phase, encode, inputs, chunks, self._start_move(step, phase, outputs[:rows])))
            embeds = {}
            for phase, encode, inputs, chunks, move in moving:
                leaf = move().requires_grad_(not forward_only)
                embeds[phase] = leaf
                if captured is not None:
                    captured[phase] = leaf.detach()
                pending.append((phase, encode, inputs, chunks, leaf))
            microbatches = _attach(step, embeds)
            for microbatch in microbatches:  # a trainer that records them names the examples of a NaN gradient
                record_non_finite_gradients(microbatch.batch, microbatch.embeds)
            if watched:
                microbatches = [dataclasses.replace(mb, embeds=first_step.WatchedEmbeds(mb.embeds))
                                for mb in microbatches]
            self.timings["encoders_forward"] = time.perf_counter() - start

        chunks = model_chunks(model)
        config = get_model_config(chunks[0])
        callbacks = {name: getattr(config, name) for name in _GRAD_CALLBACKS}
        backward_done = []

        def encoders_backward_once(synced: bool = True):
            if not backward_done:
                backward_done.append(True)
                self._encoders_backward(step, module, pending, _no_sync(config), synced, sharded)

        if not forward_only:
            _run_encoders_backward_first(config, len(chunks), encoders_backward_once)
        watching = bool(watched) and bool(encoders)
        try:
            result = self.forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterators(microbatches, chunks), model=model,
                num_microbatches=len(microbatches), forward_only=forward_only, **kwargs)
        except Exception as err:
            if watching:  # a forward that encodes batch.items fails on their absence: say so
                first_step.check_embeds_read(module, microbatches, watched, err)
            raise
        finally:
            for name, callback in callbacks.items():
                setattr(config, name, callback)
        if watched:  # every rank, so that all stop together
            problem = None
            try:
                if watching:
                    first_step.check_embeds_read(module, microbatches, watched)
            except ValueError as err:
                problem = err
            raise_if_any_rank_failed(problem, what="post-balancing's check of forward(batch, embeds)")
        if not forward_only:
            encoders_backward_once()  # no callback set (or none called): after the backbone schedule
        return result

    def _run_receiving(self, step: BalancedStep, module: BalanceableModel, forward_step_func, model,
                       forward_only: bool, kwargs: dict):
        """The balanced step of a backbone rank whose encoder outputs come from encoder ranks of their own (module
        docstring): each phase's outputs received, in phase order as the encoder ranks send them, Megatron's
        schedule, the gradients back before ``finalize_model_grads_func`` reduces the backbone's (after the schedule
        where none is set: then undivided, as the backbone's own)."""
        if forward_only:
            raise NotImplementedError("post-balancing with encoder ranks of their own runs training steps only: the "
                                      "encoder ranks' loop (OwnEncoderRanksLoop) has no forward-only step")
        start = time.perf_counter()
        config = get_model_config(model_chunks(model)[0])
        nothing = torch.zeros(0, module.config.hidden_size, dtype=module.config.params_dtype,
                              device=next(module.parameters()).device)
        moving = [(phase, self._start_move(step, phase, nothing)) for phase in step.inputs]
        embeds = {phase: move().requires_grad_() for phase, move in moving}
        microbatches = _attach(step, embeds)
        for microbatch in microbatches:
            record_non_finite_gradients(microbatch.batch, microbatch.embeds)
        self.timings = {"encoders_forward": time.perf_counter() - start}  # here: the wait for the encoder ranks
        sent = []

        def send_gradients(num_tokens: Optional[torch.Tensor]) -> None:
            if sent:
                return
            sent.append(True)
            scale = 1.0
            if num_tokens is not None:  # the loss tokens of the whole step, as finalize_model_grads counts them
                total = to_communication_device(num_tokens.detach().clone(), self.dp_group)
                dist.all_reduce(total, group=self.dp_group)
                scale = 1.0 / float(total.cpu())
            returning = [self._start_move(step, phase, scale * (torch.zeros_like(leaf) if leaf.grad is None
                                                                 else leaf.grad), inverse=True)
                         for phase, leaf in embeds.items()]
            for wait in returning:
                wait()

        finalize = config.finalize_model_grads_func
        if finalize is not None:
            def finalize_after_sending(chunks, num_tokens=None, *args, **kw):
                send_gradients(num_tokens)
                return finalize(chunks, num_tokens, *args, **kw)
            config.finalize_model_grads_func = finalize_after_sending
        try:
            result = self.forward_backward_func(
                forward_step_func=forward_step_func, data_iterator=data_iterators(microbatches, model_chunks(model)),
                model=model, num_microbatches=len(microbatches), forward_only=False, **kwargs)
        finally:
            config.finalize_model_grads_func = finalize
        send_gradients(None)  # no finalize_model_grads_func set (or not called)
        return result

    def _start_move(self, step: BalancedStep, phase: str, rows: torch.Tensor,
                    inverse: bool = False) -> Callable[[], torch.Tensor]:
        """Launch the all-to-all of encoder outputs (item by item, in slot order) to the backbone ranks, or
        of their gradients back, on the step's communicator (not the DP group's, where DDP reduces); the
        returned function waits for it and gives the rows on the device of ``rows``."""
        group = step.encoder_moves_group
        if self.dp_group is not None and step.encoder_group is None and dist.get_process_group_ranks(
                group) != dist.get_process_group_ranks(self.dp_group):
            raise ValueError("the post-balancing step moves its data over a group of other ranks than this "
                             "schedule's DP group (iterator and schedule of different groups?)")
        return start_encoder_move(step.moves, phase, rows, step.rows_per_item[phase], group, inverse)

    def _chunking(self, step: BalancedStep, phase: str, inputs: torch.Tensor, sharded: bool) -> List[ChunkBounds]:
        """This rank's chunks of ``phase`` under the step's plan; with sharded parameters the chunks every rank
        runs alike (:func:`~megatron_orch.megatron.sharding.aligned_chunks`)."""
        chunks = step.encoder_chunks(phase)
        count = inputs.shape[0]
        encoded = step.encoded(phase)
        rank = step.encoding_rank()
        counts = np.bincount(encoded.rank, minlength=encoded.num_ranks)
        if counts[rank] != count:
            raise ValueError(f"encoder rank {rank}: the plan encodes {counts[rank]} {phase} items here but the "
                             f"step brings {count}")
        if chunks is None:  # a plan without a memory model: one chunk per rank
            chunk_items, kept = max(int(counts.max(initial=0)), 1), counts
        else:
            chunk_items, kept = chunks.items, chunks.kept
        if int(kept[rank]) > count:
            raise ValueError(f"encoder rank {rank}: the plan keeps {kept[rank]} {phase} items but the step "
                             f"brings {count}")
        kept = np.zeros_like(counts) if self.encoder_recompute else np.asarray(kept)
        if sharded:
            return aligned_chunks(counts, chunk_items, kept, rank)
        return chunk_bounds(count, chunk_items, int(kept[rank]))

    def _encoders_backward(self, step: BalancedStep, module: BalanceableModel, pending, no_sync,
                           synced: bool, sharded: bool = False) -> None:
        """Every encoder chunk's backward; a phase's last one (and an idle encoder's zero gradients) outside
        ``no_sync`` where ``synced`` (Megatron DDP then counts them, as it counts the backbone's last micro-batch),
        all of them under it where not (the schedule's explicit grad sync follows). With the encoders on every
        pipeline stage (``step.pipeline_group``) every backward runs under ``no_sync``, the gradients are summed
        over the stages (:func:`sum_encoder_gradients`) and then, where ``synced``, each reports ready once (a zero
        gradient), so that DDP reduces the sum over DP, also where ``--overlap-grad-reduce`` starts a bucket's
        reduction at that report. ``sharded``: phase after phase, the same order on every rank."""
        start = time.perf_counter()
        over_stages, report = step.pipeline_group is not None, synced
        synced = synced and not over_stages
        # Every phase's gradients start back at once; the first chunks' backward hides the later transfers.
        returning = {phase: self._start_move(step, phase, torch.zeros_like(leaf) if leaf.grad is None else leaf.grad,
                                             inverse=True) for phase, _, _, _, leaf in pending}
        grads = {}
        # Kept chunks first, of every phase: their activations are freed before any chunk is recomputed. With
        # sharded parameters phase after phase (kept chunks first), the same order on every rank.
        order = [(phase, encode, inputs, chunk) for kept in (True, False)
                 for phase, encode, inputs, chunks, _ in pending for chunk in chunks if chunk.kept == kept]
        if sharded:
            names = [phase for phase, *_ in pending]
            order.sort(key=lambda entry: names.index(entry[0]))  # stable: kept chunks stay first in a phase
        last = {phase: i for i, (phase, *_) in enumerate(order)}
        for i, (phase, encode, inputs, chunk) in enumerate(order):
            rows = step.rows_per_item[phase]
            if phase not in grads:  # a padding chunk's rows (sharded) get a zero gradient
                grads[phase] = _zero_padded(returning[phase](), inputs.shape[0] * rows)
            with contextlib.nullcontext() if synced and last[phase] == i else no_sync():
                backward_chunk(encode, inputs, chunk, grads[phase][chunk.start * rows:chunk.stop * rows])
        for phase, _, _, chunks, _ in pending:
            if phase not in grads:  # a phase without chunks: its (empty) transfer still completes
                returning[phase]()
            # no items of this phase on this rank in this step (over the stages every encoder reports below)
            if not chunks and not over_stages:
                with contextlib.nullcontext() if synced else no_sync():
                    _zero_gradients(module.phase_encoders()[phase])
        if over_stages:
            sum_encoder_gradients(module, step.pipeline_group)
            if report:
                for encoder in module.phase_encoders().values():
                    _zero_gradients(encoder)
        self.timings["encoders_backward"] = time.perf_counter() - start


def start_encoder_move(moves: StepMoves, phase: str, rows: torch.Tensor, rows_per_item: int, group: ProcessGroup,
                       inverse: bool = False) -> Callable[[], torch.Tensor]:
    """Launch the all-to-all of ``phase``'s encoder outputs ``rows`` (this rank's items in slot order,
    ``rows_per_item`` each) to the backbone ranks, or with ``inverse`` of their gradients back, over ``group``; the
    returned function waits for it and gives the received rows on the device of ``rows``."""
    move = (moves.gradients if inverse else moves.outputs)[phase]
    layout = ItemLayout(np.full(move.transfer.src.num_items, rows_per_item, dtype=np.int64), tuple(rows.shape[1:]),
                        rows.dtype)
    pending = move.start([to_communication_device(move.send_rows(rows), group)], [layout], group)
    return lambda: pending.wait()[0].to(rows.device, non_blocking=True)


def _run_encoders_backward_first(config, num_chunks: int, encoders_backward: Callable[[bool], None]) -> None:
    """Wrap the model config's gradient callbacks (:data:`_GRAD_CALLBACKS`) so that whichever reduces gradients
    first calls ``encoders_backward(synced)`` before it (calling it once is the caller's concern); the caller
    puts the callbacks back. ``synced``: whether the encoders' last backward may run outside ``no_sync``, false
    where the schedule syncs the encoders' chunk by its ``grad_sync_func`` (``--overlap-grad-reduce``): megatron-core
    calls it only after running every backward of the chunk under ``no_sync`` (the interleaved schedule, 1F1B's
    later pipeline stages), and it reduces the whole chunk; its first stage reports its last micro-batch's
    gradients and reduces at ``finalize_model_grads_func``. ``num_chunks``: the model chunks (virtual stages)."""
    def after_encoders_backward(callback, synced: bool):
        def call(*args, **kw):
            encoders_backward(synced)
            return callback(*args, **kw)
        return call

    for name in _GRAD_CALLBACKS:
        callback = getattr(config, name)
        if name == "grad_sync_func" and callback is not None and num_chunks > 1 and not isinstance(callback, list):
            callback = [callback] * num_chunks  # as the interleaved schedule spreads it over the chunks
        synced = name != "grad_sync_func"
        if isinstance(callback, list):  # one per model chunk: the first chunk's (the encoders')
            setattr(config, name, [after_encoders_backward(callback[0], synced), *callback[1:]])
        elif callback is not None:
            setattr(config, name, after_encoders_backward(callback, synced))


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


def model_chunks(model) -> List[torch.nn.Module]:
    """The model chunks a megatron-core schedule is given (one module, or one per virtual pipeline stage)."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def shadow_line(figures: Dict[str, float]) -> str:
    """One shadow step's figures (``StepPlan.report()``) as a line: each phase's modeled cost max/mean over DP as
    loaded and as planned, the MB the plan would move, the modeled step time it would save."""
    phases = [name[:-len(" before")] for name in figures if name.endswith(" before")]
    costs = ", ".join(f"{p} {figures[f'{p} before']:.2f}->{figures[f'{p} after']:.2f}" for p in phases)
    return (f"> post-balancing shadow (planned, not applied) cost max/mean over DP before->after: {costs} | would "
            f"move MB intra/inter node: {figures['intra-node MB']:.2f}/{figures['inter-node MB']:.2f} | modeled "
            f"step time saved: {figures['step saved %']:.1f}%")


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


def _encoder_gradients(module: BalanceableModel) -> List[torch.Tensor]:
    """Every trained encoder parameter's gradient: Megatron DDP's accumulated ``main_grad`` where it has one, else
    ``.grad``, a zero one made for a parameter without (an encoder that ran nothing, outside DDP)."""
    grads = []
    for encoder in module.phase_encoders().values():
        for param in encoder.parameters():
            if not param.requires_grad:
                continue
            grad = getattr(param, "main_grad", None)
            if grad is None:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
            grads.append(grad)
    return grads


def _over_group(grads: List[torch.Tensor], group: ProcessGroup, collective: Callable) -> None:
    """``collective(flat, group)`` on ``grads`` flattened into one tensor, the result copied back into them."""
    if not grads:
        return
    flat = to_communication_device(torch.cat([grad.reshape(-1) for grad in grads]), group)
    collective(flat, group)
    for grad, result in zip(grads, torch.split(flat.to(grads[0].device), [grad.numel() for grad in grads])):
        grad.copy_(result.view_as(grad))


def sum_encoder_gradients(module: BalanceableModel, pipeline_group: ProcessGroup) -> None:
    """Sum every encoder parameter's gradient over ``pipeline_group`` (the encoders on every pipeline stage: each
    stage's encoders saw a share of the step's items), in one all-reduce. Run before the DP reduction, so that
    the gradients end up summed over DP x PP, whatever DDP reduces them with (all-reduce, or the distributed
    optimizer's reduce-scatter), and equal on every stage."""
    _over_group(_encoder_gradients(module), pipeline_group, lambda flat, group: dist.all_reduce(flat, group=group))


def _with_first_replicas_encoder_gradients(run_home: Callable[[], list], module: BalanceableModel,
                                           chunks: Sequence[torch.nn.Module], pipeline_group: ProcessGroup) -> list:
    """``run_home()`` (the loader's layout, the checked first step's upstream run) with the encoders on every stage:
    where the balanced step sums its encoder gradients over ``pipeline_group``, this gives every replica the first
    one's (the first stage's, which encoded every item of its DP rank; the others encoded none), in one broadcast
    before DDP reduces them, so that both layouts leave upstream's encoder gradients on every replica."""
    config = get_model_config(chunks[0])
    callbacks = {name: getattr(config, name) for name in _GRAD_CALLBACKS}
    done = []
    first = dist.get_global_rank(pipeline_group, 0)

    def from_first_replica(*_):  # as a gradient callback calls the encoders' backward (synced or not)
        if not done:
            done.append(True)
            _over_group(_encoder_gradients(module), pipeline_group,
                        lambda flat, group: dist.broadcast(flat, src=first, group=group))

    _run_encoders_backward_first(config, len(chunks), from_first_replica)
    try:
        result = run_home()
    finally:
        for name, callback in callbacks.items():
            setattr(config, name, callback)
    from_first_replica()  # no callback set (or none called): after the schedule
    return result


def _zero_padded(rows: torch.Tensor, length: int) -> torch.Tensor:
    """``rows`` followed by zero rows up to ``length``."""
    if rows.shape[0] >= length:
        return rows
    return torch.cat([rows, rows.new_zeros(length - rows.shape[0], *rows.shape[1:])])


def _zero_gradients(encoder: torch.nn.Module) -> None:
    """A zero gradient for every parameter of ``encoder`` (one that had no items, or one whose gradients were
    summed over the pipeline stages under ``no_sync``): every encoder parameter then reports a gradient exactly
    once per step, which Megatron DDP's ``--overlap-grad-reduce`` needs (it launches a bucket's reduction once
    each of its parameters has reported as often as in the first step, and asserts that every parameter reported
    in the first step)."""
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
