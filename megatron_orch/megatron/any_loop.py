"""Post-balancing for any training loop that calls megatron-core's schedule itself (your own loop, or one
shaped like Megatron-Bridge's ``train_step``): one call, :func:`post_balance`, wraps the forward-backward
function and the data iterator; the loop then calls the returned schedule exactly as it called megatron-core's.

What the loop already does for megatron-core is what post-balancing needs, with one addition
(``calculate_per_token_loss``); :func:`post_balance` and the schedule's first call check it:

* the model config (``get_model_config(model[0])``, a ``TransformerConfig``) has
  ``calculate_per_token_loss=True``; the loss function returns ``(sum of token losses, number of loss
  tokens, {name: [sum, count]})`` (:func:`~megatron_orch.megatron.contract.loss_func` does);
* the model config's callbacks, set once before the loop as Megatron-LM's and Bridge's setup do:
  ``finalize_model_grads_func = megatron.core.distributed.finalize_model_grads`` (the DP reduction of the
  gradients, and the per-token division; the encoders' backward runs right before it, or before
  ``grad_sync_func`` where that is set, so encoder and backbone gradients are reduced together once),
  ``no_sync_func = ddp_model.no_sync`` (encoder chunks accumulate without reducing), ``grad_scale_func =
  optimizer.scale_loss``; with Megatron DDP's ``overlap_grad_reduce``, ``grad_sync_func`` as usual;
* per step, the loop zeroes the gradients (``zero_grad_buffer()`` of each DDP chunk, ``optimizer.zero_grad()``),
  calls the schedule with ``num_microbatches`` equal to the step's of the :class:`StepShape` (a global batch that
  ramps up: ``StepShape.ramp_up``, e.g. from megatron-core's calculator, :func:`megatron_core_counts`), then
  ``optimizer.step()``;
  the data iterator it passes is the one :func:`post_balance` returned (or Megatron's ``RerunDataIterator``
  around it), and ``forward_step`` is :func:`~megatron_orch.megatron.contract.forward_step` or one that
  handles a :class:`~megatron_orch.megatron.post_balancing.BalancedMicroBatch` the same way.
"""
from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta
from typing import Callable, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_orch.comm.communicator import dedicated_group, replica_group
from megatron_orch.comm.device import to_communication_device
from megatron_orch.comm.group_topology import group_topology
from megatron_orch.megatron.batch import BatchSpec, MicroBatch
from megatron_orch.megatron.contract import check_model
from megatron_orch.megatron.encoder_layout import encoder_groups
from megatron_orch.megatron.first_step import check_model_and_config, print_on_rank_0
from megatron_orch.megatron.post_balancing import (ParallelGroups, PostBalancingDataIterator, StepShape,
                                                   resolve_microbatching)
from megatron_orch.megatron.schedule import ModalityAwareSchedule
from megatron_orch.megatron.sharding import sharding_of
from megatron_orch.orchestrator.config import EncoderRanks, OrchestratorConfig
from megatron_orch.orchestrator.encoder_ranks import decide_encoder_ranks, unsupported_layout


def post_balance(forward_backward_func: Optional[Callable], data_iterator: Iterator[MicroBatch], spec: BatchSpec,
                 step: StepShape, *, model=None, config: OrchestratorConfig = OrchestratorConfig(),
                 compute_device: Optional[torch.device] = None, input_dtype: torch.dtype = torch.float32,
                 timeout: Optional[timedelta] = None,
                 announce: Callable[[str], None] = print_on_rank_0) -> Tuple[ModalityAwareSchedule,
                                                                              PostBalancingDataIterator]:
    """The modality-aware schedule around ``forward_backward_func`` (``get_forward_backward_func(pp, vp)``'s
    result) and the post-balancing iterator around this DP rank's ``data_iterator`` (micro-batches of
    ``spec``, ``step.num_microbatches`` per step), for megatron-core's parallel state as initialised: the DP
    group, its topology (``config.gpus_per_node``, else the processes per node), the encoders on the first
    pipeline stage, the TP/PP peers, and a communicator of the DP group's ranks (``timeout``: its collectives').

    ``model`` (optional): checked now (the contract, per-token loss), else on the schedule's first call; either
    way before any collective, as packed micro-batches for a model that cannot take them are refused. A model whose
    encoders are built at a TP size of their own says so (``encoder_tensor_parallel_size``, e.g.
    :class:`~megatron_orch.megatron.mimo.MimoBalancing` of a MimoModel with its own encoder grid): ``config`` must
    then put the encoders on every rank at that size, checked here.
    ``compute_device``: where the encoders run (default: this rank's GPU, else the CPU); ``input_dtype``: what raw encoder items travel in (the encoders' own dtype). ``config``: the
    planner's settings, shadow mode (``shadow=True``) and the checked first step (``verify_first_step``, on
    by default); ``announce`` gets the encoder layout's line (with ``AUTO``) and the checked first step's. Call
    every collective-making part of this on every rank, after ``parallel_state.initialize_model_parallel``.

    ``config.encoder_ranks`` ``ALL`` with pipeline parallelism or encoders at a TP size below the backbone's
    (``config.encoder_tensor_parallel_size``): every rank's model holds the encoders (built so, and given the first
    replica's parameters by :func:`~megatron_orch.megatron.encoder_layout.share_encoders` before the optimizer),
    and the encoder phases run over DP x PP x TP / encoder TP encoder replicas
    (:mod:`~megatron_orch.megatron.encoder_layout`); the layouts it does not run are refused here. ``AUTO`` (the
    default) is ``ALL`` where it differs from ``FIRST_STAGE``, the layout runs it and every rank's ``model`` holds
    the encoders (a model not given: ``FIRST_STAGE``), else ``FIRST_STAGE``; ``announce`` says which and why (where
    they differ).
    """
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    module = None if model is None else check_model_and_config(model)
    if getattr(module, "own_encoder_ranks", None) is not None:
        raise ValueError("post_balance builds its groups from megatron-core's global parallel state, which a model on "
                         "encoder ranks of their own (non-colocated module grids) does not use: give its language "
                         "ranks a PostBalancingDataIterator with ParallelGroups(own_encoder_ranks=...) and the "
                         "ModalityAwareSchedule, its encoder ranks an OwnEncoderRanksLoop "
                         "(megatron_orch.megatron.own_encoder_ranks)")
    built_at = getattr(module, "encoder_tensor_parallel_size", None)
    resolve_microbatching(spec, config, step)  # packed rows the model cannot take: refused before the collectives
    if config.encoder_ranks is EncoderRanks.AUTO:
        config = _decide_encoder_ranks(config, model, built_at, tp, pp, announce)
    if built_at is not None and not (config.encoders_on_every_stage and config.encoder_tensor_parallel_size == built_at):
        raise ValueError(f"post_balance: the model's encoders are built at tensor-parallel size {built_at} (a grid "
                         "of their own); balance them with encoder_ranks ALL and encoder_tensor_parallel_size "
                         f"{built_at}, got {config.encoder_ranks.name} and {config.encoder_tensor_parallel_size}")
    if compute_device is None:
        compute_device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    if config.encoders_on_every_stage and (pp > 1 or config.encoder_tensor_parallel_size is not None):
        refused = unsupported_layout(sharded=None, tensor_parallel_size=tp,
                                     encoder_tensor_parallel_size=config.encoder_tensor_parallel_size)
        if refused is not None:
            raise ValueError(refused)
    spread = config.spreads_encoders(tp, pp)
    dp_group = parallel_state.get_data_parallel_group()
    comm_group = dedicated_group(dp_group, timeout=timeout)
    encoder_group, pipeline_group = (encoder_groups(config.encoder_tensor_parallel_size, timeout) if spread
                                     else (None, None))
    # The peers that must hold the same plan: TP x PP (megatron-core's model-parallel group), x CP with CP.
    peers = (parallel_state.get_model_parallel_group() if parallel_state.get_context_parallel_world_size() == 1
             else replica_group(dp_group, timeout=timeout))
    groups = ParallelGroups(dp_group=dp_group, topology=group_topology(dp_group, gpus_per_node=config.gpus_per_node),
                            encoder_stage=spread or parallel_state.is_pipeline_first_stage(), peer_group=peers,
                            comm_group=comm_group, encoder_group=encoder_group, pipeline_group=pipeline_group,
                            tp_replicas=config.encoder_tp_replicas(tp) if spread else 1)
    iterator = PostBalancingDataIterator(data_iterator, spec, config, step, groups, compute_device=compute_device,
                                         input_dtype=input_dtype)
    schedule = ModalityAwareSchedule(forward_backward_func, dp_group, encoder_recompute=config.encoder_recompute,
                                     announce=announce, encoders_on_every_stage=spread)
    return schedule, iterator


def megatron_core_counts(consumed_samples: int, steps: int, samples_per_microbatch: int) -> List[int]:
    """The micro-batches of each of the run's next ``steps`` steps as megatron-core's num-microbatches calculator
    (``init_num_microbatches_calculator``: a constant global batch, ``--rampup-batch-size``,
    ``--step-batch-size-schedule``) gives them to a loop that starts after ``consumed_samples`` and consumes
    ``samples_per_microbatch`` (micro-batch size x DP) per micro-batch, as Megatron-LM's ``train()`` does; asked of
    a copy, so the loop's calculator stays as it is. For :meth:`StepShape.of_steps`."""
    from megatron.core import num_microbatches_calculator

    calculator = getattr(num_microbatches_calculator, "_GLOBAL_NUM_MICROBATCHES_CALCULATOR", None)
    if calculator is None:
        raise ValueError("megatron_core_counts: megatron-core's num-microbatches calculator is not initialised "
                         "(init_num_microbatches_calculator)")
    calculator = copy.deepcopy(calculator)
    counts = []
    for _ in range(steps):
        calculator.update(consumed_samples, consistency_check=False)
        counts.append(calculator.get())
        consumed_samples += counts[-1] * samples_per_microbatch
    return counts


def _decide_encoder_ranks(config: OrchestratorConfig, model, built_at: Optional[int], tp: int, pp: int,
                          announce: Callable[[str], None]) -> OrchestratorConfig:
    """``config`` with ``encoder_ranks`` ``AUTO`` decided for this job
    (:func:`~megatron_orch.orchestrator.encoder_ranks.decide_encoder_ranks`, announced): the encoders on every rank
    where the model was built so (given, every rank's holding encoders: one collective over the job; ``built_at``,
    encoders built at a TP size of their own, set their size) and the layout runs them, else on the first stage.
    Announced where the two layouts differ."""
    if built_at is not None and config.encoder_tensor_parallel_size is None:
        config = dataclasses.replace(config, encoder_tensor_parallel_size=built_at)
    chunk = None if model is None else (model[0] if isinstance(model, (list, tuple)) else model)
    unavailable = unsupported_layout(
        sharded=None if chunk is None else sharding_of(chunk), tensor_parallel_size=tp,
        encoder_tensor_parallel_size=config.encoder_tensor_parallel_size)
    etp = config.encoder_tensor_parallel_size or tp
    if unavailable is None and (pp > 1 or etp != tp) and not config.shadow:
        if model is None:
            unavailable = ("post_balance was given no model, so whether every rank's holds the encoders is not known "
                           "(pass model=)")
        else:
            holds = torch.tensor([float(bool(check_model(model).phase_encoders()))])
            holds = to_communication_device(holds, None)
            dist.all_reduce(holds, op=dist.ReduceOp.MIN)
            if float(holds.cpu()[0]) < 1:
                unavailable = ("the model holds no encoders off the first pipeline stage (build every rank's with "
                               "them and give them the first one's parameters, share_encoders, for all)")
    decision = decide_encoder_ranks(config, pipeline_parallel_size=pp, tensor_parallel_size=tp,
                                    unavailable=unavailable, memory="every rank's model holds the encoders already")
    if pp > 1 or etp != tp:  # else both layouts are one
        announce(decision.line())
    return config.with_encoder_ranks(decision.ranks)
