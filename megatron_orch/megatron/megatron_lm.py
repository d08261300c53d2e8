"""Post-balancing inside Megatron-LM's own training loop (``megatron.training.pretrain``, tag core_v0.16.1).

Three hooks; only the schedule needs a patch (``patches/core_v0.16.1/0001``):

* **data**: with ``--dataloader-type external`` the train-valid-test provider's iterator reaches
  ``train()`` as is; :func:`external_data_provider` returns the post-balancing iterator from it and marks
  the provider ``is_distributed`` so every TP/PP rank builds one (the iterator's collectives run on
  every rank of the DP group and checks its plan with the TP/PP peers);
* **schedule**: ``pretrain(..., forward_backward_func_wrapper=...)`` (the patch) wraps the training
  loop's ``get_forward_backward_func()`` in :class:`~megatron_orch.megatron.schedule.ModalityAwareSchedule`
  (:func:`schedule_wrapper`); evaluation keeps the stock schedule;
* **deferred encoder backward**: the schedule wraps ``config.finalize_model_grads_func`` and
  ``config.grad_sync_func`` for the duration of each call, which ``train()`` sets once before its
  loop, so the encoders' backward runs before either one reduces gradients.

:func:`check_args` refuses the Megatron-LM settings these hooks do not support, naming the flag.
"""
from __future__ import annotations

import argparse
import inspect
from typing import Callable, Iterator

from megatron.core import parallel_state

from megatron_orch.megatron.schedule import ModalityAwareSchedule

WRAPPER_ARGUMENT = "forward_backward_func_wrapper"
APPLY_COMMAND = "scripts/apply_patches.sh MEGATRON_LM_DIR"


class PatchMissingError(RuntimeError):
    """``megatron.training.pretrain`` lacks the argument that ``patches/`` adds."""


def is_patched(pretrain: Callable) -> bool:
    """Whether ``pretrain`` (``megatron.training.pretrain``) takes the patch's schedule wrapper."""
    return WRAPPER_ARGUMENT in inspect.signature(pretrain).parameters


def require_patched(pretrain: Callable) -> None:
    if not is_patched(pretrain):
        raise PatchMissingError(
            f"--orch-post-balancing needs the megatron-orch patch of Megatron-LM: megatron.training.pretrain "
            f"(from {inspect.getsourcefile(pretrain)}) has no '{WRAPPER_ARGUMENT}' argument. Apply the patch "
            f"to the Megatron-LM checkout at tag core_v0.16.1 with `{APPLY_COMMAND}` (from the megatron-orch "
            f"repository), or run without --orch-post-balancing for the upstream baseline")


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the Megatron-LM flag that post-balancing cannot run with."""
    problems = []
    if args.dataloader_type != "external":
        problems.append(f"--dataloader-type {args.dataloader_type}: post-balancing needs 'external' (the "
                        "provider's iterator must reach the training loop as is)")
    if not args.calculate_per_token_loss:
        problems.append("--calculate-per-token-loss is required: the loss is normalised by the global number of "
                        "loss tokens, which is what makes moving examples between DP ranks loss-invariant")
    if args.virtual_pipeline_model_parallel_size is not None:
        problems.append("virtual pipeline stages (--num-layers-per-virtual-pipeline-stage / "
                        "--num-virtual-stages-per-pipeline-rank): one model chunk per rank only")
    if args.context_parallel_size > 1:
        problems.append(f"--context-parallel-size {args.context_parallel_size}: post-balancing moves whole "
                        "examples between DP ranks, context parallelism is not supported")
    if args.orch_microbatching == "packed" and args.transformer_impl == "transformer_engine":
        problems.append("--orch-microbatching packed with --transformer-impl transformer_engine: TE's causal "
                        "attention ignores the block-diagonal mask of packed rows (use --transformer-impl local "
                        "or --orch-microbatching equal_count)")
    if args.rampup_batch_size is not None:
        problems.append("--rampup-batch-size: a post-balancing step has a fixed number of micro-batches")
    if problems:
        raise ValueError("with --orch-post-balancing: " + "; ".join(problems))


def external_data_provider(build_train_iterator: Callable[[], Iterator]) -> Callable:
    """Megatron-LM's ``train_valid_test_datasets_provider`` for ``--dataloader-type external``: the
    training iterator ``build_train_iterator()`` returns, no validation or test data."""

    def train_valid_test_data_provider(train_val_test_num_samples, vp_stage=None):
        return build_train_iterator(), None, None

    train_valid_test_data_provider.is_distributed = True
    return train_valid_test_data_provider


def schedule_wrapper(encoder_recompute: Callable[[], bool]) -> Callable[[Callable], ModalityAwareSchedule]:
    """The patch's ``forward_backward_func_wrapper``: the modality-aware schedule around Megatron's.
    ``encoder_recompute`` is asked when training starts (after the arguments are parsed)."""

    def wrap(forward_backward_func: Callable) -> ModalityAwareSchedule:
        return ModalityAwareSchedule(forward_backward_func, parallel_state.get_data_parallel_group(),
                                     encoder_recompute=encoder_recompute())

    return wrap
