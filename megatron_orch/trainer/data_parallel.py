"""The compact trainer's data-parallel wrapper: Megatron DDP, torch FSDP2 or Megatron-FSDP (Megatron-LM's
``--use-torch-fsdp2`` / ``--use-megatron-fsdp``), built as ``megatron.training``'s ``get_model`` builds them.

One difference, for FSDP2: megatron-core's ``TorchFullyShardedDataParallel`` leaves ``scale_gradients`` a
no-op and FSDP2 averages gradients over the DP group, so with per-token loss (``finalize_model_grads``
divides by the global number of loss tokens) its gradients are the DP mean of token sums instead of the
per-token mean. :class:`PerTokenTorchFSDP` scales them as Megatron DDP does, so an FSDP2 run
trains exactly like a DDP run (tested to 1e-5 on CPU). Megatron-LM's own launch keeps megatron-core's
behaviour; both its upstream and post-balanced runs get it alike.
"""
from __future__ import annotations

import argparse

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron.core.distributed.torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig
from megatron.core.transformer.module import MegatronModule


class PerTokenTorchFSDP(TorchFullyShardedDataParallel):
    """megatron-core's FSDP2 wrapper with Megatron DDP's gradient arithmetic: ``finalize_model_grads``'s
    scaling (one over the global number of loss tokens) applied to the sum over the DP group, which is FSDP2's
    mean times the group's size. (FSDP2's own sum, ``set_gradient_divide_factor(1.0)``, reduces with
    ``ReduceOp.PREMUL_SUM``, which gloo does not have.)"""

    def scale_gradients(self, scaling_factor) -> None:
        factor = scaling_factor * self.process_group.size()
        for param in self.module.parameters():
            if param.grad is not None:
                param.grad.to_local().mul_(factor)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """FSDP2 reduce-scatters in each unit's backward: nothing is left to reduce here. (megatron-core
        0.16.1's wrapper takes no ``force_all_reduce``, which its own ``finalize_model_grads`` passes.)"""
        super().finish_grad_sync()


def wrap_data_parallel(args: argparse.Namespace, config, module: MegatronModule, device: torch.device,
                       disable_bucketing: bool = False) -> MegatronModule:
    """``module`` (one of this rank's model chunks, on ``device``; ``config`` its transformer config) in the
    data-parallel wrapper the flags ask for; ``disable_bucketing``: Megatron DDP's, for the model chunks after
    the first (sharding runs one model chunk)."""
    if args.use_torch_fsdp2:
        return PerTokenTorchFSDP(config, TorchFullyShardedDataParallelConfig(reshard_after_forward=True), module)
    if args.use_megatron_fsdp:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=False, use_distributed_optimizer=True,
            use_megatron_fsdp=True, data_parallel_sharding_strategy=args.data_parallel_sharding_strategy)
        return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=module, device=device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16, overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, bucket_size=args.ddp_bucket_size,
        use_distributed_optimizer=args.use_distributed_optimizer)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                   disable_bucketing=disable_bucketing)
