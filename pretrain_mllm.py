"""Pretrain the multimodal LLM (vision + audio encoders, projectors, GPT backbone) on Megatron.

Launch with torchrun and Megatron-LM's flag names, e.g.::

    torchrun --nproc-per-node 2 pretrain_mllm.py --model-config tiny --seq-length 256 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --log-interval 1

Where a Megatron-LM checkout is importable (``megatron.training``) and a GPU is present, training
goes through ``megatron.training.pretrain`` with the providers of
:mod:`megatron_orch.mllm.providers` (:func:`main_megatron_lm`; post-balancing there needs the checkout
patched with ``scripts/apply_patches.sh``, see the README's "Using it with Megatron-LM"); everywhere else
(no Megatron-LM, or CPU) the compact trainer of :mod:`megatron_orch.trainer.loop` runs, on
megatron-core alone. The compact trainer's command line, and a ``--data-path`` manifest line by line,
are checked before the model is built (the flags before torch is even imported): an error is one line
``pretrain_mllm.py: error: ...`` (from rank 0 under torchrun) and exit status 2.
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


def megatron_lm_available() -> bool:
    """Whether Megatron-LM's ``megatron.training`` is installed (found, not imported: that takes torch)."""
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron package at all
        return False


def main_compact(argv=None) -> None:
    from megatron_orch.trainer import arguments
    args = arguments.parse_args_or_exit(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    arguments.check_data_or_exit(args)
    from megatron_orch.trainer import loop as trainer
    try:
        trainer.pretrain(args, print_fn=lambda line: print(line, flush=True))
    finally:
        trainer.shutdown()


def main_megatron_lm() -> None:
    """Megatron-LM's own loop (``megatron.training.pretrain``) with this project's providers.

    Megatron-LM parses ``sys.argv`` (its flags plus ``--model-config`` and ``--orch-*``). Post-balancing
    goes through the hooks of :mod:`megatron_orch.megatron.megatron_lm` and needs ``patches/`` applied
    to the checkout (``scripts/apply_patches.sh``); without ``--orch-post-balancing`` this is the upstream
    run, patched or not.
    """
    import copy
    import dataclasses

    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args, pretrain, print_rank_0

    from megatron_orch.mllm.config import load_model_config
    from megatron_orch.megatron import megatron_lm
    from megatron_orch.megatron.orch_arguments import orch_config_from_args
    from megatron_orch.mllm import providers
    from megatron_orch.mllm.model import transformer_engine_available
    from megatron_orch.trainer import arguments

    post_balancing = "--orch-post-balancing" in sys.argv[1:]  # Megatron's parser takes no abbreviations
    if post_balancing:
        try:
            megatron_lm.require_patched(pretrain)
        except megatron_lm.PatchMissingError as err:
            sys.exit(f"pretrain_mllm.py: error: {err}")
    elif "--overlap-grad-reduce" in sys.argv[1:]:
        # Megatron DDP then reduces a bucket once each of its parameters reported a gradient in the last
        # micro-batch, and asserts after the first step that every parameter did. Without post-balancing
        # the encoders run inside each micro-batch and skip one without images or audio, so the step
        # fails at the start of iteration 2 (post-balancing runs every encoder once per step instead).
        sys.exit("pretrain_mllm.py: error: --overlap-grad-reduce without --orch-post-balancing is not supported: "
                 "an encoder skipped by a last micro-batch without images or audio reports no gradients, which "
                 "Megatron DDP's overlapped reduction asserts against; drop the flag (the numerics are the "
                 "same) or add --orch-post-balancing")

    def resolve_model(args):
        """The --model-config with Megatron-LM's shape flags applied; rank 0 prints what they changed.
        Megatron-LM's --num-query-groups (default 1) counts only with --group-query-attention, else
        attention is multi-head, and it fills --kv-channels with hidden size / heads, as the config does."""
        if args.transformer_impl == "transformer_engine" and not transformer_engine_available():
            raise ValueError("--transformer-impl transformer_engine (Megatron-LM's default): Transformer Engine "
                             "does not import here; pass --transformer-impl local")
        shape = copy.copy(args)
        shape.num_query_groups = args.num_query_groups if args.group_query_attention else None
        if args.kv_channels == args.hidden_size // args.num_attention_heads:
            shape.kv_channels = None
        config = arguments.resolve_model_config(shape)
        configured, resolved = load_model_config(args.model_config).backbone.transformer, config.backbone.transformer
        changed = [f"{field.name} {getattr(configured, field.name)} -> {getattr(resolved, field.name)}"
                   for field in dataclasses.fields(resolved)
                   if getattr(configured, field.name) != getattr(resolved, field.name)]
        if changed:
            print_rank_0(f" > backbone of --model-config {args.model_config} overridden by Megatron-LM's shape "
                         f"flags: {', '.join(changed)}")
        return config

    def mllm_args():
        """Megatron's args with this project's settings resolved once (the model, the orchestrator)."""
        args = get_args()
        if not hasattr(args, "mllm_config"):
            try:
                args.mllm_config = resolve_model(args)
                args.orch_config = orch_config_from_args(args)
                if args.orch_config is not None:
                    megatron_lm.check_args(args)
            except ValueError as err:  # ArgumentError included
                sys.exit(f"pretrain_mllm.py: error: {err}")
            args.num_microbatches = get_num_microbatches()
        return args

    def model_provider(pre_process=True, post_process=True, vp_stage=None, **unused):
        return providers.build_model(mllm_args(), pre_process=pre_process, post_process=post_process)

    def build_train_iterator():
        args = mllm_args()
        train = providers.build_train_data_iterator(args, args.consumed_train_samples,
                                                    mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size())
        if args.orch_config is not None:  # its schedule comes from the patch's wrapper, around train()'s
            train, _ = providers.build_post_balancing(args, args.orch_config, train, forward_backward_func=None)
        return train

    extra = {}
    if post_balancing:
        extra["forward_backward_func_wrapper"] = megatron_lm.schedule_wrapper(
            lambda: mllm_args().orch_config.encoder_recompute)
    pretrain(megatron_lm.external_data_provider(build_train_iterator), model_provider,
             ModelType.encoder_or_decoder, providers.forward_step, extra_args_provider=arguments.add_mllm_args,
             args_defaults={"dataloader_type": "external"}, **extra)


def _on_gpus() -> bool:
    import torch
    return torch.cuda.is_available()


if __name__ == "__main__":
    if megatron_lm_available() and _on_gpus():
        main_megatron_lm()
    else:
        main_compact()
