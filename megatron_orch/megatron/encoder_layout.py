"""The encoders on every pipeline stage (``--orch-encoder-ranks all``, ``EncoderRanks.ALL``): what a job needs
beyond the plan (:mod:`~megatron_orch.orchestrator.encoder_ranks`).

* :func:`encoder_groups`: the encoder group (DP x PP x TP / encoder TP replicas at one encoder TP rank) from
  megatron-core's ``HyperCommGrid`` over the job's ``tp-cp-dp-pp`` ranks, and the group of a DP rank's encoder
  replicas (PP x TP / encoder TP) their gradients are summed over; :func:`encoder_tensor_parallel_group`: the
  encoders' own TP group, of the same grid, for building them at their own TP size;
* :func:`share_encoders`: every stage's encoders start from the first stage's parameters (each stage seeds its
  own initialisation, Megatron's rule), and off the first stage they are marked ``shared`` so the gradient
  norm counts them once (Megatron's mark for a tied embedding's second copy).

The gradients: each replica's encoders see a share of the step's items; the schedule sums their gradients over
the replica group before DDP reduces them over DP (:func:`~megatron_orch.megatron.schedule.sum_encoder_gradients`),
so every stage's optimizer applies the same update to the same parameters.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional, Tuple

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.utils import get_attr_wrapped_model
from torch.distributed import ProcessGroup

from megatron_orch.comm.device import to_communication_device
from megatron_orch.megatron.orch_arguments import flag_setting


def _encoder_grid(encoder_tensor_parallel_size: Optional[int]) -> HyperCommGrid:
    """megatron-core's ``HyperCommGrid`` over the job's ``tp-cp-dp-pp`` ranks with TP split into the encoders' TP
    (fastest) and their replicas in a TP group: dims ``etp, erep, cp, dp, pp``. A parallel state of another rank
    order, or an encoder TP that does not divide TP, is refused before any group is made."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    etp = tp if encoder_tensor_parallel_size is None else encoder_tensor_parallel_size
    if etp < 1 or tp % etp:
        raise ValueError(f"{flag_setting('encoder_tensor_parallel_size', str(etp))} does not divide the tensor-parallel "
                         f"size {tp}")
    coords = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank(),
              parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    expected = coords[0] + tp * (coords[1] + cp * (coords[2] + dp * coords[3]))
    if tp * cp * dp * pp != dist.get_world_size() or expected != dist.get_rank():
        raise ValueError(f"{flag_setting('encoder_ranks', 'all')}: rank {dist.get_rank()} is not at tp + TP * (cp + CP * (dp + DP * pp)) = {expected} "
                         f"(megatron-core's tp-cp-dp-pp order, {tp}x{cp}x{dp}x{pp} ranks), which the encoder group "
                         "assumes")
    return HyperCommGrid([etp, tp // etp, cp, dp, pp], ["etp", "erep", "cp", "dp", "pp"])


def encoder_groups(encoder_tensor_parallel_size: Optional[int] = None,
                   timeout: Optional[timedelta] = None) -> Tuple[ProcessGroup, ProcessGroup]:
    """(encoder group, replica group) of this rank, for megatron-core's parallel state as initialised and the
    encoders' TP size (None: the backbone's): the DP x PP x R encoder replicas at its encoder TP rank (ranked
    ``(stage * DP + dp) * R + j``, :mod:`~megatron_orch.orchestrator.encoder_ranks`), and the PP x R encoder
    replicas of its DP rank (ranked ``stage * R + j``), over which the encoders' gradients are summed and their
    parameters shared. Every rank calls this (group creation is collective)."""
    grid = _encoder_grid(encoder_tensor_parallel_size)
    kwargs = {} if timeout is None else {"timeout": timeout}
    return grid.create_pg(["erep", "dp", "pp"], **kwargs), grid.create_pg(["erep", "pp"], **kwargs)


_TENSOR_GROUPS: Dict[tuple, ProcessGroup] = {}  # (encoder TP, the job's TP, CP, DP, PP) -> this rank's group


def encoder_tensor_parallel_group(encoder_tensor_parallel_size: int) -> ProcessGroup:
    """This rank's encoder TP group: the ``encoder_tensor_parallel_size`` consecutive ranks of its TP group that
    hold one encoder replica (made once per layout; every rank calls this, as every rank builds encoders)."""
    key = (encoder_tensor_parallel_size, parallel_state.get_tensor_model_parallel_world_size(),
           parallel_state.get_context_parallel_world_size(), parallel_state.get_data_parallel_world_size(),
           parallel_state.get_pipeline_model_parallel_world_size())
    if key not in _TENSOR_GROUPS:
        _TENSOR_GROUPS[key] = _encoder_grid(encoder_tensor_parallel_size).create_pg(["etp"])
    return _TENSOR_GROUPS[key]


def share_encoders(model, pipeline_group: ProcessGroup) -> None:
    """Give every encoder replica the first one's parameters (a broadcast over ``pipeline_group``: the replica
    group of :func:`encoder_groups`, the pipeline group where the encoders run at the backbone's TP size) and mark
    them ``shared`` off the first, so the gradient norm counts them once. Call on every rank after building the
    model chunks (``model``: the first chunk, or a list of chunks) and before building the optimizer, which copies
    the parameters."""
    chunk = model[0] if isinstance(model, (list, tuple)) else model
    module = get_attr_wrapped_model(chunk, "phase_encoders", return_model_obj=True)
    first = dist.get_global_rank(pipeline_group, 0)
    first_stage = dist.get_rank(pipeline_group) == 0
    for encoder in module.phase_encoders().values():
        for param in encoder.parameters():
            data = param.data
            wire = to_communication_device(data, pipeline_group)
            dist.broadcast(wire, src=first, group=pipeline_group)
            if wire.data_ptr() != data.data_ptr():
                data.copy_(wire)
            if not first_stage:
                param.shared = True
