"""Post-balancing inside Megatron-LM's own training loop (``megatron.training.pretrain``), releases
core_v0.16.1 .. core_v0.19.x and their pip wheels.

Three hooks:

* **data**: with ``--dataloader-type external`` the train-valid-test provider's iterator reaches
  ``train()`` as is; :func:`external_data_provider` returns the post-balancing iterator from it and marks
  the provider ``is_distributed`` so every TP/PP rank builds one (the iterator's collectives run on
  every rank of the DP group and checks its plan with the TP/PP peers);
* **schedule**: the training loop's forward-backward function is wrapped in
  :class:`~megatron_orch.megatron.schedule.ModalityAwareSchedule`; evaluation keeps the stock schedule.
  Where the checkout carries ``patches/<release>/`` (``scripts/apply_patches.sh``), through the patch's
  ``pretrain(..., forward_backward_func_wrapper=...)``; where no patched ``train()`` is found (a pip
  wheel's ``megatron/training``, Megatron-LM main), by the same wrapper installed at run time
  (:func:`runtime_schedule_hook`: ``train()`` found through decorators; a hook that never fires is an
  error). :func:`pretrain` picks one and rank 0 prints which when it fires; a post-balancing step that
  reaches a stock schedule anyway raises :class:`~megatron_orch.megatron.post_balancing.StockScheduleError`;
* **deferred encoder backward**: the schedule wraps ``config.finalize_model_grads_func`` and
  ``config.grad_sync_func`` for the duration of each call, which ``train()`` sets once before its
  loop, so the encoders' backward runs before either one reduces gradients.

The encoders on every rank (``--orch-encoder-ranks all``, what ``auto`` picks with pipeline parallelism where it
runs and fits, :func:`encoder_ranks_decision`) run here as in the compact trainer: the model provider builds every
stage's first chunk with the encoders and gives them the first stage's parameters
(:func:`~megatron_orch.megatron.encoder_layout.share_encoders`) before ``megatron.training`` builds the optimizer,
and the schedule sums their gradients over the stages (:func:`schedule_wrapper`).

:func:`pretrain` also hides the two ``pretrain()`` APIs, told apart by what the installed function
accepts: up to 0.17 ``pretrain(provider, model_provider, ..., extra_args_provider=, args_defaults=)``
parses the command line itself; from 0.18 the caller parses (``parse_and_validate_args``), builds a
``PretrainConfigContainer`` (``pretrain_cfg_container_from_args``) and calls ``pretrain(container, ...)``.

:func:`check_args` refuses the Megatron-LM settings these hooks do not support, naming the flag. Sharded data
parallelism (``--use-torch-fsdp2``, ``--use-megatron-fsdp``) runs as the schedule's encoders need it
(:mod:`~megatron_orch.megatron.sharding`); an MoE backbone's settings whose losses change with an example's
placement are refused (:mod:`~megatron_orch.megatron.moe`).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, Mapping, Optional

import torch
from megatron.core import parallel_state

from megatron_orch.megatron.moe import placement_dependent_moe_settings
from megatron_orch.megatron.pipeline_layout import check_interleaved_microbatches
from megatron_orch.megatron.schedule import ModalityAwareSchedule
from megatron_orch.balance.workload import ModelPhases
from megatron_orch.megatron.orch_arguments import decide_encoder_ranks_of_args
from megatron_orch.orchestrator.config import OrchestratorConfig
from megatron_orch.orchestrator.encoder_ranks import EncoderRanksDecision

WRAPPER_ARGUMENT = "forward_backward_func_wrapper"
PATCHES = Path(__file__).resolve().parents[2] / "patches"


def is_patched(pretrain: Callable) -> bool:
    """Whether ``pretrain`` (``megatron.training.pretrain``) takes the patch's schedule wrapper."""
    return WRAPPER_ARGUMENT in inspect.signature(pretrain).parameters


def takes_config_container(pretrain: Callable) -> bool:
    """Whether ``pretrain`` is the 0.18+ API (``pretrain(cfg_container, ...)``, no ``extra_args_provider``)."""
    parameters = inspect.signature(pretrain).parameters
    return "extra_args_provider" not in parameters and next(iter(parameters)) == "cfg_container"


def patch_release(training_file: Path) -> Optional[str]:
    """The ``patches/`` release whose patched ``training.py`` is ``training_file`` (by git blob hash), or
    None (a fork's own changes on top, or no patch at all)."""
    try:
        blob = subprocess.run(["git", "hash-object", str(training_file)], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    for patch in sorted(PATCHES.glob("core_v*/*.patch")):
        if f"..{blob} " in patch.read_text():
            return patch.parent.name
    return None


def schedule_wrapper(config: Callable[[], OrchestratorConfig]) -> Callable[[Callable], ModalityAwareSchedule]:
    """The ``forward_backward_func_wrapper``: the modality-aware schedule around Megatron's, run as ``config()``
    (asked when training starts, after the arguments are parsed) says: encoder recompute, the encoders on every
    rank."""

    def wrap(forward_backward_func: Callable) -> ModalityAwareSchedule:
        settings = config()
        return ModalityAwareSchedule(forward_backward_func, parallel_state.get_data_parallel_group(),
                                     encoder_recompute=settings.encoder_recompute,
                                     encoders_on_every_stage=settings.spreads_encoders(
                                         parallel_state.get_tensor_model_parallel_world_size(),
                                         parallel_state.get_pipeline_model_parallel_world_size()))

    return wrap


class HookNeverFiredError(RuntimeError):
    """The run-time schedule hook's block ended without ``train()`` having asked for its schedule."""


@contextlib.contextmanager
def runtime_schedule_hook(training, wrapper: Callable[[Callable], Callable]):
    """For the duration of the block, ``train()`` of the module ``training`` (``megatron.training.training``)
    gets ``wrapper(schedule)`` from its call of ``get_forward_backward_func``; every other caller
    (``evaluate()``) gets the stock schedule. No file changes: what the patch does, done at run time.

    ``train()`` is told by its code object, through any decorators (``inspect.unwrap``: those made with
    ``functools.wraps``). A block that ends without ``train()``'s call having been answered raises
    :class:`HookNeverFiredError`: the run got no modality-aware schedule."""
    stock = training.get_forward_backward_func
    train = inspect.unwrap(training.train)
    fired = []

    def get_forward_backward_func(*args, **kwargs):
        schedule = stock(*args, **kwargs)
        if sys._getframe(1).f_code is not train.__code__:
            return schedule
        fired.append(True)
        return wrapper(schedule)

    training.get_forward_backward_func = get_forward_backward_func
    try:
        yield
    finally:
        training.get_forward_backward_func = stock
    if not fired:
        code = train.__code__
        raise HookNeverFiredError(
            f"post-balancing's run-time schedule hook never fired: train() ({code.co_filename}:{code.co_firstlineno}) "
            "did not ask get_forward_backward_func for its schedule (a train() changed, or wrapped by a decorator "
            "without functools.wraps), so nothing ran the modality-aware schedule; apply the patch of patches/ "
            "(scripts/apply_patches.sh) or pass forward_backward_func_wrapper to a patched pretrain()")


def pretrain(train_valid_test_dataset_provider: Callable, model_provider: Callable, model_type,
             forward_step_func: Callable, *, extra_args_provider: Callable, args_defaults: Dict,
             forward_backward_func_wrapper: Optional[Callable[[Callable], Callable]] = None,
             announce: Callable[[str], None] = print) -> None:
    """``megatron.training.pretrain`` on whichever API the installed Megatron-LM has, with
    ``forward_backward_func_wrapper`` (None: the upstream run) around the training loop's schedule
    through the patch where ``pretrain`` takes it, else through :func:`runtime_schedule_hook`.
    ``announce`` (e.g. ``print_rank_0``) gets one line naming the API and the hook."""
    from megatron.training import pretrain as megatron_pretrain
    from megatron.training import training

    providers = dict(train_valid_test_dataset_provider=train_valid_test_dataset_provider,
                     model_provider=model_provider, model_type=model_type, forward_step_func=forward_step_func)
    if takes_config_container(megatron_pretrain):
        from megatron.training.argument_utils import pretrain_cfg_container_from_args
        from megatron.training.arguments import parse_and_validate_args

        def run(**hook):
            args = parse_and_validate_args(extra_args_provider=extra_args_provider, args_defaults=args_defaults)
            megatron_pretrain(pretrain_cfg_container_from_args(args), **providers, **hook)
        api = "pretrain(cfg_container, ...)"
    else:
        def run(**hook):
            megatron_pretrain(extra_args_provider=extra_args_provider, args_defaults=args_defaults, **providers,
                              **hook)
        api = "pretrain(..., extra_args_provider=...)"

    if forward_backward_func_wrapper is None:
        return run()
    if is_patched(megatron_pretrain):
        release = patch_release(Path(inspect.getsourcefile(training)))
        how = f"the patch of patches/{release}" if release else "a patched train() (training.py of no known release)"
        wrapper = _announcing(forward_backward_func_wrapper, announce, f"{api}, schedule hook: {how}")
        return run(**{WRAPPER_ARGUMENT: wrapper})
    wrapper = _announcing(forward_backward_func_wrapper, announce,
                          f"{api}, schedule hook: installed at run time (no patched train() in "
                          f"{inspect.getsourcefile(training)}), fired in train()")
    with runtime_schedule_hook(training, wrapper):
        run()


def _announcing(wrapper: Callable, announce: Callable[[str], None], line: str) -> Callable:
    """``wrapper``, announcing ``line`` when it is applied (when the hook fires: train() asked for its schedule)."""
    def wrap(forward_backward_func):
        announce(f"> post-balancing in megatron.training: {line}")
        return wrapper(forward_backward_func)
    return wrap


# The Megatron-LM flags (argparse destinations) check_args refuses with post-balancing, of any release.
POST_BALANCING_REFUSALS = ("dataloader_type", "calculate_per_token_loss", "hybrid_context_parallel",
                           "sequence_packing_scheduler", "use_varlen_dataset", "cuda_graph_impl", "cuda_graph_scope",
                           "moe_expert_rank_capacity_factor", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                           "moe_z_loss_coeff", "moe_expert_capacity_factor", "perform_rl_step")


# Why post-balancing refuses Megatron-LM's sequence-packing scheduler rather than composing with it.
_UPSTREAM_PACKING = (
    "Megatron's own packing scheduler re-packs the step in train_step, after post-balancing planned it: it reads "
    "the iterator's micro-batches as GPT samples and its dp_balanced one moves them across DP ranks (two balancers "
    "must not both move examples), and the modality-aware schedule runs the micro-batches of its own plan, not "
    "the per-step num_microbatches the scheduler returns; use --orch-microbatching packed instead (post-balancing "
    "packs the balanced rows itself)")


_OWN_ENCODER_TP = ("the encoders at a tensor-parallel size of their own (--orch-encoder-tensor-parallel-size below "
                   "--tensor-model-parallel-size) through megatron.training is not supported: its checkpoint does not "
                   "tell the encoder replicas of a TP group apart")


def allow_in_checkpoints(*settings) -> None:
    """Let ``torch.load(weights_only=True)`` read ``settings`` back: megatron.training saves its ``args``, which hold
    them, in every checkpoint, and megatron-core 0.16.1 reads a distributed checkpoint's common state that way,
    refusing any class it was not told of (megatron-core registers its own, ``megatron.core.safe_globals``). The
    classes of every dataclass and enum in ``settings``, walked through their fields and containers, are
    registered."""
    classes, pending = set(), list(settings)
    while pending:
        value = pending.pop()
        if isinstance(value, enum.Enum):
            classes.add(type(value))
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            classes.add(type(value))
            pending.extend(getattr(value, field.name) for field in dataclasses.fields(value))
        elif isinstance(value, (tuple, list, set, frozenset)):
            pending.extend(value)
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
    torch.serialization.add_safe_globals(sorted(classes, key=lambda cls: (cls.__module__, cls.__qualname__)))


def encoder_ranks_decision(args: argparse.Namespace, phases: ModelPhases,
                           parameters: Optional[Mapping[str, int]]) -> EncoderRanksDecision:
    """The encoder layout under megatron.training, decided before the model is built, ``args.orch_config`` (and
    ``args.orch_encoder_ranks``) set to it
    (:func:`~megatron_orch.megatron.orch_arguments.decide_encoder_ranks_of_args`; ``phases`` and ``parameters``: the
    model's, for the per-GPU memory model): ``auto`` is ``all`` with pipeline parallelism where the layout runs it and
    it fits, never at an encoder TP of its own (:func:`check_args` refuses that asked for)."""
    etp = args.orch_config.encoder_tensor_parallel_size
    own_tp = etp is not None and etp != args.tensor_model_parallel_size
    return decide_encoder_ranks_of_args(args, phases, parameters, unavailable=_OWN_ENCODER_TP if own_tp else None)


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the Megatron-LM flag that post-balancing cannot run with. Flags of a newer
    release are read with ``getattr``: an older release simply has none of them."""
    problems = []
    if args.dataloader_type != "external":
        problems.append(f"--dataloader-type {args.dataloader_type}: post-balancing needs 'external' (the "
                        "provider's iterator must reach the training loop as is)")
    if not args.calculate_per_token_loss:
        problems.append("--calculate-per-token-loss is required: the loss is normalised by the global number of "
                        "loss tokens, which is what makes moving examples between DP ranks loss-invariant")
    if args.virtual_pipeline_model_parallel_size is not None:  # the step's plan and moves run before the schedule
        try:
            check_interleaved_microbatches(args.global_batch_size // (args.micro_batch_size * args.data_parallel_size),
                                           args.pipeline_model_parallel_size,
                                           getattr(args, "microbatch_group_size_per_vp_stage", None))
        except ValueError as err:
            problems.append(str(err))
    config = getattr(args, "orch_config", None)
    if config is not None and config.encoder_tensor_parallel_size not in (None, args.tensor_model_parallel_size):
        problems.append(f"{_OWN_ENCODER_TP}: use the compact trainer, or leave the flag out")
    if getattr(args, "hybrid_context_parallel", False):
        problems.append("--hybrid-context-parallel: it regroups the data iterator's sequences over DP x CP "
                        "ranks (HybridCPDataLoaderWrapper), which would undo the post-balancing plan")
    if getattr(args, "sequence_packing_scheduler", None) is not None:
        problems.append(f"--sequence-packing-scheduler {args.sequence_packing_scheduler}: {_UPSTREAM_PACKING}")
    if getattr(args, "use_varlen_dataset", False):
        problems.append(f"--use-varlen-dataset (it runs Megatron's sequence-packing scheduler): {_UPSTREAM_PACKING}")
    if _full_iteration_cuda_graph(args):
        problems.append("full-iteration CUDA graphs (--cuda-graph-impl full_iteration, or --cuda-graph-scope "
                        "full_iteration): the graph would replay one step's routes and item counts, which "
                        "change every step")
    if getattr(args, "moe_expert_rank_capacity_factor", None) is not None:
        problems.append("--moe-expert-rank-capacity-factor: its PagedStashRunner re-runs a step's "
                        "forward-backward on overflow, which would run the encoders and all-to-alls again")
    if getattr(args, "num_experts", None) is not None:
        packed = getattr(getattr(args, "orch_config", None), "microbatching", None) == "packed"
        problems.extend(placement_dependent_moe_settings(args, packed))
    if getattr(args, "perform_rl_step", False):
        problems.append("--perform-rl-step: RL training builds its own batches")
    if problems:
        raise ValueError(f"with --orch-{'shadow' if getattr(args, 'orch_shadow', False) else 'post-balancing'}: "
                         + "; ".join(problems))


def _full_iteration_cuda_graph(args: argparse.Namespace) -> bool:
    """0.19: ``--cuda-graph-impl full_iteration``; 0.16-0.18: ``--cuda-graph-impl local`` with the
    ``full_iteration`` scope."""
    impl = getattr(args, "cuda_graph_impl", "none")
    scope = getattr(args, "cuda_graph_scope", None) or []
    return impl == "full_iteration" or (impl == "local" and any("full_iteration" in str(s) for s in scope))


def external_data_provider(build_train_iterator: Callable[[], Iterator], post_balancing: bool) -> Callable:
    """Megatron-LM's ``train_valid_test_datasets_provider`` for ``--dataloader-type external``: the
    training iterator ``build_train_iterator()`` returns, no validation or test data. With virtual pipeline
    stages Megatron-LM asks once per model chunk (``vp_stage``): upstream every chunk gets an iterator of its
    own over the same samples (as Megatron-LM's loaders); with post-balancing (shadow mode too) the first
    chunk gets the iterator and the others None, since the modality-aware schedule feeds every chunk the
    first chunk's steps."""

    def train_valid_test_data_provider(train_val_test_num_samples, vp_stage=None):
        if post_balancing and vp_stage:
            return None, None, None
        return build_train_iterator(), None, None

    train_valid_test_data_provider.is_distributed = True
    return train_valid_test_data_provider
