"""Pretrain the multimodal LLM (vision + audio encoders, projectors, GPT backbone) on Megatron.

Launch with torchrun and Megatron-LM's flag names, e.g.::

    torchrun --nproc-per-node 2 pretrain_mllm.py --model-config tiny --seq-length 256 \\
        --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --log-interval 1

``--orch-trainer`` picks the training loop (never the machine): ``compact`` (the default) is the compact
trainer of :mod:`megatron_orch.trainer.loop`, on megatron-core alone, CPU or GPUs, given this project's model
as a task (:data:`megatron_orch.mllm.task.MLLM_TASK`, as a user's model would be: :func:`main_compact`);
``megatron-lm`` is Megatron-LM's own ``megatron.training.pretrain`` with the providers of
:mod:`megatron_orch.mllm.providers`, on GPUs (:func:`main_megatron_lm`; post-balancing there goes through
:func:`megatron_orch.megatron.megatron_lm.pretrain`, with a patch of ``patches/`` or without one: see the
README's "Using it with Megatron-LM"). The compact trainer's command line, and a ``--data-path`` manifest
line by line, are checked before the model is built (the flags before torch is even imported): an error
is one line ``pretrain_mllm.py: error: ...`` (from rank 0 under torchrun) and exit status 2.
"""
from __future__ import annotations

import os
import sys

from megatron_orch import quiet_megatron_core_warnings

quiet_megatron_core_warnings()  # before megatron-core is imported


def megatron_lm_available() -> bool:
    """Whether Megatron-LM's ``megatron.training`` is installed (found, not imported: that takes torch)."""
    import importlib.util
    try:
        return importlib.util.find_spec("megatron.training") is not None
    except ImportError:  # no megatron package at all
        return False


def main_compact(argv=None) -> None:
    from megatron_orch.mllm.task import MLLM_TASK
    from megatron_orch.trainer import arguments
    args = arguments.parse_args_or_exit(MLLM_TASK, argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    arguments.check_data_or_exit(args, MLLM_TASK)
    from megatron_orch.trainer import loop as trainer
    try:
        trainer.pretrain(args, MLLM_TASK, print_fn=lambda line: print(line, flush=True))
    finally:
        trainer.shutdown()


def main_megatron_lm() -> None:
    """Megatron-LM's own loop (``megatron.training.pretrain``) with this project's providers.

    Megatron-LM parses ``sys.argv`` (its flags plus ``--orch-trainer``, ``--model-config`` and ``--orch-*``).
    With ``--orch-post-balancing`` the schedule goes through :func:`megatron_orch.megatron.megatron_lm.pretrain`
    (the patch of ``patches/`` where the checkout has it, else the run-time hook); without it this is the
    upstream run.
    """
    import copy
    import dataclasses
    import warnings

    from megatron.core import mpu
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.training import get_args, print_rank_0

    from megatron_orch.mllm.config import is_shipped_config, load_model_config
    from megatron_orch.megatron import megatron_lm
    from megatron_orch.megatron.any_loop import megatron_core_counts
    from megatron_orch.megatron.encoder_layout import encoder_groups, share_encoders
    from megatron_orch.megatron.orch_arguments import flag_setting, orch_config_from_args
    from megatron_orch.mllm import megatron_flags, providers
    from megatron_orch.mllm.model import transformer_engine_available
    from megatron_orch.mllm.task import OVERLAP_NEEDS_POST_BALANCING, add_mllm_args, resolve_model_config

    # megatron.training's optimizer set-up imports MIMO (an isinstance check), which warns it is experimental;
    # the MLLM is no MIMO model
    warnings.filterwarnings("ignore", message="MimoModelConfig is experimental", category=UserWarning)
    post_balancing = "--orch-post-balancing" in sys.argv[1:]  # Megatron's parser takes no abbreviations
    shadow = "--orch-shadow" in sys.argv[1:]  # plans through the same hooks, trains upstream
    if not post_balancing and "--overlap-grad-reduce" in sys.argv[1:]:
        sys.exit(f"pretrain_mllm.py: error: {OVERLAP_NEEDS_POST_BALANCING}")

    refused = megatron_flags.refusals(sys.argv[1:], add_mllm_args)  # parsing only: before any collective
    if refused:
        sys.exit("pretrain_mllm.py: error: " + "; ".join(refused))

    def resolve_model(args):
        """The --model-config with Megatron-LM's shape flags and --max-position-embeddings applied; rank 0 prints
        what they changed. Megatron-LM's --num-query-groups (default 1) counts only with --group-query-attention,
        else attention is multi-head, and it fills --kv-channels with hidden size / heads, as the config does."""
        if args.transformer_impl == "transformer_engine" and not transformer_engine_available():
            raise ValueError("--transformer-impl transformer_engine (Megatron-LM's default): Transformer Engine "
                             "does not import here; pass --transformer-impl local")
        shape = copy.copy(args)
        shape.num_query_groups = args.num_query_groups if args.group_query_attention else None
        if args.kv_channels == args.hidden_size // args.num_attention_heads:
            shape.kv_channels = None
        config = resolve_model_config(shape)
        configured, resolved = load_model_config(args.model_config).backbone, config.backbone
        moe = resolved.transformer
        if moe.is_moe and args.num_experts is None:
            raise ValueError(f"--model-config {args.model_config} has a mixture-of-experts backbone: pass "
                             f"--num-experts {moe.num_experts} (Megatron-LM sets up its MoE training from it)")
        if moe.is_moe and (args.moe_layer_freq != 1 or args.moe_shared_expert_intermediate_size
                           != moe.moe_shared_expert_intermediate_size):
            raise ValueError("the MLLM's MoE backbone has an MoE FFN in every layer and the config's shared expert "
                             f"({moe.moe_shared_expert_intermediate_size}): --moe-layer-freq "
                             f"{args.moe_layer_freq}, --moe-shared-expert-intermediate-size "
                             f"{args.moe_shared_expert_intermediate_size}")
        changed = [f"{name} {getattr(before, name)} -> {getattr(after, name)}"
                   for before, after in ((configured.transformer, resolved.transformer), (configured, resolved))
                   for name in (field.name for field in dataclasses.fields(after) if field.name != "transformer")
                   if getattr(before, name) != getattr(after, name)]
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
                args.num_microbatches = get_num_microbatches()
                args.orch_config = orch_config_from_args(
                    args, verify_by_default=not is_shipped_config(args.model_config))
                megatron_lm.allow_in_checkpoints(args.mllm_config, args.orch_config)
                if args.orch_config is not None:
                    decision = megatron_lm.encoder_ranks_decision(args, args.mllm_config.phases(),
                                                                  args.mllm_config.phase_parameters())
                    print_rank_0(f" > {decision.line(flag_setting)}")
                    megatron_lm.check_args(args)
            except ValueError as err:  # ArgumentError included
                sys.exit(f"pretrain_mllm.py: error: {err}")
        return args

    def model_provider(pre_process=True, post_process=True, vp_stage=None, **unused):
        """This rank's model chunk; with the encoders on every rank, the first chunk's get the first stage's
        parameters before megatron.training builds the optimizer (every rank builds its first chunk at once)."""
        args = mllm_args()
        model = providers.build_model(args, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage)
        if args.orch_config is not None and not vp_stage and args.orch_config.spreads_encoders(
                args.tensor_model_parallel_size, args.pipeline_model_parallel_size):
            share_encoders(model, encoder_groups(args.orch_config.encoder_tensor_parallel_size)[1])
        return model

    def build_train_iterator():
        """The loader from the run's consumed samples on, over the samples its steps consume (their micro-batches
        as Megatron's calculator counts them: a batch-size ramp-up changes them from step to step)."""
        args = mllm_args()
        per_microbatch = args.micro_batch_size * mpu.get_data_parallel_world_size()
        counts = megatron_core_counts(args.consumed_train_samples, args.train_iters - args.iteration, per_microbatch)
        train = providers.build_train_data_iterator(
            args, args.consumed_train_samples, mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(),
            num_samples=args.consumed_train_samples + sum(counts) * per_microbatch)
        if args.orch_config is not None:  # its schedule: megatron_lm.pretrain's hook, around train()'s
            train, _ = providers.build_post_balancing(args, args.orch_config, train, forward_backward_func=None,
                                                      step_counts=counts or None)
        return train

    hooked = post_balancing or shadow  # the modality-aware schedule takes the steps of the first model chunk
    wrapper = megatron_lm.schedule_wrapper(lambda: mllm_args().orch_config) if hooked else None
    megatron_lm.pretrain(megatron_lm.external_data_provider(build_train_iterator, hooked), model_provider,
                         ModelType.encoder_or_decoder, providers.forward_step,
                         extra_args_provider=add_mllm_args, args_defaults={"dataloader_type": "external"},
                         forward_backward_func_wrapper=wrapper, announce=print_rank_0)


def run() -> None:
    """The trainer ``--orch-trainer`` names (default: the compact one), never a choice by environment."""
    from megatron_orch.mllm.task import PROGRAM, trainer_of
    from megatron_orch.trainer.arguments import exit_with_error
    trainer = trainer_of(sys.argv[1:])
    if trainer == "compact":
        return main_compact()
    if not megatron_lm_available():
        exit_with_error(
            "--orch-trainer megatron-lm: megatron.training does not import here; megatron-core wheels from 0.17 "
            "on ship it, for 0.16.1 put a Megatron-LM checkout (tag core_v0.16.1) on PYTHONPATH", PROGRAM)
    import torch
    if not torch.cuda.is_available():
        exit_with_error(
            "--orch-trainer megatron-lm needs GPUs (Megatron-LM's initialisation asserts CUDA); on CPU the "
            "compact trainer (--orch-trainer compact, the default) trains the same model from the same flags",
            PROGRAM)
    main_megatron_lm()


LAUNCH_HINT = ("launch it with torchrun, one process per rank: torchrun --nproc-per-node N pretrain_mllm.py FLAGS... "
               "(on CPU: scripts/train_tiny_cpu.sh FLAGS..., which sets up and checks the flags first)")


def main() -> None:
    """The torchrun entry point: a failure ends this rank with one line (``pretrain_mllm.py: error on rank
    R: ...``, status 1; ``ORCH_DEBUG=1``: the traceback), written to torchrun's error file so that
    ``python -m megatron_orch.trainer.launch`` prints it last (:mod:`megatron_orch.trainer.launch`)."""
    from megatron_orch.trainer import launch
    if "RANK" not in os.environ and not {"-h", "--help"} & set(sys.argv[1:]):
        launch.report_failure("pretrain_mllm.py", f"not started by torchrun ($RANK is not set): {LAUNCH_HINT}")
        sys.exit(2)
    try:
        run()
    except SystemExit as stop:  # a message (main_megatron_lm's refusals): reported like any error
        if not isinstance(stop.code, str) or launch.debug():
            raise
        message = stop.code.removeprefix("pretrain_mllm.py: error: ")
        launch.report_failure("pretrain_mllm.py", message, show=os.environ.get("RANK", "0") == "0")
        sys.exit(1)
    except Exception as err:  # noqa: BLE001 -- every failure becomes one line, unless ORCH_DEBUG=1
        if launch.debug():
            raise
        launch.report_exception("pretrain_mllm.py", err)
        sys.exit(1)


if __name__ == "__main__":
    main()
