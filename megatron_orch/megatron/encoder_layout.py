"""The encoders on every pipeline stage (``--orch-encoder-ranks all``, ``EncoderRanks.ALL``): what a job needs
beyond the plan (:mod:`~megatron_orch.orchestrator.encoder_ranks`).

* :func:`encoder_groups`: the encoder group (DP x PP ranks at one TP rank) from megatron-core's
  ``HyperCommGrid`` over the job's ``tp-cp-dp-pp`` ranks, and the pipeline group its gradients are summed over;
* :func:`share_encoders`: every stage's encoders start from the first stage's parameters (each stage seeds its
  own initialisation, Megatron's rule), and off the first stage they are marked ``shared`` so the gradient
  norm counts them once (Megatron's mark for a tied embedding's second copy).

The gradients: each stage's encoders see a share of the step's items; the schedule sums their gradients over
the pipeline group before DDP reduces them over DP (:func:`~megatron_orch.megatron.schedule.sum_encoder_gradients`),
so every stage's optimizer applies the same update to the same parameters.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional, Tuple

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.utils import get_attr_wrapped_model
from torch.distributed import ProcessGroup

from megatron_orch.comm.device import to_communication_device
from megatron_orch.orchestrator.encoder_ranks import FLAG

def encoder_groups(timeout: Optional[timedelta] = None) -> Tuple[ProcessGroup, ProcessGroup]:
    """(encoder group, pipeline group) of this rank, for megatron-core's parallel state as initialised: the DP x
    PP ranks at its TP rank (``HyperCommGrid`` over ``tp, cp, dp, pp``; ranked ``stage * DP + dp``), and its
    pipeline stages (megatron-core's). Every rank calls this (group creation is collective). A parallel state
    of another rank order is refused before the groups are made."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    dp = parallel_state.get_data_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    coords = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_context_parallel_rank(),
              parallel_state.get_data_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    expected = coords[0] + tp * (coords[1] + cp * (coords[2] + dp * coords[3]))
    if tp * cp * dp * pp != dist.get_world_size() or expected != dist.get_rank():
        raise ValueError(f"{FLAG}: rank {dist.get_rank()} is not at tp + TP * (cp + CP * (dp + DP * pp)) = {expected} "
                         f"(megatron-core's tp-cp-dp-pp order, {tp}x{cp}x{dp}x{pp} ranks), which the encoder group "
                         "assumes")
    grid = HyperCommGrid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])
    group = grid.create_pg(["dp", "pp"], **({} if timeout is None else {"timeout": timeout}))
    return group, parallel_state.get_pipeline_model_parallel_group()


def share_encoders(model, pipeline_group: ProcessGroup) -> None:
    """Give every stage's encoders the first stage's parameters (a broadcast over ``pipeline_group``) and mark
    them ``shared`` off the first stage. Call on every rank after building the model chunks (``model``: the
    first chunk, or a list of chunks) and before building the optimizer, which copies the parameters."""
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
