"""What the compact trainer trains: a :class:`TrainingTask`, one documented hook per step of a run.

The trainer (:mod:`~megatron_orch.trainer.arguments`, :mod:`~megatron_orch.trainer.loop`,
:mod:`~megatron_orch.trainer.checkpointing`) owns Megatron-LM's flags, the process groups, the wrapping,
the optimizer, the schedule, the logs and the checkpoints; a task owns its model and its data. It is
handed to the trainer as a whole, in the manner of Megatron-LM's ``pretrain(train_valid_test_datasets_provider,
model_provider, model_type, forward_step_func, extra_args_provider)`` or of an Energon ``TaskEncoder``::

    args = arguments.parse_args_or_exit(MY_TASK, world_size=int(os.environ["WORLD_SIZE"]))
    arguments.check_data_or_exit(args, MY_TASK)
    loop.pretrain(args, MY_TASK)

In the order a run calls them:

1. :attr:`TrainingTask.add_arguments` adds the task's own flags to the trainer's parser (Megatron's
   ``extra_args_provider``: ``provider(parser) -> parser``);
2. :attr:`TrainingTask.configure` checks them once the trainer's flags are checked (it may read
   ``args.world_size``, ``args.data_parallel_size``, ``args.num_microbatches``, the parallel sizes), keeps
   what its own hooks need on ``args``, and returns the :class:`ModelSummary` the trainer needs; neither it
   nor the parser may import torch or megatron, so a wrong command line fails in about a second;
3. :attr:`TrainingTask.check_data` checks the data before any rank builds a model (may import torch);
4. :attr:`TrainingTask.build_model`: one model chunk (Megatron's ``model_provider``), a
   :class:`~megatron_orch.megatron.BalanceableModel` whose config has ``calculate_per_token_loss=True``;
5. :attr:`TrainingTask.build_train_data_iterator`: this DP rank's micro-batches (the contract's
   :class:`~megatron_orch.megatron.batch.MicroBatch`); one that is a
   :class:`~megatron_orch.trainer.data_events.DataEvents` also reports bad and truncated examples;
6. :attr:`TrainingTask.build_post_balancing`: with ``--orch-post-balancing`` or ``--orch-shadow``, the
   balancing iterator and schedule around that loader (:func:`megatron_orch.megatron.post_balance`);
7. :attr:`TrainingTask.forward_step`: Megatron's ``forward_step_func`` (the contract's
   :func:`megatron_orch.megatron.forward_step` fits any model of the contract);
8. :attr:`TrainingTask.model_identity` and :attr:`TrainingTask.data_identity`: what a checkpoint records of
   the model and the data, so that a resumed run refuses another model or changed data.

Where a model computes (its GPU, or the CPU for ``--distributed-backend gloo``) is the trainer's:
:func:`runs_on_cpu`, :func:`compute_device`.
"""
from __future__ import annotations

import argparse
import importlib
import warnings
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

from megatron_orch.balance.workload import ModelPhases

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


@dataclass(frozen=True)
class ModelSummary:
    """What the trainer knows of a task's model once its flags are checked (:attr:`TrainingTask.configure`)."""

    name: str                 # in rank 0's line " > model config NAME: N parameters on rank 0 | ..."
    num_layers: int           # the backbone's layers: split over the pipeline (and virtual pipeline) stages
    phases: ModelPhases       # what post-balancing plans (--orch-phases names them) and the iteration lines show
    num_experts: Optional[int] = None  # experts of the backbone's MoE layers; None: a dense backbone
    verify_first_step: bool = True     # --orch-verify-first-step's default: on, but for a model tested already
    parameters: Optional[Mapping[str, int]] = None  # each phase's parameters (None: --orch-encoder-ranks all unchecked
    #                                                 against the GPU's memory)


def _no_data_check(args: argparse.Namespace) -> None:
    return None


def _no_data_identity(args: argparse.Namespace) -> Optional[dict]:
    return None


def _no_flag_reason(flag: str) -> Optional[str]:
    return None


@dataclass(frozen=True)
class TrainingTask:
    """A model and its data, as the compact trainer calls them (the module docstring lists when).

    ``dataclasses.replace(task, build_model=...)`` gives a task with one hook changed (the tests wrap
    :attr:`build_model` so).
    """

    program: str  # the entry point's name: "<program>: error: ..." lines, --help's usage
    description: str  # --help's first line
    # (parser) -> parser: the task's flags; the trainer adds the --orch-* flags itself
    add_arguments: ArgsProvider
    # (args) -> ModelSummary; raises ValueError (ArgumentError included) naming the flag
    configure: Callable[[argparse.Namespace], ModelSummary]
    # (args, pre_process, post_process, vp_stage=None) -> this pipeline stage's model chunk
    build_model: Callable[..., object]
    # (data_iterator, model) -> (output, loss_func): Megatron's forward_step_func
    forward_step: Callable
    # (args, consumed_samples, data_parallel_rank, data_parallel_size, **restored) -> iterator of micro-batches;
    # restored: loader_state=..., what the loader's loader_state() returned for the checkpoint
    build_train_data_iterator: Callable
    # (args, orch_config, loader_iterator, forward_backward_func) -> (iterator, schedule)
    build_post_balancing: Callable
    # (args) -> flat dict of the model's defining values, saved with each checkpoint and compared on resume
    model_identity: Callable[[argparse.Namespace], dict]
    # (args) -> what identifies the data's content (None: nothing to compare), checked like the model's
    data_identity: Callable[[argparse.Namespace], Optional[dict]] = _no_data_identity
    # (args) -> None, before any model is built; raises OSError, ValueError or ImportError with a message
    check_data: Callable[[argparse.Namespace], None] = _no_data_check
    # (option, e.g. "--swiglu") -> why the compact trainer refuses this Megatron-LM flag for this model and what to
    # use instead, or None; asked for a flag the trainer's parser does not know (after the trainer's own reasons)
    explain_flag: Callable[[str], Optional[str]] = _no_flag_reason


def runs_on_cpu(args: argparse.Namespace) -> bool:
    """A gloo launch trains on CPU (megatron-core through the CPU harness); nccl on GPUs."""
    return args.distributed_backend == "gloo"


def compute_device(args: argparse.Namespace):
    """Where this rank's model computes: its GPU, or the CPU for a gloo run (a ``torch.device``)."""
    import torch
    return torch.device("cpu") if runs_on_cpu(args) else torch.device("cuda", torch.cuda.current_device())


def task_or_the_mllm(task, call: str, new_form: str, stacklevel: int = 3) -> "TrainingTask":
    """``task``, or for a call written before :class:`TrainingTask` (no task given) the task it meant: this
    project's MLLM, then the only model the trainer trained, with a DeprecationWarning naming the call to write
    instead (these forms go in the next release). That task is found by name, as the trainer imports no module
    of ``megatron_orch.mllm``; anything else where a task goes is a TypeError naming the new form.
    ``stacklevel``: the caller's frame, for the warning's line."""
    if isinstance(task, TrainingTask):
        return task
    if task is not None:
        raise TypeError(f"megatron_orch.trainer: {call} takes a TrainingTask, got {type(task).__name__}; call "
                        f"{new_form}")
    warnings.warn(f"megatron_orch.trainer: {call} without a task is deprecated; call {new_form} (this project's "
                  "model: megatron_orch.mllm.task.MLLM_TASK)", DeprecationWarning, stacklevel=stacklevel)
    return importlib.import_module("megatron_orch.mllm.task").MLLM_TASK
