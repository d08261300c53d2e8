"""A compact training loop on megatron-core, for machines without a Megatron-LM checkout.

It does what ``megatron.training.pretrain`` does, for the model of a
:class:`~megatron_orch.trainer.task.TrainingTask` (any model of the balancing contract), with
megatron-core's own parts:
``parallel_state`` (gloo on CPU, through :mod:`~megatron_orch.trainer.cpu_harness`), Megatron DDP,
``get_megatron_optimizer`` (optionally the distributed optimizer), ``OptimizerParamScheduler``,
``get_forward_backward_func()`` (no pipelining, 1F1B with pipeline parallelism, or the interleaved 1F1B
with virtual pipeline stages: one model chunk per virtual stage, as Megatron-LM's ``get_model``),
``finalize_model_grads`` with per-token loss normalisation, Megatron timers, iteration log lines,
TensorBoard scalars and checkpoint save/resume.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import time
import warnings
from datetime import datetime, timedelta
from typing import Callable, Iterator, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import RerunDataIterator
from megatron.core.timers import Timers
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron_orch.comm.device import to_communication_device
from megatron_orch.comm.gather import all_gather_to_host
from megatron_orch.comm.status import raise_if_any_rank_failed
from megatron_orch.megatron.contract import recording_non_finite_losses
from megatron_orch.megatron.encoder_layout import encoder_groups, share_encoders
from megatron_orch.megatron.orch_arguments import flag_setting
from megatron_orch.megatron.schedule import data_iterators
from megatron_orch.trainer.data_events import DataEvent, TooManyBadExamplesError, max_bad_examples
from megatron_orch.trainer.checkpointing import (TrainState, check_save_folder, load_checkpoint, lock_save_folder,
                                                 new_run_id, run_config, save_checkpoint)
from megatron_orch.trainer.data_parallel import wrap_data_parallel
from megatron_orch.trainer.faults import StepReader, naming_lost_collectives
from megatron_orch.trainer.task import TrainingTask, compute_device, runs_on_cpu, task_or_the_mllm
from megatron_orch.trainer.timers import EventTimers
from megatron_orch.trainer.training_log import (RUN_PEER_FIELDS, IntervalStats, IterationRecord, LoadMeter,
                                                TensorBoardLog, gather_data_events, load_fields,
                                                max_and_mean_over_group, memory_report, phase_timers,
                                                post_balancing_fields)

ForwardStep = Callable[[Iterator, torch.nn.Module], tuple]


def initialize(args: argparse.Namespace) -> None:
    """Process group, model-parallel groups and seeds (Megatron's ``initialize_megatron``)."""
    if runs_on_cpu(args):
        from megatron_orch.trainer import cpu_harness
        cpu_harness.install()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if not dist.is_initialized():
        # No device_id, as Megatron-LM: bound to a device, NCCL turns every later new_group into an eager
        # split of the world's communicator (each group then costs a world-wide collective at creation);
        # unbound, a group's communicator is set up at its first collective, on the current device.
        dist.init_process_group(args.distributed_backend,
                                timeout=timedelta(minutes=args.distributed_timeout_minutes))
    if dist.get_world_size() != args.world_size:
        raise RuntimeError(f"the arguments were validated for world size {args.world_size}, "
                           f"but the process group has {dist.get_world_size()} ranks")
    # Every group megatron-core creates (DP, TP, PP, model-parallel, their gloo twins) gets the timeout;
    # without it they keep megatron-core's 30-minute default whatever the flag says.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        expert_model_parallel_size=args.expert_model_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes)
    set_random_seed(args.seed)


def set_random_seed(seed: int) -> None:
    """Megatron's seeding: one seed per pipeline stage; per-TP-rank streams in the RNG tracker."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def build_model(args: argparse.Namespace, model_provider: Callable) -> list:
    """This rank's model chunks, in bf16 if asked, each wrapped in Megatron DDP, torch FSDP2 or Megatron-FSDP
    (:func:`~megatron_orch.trainer.data_parallel.wrap_data_parallel`): one, or one per virtual pipeline stage
    (``model_provider(args, pre_process, post_process, vp_stage=...)``, as Megatron-LM's ``get_model`` builds
    them, bucketing the first chunk's gradients only).

    A rank whose ``model_provider`` fails (a bad config, out of memory) raises on every rank: the
    outcome is agreed before the wrapping and the optimizer, which run collectives.
    """
    chunks, error = [], None
    try:
        if args.virtual_pipeline_model_parallel_size is None:
            chunks.append(model_provider(args, pre_process=parallel_state.is_pipeline_first_stage(),
                                         post_process=parallel_state.is_pipeline_last_stage()))
        for vp_stage in range(args.virtual_pipeline_model_parallel_size or 0):
            chunk = {"ignore_virtual": False, "vp_stage": vp_stage}
            chunks.append(model_provider(args, pre_process=parallel_state.is_pipeline_first_stage(**chunk),
                                         post_process=parallel_state.is_pipeline_last_stage(**chunk),
                                         vp_stage=vp_stage))
    except Exception as err:  # noqa: BLE001
        error = err
    raise_if_any_rank_failed(error, what="building the model")
    device = compute_device(args)
    model = []
    for index, module in enumerate(chunks):
        config = module.config
        module.to(device)  # the encoders' plain torch layers are built on the CPU
        if args.bf16:
            module = Float16Module(config, module)
        model.append(wrap_data_parallel(args, config, module, device, disable_bucketing=index > 0))
    return model


def build_optimizer(args: argparse.Namespace, model: list, timers: Optional[Timers] = None, *, pg_collection=None):
    """Megatron optimizer (Adam or SGD, optionally distributed) and its LR / weight-decay schedule; ``pg_collection``:
    the model's process groups where they are not the global parallel state's (a module on a grid of its own,
    :func:`~megatron_orch.megatron.own_encoder_ranks.grid_process_groups`)."""
    config = OptimizerConfig(
        optimizer=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, bf16=args.bf16,
        params_dtype=torch.bfloat16 if args.bf16 else torch.float32,
        use_distributed_optimizer=args.use_distributed_optimizer, timers=timers)
    with warnings.catch_warnings():
        # megatron-core 0.19's get_megatron_optimizer imports MIMO for an isinstance check, which warns that MIMO
        # is experimental; a MIMO model was imported, and warned, before it was built
        warnings.filterwarnings("ignore", message="MimoModelConfig is experimental", category=UserWarning)
        groups = {} if pg_collection is None else {"pg_collection": pg_collection, "use_gloo_process_groups": False}
        optimizer = get_megatron_optimizer(config, model, **groups)
    samples = args.global_batch_size  # Megatron steps the schedule in samples
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=args.lr_warmup_iters * samples, lr_decay_steps=args.lr_decay_iters * samples,
        lr_decay_style=args.lr_decay_style, start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * samples, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    return optimizer, scheduler


def scheduler_source(args: argparse.Namespace) -> str:
    """Which LR schedule a resumed run follows (Megatron-LM's flags): "override" (this run's),
    "checkpoint" (the checkpoint's) or "match" (both must be equal)."""
    if args.override_opt_param_scheduler:
        return "override"
    return "checkpoint" if args.use_checkpoint_opt_param_scheduler else "match"


def attach_to_model_config(model: list, optimizer, timers: Timers) -> None:
    """Hooks the schedule reads from the model config: grad sync, loss scaling, timers."""
    config = get_model_config(model[0])
    config.timers = timers
    # Level-1 timers (forward-backward, all-grads-sync) would put a world barrier, a host sync, in every
    # step; the step times are per rank anyway (the log line shows max/mean over ranks).
    config.barrier_with_L1_time = False
    config.grad_scale_func = optimizer.scale_loss
    config.no_sync_func = _per_chunk(model, "no_sync")
    # As Megatron-LM (align_grad_reduce, its default): with --overlap-grad-reduce the schedule starts each chunk's
    # reduction where its backward ends; with --overlap-param-gather and virtual stages (align_param_gather), each
    # chunk's gather before its first forward (without, each bucket's forward pre-hook gathers it).
    if any(_ddp_setting(chunk, "overlap_grad_reduce") for chunk in model):
        config.grad_sync_func = _per_chunk(model, "start_grad_sync")
    if len(model) > 1 and any(_ddp_setting(chunk, "overlap_param_gather") for chunk in model):
        config.param_sync_func = _per_chunk(model, "start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads
    if not config.calculate_per_token_loss:
        raise ValueError("the MLLM trains with per-token loss normalisation (calculate_per_token_loss)")


def _per_chunk(model: list, method: str):
    """The model config's form of a callback: one per model chunk, or the only chunk's."""
    return [getattr(chunk, method) for chunk in model] if len(model) > 1 else getattr(model[0], method)


def _ddp_setting(chunk, name: str) -> bool:
    """A Megatron DDP setting of a model chunk (False for a wrapper without it)."""
    return bool(getattr(getattr(chunk, "ddp_config", None), name, False))


def gather_parameters(model: list) -> None:
    """With ``--overlap-param-gather`` an optimizer step's parameters reach the model chunks at their next
    forward; gather them now (before a checkpoint, at the end of training: Megatron-LM's ``force_param_sync``)."""
    for chunk in model:
        if _ddp_setting(chunk, "overlap_param_gather"):
            chunk.start_param_sync(force_sync=True)


def time_encoder_forwards(model: list, timers: Timers) -> None:
    """Record each encoder's forward time in the timers (``<phase>-encoder-forward``)."""
    unwrapped = get_attr_wrapped_model(model[0], "phase_encoders", return_model_obj=True)
    for name, encoder in unwrapped.phase_encoders().items():
        timer_name = f"{name}-encoder-forward"
        encoder.register_forward_pre_hook(lambda *_, n=timer_name: timers(n, log_level=0).start())
        encoder.register_forward_hook(lambda *_, n=timer_name: timers(n, log_level=0).stop())


def train_step(forward_step: ForwardStep, data_iterator: Iterator, model: list, optimizer, scheduler,
               args: argparse.Namespace, timers: Timers, forward_backward_func: Optional[Callable] = None) -> dict:
    """One global batch: forward/backward over the micro-batches, grad sync, optimizer step.

    Returns ``lm_loss`` (global, per token; on the last pipeline stage, else None), ``grad_norm``
    and ``skipped``. ``forward_backward_func``: default megatron-core's ``get_forward_backward_func()``;
    with post-balancing the modality-aware schedule that wraps it.
    """
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    with recording_non_finite_losses() as non_finite:
        losses = (forward_backward_func or get_forward_backward_func())(
            forward_step_func=forward_step, data_iterator=data_iterator, model=model,
            num_microbatches=args.num_microbatches, seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, decoder_seq_length=args.seq_length, forward_only=False)
    timers("optimizer", log_level=0).start()
    update_successful, grad_norm, _ = optimizer.step()
    timers("optimizer").stop()
    if update_successful:
        scheduler.step(increment=args.global_batch_size)
    lm_loss, non_finite_samples, non_finite_gradient_samples = None, [], []
    if parallel_state.is_pipeline_last_stage():  # sum of token losses / number of loss tokens, over DP (x CP)
        dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        report = to_communication_device(torch.stack([x["lm loss"] for x in losses]).sum(dim=0).double(), dp_group)
        dist.all_reduce(report, group=dp_group)
        report = report.cpu()
        lm_loss = float(report[0] / report[1]) if report[1] > 0 else float("nan")
        if not math.isfinite(lm_loss):  # the same on every rank of the group
            non_finite_samples = _non_finite_samples(non_finite.losses, args.global_batch_size, dp_group)
    if grad_norm is not None and not math.isfinite(float(grad_norm)):  # global: every rank of the job alike
        non_finite_gradient_samples = _non_finite_samples(non_finite.gradients, args.global_batch_size, None)
    return {"lm_loss": lm_loss, "grad_norm": grad_norm, "skipped": not update_successful,
            "non_finite_samples": non_finite_samples, "non_finite_gradient_samples": non_finite_gradient_samples}


def _non_finite_samples(records, most: int, group) -> List[int]:
    """The sample ids of the examples flagged on any rank of ``group`` (None: the job) in each rank's ``records``
    (one list of :class:`~megatron_orch.megatron.contract.NonFiniteRecords`: empty where nothing recorded any), at
    most ``most`` of them per rank; read only for a step whose loss or gradient norm is not finite."""
    mine = sorted({int(i) for ids, bad in records for i in ids[bad.to(ids.device)].tolist() if i >= 0})[:most]
    buffer = torch.full((most + 1,), -1, dtype=torch.long)
    buffer[0] = len(mine)
    buffer[1:1 + len(mine)] = torch.tensor(mine, dtype=torch.long)
    rows = all_gather_to_host(buffer, group)
    return sorted({int(i) for row in rows for i in row[1:1 + int(row[0])].tolist()})


def _logging_rank() -> bool:
    """Megatron logs from the last rank: it sits on the last pipeline stage, where the loss is."""
    return dist.get_rank() == dist.get_world_size() - 1


def _interval_record(args, state: TrainState, stats: IntervalStats, last_step: dict,
                     optimizer) -> IterationRecord:
    """Collective over the world: per-rank load as max/mean over the DP group, phase times as max/mean
    over the ranks that run the phase (the encoders run on the first pipeline stage only)."""
    n = max(stats.iterations, 1)
    phases = args.model_summary.phases
    fields, timer_names = load_fields(phases), phase_timers(phases)
    load_max, load_mean = max_and_mean_over_group(stats.load / n, parallel_state.get_data_parallel_group())
    times = torch.tensor([stats.phase_s.get(name, float("nan")) * 1000.0 / n for name in timer_names],
                         dtype=torch.float64)
    per_rank = all_gather_to_host(times).numpy()
    ran = [i for i, name in enumerate(timer_names) if not np.all(np.isnan(per_rank[:, i]))]
    elapsed_s = stats.elapsed_s / n
    tokens_per_s = float(load_mean[-1]) * args.data_parallel_size / elapsed_s  # the backbone's tokens
    grad_norm = last_step["grad_norm"]
    return IterationRecord(
        iteration=state.iteration, consumed_samples=state.consumed_samples, elapsed_ms=elapsed_s * 1000.0,
        learning_rate=optimizer.param_groups[0]["lr"], global_batch_size=args.global_batch_size,
        lm_loss=stats.mean_loss, grad_norm=None if grad_norm is None else float(grad_norm),
        loss_scale=float(optimizer.get_loss_scale()), skipped=stats.skipped, nan=stats.nan,
        tokens_per_s=tokens_per_s,
        load_max=dict(zip(fields, load_max.tolist())), load_mean=dict(zip(fields, load_mean.tolist())),
        phase_ms_max={timer_names[i]: float(np.nanmax(per_rank[:, i])) for i in ran},
        phase_ms_mean={timer_names[i]: float(np.nanmean(per_rank[:, i])) for i in ran},
        post_balancing=_post_balancing_figures(stats, n, post_balancing_fields(phases)),
        bad_examples=stats.bad_examples, truncated_answers=stats.truncated_answers,
        **_items_encoded(args, stats, n, phases.encoder_names))


def _items_encoded(args, stats: IntervalStats, n: int, phases) -> dict:
    """The record's encoder layout and items each global rank encoded per iteration (a collective over the world
    where balanced steps ran: on every rank alike), else nothing."""
    if stats.encoded is None:
        return {}
    per_rank = all_gather_to_host(stats.encoded / n).numpy()
    return {"encoder_ranks": args.orch_config.encoder_ranks.value,
            "items_encoded": {phase: per_rank[:, k].tolist() for k, phase in enumerate(phases)}}


def _post_balancing_figures(stats: IntervalStats, n: int, fields) -> Optional[dict]:
    """Interval means; the plan's figures agree on all ranks, times are the max over the DP group, and so is a
    rank's peers over the run after the interval (the busiest rank's)."""
    if stats.post_balancing is None:
        return None
    figures, names = stats.post_balancing / n, tuple(fields)
    if stats.run_peers is not None:  # (every rank's steps carry them, or none's)
        figures = torch.cat((figures, torch.tensor(stats.run_peers, dtype=torch.float64)))
        names += RUN_PEER_FIELDS
    figures, _ = max_and_mean_over_group(figures, parallel_state.get_data_parallel_group())
    return dict(zip(names, figures.tolist()))


def _phase_seconds(timers: Timers, names) -> dict:
    """Seconds each of the phase timers ``names`` accumulated since the last call. Timers this rank never
    created (an encoder on a later pipeline stage, a level above --timing-log-level) are left out;
    Megatron's Timers has no public lookup that does not create a timer, hence ``_timers``."""
    return {name: timers._timers[name].elapsed(reset=True) for name in names if name in timers._timers}


def train(args: argparse.Namespace, model: list, optimizer, scheduler, data_iterator: Iterator,
          state: TrainState, timers: Timers, forward_step: ForwardStep, config: dict,
          print_fn: Callable[[str], None] = print,
          forward_backward_func: Optional[Callable] = None,
          read_step: Optional[Callable[[], None]] = None, data_source=None, lock=None) -> list[IterationRecord]:
    """Train up to ``args.train_iters`` (or the next multiple of ``--exit-interval``), then save if
    ``--save``; returns the records of the logged iterations (on the logging rank, else empty).

    ``read_step``: called on every rank before each step (:meth:`StepReader.read_step`). A collective
    that times out or loses a peer raises :class:`~megatron_orch.trainer.faults.CollectiveFailureError`
    naming the ranks that never reached a collective. ``data_source``: the loader where it is a
    :class:`~megatron_orch.trainer.data_events.DataEvents`, whose skipped examples and truncated answers are
    reported after each step (:func:`_report_data_events`). ``lock``: rank 0's lock of ``--save``.
    ``config``: the run config saved with each checkpoint (:func:`run_config`).
    """
    with naming_lost_collectives(lambda: f"iteration {state.iteration + 1}", args.distributed_timeout_minutes):
        return _train(args, model, optimizer, scheduler, data_iterator, state, timers, forward_step, print_fn,
                      forward_backward_func, read_step, data_source, lock, config)


def _report_data_events(args, data_source, state: TrainState, print_fn) -> List[DataEvent]:
    """The events (bad examples skipped, answers truncated) of the samples trained so far, over every DP rank.

    Every rank of a DP group gets the same events (its TP/PP peers read the same samples), so every
    rank counts alike and raises alike once more than ``--max-bad-examples`` were skipped; the logging
    rank prints each skip and the run's first truncated answer."""
    if data_source is None:  # a loader without events (every rank builds the same kind)
        return []
    events = gather_data_events(data_source.take_events(state.consumed_samples),
                                parallel_state.get_data_parallel_group())
    skipped = [e for e in events if e.skipped]
    truncated = [e for e in events if not e.skipped]
    if _logging_rank():
        for event in skipped:
            print_fn(f" > bad example skipped (--max-bad-examples {max_bad_examples(args)}): {event.message}; "
                     f"sample {event.position} trains on {event.replacement} instead")
        if truncated and state.truncated_answers == 0:
            print_fn(f" > {truncated[0].message}; answers truncated from here on are counted in the iteration "
                     "lines (--refuse-long-answers makes them bad examples)")
    state.bad_examples += len(skipped)
    state.truncated_answers += len(truncated)
    if state.bad_examples > max_bad_examples(args):
        last = skipped[-1].message if skipped else "skipped before the checkpoint this run resumed from"
        raise TooManyBadExamplesError(
            f"{state.bad_examples} bad examples by iteration {state.iteration}, more than --max-bad-examples "
            f"{max_bad_examples(args)}; the last: {last}")
    return events


class NonFiniteStepError(ValueError):
    """A step whose loss or gradient norm is NaN or infinite (Megatron-LM's --check-for-nan-in-loss-and-grad)."""


def _stop_if_not_finite(args, state: TrainState, result: dict, data_source, events: List[DataEvent]) -> None:
    """Raise :class:`NonFiniteStepError` naming the iteration and its examples if its loss or grad norm is
    not finite, before anything saves it: those whose own loss is not finite where the forward step recorded
    them (``result["non_finite_samples"]``), else those whose encoder output rows got a non-finite gradient
    (``result["non_finite_gradient_samples"]``, balanced steps), else all of the step's. The grad norm is global
    (every rank raises alike); the loss is known on the last pipeline stage (a non-finite loss with finite
    gradients stops that stage there, and the other stages at their next collective with it)."""
    bad = [f"the {what} is {float(value)}" for what, value in (("lm loss", result["lm_loss"]),
                                                                ("grad norm", result["grad_norm"]))
           if value is not None and not math.isfinite(float(value))]
    if not bad:
        return
    examples = ""
    found = [(what, ids) for what, ids in (
        ("own loss is not finite", result["non_finite_samples"]),
        ("encoder outputs got a non-finite gradient", result["non_finite_gradient_samples"])) if ids]
    if found:  # found per example
        what, ids = found[0]
        shown = data_source.describe_examples(ids) if data_source is not None else f"sample ids {ids}"
        examples = f"; the examples whose {what}: {shown}"
    elif data_source is not None:
        first = state.consumed_samples - args.global_batch_size
        replaced = {event.position: event.replacement for event in events if event.skipped}
        examples = f"; its examples: {data_source.describe_samples(range(first, state.consumed_samples), replaced)}"
    raise NonFiniteStepError(f"iteration {state.iteration}: {' and '.join(bad)}{examples}; the run stops before "
                             "saving it (--no-check-for-nan-in-loss-and-grad trains on)")


def _train(args, model, optimizer, scheduler, data_iterator, state, timers, forward_step, print_fn,
           forward_backward_func, read_step, data_source, lock, config) -> list[IterationRecord]:
    phases = args.model_summary.phases
    meter = LoadMeter(data_iterator, phases)
    tensorboard = TensorBoardLog(args.tensorboard_dir) if args.tensorboard_dir and _logging_rank() else None
    records, stats, first_iteration = [], IntervalStats(), state.iteration
    for chunk in model:
        chunk.train()
    exit_interval_reached = False
    report_memory = not runs_on_cpu(args)  # Megatron-LM's report_memory_flag: CUDA memory after the first logs
    while state.iteration < args.train_iters:
        if args.exit_interval and state.iteration > first_iteration and state.iteration % args.exit_interval == 0:
            exit_interval_reached = True
            break
        start = time.perf_counter()
        if read_step is not None:
            read_step()
        result = train_step(forward_step, meter, model, optimizer, scheduler, args, timers, forward_backward_func)
        elapsed = time.perf_counter() - start
        state.iteration += 1
        state.consumed_samples += args.global_batch_size
        events = _report_data_events(args, data_source, state, print_fn)
        stats.add(elapsed, meter.take(), result["skipped"], result["lm_loss"], meter.take_post_balancing(),
                  sum(e.skipped for e in events), sum(not e.skipped for e in events), meter.take_encoded(),
                  meter.run_peers)
        if args.check_for_nan_in_loss_and_grad:
            _stop_if_not_finite(args, state, result, data_source, events)
        if state.iteration % args.log_interval == 0 or state.iteration == args.train_iters:
            stats.phase_s = _phase_seconds(timers, phase_timers(phases))  # the interval's: timers read here only
            record = _interval_record(args, state, stats, result, optimizer)
            stats = IntervalStats()
            if _logging_rank():
                print_fn(record.line(args.train_iters, full=args.orch_log_level >= 1))
                records.append(record)
                if tensorboard is not None:
                    tensorboard.write(record)
            if report_memory:  # as Megatron-LM: on DP rank 0, until an iteration past the first has been logged
                if parallel_state.get_data_parallel_rank() == 0:
                    print_fn(memory_report(f"(after {state.iteration} iterations)"))
                report_memory = state.iteration <= first_iteration + 1
        if args.save and args.save_interval and state.iteration % args.save_interval == 0:
            _save(args, state, model, optimizer, scheduler, print_fn, config, lock, data_source)
    gather_parameters(model)  # the model as trained, for the last save and the caller
    saved_last = args.save_interval and state.iteration % args.save_interval == 0
    if args.save and state.iteration > first_iteration and not saved_last:
        _save(args, state, model, optimizer, scheduler, print_fn, config, lock, data_source)
    if exit_interval_reached and _logging_rank():
        print_fn(f"[exiting program at iteration {state.iteration} (--exit-interval {args.exit_interval})] "
                 f"datetime: {_now()} ")
    if tensorboard is not None:
        tensorboard.close()
    return records


def _now() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")


def _save(args, state: TrainState, model: list, optimizer, scheduler, print_fn: Callable[[str], None], config,
          lock, data_source) -> None:
    """save_checkpoint with Megatron-LM's lines before and after (from the rank that logs the iterations),
    and the loader's state after the samples trained so far where it has one (an Energon loader)."""
    if hasattr(data_source, "loader_state"):
        state.rank_state["loader"] = data_source.loader_state(state.consumed_samples)
    gather_parameters(model)
    if _logging_rank():
        print_fn(f"[{_now()}] saving checkpoint at iteration {state.iteration:7d} to {args.save}")
    save_checkpoint(args.save, state, model, optimizer, scheduler, args.use_distributed_optimizer, config, lock,
                    args.keep_last_checkpoints)
    if _logging_rank():
        print_fn(f"  [{_now()}] successfully saved checkpoint from iteration {state.iteration:7d} to {args.save}")


def pretrain(args: argparse.Namespace, task: Optional[TrainingTask] = None,
             print_fn: Callable[[str], None] = print) -> list[IterationRecord]:
    """Initialise, build, (resume,) train ``task`` (``args``: its command line, parsed by
    :func:`~megatron_orch.trainer.arguments.parse_args` with the same task); the compact counterpart of
    ``megatron.training.pretrain``, whose providers are the task's hooks (``task.build_model(args,
    pre_process, post_process, vp_stage=None)``, ``task.forward_step(data_iterator, model)``, ...).
    Deprecated: ``pretrain(args)`` without a task (this project's MLLM, with a DeprecationWarning)."""
    task = task_or_the_mllm(task, "pretrain(args)", "pretrain(args, task)")
    initialize(args)
    lock = None
    try:
        # A collective lost while building, loading or setting up the data (a rank stuck or gone) is
        # reported with the ranks that never reached one; train() does the same per iteration.
        with naming_lost_collectives(lambda: "setup", args.distributed_timeout_minutes):
            if args.save:  # one run per save folder; rank 0 holds the lock until the run ends
                lock, notes = lock_save_folder(args.save)
                for note in notes:
                    print_fn(note)
            return _set_up_and_train(args, task, print_fn, lock)
    finally:
        if lock is not None:
            lock.release()


def _starting(print_fn: Callable[[str], None], what: str) -> None:
    """A start-up line from rank 0 (``> building the model ...``): set-up can take minutes, never in silence."""
    if dist.get_rank() == 0:
        print_fn(f" > {what} ...")


def _set_up_and_train(args, task: TrainingTask, print_fn, lock) -> list[IterationRecord]:
    timers = EventTimers(log_level=max(1, args.timing_log_level), log_option="minmax", cuda=not runs_on_cpu(args))
    decision = getattr(args, "encoder_ranks_decision", None)
    if decision is not None and dist.get_rank() == 0:
        print_fn(f" > {decision.line(flag_setting)}")
    _starting(print_fn, f"{dist.get_world_size()} ranks initialised; building the model")
    model = build_model(args, task.build_model)
    orch_config = getattr(args, "orch_config", None)
    if orch_config is not None and orch_config.spreads_encoders(args.tensor_model_parallel_size,
                                                                args.pipeline_model_parallel_size):
        _, replicas = encoder_groups(orch_config.encoder_tensor_parallel_size)
        share_encoders(model, replicas)  # before the optimizer copies them
    optimizer, scheduler = build_optimizer(args, model, timers)
    attach_to_model_config(model, optimizer, timers)
    time_encoder_forwards(model, timers)
    state, config = TrainState(), run_config(args, task)  # the data as it is now, which the run reads next
    if args.load:
        # Returns on every rank only when every rank loaded (or none found a checkpoint).
        state = load_checkpoint(args.load, model, optimizer, scheduler, args.use_distributed_optimizer,
                                config, scheduler_source(args), args.ckpt_step, args.allow_changed_data)
        if _logging_rank():
            for note in state.notes:
                print_fn(note)
            if state.iteration:
                print_fn(f" resumed from {args.load} at iteration {state.iteration} "
                         f"(consumed samples {state.consumed_samples})")
        if state.iteration >= args.train_iters:  # the same on every rank: each one stops here
            raise ValueError(f"nothing left to train: the checkpoint under --load {args.load} is at iteration "
                             f"{state.iteration} and --train-iters is {args.train_iters}; raise --train-iters "
                             "to train further, with --override-opt_param-scheduler (--train-iters is part of the "
                             "LR schedule, which must otherwise match the checkpoint's)")
    if not state.run_id:
        state.run_id = new_run_id()
    if args.save:  # saved work of another run is replaced only when the user says so
        for note in check_save_folder(args.save, state.run_id, args.allow_overwrite_checkpoints):  # rank 0's
            print_fn(note)
    if dist.get_rank() == 0:
        print_fn(_describe(args, model))
    _starting(print_fn, "building the training data iterator")
    data_iterator, error = None, None
    try:  # the manifest is read here: a bad one raises on every rank, with its line and path
        restored = {"loader_state": state.rank_state["loader"]} if "loader" in state.rank_state else {}  # Energon's
        data_iterator = task.build_train_data_iterator(
            args, state.consumed_samples, parallel_state.get_data_parallel_rank(), args.data_parallel_size, **restored)
    except Exception as err:  # noqa: BLE001
        error = err
    raise_if_any_rank_failed(error, what="building the training data iterator")
    data_source = data_iterator if hasattr(data_iterator, "take_events") else None
    if data_source is not None and _logging_rank() and data_source.epoch_note() is not None:
        print_fn(data_source.epoch_note())
    forward_backward_func, read_step = get_forward_backward_func(), None
    if args.orch_config is not None:
        data_iterator, forward_backward_func = task.build_post_balancing(
            args, args.orch_config, data_iterator, forward_backward_func)
        if dist.get_rank() == 0:
            topology = data_iterator.topology
            mode = "shadow mode (every step planned and logged, nothing moved)" if args.orch_config.shadow else "on"
            print_fn(f" > post-balancing {mode}: {args.orch_config} | DP group: {topology.num_ranks} ranks on "
                     f"{topology.num_nodes} node(s)")
    else:
        data_iterator = StepReader(data_iterator, args.num_microbatches)
        read_step = data_iterator.read_step
        if len(model) > 1:
            forward_backward_func = feeding_every_chunk(forward_backward_func)
    # megatron.training hands the schedule its iterator wrapped by the rerun machinery; so do we, so the
    # post-balancing iterator is exercised exactly as it is there.
    data_iterator = RerunDataIterator(data_iterator)
    _starting(print_fn, f"training iteration {state.iteration + 1}"
                        + (" (its plan first)" if args.orch_config is not None else ""))
    return train(args, model, optimizer, scheduler, data_iterator, state, timers, task.forward_step, config,
                 print_fn, forward_backward_func, read_step, data_source, lock)


def feeding_every_chunk(forward_backward_func: Callable) -> Callable:
    """The interleaved schedule for an upstream step: megatron-core's takes one data iterator per model chunk
    (Megatron-LM gives every chunk a loader over the same samples); here each micro-batch of the step is read
    once, so counted once, and every chunk iterates over them (:func:`~megatron_orch.megatron.schedule.data_iterators`,
    as the modality-aware schedule feeds a balanced step)."""
    def run(*, data_iterator, model, num_microbatches, **kwargs):
        microbatches = [next(data_iterator) for _ in range(num_microbatches)]
        return forward_backward_func(data_iterator=data_iterators(microbatches, model), model=model,
                                     num_microbatches=num_microbatches, **kwargs)
    return run


def _describe(args: argparse.Namespace, model: list) -> str:
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    virtual = f" (x {len(model)} virtual stages)" if len(model) > 1 else ""
    return (f" > model config {args.model_summary.name}: {params} parameters on rank 0 | world size "
            f"{args.world_size} = TP {args.tensor_model_parallel_size}{' (sequence parallel)' * args.sequence_parallel}"
            f" x CP {args.context_parallel_size} x PP {args.pipeline_model_parallel_size}{virtual} x DP "
            f"{args.data_parallel_size} | global batch "
            f"{args.global_batch_size} = micro-batch {args.micro_batch_size} x {args.num_microbatches} "
            f"micro-batches x DP {args.data_parallel_size}")


_MOVED = {"DistributedDataParallel": "megatron.core.distributed",
          "DistributedDataParallelConfig": "megatron.core.distributed"}  # imported here before sharded DP


def __getattr__(name: str):
    """Names this module used to import (and code of its time imported from it): still there, with a
    DeprecationWarning naming their module, for one release."""
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings
    warnings.warn(f"megatron_orch.trainer.loop.{name} is deprecated: import it from {_MOVED[name]} (the compact "
                  "trainer wraps its model with megatron_orch.trainer.data_parallel.wrap_data_parallel)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(_MOVED[name]), name)
