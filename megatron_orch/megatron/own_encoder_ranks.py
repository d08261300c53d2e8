"""Encoder ranks of their own (megatron-core MIMO's non-colocated ``module_to_grid_map``): the encoder-only ranks'
training step, and what the two kinds of ranks share.

The backbone ranks run their usual post-balanced step (:class:`~megatron_orch.megatron.post_balancing.
PostBalancingDataIterator` with ``ParallelGroups.own_encoder_ranks``, the
:class:`~megatron_orch.megatron.schedule.ModalityAwareSchedule`): they load every example, plan the step, send each
item's raw input from the backbone TP rank 0 that loaded it to the encoder rank that encodes it, receive the encoder
outputs instead of computing them, and send their gradients back (divided by the step's loss tokens, the per-token
normalisation) just before the backbone's gradients are reduced. The encoder-only ranks run
:meth:`OwnEncoderRanksLoop.train_step` once per step, over the same group of the layout's ranks and in the same
order: the step's sizes from the first backbone rank (``share_planned_step``), the same plan (its digest checked),
their items, the encoders (with their input projections) forward, the outputs out, the gradients in, the backward,
the gradients summed over the encoder ranks' own DP group (Megatron DDP built on the modalities' grid), their
optimizer step. The encoders run while the backbone waits for their outputs, and wait while it trains: encoding the
next step during this one would train on stale encoder parameters, which is modeled in the simulator only.

Both kinds of ranks step through :class:`SharedNormOptimizer`: one gradient norm for the whole model (each side's
norm over its own grid, squared, reduced over the layout's ranks by MAX, as every rank of one side holds the same,
then summed: the encoder parameters count once), clipped and skipped alike everywhere, as upstream's
``MimoOptimizer`` does. The encoder ranks have no loss; the iteration's loss is the backbone ranks'.

A checkpoint of such a job holds each rank's modules as its MimoModel holds them (the encoder ranks' modality
submodules, the backbone ranks' language model, each with its own grid's replica ids and optimizer state, as
upstream MIMO's ``sharded_state_dict`` and ``MimoOptimizer.sharded_state_dict`` lay them out); the compact trainer's
checkpointing does not write it (module docstring of :mod:`~megatron_orch.megatron.mimo`).
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Dict, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.utils import get_model_config
from torch.distributed import ProcessGroup

from megatron_orch.comm.alltoall import ItemLayout
from megatron_orch.comm.device import communication_device, to_communication_device
from megatron_orch.megatron.batch import BatchSpec
from megatron_orch.megatron.contract import check_model
from megatron_orch.megatron.post_balancing import StepShape, prepare_moves, share_planned_step
from megatron_orch.megatron.schedule import start_encoder_move
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.encoder_ranks import OwnEncoderRanks, encode_on_own_ranks, own_ranks_refusal
from megatron_orch.orchestrator.step_plan import plan_step

if TYPE_CHECKING:
    from megatron.core.hyper_comm_grid import HyperCommGrid


def grid_process_groups(grids: Mapping[str, "HyperCommGrid"]):
    """Megatron-core's process groups of every module grid of a ``module_to_grid_map`` (grids of TP then DP, CP and
    PP 1: :func:`~megatron_orch.megatron.mimo.own_encoder_ranks`), created on every rank in the map's order (each a
    collective over the world), as ``{module: ProcessGroupCollection}`` of the grids this rank is in: ``tp``, ``cp``,
    ``dp``, ``pp``, ``dp_cp``, ``mp`` (TP x PP), the expert groups as the dense ones (no experts), no embedding
    groups (PP 1). What DDP, the optimizer and ``finalize_model_grads`` of each module take; the global parallel state
    is left as it is."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    out = {}
    for name, grid in grids.items():
        made = {dims: grid.create_pg(list(dims)) for dims in (("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp"),
                                                               ("tp", "pp"))}
        if not grid.is_current_rank_in_grid():
            continue
        mp = made[("tp", "pp")]
        out[name] = ProcessGroupCollection(
            tp=made[("tp",)], cp=made[("cp",)], dp=made[("dp",)], pp=made[("pp",)], dp_cp=made[("dp", "cp")], mp=mp,
            tp_ep_pp=mp, ep=made[("pp",)], expt_tp=made[("tp",)], expt_dp=made[("dp",)], embd=None, pos_embd=None)
    return out


class SharedNormOptimizer:
    """This rank's optimizer (Megatron's, over this rank's modules and its grid's groups) stepping with the gradient
    norm of the whole model (module docstring): ``encoder_rank`` says which side this rank is on, ``group`` the
    layout's ranks. :meth:`step` returns what Megatron's does: (updated, the whole model's gradient norm, None)."""

    def __init__(self, optimizer, group: ProcessGroup, encoder_rank: bool):
        self.optimizer, self.group, self.encoder_rank = optimizer, group, encoder_rank

    def __getattr__(self, name):  # zero_grad, param_groups, state_dict, ... as the wrapped optimizer's
        return getattr(self.optimizer, name)

    @torch.no_grad()
    def step(self):
        found_inf = bool(self.optimizer.prepare_grads())
        norm = 0.0 if found_inf else float(self.optimizer.get_grad_norm() or 0.0)
        shared = torch.tensor([float(found_inf), 0.0, 0.0], dtype=torch.float64)
        shared[1 if self.encoder_rank else 2] = norm ** 2
        shared = to_communication_device(shared, self.group)
        dist.all_reduce(shared, op=dist.ReduceOp.MAX, group=self.group)
        found_inf, encoder_sq, backbone_sq = shared.cpu().tolist()
        if found_inf > 0:
            return False, None, None
        total = math.sqrt(encoder_sq + backbone_sq)
        clip = self.optimizer.config.clip_grad
        params = self.optimizer.get_parameters()
        if clip > 0.0 and params:
            clip_grad_by_total_norm_fp32(params, max_norm=clip, total_norm=total)
        return bool(self.optimizer.step_with_ready_grads()), total, None


class OwnEncoderRanksLoop:
    """The encoder-only ranks' side of the step (module docstring): :meth:`train_step` once per backbone step.

    ``model``: this rank's module (Megatron DDP over the modalities' grid's DP group, its config with per-token
    loss) meeting the contract (``encode``, ``phase_encoders``: every phase's, e.g. a
    :class:`~megatron_orch.megatron.mimo.MimoBalancing` of the encoder rank's MimoModel); ``optimizer``: a
    :class:`SharedNormOptimizer` over its parameters; ``spec``, ``config``, ``step``: the backbone ranks' (their
    ``microbatching`` is taken from each step's message); ``layout``, ``group``: the layout and the group of its
    ranks, as the backbone ranks' ``ParallelGroups`` give them. Bad settings raise here, before any collective."""

    def __init__(self, model, optimizer: SharedNormOptimizer, spec: BatchSpec, config: OrchestratorConfig,
                 step: StepShape, layout: OwnEncoderRanks, group: ProcessGroup, *, compute_device: torch.device,
                 input_dtype: torch.dtype = torch.float32):
        self.module = check_model(model)
        self.model, self.optimizer, self.spec, self.config, self.step = model, optimizer, spec, config, step
        self.layout, self.group = layout, group
        self.compute_device, self.input_dtype = torch.device(compute_device), input_dtype
        self.rank = dist.get_rank(group)
        if dist.get_world_size(group) != layout.num_ranks or self.rank not in layout.encoder_ranks:
            raise ValueError(f"OwnEncoderRanksLoop: rank {self.rank} of a group of {dist.get_world_size(group)} ranks "
                             f"is not an encoder rank of {layout}")
        missing = set(spec.phases.encoder_names) - set(self.module.phase_encoders())
        if missing:
            raise ValueError(f"OwnEncoderRanksLoop: this encoder rank's model holds no encoders of {sorted(missing)}")
        model_config = get_model_config(model)
        if not getattr(model_config, "calculate_per_token_loss", False):
            raise ValueError("OwnEncoderRanksLoop: the encoder ranks' model config needs calculate_per_token_loss=True "
                             "(their gradients arrive divided by the step's loss tokens; DDP must sum, not average)")
        ddp_config = getattr(model, "ddp_config", None)
        if ddp_config is None or ddp_config.overlap_grad_reduce or ddp_config.use_distributed_optimizer:
            raise ValueError("OwnEncoderRanksLoop: the encoder ranks' model must be Megatron DDP without "
                             "--overlap-grad-reduce or the distributed optimizer (their gradients are reduced once, "
                             "after the backward of every phase)")
        refused = own_ranks_refusal(config)
        if refused is not None:
            raise ValueError(f"OwnEncoderRanksLoop: {refused} (as the backbone ranks must)")
        self.rows_per_item = {p: spec.rows_per_item(p) for p in spec.phases.encoder_names}
        self.device = communication_device(group)
        self.items_encoded: Dict[str, int] = {}  # this rank's items of each phase in the last step

    def train_step(self) -> Optional[dict]:
        """One step (module docstring); None where the backbone ranks' data ended (nothing else ran). Returns the
        optimizer's outcome: ``grad_norm`` (the whole model's) and ``skipped``."""
        phases = self.spec.phases.encoder_names
        planned = share_planned_step(None, phases, self.group, self.layout)
        if planned is None:
            return None
        config = dataclasses.replace(self.config, microbatching="packed" if planned.packed else "equal_count")
        plan = plan_step(planned.sizes, self.spec.phases, config, planned.topology, self.step.micro_batch_size,
                         planned.num_microbatches)
        if plan.digest != planned.digest:
            raise RuntimeError(f"encoder rank {self.rank}: its plan of the step (digest {plan.digest}) differs from "
                               f"the backbone ranks' ({planned.digest}): do both sides pass the same "
                               "OrchestratorConfig and batch spec?")
        encode = encode_on_own_ranks(plan, self.layout)
        moves = prepare_moves(plan, planned.sizes.num_tokens, self.rows_per_item, None, True, group_rank=self.rank,
                              own=(self.layout, encode)).uploaded(self.device)
        pending = {}
        for encoder_input in self.spec.inputs:  # as the backbone ranks' iterator starts them
            phase = encoder_input.phase
            layout = ItemLayout(np.ones(plan.encoders[phase].example.size, dtype=np.int64), encoder_input.item_shape,
                                self.input_dtype)
            nothing = torch.empty((0, *encoder_input.item_shape), dtype=self.input_dtype, device=self.device)
            pending[phase] = moves.inputs[phase].start([nothing], [layout], self.group)
        inputs = {phase: move.wait()[0].to(self.compute_device) for phase, move in pending.items()}
        self.items_encoded = {phase: int(items.shape[0]) for phase, items in inputs.items()}

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs, sending = {}, []
        for phase, items in inputs.items():  # each phase's outputs travel while the next phase encodes
            rows = self.module.encode(phase, items)
            outputs[phase] = rows
            sending.append(start_encoder_move(moves, phase, rows.detach(), self.rows_per_item[phase], self.group))
        for wait in sending:
            wait()
        returning = {phase: start_encoder_move(moves, phase, rows.new_zeros(0, *rows.shape[1:]),
                                               self.rows_per_item[phase], self.group, inverse=True)
                     for phase, rows in outputs.items()}
        grads = {phase: wait() for phase, wait in returning.items()}
        ran = [phase for phase, rows in outputs.items() if rows.requires_grad]
        if ran:
            torch.autograd.backward([outputs[p] for p in ran], [grads[p] for p in ran])
        self.model.finish_grad_sync()  # summed over the encoder ranks' DP group (per-token loss: no averaging)
        updated, grad_norm, _ = self.optimizer.step()
        return {"grad_norm": grad_norm, "skipped": not updated}
