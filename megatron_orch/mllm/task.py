"""This project's multimodal LLM as a task of the compact trainer (:data:`MLLM_TASK`, a
:class:`~megatron_orch.trainer.task.TrainingTask`), plugged in by ``pretrain_mllm.py`` as a user's model
would be; and its flags, which Megatron-LM's ``pretrain`` takes as ``extra_args_provider``
(:func:`add_mllm_args`).

Parsing and :func:`configure` import neither torch nor megatron; the hooks that build (the model, the
data iterator, post-balancing) import :mod:`~megatron_orch.mllm.providers` when first called.
``python -m megatron_orch.mllm.task FLAGS...`` checks a ``pretrain_mllm.py`` command line for a launch of
``$WORLD_SIZE`` processes, its ``--data-path`` line by line (the launch scripts do, before torchrun).
"""
from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

from megatron_orch.megatron.orch_arguments import add_orch_args
from megatron_orch.mllm import megatron_flags
from megatron_orch.mllm.check_data import add_data_args
from megatron_orch.mllm.config import MLLMConfig, is_shipped_config, load_model_config
from megatron_orch.mllm.files import data_path_problem
from megatron_orch.trainer.arguments import (BACKBONE_SHAPE_FLAGS, ArgumentError, check_command_line,
                                             check_in_range, check_positive, exit_with_error, new_parser)
from megatron_orch.trainer.data_events import add_max_bad_examples_arg
from megatron_orch.trainer.task import ModelSummary, TrainingTask

PROGRAM = "pretrain_mllm.py"
TRAINERS = ("compact", "megatron-lm")
# Model-config fields that only describe it (a YAML path and a shipped name can hold the same model).
_DESCRIPTIVE_MODEL_FIELDS = ("name", "shaped_after")


def add_trainer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--orch-trainer", choices=TRAINERS, default="compact",
                        help="which training loop runs: compact (this project's, on megatron-core: CPU or GPUs) or "
                             "megatron-lm (Megatron-LM's own megatron.training.pretrain: GPUs, Megatron-LM's flags)")


def trainer_of(argv: Sequence[str]) -> str:
    """The ``--orch-trainer`` of a command line (the full parsers check the rest); a bad value exits with
    :func:`~megatron_orch.trainer.arguments.exit_with_error`. Imports neither torch nor megatron."""
    parser = new_parser(PROGRAM, add_help=False)
    add_trainer_arg(parser)
    try:
        return parser.parse_known_args(argv)[0].orch_trainer
    except ArgumentError as err:
        exit_with_error(str(err), PROGRAM)


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The MLLM's own flags: the trainer, which multimodal model, and the data's limits."""
    g = parser.add_argument_group("multimodal model")
    add_trainer_arg(g)
    g.add_argument("--model-config", type=str, default="tiny",
                   help="name in configs/ (tiny, mllm_10b, ...) or a YAML path; the shape flags above "
                        "override its backbone")
    add_max_bad_examples_arg(add_data_args(parser))
    return parser


def add_mllm_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """This project's flags: the trainer, which multimodal model, and the ``--orch-*`` post-balancing group
    (Megatron-LM's ``extra_args_provider``; the compact trainer adds the ``--orch-*`` group itself)."""
    return add_orch_args(add_model_args(parser))


# Megatron DDP's overlapped reduction starts a bucket once each of its parameters reported a gradient in the last
# micro-batch, and asserts after the first step that every parameter did. Without post-balancing the encoders run
# inside each micro-batch and skip one without images or audio (post-balancing runs every encoder once per step).
OVERLAP_NEEDS_POST_BALANCING = (
    "--overlap-grad-reduce without --orch-post-balancing is not supported: an encoder skipped by a last micro-batch "
    "without images or audio reports no gradients, which Megatron DDP's overlapped reduction asserts against; drop "
    "the flag (the numerics are the same) or add --orch-post-balancing")


def configure(args: argparse.Namespace) -> ModelSummary:
    """The MLLM's checks of a parsed command line: its data flags, ``--data-path``, ``--overlap-grad-reduce``
    (:data:`OVERLAP_NEEDS_POST_BALANCING`), and ``--model-config`` with the backbone shape flags applied
    (``args.mllm_config``, which its hooks build from)."""
    if args.overlap_grad_reduce and not args.orch_post_balancing:
        raise ArgumentError(OVERLAP_NEEDS_POST_BALANCING)
    check_positive(args, "max_num_tiles", "max_image_pixels", "max_vision_items_per_sample")
    check_in_range(args, "max_audio_seconds", 0.0, low_open=True)
    problem = None if args.data_path is None else data_path_problem(args.data_path)
    if problem is not None:
        raise ArgumentError(f"--data-path {args.data_path}: {problem}")
    args.mllm_config = config = resolve_model_config(args)
    backbone = config.backbone.transformer
    return ModelSummary(name=config.name, num_layers=backbone.num_layers, phases=config.phases(),
                        num_experts=backbone.num_experts, verify_first_step=not is_shipped_config(args.model_config),
                        parameters=config.phase_parameters())


def resolve_model_config(args: argparse.Namespace) -> MLLMConfig:
    """``--model-config`` with the backbone shape flags applied, checked against the parallel sizes."""
    try:
        loaded = load_model_config(args.model_config)
    except (OSError, ValueError, TypeError) as err:  # missing file, bad YAML or fields
        raise ArgumentError(f"--model-config {args.model_config}: {err}") from None
    config = backbone_overrides(loaded, args)
    backbone = config.backbone
    if backbone.transformer.num_layers % args.pipeline_model_parallel_size:
        raise ArgumentError(f"the backbone's {backbone.transformer.num_layers} layers (--num-layers) are not "
                            f"divisible by --pipeline-model-parallel-size {args.pipeline_model_parallel_size}")
    _check_tensor_parallel(config, args.tensor_model_parallel_size)
    if args.seq_length > backbone.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} exceeds the backbone's max_position_embeddings "
                            f"({backbone.max_position_embeddings})")
    return config


def backbone_overrides(config: MLLMConfig, args: argparse.Namespace) -> MLLMConfig:
    """``config`` with the backbone shape flags and ``--max-position-embeddings`` given on the command line applied."""
    changes = {flag: getattr(args, flag) for flag in BACKBONE_SHAPE_FLAGS  # each names its TransformerShape field
               if getattr(args, flag) is not None}
    backbone = config.backbone
    if changes:
        try:
            backbone = dataclasses.replace(backbone, transformer=dataclasses.replace(backbone.transformer, **changes))
        except ValueError as err:
            raise ArgumentError(f"backbone shape flags {changes}: {err}") from None
    if args.max_position_embeddings is not None:
        backbone = dataclasses.replace(backbone, max_position_embeddings=args.max_position_embeddings)
    return config if backbone is config.backbone else dataclasses.replace(config, backbone=backbone)


def _check_tensor_parallel(config: MLLMConfig, tp: int) -> None:
    """Megatron splits heads, query groups and FFN columns over TP ranks: each must divide."""
    stacks = {"backbone": config.backbone.transformer}
    stacks.update({f"encoders.{name}": encoder.transformer for name, encoder in config.encoders.items()})
    for where, shape in stacks.items():
        for field in ("num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            value = getattr(shape, field)
            if value is not None and value % tp:
                raise ArgumentError(f"{where}.{field}={value} is not divisible by "
                                    f"--tensor-model-parallel-size {tp}")
    for name, encoder in config.encoders.items():
        if encoder.projector_ffn_hidden_size % tp:
            raise ArgumentError(f"encoders.{name}.projector_ffn_hidden_size={encoder.projector_ffn_hidden_size} is "
                                f"not divisible by --tensor-model-parallel-size {tp}")


def check_data(args: argparse.Namespace) -> None:
    """With ``--data-path``: parse and check the manifest line by line, and that it holds every sample the
    run consumes (an Energon dataset: its metadata and sample type). Imports torch. (The synthetic default
    is checked where the ranks build it.)"""
    if args.data_path is None:
        return
    from megatron_orch.mllm.data import checked_dataset
    from megatron_orch.mllm.data_config import data_config
    checked_dataset(data_config(args))


def model_identity(args: argparse.Namespace) -> dict:
    """The model config's fields (but those that only describe it), and the backbone's megatron-core class:
    GPTModel's and HybridModel's parameters are named differently."""
    from megatron_orch.mllm.model import BACKBONE_MODULE
    return {**_flatten(dataclasses.asdict(args.mllm_config)), "backbone.module": BACKBONE_MODULE}


def data_identity(args: argparse.Namespace) -> Optional[dict]:
    """What identifies the content of ``--data-path`` (a manifest's or an Energon dataset's); None: synthetic."""
    if not args.data_path:
        return None
    from megatron_orch.mllm.data import data_identity as identity
    return identity(args.data_path)


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        elif prefix or key not in _DESCRIPTIVE_MODEL_FIELDS:
            out[f"{prefix}{key}"] = value
    return out


def _provider(name: str):
    """:mod:`megatron_orch.mllm.providers`' function ``name``, imported (with torch and megatron) when called."""
    def hook(*args, **kwargs):
        from megatron_orch.mllm import providers
        return getattr(providers, name)(*args, **kwargs)
    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"megatron_orch.mllm.providers.{name}"
    return hook


def _forward_step(data_iterator, model):
    """:func:`megatron_orch.megatron.contract.forward_step` (the MLLM has no path of its own), imported when called."""
    from megatron_orch.megatron.contract import forward_step
    return forward_step(data_iterator, model)


MLLM_TASK = TrainingTask(
    program=PROGRAM, description="Train the multimodal LLM with megatron-core.",
    add_arguments=add_model_args, configure=configure,
    build_model=_provider("build_model"), forward_step=_forward_step,
    build_train_data_iterator=_provider("build_train_data_iterator"),
    build_post_balancing=_provider("build_post_balancing"),
    model_identity=model_identity, data_identity=data_identity, check_data=check_data,
    explain_flag=megatron_flags.compact_trainer_reason)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Check a ``pretrain_mllm.py`` command line for a launch of ``$WORLD_SIZE`` processes (default 1),
    including its ``--data-path`` manifest, line by line; exit 0 if it is fine, else 2 with the error."""
    from megatron_orch import quiet_megatron_core_warnings
    quiet_megatron_core_warnings()  # an Energon dataset's check imports megatron-core
    check_command_line(MLLM_TASK, argv)


if __name__ == "__main__":
    main()
