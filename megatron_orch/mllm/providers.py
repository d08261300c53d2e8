"""Model, data and forward-step providers, in the shape ``megatron.training.pretrain`` expects.

The compact trainer (the hooks of :data:`megatron_orch.mllm.task.MLLM_TASK`) and Megatron-LM's
``pretrain`` use the same functions: :func:`build_model` (wrapped as Megatron's ``model_provider``),
``forward_step`` (the contract's, :func:`megatron_orch.megatron.contract.forward_step`: the MLLM has no
path of its own), :func:`build_train_data_iterator` and :func:`build_post_balancing`.
"""
from __future__ import annotations

import argparse
import dataclasses
from datetime import timedelta
from typing import Iterator, Optional, Sequence

import torch
from megatron.core import parallel_state

from megatron_orch.megatron.any_loop import post_balance
from megatron_orch.megatron.batch import MicroBatch
from megatron_orch.megatron.contract import forward_step  # noqa: F401 -- Megatron's forward_step_func
from megatron_orch.megatron.post_balancing import StepShape
from megatron_orch.mllm.data import build_train_iterator
from megatron_orch.mllm.data_config import data_config
from megatron_orch.mllm.model import MLLMModel, ModelParallelSettings
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.trainer.data_events import DataEvents
from megatron_orch.trainer.task import compute_device, runs_on_cpu  # noqa: F401 -- where the model computes


def fusion_settings(args: argparse.Namespace) -> dict:
    """megatron-core's kernel fusions as Megatron-LM sets them: off on the CPU (the fused kernels are
    GPU code); on a GPU Megatron-LM's flags where its parser gave them (``megatron.training``), else their
    defaults (on), and the cross-entropy fusion too (no fp32 copy of the logits: ~10 GB at 16k tokens x
    152k vocabulary). The gradient-accumulation fusion needs Apex's ``fused_weight_gradient_mlp_cuda``
    (megatron-core's check): Transformer Engine fuses it in its own layers, but the output layer and the
    projectors are megatron-core's ``ColumnParallelLinear``, which refuses the fusion without Apex."""
    from megatron.core.tensor_parallel import layers

    names = ("bias_gelu_fusion", "bias_swiglu_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
             "gradient_accumulation_fusion", "cross_entropy_loss_fusion")
    if runs_on_cpu(args):
        return dict.fromkeys(names, False)
    settings = {name: bool(getattr(args, name, True)) for name in names}
    settings["gradient_accumulation_fusion"] &= layers._grad_accum_fusion_available
    return settings


def moe_settings(args: argparse.Namespace) -> dict:
    """Expert parallelism and the MoE flags (Megatron-LM's names, both launches) for an MoE backbone."""
    names = ("moe_router_load_balancing_type", "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_token_dispatcher_type",
             "moe_expert_capacity_factor")
    settings = {name: getattr(args, name) for name in names if hasattr(args, name)}
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):  # Megatron-LM: one value or a list
        if isinstance(settings.get(name), list):
            settings[name] = tuple(settings[name])
    return {"expert_model_parallel_size": getattr(args, "expert_model_parallel_size", 1), **settings}


def model_parallel_settings(args: argparse.Namespace) -> ModelParallelSettings:
    return ModelParallelSettings(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        # Megatron-LM's flags (the compact trainer keeps Megatron-LM's defaults)
        overlap_p2p_comm=getattr(args, "overlap_p2p_comm", True),
        microbatch_group_size_per_vp_stage=getattr(args, "microbatch_group_size_per_vp_stage", None),
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        encoder_tensor_model_parallel_size=_encoder_tensor_parallel_size(args),
        bf16=args.bf16,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        use_cpu_initialization=runs_on_cpu(args) or bool(getattr(args, "use_cpu_initialization", False)),
        calculate_per_token_loss=True,
        transformer_impl=args.transformer_impl,
        sharded_parameters=bool(getattr(args, "use_torch_fsdp2", False) or getattr(args, "use_megatron_fsdp", False)),
        **moe_settings(args),
        **fusion_settings(args),
    )


def build_model(args: argparse.Namespace, pre_process: bool = True, post_process: bool = True,
                vp_stage: Optional[int] = None) -> MLLMModel:
    """This pipeline stage's part of the MLLM, its model chunk ``vp_stage`` with virtual pipeline stages
    (Megatron's ``model_provider(pre_process, post_process, vp_stage)``)."""
    return MLLMModel(args.mllm_config, model_parallel_settings(args), args.seq_length,
                     pre_process=pre_process, post_process=post_process, vp_stage=vp_stage,
                     encoders=pre_process or (_encoders_on_every_stage(args) and not vp_stage))


def _encoders_on_every_stage(args: argparse.Namespace) -> bool:
    config = getattr(args, "orch_config", None)
    return config is not None and config.encoders_on_every_stage


def _encoder_tensor_parallel_size(args: argparse.Namespace) -> Optional[int]:
    """The encoders' own TP size where post-balancing runs them on every rank (None: the backbone's)."""
    config = getattr(args, "orch_config", None)
    return config.encoder_tensor_parallel_size if _encoders_on_every_stage(args) else None


def build_train_data_iterator(args: argparse.Namespace, consumed_samples: int, data_parallel_rank: int,
                              data_parallel_size: int, loader_state: Optional[dict] = None,
                              num_samples: Optional[int] = None) -> DataEvents:
    """This DP rank's training micro-batches from ``consumed_samples`` on (same on its TP/PP peers): a
    :class:`~megatron_orch.mllm.data.TrainIterator`, or over an Energon dataset an
    :class:`~megatron_orch.mllm.energon.EnergonTrainIterator` restored to ``loader_state`` (what its
    ``loader_state`` gave for the checkpoint); the trainer takes their events. ``num_samples``: the samples the
    whole run consumes where the global batch changes from step to step (default: ``--train-iters`` x
    ``--global-batch-size``).

    On GPUs without post-balancing the batches come in pinned memory, so ``forward_step``'s copies to
    the GPU do not block the host (post-balancing stages what it sends itself).
    """
    pin_memory = not runs_on_cpu(args) and getattr(args, "orch_config", None) is None
    config = data_config(args)
    if num_samples is not None:
        config = dataclasses.replace(config, num_samples=num_samples)
    return build_train_iterator(config, consumed_samples, data_parallel_rank, data_parallel_size,
                                pin_memory, data_parallel_group=parallel_state.get_data_parallel_group(),
                                loader_state=loader_state)


def build_post_balancing(args: argparse.Namespace, config: OrchestratorConfig, source: Iterator[MicroBatch],
                         forward_backward_func, step_counts: Optional[Sequence[int]] = None):
    """Wrap the loader's iterator and the forward-backward function for post-balancing
    (:func:`~megatron_orch.megatron.any_loop.post_balance`); ``step_counts``: the micro-batches of each step
    where they change from step to step (a batch-size ramp-up, :meth:`StepShape.of_steps`), else
    ``args.num_microbatches`` every step.

    Returns the post-balancing data iterator (hand it to the schedule as the data iterator) and
    the modality-aware schedule (call it instead of ``get_forward_backward_func()``'s result).
    Every rank builds the iterator after initialize_model_parallel (megatron.training: an is_distributed
    provider), so every DP group gets its own communicator for the all-to-alls.
    """
    data = data_config(args)
    pad_to = data.seq_length if data.pad_to_seq_length else None
    step = (StepShape(args.micro_batch_size, args.num_microbatches, pad_to) if step_counts is None
            else StepShape.of_steps(args.micro_batch_size, step_counts, pad_to))
    schedule, iterator = post_balance(forward_backward_func, source, data.layout.spec, step, config=config,
                                      compute_device=compute_device(args),
                                      input_dtype=torch.bfloat16 if args.bf16 else torch.float32,
                                      timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return iterator, schedule
