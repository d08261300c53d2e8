"""The ``--orch-*`` flags (Megatron's ``extra_args_provider`` convention) and the config they build."""
from __future__ import annotations

import argparse
import os
from typing import Mapping, Optional

from megatron_orch.balance.cost_profile import load_cost_profile
from megatron_orch.balance.plan import ALL_TO_ALL
from megatron_orch.balance.registry import PARTITIONERS, PLACEMENTS
from megatron_orch.balance.workload import ModelPhases
from megatron_orch.orchestrator.config import (MICROBATCHING, ConfigError, EncoderRanks, OrchestratorConfig,
                                               config_setting)
from megatron_orch.orchestrator.encoder_ranks import EncoderRanksDecision, decide_encoder_ranks, unsupported_layout
from megatron_orch.orchestrator.gpu_memory import GB, ParallelLayout, encoder_ranks_all_refusal

# The flag of each OrchestratorConfig field a command line sets: its errors name the flag (:func:`flag_message`).
CONFIG_FLAGS = {"phases": "--orch-phases", "algorithm": "--orch-algorithm", "microbatching": "--orch-microbatching",
                "placement": "--orch-placement", "placement_time_limit_s": "--orch-placement-time-limit",
                "gpus_per_node": "--orch-gpus-per-node", "encoder_chunk_tokens": "--orch-encoder-chunk-tokens",
                "encoder_memory_cap": "--orch-encoder-memory-cap", "encoder_recompute": "--orch-encoder-recompute",
                "cost_profile": "--orch-cost-profile", "context_parallel_size": "--context-parallel-size",
                "all_to_all": "--orch-all-to-all", "exchange_alike": "--orch-exchange-alike",
                "encoder_ranks": "--orch-encoder-ranks",
                "encoder_tensor_parallel_size": "--orch-encoder-tensor-parallel-size"}


def flag_message(error: BaseException) -> str:
    """An error's message as a command line says it: a :class:`ConfigError` names the flag, not the field."""
    return error.naming(CONFIG_FLAGS) if isinstance(error, ConfigError) else str(error)


def flag_setting(field: str, value: Optional[str] = None) -> str:
    """A setting as a command line names it (the planning layer's messages take it as their ``naming``): the flag
    of the :class:`OrchestratorConfig` field, and its value (``--orch-encoder-ranks all``)."""
    flag = CONFIG_FLAGS.get(field)
    if flag is None:
        return config_setting(field, value)
    return flag if value is None else f"{flag} {value}"


# The flags that take a value with a default of their own: None when not given (so that one given without
# --orch-post-balancing is refused like the others, even at its default value), these once it is on.
_DEFAULTS = {"orch_algorithm": "auto", "orch_microbatching": "auto", "orch_placement": "exact",
             "orch_placement_time_limit": 1.0, "orch_all_to_all": OrchestratorConfig.all_to_all,
             "orch_encoder_ranks": EncoderRanks.AUTO.value}


def add_orch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``--orch-*`` flags; the partitioner and placement choices are the registries' at this call
    (:mod:`megatron_orch.balance.registry`: register a user's before the parser is built)."""
    g = parser.add_argument_group("post-balancing (megatron-orch)")
    g.add_argument("--orch-post-balancing", action="store_true",
                   help="master switch: rebalance every phase across DP ranks after the global batch is "
                        "drawn (off = upstream Megatron behaviour)")
    g.add_argument("--orch-shadow", action="store_true",
                   help="shadow mode, instead of --orch-post-balancing: plan every step and log what balancing would "
                        "gain (each phase's cost max/mean before->after, the MB it would move, the modeled step time "
                        "saved) while training on the loader's assignment, moving nothing")
    g.add_argument("--orch-verify-first-step", action="store_true",
                   help="run the first step, and the first with items of each encoder phase, in the loader's "
                        "(upstream) and in the balanced layout on the same batch, in training mode, stop unless "
                        "losses, gradient norms and encoder outputs agree within the dtype's tolerance, then train "
                        "on the balanced one (default: on for a model config outside configs/)")
    g.add_argument("--orch-no-verify-first-step", action="store_true",
                   help="do not check the first step (the default for the configs in configs/)")
    g.add_argument("--orch-phases", type=str, default=None,
                   help="comma-separated names of the phases to rebalance, as the model's configuration names "
                        "them; default: every phase of the model")
    g.add_argument("--orch-algorithm", choices=PARTITIONERS.names(), default=None,
                   help="partitioner of the encoder phases (and of the backbone when packed); auto (default): a "
                        "phase whose items all cost the same (the model's tiles, frames, audio windows) is spread "
                        "by count, each rank keeping its own items up to ceil(n/DP) and the rest filling its node "
                        "first (optimal balance and bytes); otherwise the best of the built-in ones. "
                        + PARTITIONERS.describe().replace("%", "%%"))
    g.add_argument("--orch-microbatching", choices=MICROBATCHING, default=None,
                   help="packed: one packed row per backbone micro-batch with a variable number of examples "
                        "(each attends to itself only); equal_count: micro-batch-size examples per micro-batch; "
                        "auto (default): packed where the model's BatchSpec says it takes packed rows "
                        "(takes_packed_rows), else equal_count (the reason is logged once: pipeline parallelism; a "
                        "model that does not say so; a MimoModel on megatron-core 0.16.1, or on 0.19 with a "
                        "language model of local `DotProductAttention` or CP)")
    g.add_argument("--orch-locality", action="store_true",
                   help="locality-aware balancing: within 1%% of the plain plan's balance, keep items on their "
                        "node/GPU (every phase: backbone examples move between nodes first, then "
                        "inside them; encoder phases of equal items are planned this way already)")
    g.add_argument("--orch-exchange-alike", action="store_true",
                   help="exchange backbone examples alike in cost, length and items between the balanced ranks so "
                        "each rank pulls from fewer ranks (fewer all-to-all peers, fewer bytes across nodes, the "
                        "same balance); it adds 7-18%% to the planner's CPU time at DP 512-2560")
    g.add_argument("--orch-placement", choices=PLACEMENTS.names(), default=None,
                   help="bins -> ranks (default exact). " + PLACEMENTS.describe().replace("%", "%%"))
    g.add_argument("--orch-placement-time-limit", type=float, default=None,
                   help="seconds for the minmax placement solver (default 1)")
    g.add_argument("--orch-all-to-all", choices=ALL_TO_ALL, default=None,
                   help=f"how post-balancing's transfers run (default {OrchestratorConfig.all_to_all}): flat, one "
                        "all-to-all over the DP group (a rank's peers: any rank of it); node-wise, within the "
                        "source's node, then between ranks of the same local index on other nodes (at most "
                        "GPUs per node - 1 + nodes - 1 peers a rank, so fewer NCCL connections; the same outputs)")
    g.add_argument("--orch-gpus-per-node", type=int, default=None,
                   help="GPUs per node for the topology (default: torchrun's LOCAL_WORLD_SIZE)")
    g.add_argument("--orch-no-background-planning", action="store_true",
                   help="plan on the training thread instead of overlapping with the previous step")
    g.add_argument("--orch-encoder-chunk-tokens", type=int, default=None, metavar="N",
                   help="run each rank's items of an encoder phase in chunks of at most N encoder tokens (whole "
                        "items); default: as many items as --orch-encoder-memory-cap holds, without a cap as many "
                        "as upstream's busiest micro-batch of encoders holds")
    g.add_argument("--orch-encoder-memory-cap", type=float, default=None, metavar="GB",
                   help="modeled activation memory (10^9 bytes) a rank may hold: encoder chunks kept through the "
                        "backbone beside its largest micro-batch, or one recomputed chunk (the rest are recomputed "
                        "for their backward, replaying the RNG); default: upstream's peak at the same global "
                        "batch; inf: keep every chunk")
    g.add_argument("--orch-encoder-recompute", action="store_true",
                   help="keep no encoder activations through the backbone: every chunk is recomputed for its "
                        "backward (least memory, one more encoder forward)")
    g.add_argument("--orch-encoder-ranks", choices=[ranks.value for ranks in EncoderRanks], default=None,
                   help="which ranks hold and run the encoders (and projectors): first-stage (Megatron's layout: the "
                        "first pipeline stage's, items balanced over DP), all (every pipeline stage's, items balanced "
                        "over DP x PP x TP / --orch-encoder-tensor-parallel-size, their outputs sent to the first "
                        "stage) or auto (default: all where it differs from first-stage, the layout and the trainer "
                        "run it and the per-GPU memory model says it fits, else first-stage; rank 0 says which and "
                        "why)")
    g.add_argument("--orch-encoder-tensor-parallel-size", type=int, default=None, metavar="N",
                   help="with --orch-encoder-ranks all (or auto, where it picks all), the encoders' own "
                        "tensor-parallel size (default: "
                        "--tensor-model-parallel-size; it must divide it): each TP group then holds TP / N encoder "
                        "replicas and the encoder phases are balanced over DP x PP x TP / N of them")
    g.add_argument("--orch-gpu-memory-gb", type=float, default=None, metavar="GB",
                   help="memory of one GPU (10^9 bytes) that --orch-encoder-ranks all must fit: refused before any "
                        "collective where the per-GPU model (parameters, gradients, optimizer state and the "
                        "backbone's activations of micro-batches of --seq-length; megatron_orch.orchestrator."
                        "gpu_memory) exceeds it (auto then picks first-stage); default: the device's memory where "
                        "a GPU is visible, else no check")
    g.add_argument("--orch-cost-profile", type=str, default=None, metavar="PROFILE.yaml",
                   help="balance item costs measured on the device (python -m megatron_orch.bench.calibrate) "
                        "instead of training FLOPs from the model's shape; refused unless measured on this "
                        "model's shape")
    return parser


def orch_config_from_args(args: argparse.Namespace, verify_by_default: bool = False) -> Optional[OrchestratorConfig]:
    """The orchestrator config of a parsed command line (None when post-balancing and shadow mode are off).
    ``verify_by_default``: whether the first step is checked without ``--orch-verify-first-step`` (a model of
    the caller's own making; the shipped configs are tested against upstream already).

    Inconsistent flags raise ValueError naming them, e.g. an ``--orch-*`` flag given without the switch. With
    the switch, the flags of :data:`_DEFAULTS` not given are set to their defaults in ``args``.
    """
    defaults = add_orch_args(argparse.ArgumentParser()).parse_args([])
    if args.orch_post_balancing and args.orch_shadow:
        raise ValueError("--orch-shadow and --orch-post-balancing exclude each other (shadow mode plans without "
                         "moving anything; post-balancing moves): give one")
    if args.orch_verify_first_step and args.orch_no_verify_first_step:
        raise ValueError("--orch-verify-first-step and --orch-no-verify-first-step exclude each other")
    if not (args.orch_post_balancing or args.orch_shadow):
        changed = [name for name, value in vars(defaults).items() if getattr(args, name) != value]
        if changed:
            flags = ", ".join("--" + name.replace("_", "-") for name in changed)
            raise ValueError(f"{flags} given without --orch-post-balancing (which turns post-balancing on) or "
                             "--orch-shadow")
        return None
    sharded = [f"--{name.replace('_', '-')}" for name in ("use_torch_fsdp2", "use_megatron_fsdp")
               if getattr(args, name, False)]
    if sharded and args.orch_verify_first_step:
        raise ValueError(f"--orch-verify-first-step with {sharded[0]}: the checked first step compares each rank's "
                         "own gradients and encodes outside the wrapper's collectives, which sharded parameters do "
                         "not allow (not supported; without it the first step is not checked)")
    all_ranks = args.orch_encoder_ranks == EncoderRanks.ALL.value
    verify = not sharded and (args.orch_verify_first_step
                              or (verify_by_default and not args.orch_no_verify_first_step))
    etp = args.orch_encoder_tensor_parallel_size
    if all_ranks and (args.pipeline_model_parallel_size > 1 or etp is not None) and not args.orch_shadow:
        refused = encoder_ranks_unsupported(args)
        if refused is not None:
            raise ValueError(refused)
    if args.orch_gpu_memory_gb is not None and not args.orch_gpu_memory_gb > 0:
        raise ValueError(f"--orch-gpu-memory-gb must be > 0, got {args.orch_gpu_memory_gb}")
    phases = None if args.orch_phases is None else tuple(p.strip() for p in args.orch_phases.split(",") if p.strip())
    try:
        config = _config(args, phases, verify)
    except ConfigError as err:
        raise ValueError(flag_message(err)) from None
    _check_gpus_per_node(config.gpus_per_node, getattr(args, "world_size", None),
                         os.environ.get("LOCAL_WORLD_SIZE"))
    if config.microbatching == "packed" and args.pipeline_model_parallel_size > 1:
        raise ValueError("--orch-microbatching packed with --pipeline-model-parallel-size > 1 is not "
                         "supported: 1F1B needs fixed-shape micro-batches (use equal_count)")
    return config


def encoder_ranks_unsupported(args: argparse.Namespace) -> Optional[str]:
    """Why the parallel layout of a checked command line cannot put the encoders on every rank (None: it can;
    :func:`~megatron_orch.orchestrator.encoder_ranks.unsupported_layout`)."""
    sharded = [f"--{name.replace('_', '-')}" for name in ("use_torch_fsdp2", "use_megatron_fsdp")
               if getattr(args, name, False)]
    return unsupported_layout(
        sharded=sharded[0] if sharded else None, tensor_parallel_size=getattr(args, "tensor_model_parallel_size", 1),
        encoder_tensor_parallel_size=args.orch_encoder_tensor_parallel_size, naming=flag_setting)


def encoder_memory_refusal(args: argparse.Namespace, config: OrchestratorConfig, phases: ModelPhases,
                           parameters: Mapping[str, int], device_memory_bytes: Optional[float]) -> Optional[str]:
    """Why ``--orch-encoder-ranks all`` (asked, or ``auto`` deciding) does not fit one GPU (None: it fits, or
    nothing to check), one line naming the bytes
    (:func:`~megatron_orch.orchestrator.gpu_memory.encoder_ranks_all_refusal`): against ``--orch-gpu-memory-gb``,
    else ``device_memory_bytes`` (None: no GPU visible, no check). ``parameters``: each phase's parameter count."""
    if config.encoder_ranks is EncoderRanks.FIRST_STAGE or config.shadow:
        return None
    given = args.orch_gpu_memory_gb
    layout = ParallelLayout(
        args.data_parallel_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size, "all",
        config.encoder_tensor_parallel_size,
        distributed_optimizer=bool(args.use_distributed_optimizer),
        sequence_parallel=bool(args.sequence_parallel))
    return encoder_ranks_all_refusal(layout, parameters, phases, args.seq_length, args.micro_batch_size,
                                     args.num_microbatches, device_memory_bytes if given is None else given * GB,
                                     limit="--orch-gpu-memory-gb" if given is not None else "the GPU's memory",
                                     naming=flag_setting)


def decide_encoder_ranks_of_args(args: argparse.Namespace, phases: ModelPhases,
                                 parameters: Optional[Mapping[str, int]],
                                 unavailable: Optional[str] = None) -> EncoderRanksDecision:
    """The encoder layout of a checked command line, decided before the model is built; ``args.orch_config`` and
    ``args.orch_encoder_ranks`` (what a checkpoint records) are set to it. ``--orch-encoder-ranks all`` where the
    per-GPU memory model says it does not fit (``--orch-gpu-memory-gb``, else the visible GPU's memory;
    ``parameters``, each phase's parameter count, None: not checked) raises ValueError naming the bytes; ``auto`` is
    decided by :func:`~megatron_orch.orchestrator.encoder_ranks.decide_encoder_ranks` (first-stage where
    ``unavailable`` or :func:`encoder_ranks_unsupported` says why not, where it does not fit, or where
    ``parameters`` is None)."""
    config = args.orch_config
    device = None
    if args.orch_gpu_memory_gb is None and config.encoder_ranks is not EncoderRanks.FIRST_STAGE:
        import torch  # the visible GPU's memory is the limit
        if torch.cuda.is_available():
            device = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory

    def memory_refusal():
        if parameters is None:
            return None if config.encoder_ranks is EncoderRanks.ALL else (
                "the task gives no parameter counts (ModelSummary.parameters) for the per-GPU memory model")
        return encoder_memory_refusal(args, config, phases, parameters, device)

    if config.encoders_on_every_stage:
        refused = memory_refusal()
        if refused is not None:
            raise ValueError(refused)
    limit = (f"--orch-gpu-memory-gb {args.orch_gpu_memory_gb:g}" if args.orch_gpu_memory_gb is not None
             else f"the GPU's {device / 1e9:.1f} GB" if device is not None else None)
    decision = decide_encoder_ranks(
        config, pipeline_parallel_size=args.pipeline_model_parallel_size,
        tensor_parallel_size=args.tensor_model_parallel_size,
        unavailable=unavailable if unavailable is not None else encoder_ranks_unsupported(args),
        memory_refusal=memory_refusal,
        memory=f"fits {limit} (per-GPU memory model)" if limit else "per-GPU memory not checked (no GPU visible, "
                                                                    "no --orch-gpu-memory-gb)")
    args.orch_config = config.with_encoder_ranks(decision.ranks)
    args.orch_encoder_ranks = decision.ranks.value
    return decision


def _config(args: argparse.Namespace, phases, verify: bool) -> OrchestratorConfig:
    """The :class:`OrchestratorConfig` the flags of a checked command line set."""
    return OrchestratorConfig(
        phases=phases, algorithm=_default_if_not_given(args, "orch_algorithm"),
        microbatching=_default_if_not_given(args, "orch_microbatching"), locality=args.orch_locality,
        exchange_alike=args.orch_exchange_alike,
        placement=_default_if_not_given(args, "orch_placement"),
        placement_time_limit_s=_default_if_not_given(args, "orch_placement_time_limit"),
        gpus_per_node=args.orch_gpus_per_node, all_to_all=_default_if_not_given(args, "orch_all_to_all"),
        background=not args.orch_no_background_planning, encoder_recompute=args.orch_encoder_recompute,
        encoder_chunk_tokens=args.orch_encoder_chunk_tokens,
        encoder_memory_cap=None if args.orch_encoder_memory_cap is None else args.orch_encoder_memory_cap * 1e9,
        cost_profile=None if args.orch_cost_profile is None else load_cost_profile(args.orch_cost_profile),
        shadow=args.orch_shadow, verify_first_step=verify and not args.orch_shadow,
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        encoder_ranks=EncoderRanks(_default_if_not_given(args, "orch_encoder_ranks")),
        encoder_tensor_parallel_size=args.orch_encoder_tensor_parallel_size)


def _default_if_not_given(args: argparse.Namespace, name: str):
    """``args.<name>``, set to its default (:data:`_DEFAULTS`) first where the flag was not given."""
    if getattr(args, name) is None:
        setattr(args, name, _DEFAULTS[name])
    return getattr(args, name)


def _check_gpus_per_node(gpus_per_node: Optional[int], world_size: Optional[int],
                         local_world_size: Optional[str]) -> None:
    """``--orch-gpus-per-node`` must fill nodes with whole numbers of ranks (ranks are numbered node by node,
    so it divides the world size; with no model parallelism that is the DP size) and, under torchrun,
    agree with the processes it started on this node (``LOCAL_WORLD_SIZE``)."""
    if gpus_per_node is None:
        return
    if world_size is not None and world_size % gpus_per_node:
        raise ValueError(f"--orch-gpus-per-node {gpus_per_node} does not divide the world size {world_size}: "
                         "nodes must hold whole numbers of ranks")
    if local_world_size and int(local_world_size) != gpus_per_node:
        raise ValueError(f"--orch-gpus-per-node {gpus_per_node} disagrees with the {local_world_size} processes "
                         "torchrun started on this node (LOCAL_WORLD_SIZE); leave the flag out to use it")
