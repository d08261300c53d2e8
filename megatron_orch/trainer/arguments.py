"""Command line of a compact-trainer run: Megatron-LM's flag names for what the compact trainer supports.

Groups of flags, in this order:

* :func:`add_megatron_args`: the subset of Megatron-LM's own flags that the compact trainer
  implements, with Megatron's names and (mostly) defaults. Under ``megatron.training`` these come
  from Megatron-LM's parser instead.
* the task's own flags (:attr:`~megatron_orch.trainer.task.TrainingTask.add_arguments`), then the
  ``--orch-*`` post-balancing flags (:func:`~megatron_orch.megatron.orch_arguments.add_orch_args`);
* extra providers: functions ``provider(parser) -> parser`` (Megatron's ``extra_args_provider``
  convention), given to :func:`parse_args`.

Unknown flags, abbreviations of flags and inconsistent values are errors that name the flag
(:class:`ArgumentError`): a Megatron-LM flag the compact trainer does not implement says why and what to use
instead (:data:`NOT_IMPLEMENTED`, then the task's :attr:`~megatron_orch.trainer.task.TrainingTask.explain_flag`),
any other unknown flag gets the closest real one ("did you mean --train-iters?"). Parsing and every check
that needs no device imports neither torch nor megatron, so a wrong command line fails in about a second:
:func:`parse_args_or_exit` prints the one line ``<program>: error: ...`` (on rank 0 only under torchrun) and
exits with status 2;
:func:`check_command_line` is that check for a launch of ``$WORLD_SIZE`` processes, the data included
(a task's entry point runs it before torchrun).
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from typing import Callable, Dict, Iterable, NoReturn, Optional, Sequence

from megatron_orch.megatron.orch_arguments import (add_orch_args, decide_encoder_ranks_of_args, flag_message,
                                                  orch_config_from_args)
from megatron_orch.megatron.pipeline_layout import check_interleaved_microbatches, virtual_pipeline_size
from megatron_orch.trainer.task import ArgsProvider, TrainingTask, runs_on_cpu, task_or_the_mllm

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")  # Megatron-FSDP's

# The backbone shape flags (Megatron-LM's names; each names the field of megatron_orch.balance.cost's
# TransformerShape it gives); None where not given: the task's model config decides.
BACKBONE_SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                        "kv_channels", "num_experts", "moe_router_topk", "moe_ffn_hidden_size")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")  # Megatron-LM's


class ArgumentError(ValueError):
    """An inconsistent command line; the message names the flags involved."""


_RECOMPUTE = ("it recomputes no backbone layers; --orch-encoder-recompute (with --orch-post-balancing) recomputes "
              "the encoders' activations for their backward, and Megatron-LM's own loop the layers of a model that "
              "implements Megatron-LM's recompute")
_ON_GPUS = ("Transformer Engine's communication overlap and CUDA graphs are set up by Megatron-LM's own loop on GPUs "
            "(pretrain_mllm.py --orch-trainer megatron-lm, or your megatron.training launch) for the models that "
            "support them")
_PRECISION = "it trains in fp32 or bf16 (--bf16)"

#: Megatron-LM flags (by dest) that the compact trainer does not implement, with why and what to use instead.
NOT_IMPLEMENTED: Dict[str, str] = {
    **dict.fromkeys(("recompute_activations", "recompute_granularity", "recompute_method", "recompute_num_layers",
                     "recompute_modules", "distribute_saved_activations", "checkpoint_activations"), _RECOMPUTE),
    **dict.fromkeys(("use_flash_attn", "attention_backend"),
                    "attention's kernel follows --transformer-impl: transformer_engine (the default on GPUs where "
                    "it imports) runs Transformer Engine's fused (flash) attention, local runs torch SDPA"),
    **dict.fromkeys(("tp_comm_overlap", "tp_comm_overlap_cfg", "tp_comm_bulk_wgrad", "tp_comm_bulk_dgrad",
                     "tp_comm_overlap_ag", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag",
                     "tp_comm_split_rs", "enable_cuda_graph", "cuda_graph_impl", "cuda_graph_scope",
                     "external_cuda_graph", "overlap_moe_expert_parallel_comm"), _ON_GPUS),
    **dict.fromkeys(("fp16", "fp8", "fp8_recipe", "fp4", "fp8_param_gather"), _PRECISION),
    **dict.fromkeys(("overlap_param_gather_with_optimizer_step", "align_param_gather", "align_grad_reduce",
                     "ddp_num_buckets", "ddp_average_in_collective"),
                    "its Megatron DDP takes --overlap-grad-reduce, --overlap-param-gather and --ddp-bucket-size "
                    "(Megatron-LM's defaults for the rest)"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's own errors (unknown or missing flags, bad values) as :class:`ArgumentError`, so that the
    caller decides where and how often to print them; an unknown flag is explained (:func:`unknown_flags`).
    ``explain_flag``: the task's reasons for Megatron-LM flags, after :data:`NOT_IMPLEMENTED`."""

    def __init__(self, *args, explain_flag: Callable[[str], Optional[str]] = lambda flag: None, **kwargs):
        super().__init__(*args, **kwargs)
        self.explain_flag = explain_flag

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flags(extras, self._option_string_actions, self.explain_flag))
        return parsed

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(message)


def megatron_dests(flag: str) -> tuple:
    """The dests Megatron-LM's option ``flag`` may set by its usual spelling: ``--x-y`` sets ``x_y``, and a
    ``--no-x-y`` or ``--disable-x-y`` (``store_false``) sets ``x_y``."""
    dest = flag.lstrip("-").replace("-", "_")
    return (dest, *(dest.removeprefix(prefix) for prefix in ("no_", "disable_") if dest.startswith(prefix)))


def unknown_flags(extras: Sequence[str], known: Iterable[str], explain_flag: Callable[[str], Optional[str]]) -> str:
    """One line for the tokens argparse did not recognise: each Megatron-LM flag that :data:`NOT_IMPLEMENTED` or
    ``explain_flag`` (option -> reason) knows with its reason (the values after it dropped), then argparse's
    ``unrecognized arguments: ...`` for the rest, with the closest of the ``known`` flags."""
    explained, rest, suggestions, dropping = [], [], [], False
    for token in extras:
        if not token.startswith("-"):
            if not dropping:
                rest.append(token)
            continue
        flag = token.split("=", 1)[0]
        reason = next((reason for reason in (*(NOT_IMPLEMENTED.get(dest) for dest in megatron_dests(flag)),
                                             explain_flag(flag)) if reason), None)
        dropping = reason is not None
        if dropping:
            explained.append(f"{flag} (Megatron-LM's) is not implemented by the compact trainer: {reason}")
        else:
            rest.append(token)
            suggestions += [(flag, close) for close in difflib.get_close_matches(flag, list(known), n=1, cutoff=0.8)]
    if rest:
        hint = ", ".join(close if len(suggestions) == 1 else f"{close} for {flag}" for flag, close in suggestions)
        explained.append(f"unrecognized arguments: {' '.join(rest)}" + (f" (did you mean {hint}?)" if hint else ""))
    return "; ".join(explained)


def transformer_engine_available() -> bool:
    """Whether ``import transformer_engine`` succeeds, asked (it imports torch) only when the answer matters:
    a run on GPUs, or ``--transformer-impl transformer_engine``."""
    try:
        import transformer_engine  # noqa: F401
    except (ImportError, OSError):  # OSError: installed, but its CUDA libraries do not load
        return False
    return True


def add_megatron_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron-LM flags the compact trainer supports (same names as ``megatron/training/arguments.py``)."""
    g = parser.add_argument_group("model shape (overrides the backbone of --model-config)")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--num-query-groups", type=int, default=None, help="grouped-query attention")
    g.add_argument("--kv-channels", type=int, default=None)
    g.add_argument("--seq-length", type=int, required=True, help="longest backbone sequence (tokens)")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="rows of the backbone's learned position embeddings (default: --model-config's)")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1,
                   help="Megatron-LM's default 0.1; with 0 (and --attention-dropout 0) runs with balancing off and "
                        "on agree to floating-point order (dropout masks follow the rank that computes an example)")
    g.add_argument("--attention-dropout", type=float, default=0.1, help="Megatron-LM's default 0.1")
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None,
                   help="layer specs: megatron-core's local layers with torch SDPA attention, or Transformer "
                        "Engine's. Default: transformer_engine when it imports and the run is on GPUs, else local")

    g = parser.add_argument_group("mixture of experts (the backbone's FFN; Megatron-LM's names and defaults)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer; default: the model config's")
    g.add_argument("--moe-router-topk", type=int, default=None, help="experts per token; default: the model config's")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="one expert's FFN width; default: the model config's")
    g.add_argument("--moe-router-load-balancing-type", choices=LOAD_BALANCING_TYPES, default="aux_loss",
                   help="with post-balancing: seq_aux_loss or none (README: mixture-of-experts backbones)")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-z-loss-coeff", type=float, default=None)
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall"], default="allgather")
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="drop tokens over capacity (refused with post-balancing); default: dropless")

    g = parser.add_argument_group("data")
    g.add_argument("--data-path", type=str, default=None,
                   help="JSONL manifest of the user's examples, or an Energon dataset (a folder with .nv-meta; "
                        "the energon extra); default: synthetic examples with modality lengths drawn from the "
                        "real traces")

    g = parser.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="virtual pipeline stages (Megatron's interleaved 1F1B): backbone layers per model chunk")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="virtual pipeline stages: model chunks per pipeline rank")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split the backbone's sequence over the TP ranks outside attention and the MLPs (Megatron's "
                        "sequence parallelism; needs --tensor-model-parallel-size > 1)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="split each backbone sequence over this many ranks (Megatron's 2 x CP zig-zag chunks); the "
                        "encoders run whole on every CP rank. On GPUs it needs --transformer-impl transformer_engine")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="expert parallelism of an MoE backbone, inside data parallelism (it divides the DP size)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="Megatron DDP reduces a bucket of gradients as soon as the last micro-batch's backward has "
                        "produced all of them, during the rest of the backward (same numerics)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="the distributed optimizer's updated parameters are gathered bucket by bucket just before "
                        "the next forward uses them (needs --use-distributed-optimizer and --overlap-grad-reduce)")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="parameters per Megatron DDP bucket with --overlap-grad-reduce (default: megatron-core's, "
                        "max(40M, 1M x DP size))")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard parameters, gradients and optimizer state over DP with torch FSDP2 "
                        "(megatron-core's TorchFullyShardedDataParallel)")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="shard over DP with Megatron-FSDP (turns on --use-distributed-optimizer, as Megatron-LM)")
    g.add_argument("--data-parallel-sharding-strategy", choices=SHARDING_STRATEGIES, default="optim_grads_params",
                   help="what Megatron-FSDP shards: optimizer state, + gradients, + parameters (Megatron-LM's default)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="nccl: train on GPUs; gloo: train on CPU through megatron_orch.trainer.cpu_harness. "
                        "Default: nccl when a GPU is visible, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10,
                   help="timeout of every process group's collectives (Megatron-LM: whole minutes; fractions "
                        "are accepted here, e.g. 0.25, which the fault tests use)")

    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, required=True)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch-size x data-parallel size")
    g.add_argument("--train-iters", type=int, required=True)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (saving a checkpoint if --save) once the iteration is a multiple of this")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", action="store_false", dest="check_for_nan_in_loss_and_grad",
                   help="train on after a step whose loss or grad norm is NaN or infinite (counted in the iteration "
                        "lines); by default, as Megatron-LM, such a step stops the run before it saves")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="always on here: the loss is the sum of token losses over the global number of "
                        "loss tokens, which makes moving examples between ranks loss-invariant")

    g = parser.add_argument_group("optimizer and learning-rate schedule")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float, required=True)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)

    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--orch-log-level", type=int, choices=[0, 1], default=0,
                   help="0: Megatron-LM's iteration line with tokens/s and each phase's load imbalance (and cost "
                        "imbalance before->after with post-balancing); 1: the full line, also the loads per rank, "
                        "the phase times and post-balancing's moves, peers and planning times")
    g.add_argument("--timing-log-level", type=int, choices=[0, 1, 2], default=0,
                   help="Megatron's timer level: 0 phase timings only, 1 adds grads-all-reduce and "
                        "optimizer, 2 adds forward/backward compute")

    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None, help="default: save at the end only")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler", action="store_true",
                   dest="override_opt_param_scheduler",
                   help="on --load, take the LR/weight-decay schedule from this run's flags, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   action="store_true", dest="use_checkpoint_opt_param_scheduler",
                   help="on --load, keep the checkpoint's LR/weight-decay schedule and ignore this run's flags "
                        "(without either flag they must match)")
    g.add_argument("--ckpt-step", type=int, default=None,
                   help="on --load, resume from this iteration instead of the latest complete one")
    g.add_argument("--keep-last-checkpoints", type=int, default=None,
                   help="after each save, delete all but the last K complete iterations under --save (default: keep all)")
    g.add_argument("--allow-overwrite-checkpoints", action="store_true",
                   help="let a run save into a --save folder that holds complete checkpoints of another run (or that "
                        "no marker names): its saves replace the iterations of the same number and the marker. "
                        "Without it such a run is refused before its first step")
    g.add_argument("--allow-changed-data", action="store_true",
                   help="on --load, train on although the --data-path manifest's content differs from the "
                        "checkpoint's (its sample positions then name other examples)")
    return parser


def new_parser(program: str, description: Optional[str] = None, **kwargs) -> argparse.ArgumentParser:
    """An argument parser whose errors are :class:`ArgumentError` (no abbreviations of flags; ``explain_flag``:
    see :class:`_Parser`)."""
    return _Parser(prog=program, allow_abbrev=False, description=description, **kwargs)


def build_parser(task: TrainingTask, extra_args_providers: Iterable[ArgsProvider] = ()) -> argparse.ArgumentParser:
    """The trainer's flags, the task's (:attr:`~megatron_orch.trainer.task.TrainingTask.add_arguments`),
    the ``--orch-*`` post-balancing flags, then each extra provider's."""
    parser = new_parser(task.program, task.description, explain_flag=task.explain_flag)
    add_megatron_args(parser)
    parser = add_orch_args(task.add_arguments(parser))
    for provider in extra_args_providers:
        parser = provider(parser)
    return parser


def _before_tasks(task, argv, world_size, extra_args_providers, call: str):
    """``(task, argv, world_size, extra_args_providers)`` of a call of ``call``; a call in the form before tasks,
    ``call(argv, world_size, extra_args_providers)`` (positional or by keyword), shifted into the task-first
    form (this project's MLLM, with a DeprecationWarning)."""
    old_form, new_form = f"{call}(argv, ...)", f"{call}(task, argv, world_size, ...)"
    if not isinstance(task, (list, tuple)):  # a task, None (deprecated) or a TypeError
        return task_or_the_mllm(task, old_form, new_form, 4), argv, world_size, extra_args_providers
    if argv is None:  # call(argv, world_size=..., extra_args_providers=...)
        return task_or_the_mllm(None, old_form, new_form, 4), task, world_size, extra_args_providers
    # call(argv, world_size[, extra_args_providers]): each one place to the right
    return (task_or_the_mllm(None, old_form, new_form, 4), task, argv,
            extra_args_providers if world_size is None else world_size)


def parse_args(task: Optional[TrainingTask] = None, argv: Optional[Sequence[str]] = None,
               world_size: Optional[int] = None, extra_args_providers: Iterable[ArgsProvider] = ()) -> argparse.Namespace:
    """Parse and validate a command line of ``task`` (``world_size``: the launch's, default from
    torch.distributed). Deprecated: the form without a task, ``parse_args(argv, world_size, ...)``
    (this project's MLLM, with a DeprecationWarning).

    Raises :class:`ArgumentError` naming the flag for anything wrong, argparse's own errors included.
    """
    task, argv, world_size, extra_args_providers = _before_tasks(task, argv, world_size, extra_args_providers,
                                                                 "parse_args")
    args = build_parser(task, extra_args_providers).parse_args(argv)
    if world_size is None:
        import torch.distributed as dist
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    return validate_args(args, world_size, task)


def parse_args_or_exit(task: Optional[TrainingTask] = None, argv: Optional[Sequence[str]] = None,
                       world_size: Optional[int] = None,
                       extra_args_providers: Iterable[ArgsProvider] = ()) -> argparse.Namespace:
    """:func:`parse_args`; on an error, print ``<program>: error: ...`` once and exit with status 2 (deprecated
    form as there)."""
    task, argv, world_size, extra_args_providers = _before_tasks(task, argv, world_size, extra_args_providers,
                                                                 "parse_args_or_exit")
    try:
        return parse_args(task, argv, world_size, extra_args_providers)
    except ArgumentError as err:
        exit_with_error(str(err), task.program)


def check_data_or_exit(args: argparse.Namespace, task: Optional[TrainingTask] = None) -> None:
    """The task's check of its data (:attr:`~megatron_orch.trainer.task.TrainingTask.check_data`, before any
    model is built); on an error, :func:`exit_with_error`. Deprecated: ``check_data_or_exit(args)``."""
    task = task_or_the_mllm(task, "check_data_or_exit(args)", "check_data_or_exit(args, task)")
    try:
        task.check_data(args)
    except (OSError, ValueError, ImportError) as err:  # ImportError: a reader's optional package missing
        exit_with_error(str(err), task.program)


def exit_with_error(message: str, program: str) -> NoReturn:
    """Print ``<program>: error: <message>`` and exit with status 2, as argparse does; under
    torchrun only global rank 0 prints (every rank parses the same command line and fails alike) and
    every rank writes it to torchrun's error file (:func:`megatron_orch.trainer.launch.report_failure`)."""
    from megatron_orch.trainer.launch import report_failure
    report_failure(program, message, show=os.environ.get("RANK", "0") == "0")
    sys.exit(2)


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Each of the flags ``names`` not given (None) or >= 1, else :class:`ArgumentError`."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_in_range(args: argparse.Namespace, name: str, low: float, high: float = math.inf,
              low_open: bool = False, high_open: bool = False) -> None:
    """A finite float flag within [low, high] (``*_open``: the end excluded)."""
    value = getattr(args, name)
    above = value > low if low_open else value >= low
    below = value < high if high_open else value <= high
    if not (math.isfinite(value) and above and below):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open or math.isinf(high) else ']'}"
        raise ArgumentError(f"--{name.replace('_', '-')} must be a finite number in {interval}, got {value}")


def validate_args(args: argparse.Namespace, world_size: int, task: TrainingTask) -> argparse.Namespace:
    """Check consistency; derive ``data_parallel_size``, ``num_microbatches`` and ``model_summary`` (what
    the task's :attr:`~megatron_orch.trainer.task.TrainingTask.configure` returned)."""
    check_positive(args, "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                   "expert_model_parallel_size", "micro_batch_size", "global_batch_size", "train_iters",
                   "exit_interval", "seq_length", "log_interval", "save_interval", "make_vocab_size_divisible_by",
                   "ddp_bucket_size", "keep_last_checkpoints", "max_position_embeddings", *BACKBONE_SHAPE_FLAGS)
    for name in ("max_bad_examples", "ckpt_step"):
        if getattr(args, name, None) is not None and getattr(args, name) < 0:
            raise ArgumentError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    for name in ("lr", "min_lr", "lr_warmup_init", "weight_decay", "clip_grad"):
        check_in_range(args, name, 0.0)
    for name in ("adam_beta1", "adam_beta2", "sgd_momentum"):
        check_in_range(args, name, 0.0, 1.0, high_open=True)
    for name in ("adam_eps", "init_method_std"):
        check_in_range(args, name, 0.0, low_open=True)
    model_parallel = args.tensor_model_parallel_size * args.pipeline_model_parallel_size * args.context_parallel_size
    if world_size % model_parallel:
        raise ArgumentError(f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                            f"({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
                            f"({args.pipeline_model_parallel_size}) x --context-parallel-size "
                            f"({args.context_parallel_size}) = {model_parallel}")
    _check_sequence_split(args)
    args.world_size = world_size
    args.data_parallel_size = world_size // model_parallel
    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size is None:
        args.global_batch_size = per_step
    if args.global_batch_size % per_step:
        raise ArgumentError(f"--global-batch-size {args.global_batch_size} is not divisible by "
                            f"--micro-batch-size ({args.micro_batch_size}) x data-parallel size "
                            f"({args.data_parallel_size}) = {per_step}")
    args.num_microbatches = args.global_batch_size // per_step
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if not 0 <= args.lr_warmup_iters < args.lr_decay_iters:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} must be >= 0 and below --lr-decay-iters "
                            f"({args.lr_decay_iters}; default --train-iters)")
    if args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} exceeds --lr {args.lr}")
    if not (math.isfinite(args.distributed_timeout_minutes) and args.distributed_timeout_minutes > 0):
        raise ArgumentError(f"--distributed-timeout-minutes must be a finite number > 0, got {args.distributed_timeout_minutes}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise ArgumentError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler exclude each "
                            "other (this run's LR schedule, or the checkpoint's)")
    for name, needs in (("save_interval", "save"), ("keep_last_checkpoints", "save"), ("ckpt_step", "load"),
                        ("allow_overwrite_checkpoints", "save")):
        if getattr(args, name) not in (None, False) and getattr(args, needs) is None:
            raise ArgumentError(f"--{name.replace('_', '-')} needs --{needs} (the checkpoint directory)")
    for name in ("hidden_dropout", "attention_dropout"):
        check_in_range(args, name, 0.0, 1.0, high_open=True)
    _check_overlap(args)
    _check_sharded_data_parallel(args)
    args.calculate_per_token_loss = True
    try:
        args.model_summary = summary = task.configure(args)
    except ArgumentError:
        raise
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    try:
        args.virtual_pipeline_model_parallel_size = virtual_pipeline_size(
            summary.num_layers, args.pipeline_model_parallel_size,
            args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank)
        if args.virtual_pipeline_model_parallel_size is not None:
            check_interleaved_microbatches(args.num_microbatches, args.pipeline_model_parallel_size)
    except ValueError as err:
        raise ArgumentError(str(err)) from None
    try:
        args.orch_config = orch_config_from_args(args, verify_by_default=summary.verify_first_step)
        if args.orch_config is not None:
            args.orch_config.check_phases(summary.phases)
    except ValueError as err:
        raise ArgumentError(flag_message(err)) from err
    _check_mixture_of_experts(args)
    # Last, the checks that need torch (is a GPU visible?) or megatron (does Transformer Engine import?).
    if args.distributed_backend is None:
        import torch
        args.distributed_backend = "nccl" if torch.cuda.is_available() else "gloo"
    _resolve_transformer_impl(args)
    _decide_encoder_ranks(args, summary)
    return args


def _decide_encoder_ranks(args: argparse.Namespace, summary) -> None:
    """The encoder layout, before the model is built
    (:func:`~megatron_orch.megatron.orch_arguments.decide_encoder_ranks_of_args`: a task without parameter counts
    gets ``first-stage`` under ``auto``, an ``all`` asked for unchecked against the GPU's memory);
    ``args.encoder_ranks_decision`` then holds the decision (rank 0's line at start)."""
    if args.orch_config is None:
        return
    try:
        args.encoder_ranks_decision = decide_encoder_ranks_of_args(args, summary.phases, summary.parameters)
    except ValueError as err:
        raise ArgumentError(str(err)) from None


def _check_mixture_of_experts(args: argparse.Namespace) -> None:
    """Expert parallelism and the MoE flags against the backbone (the task's model and the shape flags);
    with post-balancing, the settings whose losses would change with an example's placement are refused
    (:func:`~megatron_orch.megatron.moe.placement_dependent_moe_settings`)."""
    from megatron_orch.megatron.moe import placement_dependent_moe_settings

    num_experts, ep = args.model_summary.num_experts, args.expert_model_parallel_size
    if num_experts is None:
        if ep > 1:
            raise ArgumentError(f"--expert-model-parallel-size {ep} needs a mixture-of-experts backbone "
                                "(--num-experts, or a --model-config whose backbone has num_experts)")
        return
    if num_experts % ep or args.data_parallel_size % ep:
        raise ArgumentError(f"--expert-model-parallel-size {ep} must divide the {num_experts} experts and the "
                            f"data-parallel size {args.data_parallel_size} (expert parallelism runs inside DP)")
    if args.tensor_model_parallel_size > 1:
        raise ArgumentError("the compact trainer runs an MoE backbone with TP 1 (megatron-core's MoE layer with "
                            "--tensor-model-parallel-size > 1 needs sequence parallelism, not tested here with MoE); "
                            "use --orch-trainer megatron-lm")
    if args.use_torch_fsdp2 and ep > 1:
        raise ArgumentError("--use-torch-fsdp2 with --expert-model-parallel-size > 1 (not supported by "
                            "megatron-core's FSDP2 wrapper, as in Megatron-LM)")
    if args.orch_config is not None:
        problems = placement_dependent_moe_settings(args, packed=args.orch_config.microbatching == "packed")
        if problems:
            raise ArgumentError("with --orch-post-balancing, the MoE backbone's results would change with where an "
                                "example runs: " + "; ".join(problems))


def _check_overlap(args: argparse.Namespace) -> None:
    """Megatron DDP's overlapped gradient reduction and parameter gather, combined as Megatron-LM combines them;
    the compact trainer overlaps Megatron DDP only (not FSDP2 or Megatron-FSDP)."""
    sharded = [f"--{flag.replace('_', '-')}" for flag in ("use_torch_fsdp2", "use_megatron_fsdp")
               if getattr(args, flag)]
    if sharded and args.overlap_grad_reduce:
        raise ArgumentError(f"--overlap-grad-reduce with {sharded[0]}: the compact trainer overlaps Megatron DDP's "
                            "reduction only; drop the flag (the numerics are the same)")
    if args.overlap_param_gather and not (args.use_distributed_optimizer and args.overlap_grad_reduce):
        raise ArgumentError("--overlap-param-gather needs --use-distributed-optimizer (it gathers the optimizer's "
                            "shards) and --overlap-grad-reduce (as in Megatron-LM)")
    if args.ddp_bucket_size is not None and not args.overlap_grad_reduce:
        raise ArgumentError("--ddp-bucket-size needs --overlap-grad-reduce (without it Megatron DDP reduces all "
                            "gradients in one bucket)")


def _check_sharded_data_parallel(args: argparse.Namespace) -> None:
    """FSDP2 or Megatron-FSDP, as Megatron-LM combines them with the other flags; what the compact trainer
    does not do with them (model parallelism, its checkpoints of whole parameters per rank) is refused."""
    sharded = [flag for flag in ("use_torch_fsdp2", "use_megatron_fsdp") if getattr(args, flag)]
    if not sharded:
        if args.data_parallel_sharding_strategy != "optim_grads_params":
            raise ArgumentError("--data-parallel-sharding-strategy is Megatron-FSDP's: it needs --use-megatron-fsdp")
        return
    flags = " and ".join(f"--{flag.replace('_', '-')}" for flag in sharded)
    if len(sharded) > 1:
        raise ArgumentError(f"{flags} exclude each other (torch FSDP2 or Megatron-FSDP)")
    if args.use_torch_fsdp2 and args.use_distributed_optimizer:
        raise ArgumentError("--use-torch-fsdp2 shards the optimizer state itself: it does not take "
                            "--use-distributed-optimizer (as in Megatron-LM)")
    if args.use_torch_fsdp2 and args.data_parallel_sharding_strategy != "optim_grads_params":
        raise ArgumentError("--data-parallel-sharding-strategy is Megatron-FSDP's: torch FSDP2 shards parameters, "
                            "gradients and optimizer state")
    if args.use_megatron_fsdp:
        args.use_distributed_optimizer = True  # Megatron-LM: Megatron-FSDP runs the distributed optimizer
        if args.optimizer != "adam":
            raise ArgumentError(f"--use-megatron-fsdp runs the distributed optimizer, which megatron-core builds for "
                                f"--optimizer adam only, got {args.optimizer}")
    if args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1 or args.context_parallel_size > 1:
        raise ArgumentError(f"{flags}: the compact trainer shards over data parallelism only (TP 1, PP 1, CP 1); "
                            "sharding with TP, PP or CP runs under --orch-trainer megatron-lm")
    for flag in ("save", "load"):
        if getattr(args, flag) is not None:
            raise ArgumentError(f"--{flag} with {flags}: the compact trainer's checkpoints hold whole parameters per "
                                "rank; sharded checkpoints are Megatron-LM's (--orch-trainer megatron-lm)")


def _check_sequence_split(args: argparse.Namespace) -> None:
    """Sequence parallelism needs TP; a row's length is padded to a multiple of 2 x CP (x TP with SP), which
    ``--seq-length`` must be (Megatron-LM asks 2 x CP of it; rows are exactly that long with PP)."""
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        raise ArgumentError("--sequence-parallel needs --tensor-model-parallel-size > 1 (it splits the sequence "
                            "over the TP ranks)")
    cp, tp = args.context_parallel_size, args.tensor_model_parallel_size
    multiple = (2 * cp if cp > 1 else 1) * (tp if args.sequence_parallel else 1)
    if args.seq_length % multiple:
        parts = ([f"2 x --context-parallel-size {cp}"] if cp > 1 else []) + (
            [f"--tensor-model-parallel-size {tp} (--sequence-parallel)"] if args.sequence_parallel else [])
        raise ArgumentError(f"--seq-length {args.seq_length} is not a multiple of {' x '.join(parts)} = {multiple}")


def _resolve_transformer_impl(args: argparse.Namespace) -> None:
    """Default: Transformer Engine's layers on GPUs when it imports, else the local ones."""
    if args.transformer_impl is None:
        use_te = not runs_on_cpu(args) and transformer_engine_available()
        args.transformer_impl = "transformer_engine" if use_te else "local"
    elif args.transformer_impl == "transformer_engine":
        if not transformer_engine_available():
            raise ArgumentError("--transformer-impl transformer_engine: Transformer Engine does not import here "
                                "(import transformer_engine failed); use --transformer-impl local")
        if runs_on_cpu(args):
            raise ArgumentError("--transformer-impl transformer_engine needs GPUs (--distributed-backend nccl); "
                                "a gloo run trains on CPU: use --transformer-impl local")
    if args.context_parallel_size > 1 and args.transformer_impl == "local" and not runs_on_cpu(args):
        raise ArgumentError(f"--context-parallel-size {args.context_parallel_size} on GPUs runs Transformer Engine's "
                            "context-parallel attention (as Megatron does): use --transformer-impl transformer_engine; "
                            "--transformer-impl local's context-parallel attention is the CPU path (it gathers "
                            "every key and value)")


def check_command_line(task: TrainingTask, argv: Optional[Sequence[str]] = None) -> None:
    """Check a command line of ``task`` for a launch of ``$WORLD_SIZE`` processes (default 1), its data
    included (:attr:`~megatron_orch.trainer.task.TrainingTask.check_data`); return if it is fine, else exit
    with status 2 and the error (a task's entry point runs it before torchrun)."""
    check_data_or_exit(parse_args_or_exit(task, argv, world_size=int(os.environ.get("WORLD_SIZE", "1"))), task)
