"""Pretrain the multimodal LLM (vision + audio encoders, projectors, GPT backbone) on Megatron.

Launch with torchrun and Megatron-LM's flag names, e.g.::

    torchrun --nproc-per-node 2 pretrain_mllm.py --model-config tiny --seq-length 256 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --log-interval 1

Where a Megatron-LM checkout is importable (``megatron.training``) and a GPU is present, training
goes through ``megatron.training.pretrain`` with the providers of
:mod:`megatron_orch.mllm.providers` (that path is completed in a later issue); everywhere else
(no Megatron-LM, or CPU) the compact trainer of :mod:`megatron_orch.trainer.loop` runs, on
megatron-core alone.
"""
from __future__ import annotations

import os
import sys
import warnings

# megatron-core warns that the GPU-only extras (Transformer Engine, Apex) are absent, whose local
# fallbacks this script uses on CPU, about a CUDA-graph default it sets itself, and (distributed
# optimizer) about torch.distributed functions it still calls and about reading .grad of the fp32
# parameter shards, which are views (it reads, finds None, and uses main_grad).
warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
warnings.filterwarnings("ignore", message=r"full scope is deprecated")
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated")
warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor that is not a leaf Tensor")

import torch  # noqa: E402


def megatron_lm_available() -> bool:
    try:
        import megatron.training  # noqa: F401
    except ImportError:
        return False
    return True


def main_compact(argv=None) -> None:
    from megatron_orch.trainer import arguments, loop as trainer
    try:
        args = arguments.parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except arguments.ArgumentError as err:
        print(f"pretrain_mllm.py: error: {err}", file=sys.stderr)
        sys.exit(2)
    try:
        trainer.pretrain(args, print_fn=lambda line: print(line, flush=True))
    finally:
        trainer.shutdown()


def main_megatron_lm() -> None:
    """Megatron-LM's ``pretrain`` with this project's providers (GPU; finished in a later issue)."""
    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.training import get_args, pretrain

    from megatron_orch.mllm import providers
    from megatron_orch.trainer import arguments

    if "--orch-post-balancing" in sys.argv:
        # The hooks that put the post-balancing iterator and schedule into megatron.training's loop
        # (patches/) are not written yet: refuse rather than silently train unbalanced.
        sys.exit("pretrain_mllm.py: error: --orch-post-balancing runs through the compact trainer only for "
                 "now (megatron.training needs the patches/ hooks, not written yet); launch it where "
                 "megatron.training is not importable")

    def model_provider(pre_process=True, post_process=True, vp_stage=None, **unused):
        args = get_args()
        args.mllm_config = arguments.resolve_model_config(args)
        return providers.build_model(args, pre_process=pre_process, post_process=post_process)

    def train_valid_test_data_provider(train_val_test_num_samples, vp_stage=None):
        # With --dataloader-type external Megatron iterates what the provider returns as is.
        args = get_args()
        args.mllm_config = arguments.resolve_model_config(args)
        train = providers.build_train_data_iterator(args, args.consumed_train_samples,
                                                    mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        return train, None, None

    train_valid_test_data_provider.is_distributed = True
    pretrain(train_valid_test_data_provider, model_provider, ModelType.encoder_or_decoder, providers.forward_step,
             extra_args_provider=arguments.add_mllm_args,
             args_defaults={"dataloader_type": "external", "calculate_per_token_loss": True})


if __name__ == "__main__":
    if megatron_lm_available() and torch.cuda.is_available():
        main_megatron_lm()
    else:
        main_compact()
