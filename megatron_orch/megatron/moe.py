"""Which settings of a mixture-of-experts backbone keep a post-balanced run equal to upstream's.

Post-balancing moves whole examples between DP ranks and regroups them into other micro-batches; expert
parallelism (EP) runs inside the model replica and is left as it is (the MoE layer's token dispatch over
the EP group is the model's own all-to-all, not one of post-balancing's moves). What megatron-core's MoE
layer computes per token does not depend on which tokens share its micro-batch: the router's top-k choice,
the experts' outputs (dropless: no capacity), hence the token-level loss. So the rule is about the
load-balancing losses and the routing rules that look across tokens.

Placement-free, allowed with post-balancing:

* no load-balancing loss (``--moe-router-load-balancing-type none``, or a coefficient 0: Megatron-LM's
  default ``--moe-aux-loss-coeff 0.0``);
* ``seq_aux_loss``: the per-sequence loss (DeepSeek-V2/V3), summed over the rows of a micro-batch. A row is
  one example: equal-count micro-batches, and an MoE backbone's rows are ``--seq-length`` tokens each
  (:func:`pads_rows_to_seq_length`), so each example's loss is the same wherever it runs;
* the z-loss (``--moe-z-loss-coeff``): per token, over those same rows;
* (the expert bias, ``--moe-router-enable-expert-bias``, would be too: it is updated from the step's token
  counts per expert, summed over every micro-batch and the DP group; the MLLM does not build it, and the
  Megatron-LM launch refuses the flag with the others it does not read: ``megatron_orch.mllm.megatron_flags``.)

Placement-dependent, refused with post-balancing (:func:`placement_dependent_moe_settings`), naming each:

* ``aux_loss`` with a coefficient above 0, the micro-batch-level loss (GShard / Switch): its token counts per
  expert and mean router probabilities are over one micro-batch's tokens, so it changes with which
  examples share a micro-batch; use ``seq_aux_loss``;
* ``global_aux_loss``: its token counts are summed over the DP group micro-batch by micro-batch and averaged
  in order, so they change with which examples each rank's k-th micro-batch holds;
* ``sinkhorn`` routing (normalised over a micro-batch's tokens) and ``quantile_balancing`` (its bias update
  averages quantiles of each micro-batch's router logits);
* ``--moe-expert-capacity-factor``: which tokens an expert drops depends on the others routed to it;
* ``seq_aux_loss`` or the z-loss with packed micro-batches (``--orch-microbatching packed``): a packed row is
  one sequence of several examples to the router, and its padding tail changes with the packing.
"""
from __future__ import annotations

import argparse
from typing import List, Sequence, Tuple

PLACEMENT_FREE_BALANCING = ("seq_aux_loss", "none")


def balancing_losses(load_balancing_type, aux_loss_coeff) -> List[Tuple[str, float]]:
    """Megatron-LM's ``--moe-router-load-balancing-type`` and ``--moe-aux-loss-coeff`` (each one value or a
    list, one coefficient per type) as (type, coefficient) pairs."""
    types = [load_balancing_type] if isinstance(load_balancing_type, str) else list(load_balancing_type)
    coeffs = list(aux_loss_coeff) if isinstance(aux_loss_coeff, Sequence) else [aux_loss_coeff] * len(types)
    if len(coeffs) != len(types):
        raise ValueError(f"--moe-router-load-balancing-type {types} takes one --moe-aux-loss-coeff per type, got "
                         f"{coeffs}")
    return [(kind, float(coeff)) for kind, coeff in zip(types, coeffs)]


def pads_rows_to_seq_length(num_experts) -> bool:
    """Whether the backbone's rows are exactly ``--seq-length`` tokens: an MoE backbone's always (its
    per-sequence losses then count each example's own row, wherever it runs)."""
    return num_experts is not None


def placement_dependent_moe_settings(args: argparse.Namespace, packed: bool) -> List[str]:
    """The MoE settings of ``args`` (Megatron-LM's flag names) whose results would change with where
    post-balancing puts an example, each named with the reason; ``packed``: packed micro-batches."""
    problems = []
    for kind, coeff in balancing_losses(args.moe_router_load_balancing_type, args.moe_aux_loss_coeff):
        if kind == "aux_loss" and coeff > 0:
            problems.append(f"--moe-router-load-balancing-type aux_loss with --moe-aux-loss-coeff {coeff:g}: the "
                            "micro-batch-level load-balancing loss counts tokens per expert over one micro-batch, "
                            "so it changes with which examples share it; use seq_aux_loss (per sequence)")
        elif kind == "global_aux_loss" and coeff > 0:
            problems.append(f"--moe-router-load-balancing-type global_aux_loss: its token counts per expert are "
                            "summed over DP micro-batch by micro-batch and averaged in order, so they change with "
                            "which examples each rank's micro-batches hold; use seq_aux_loss")
        elif kind in ("sinkhorn", "quantile_balancing"):
            problems.append(f"--moe-router-load-balancing-type {kind}: the routing itself looks across a "
                            "micro-batch's tokens; use seq_aux_loss")
        elif kind == "seq_aux_loss" and coeff > 0 and packed:
            problems.append("--moe-router-load-balancing-type seq_aux_loss with --orch-microbatching packed: a "
                            "packed row is one sequence of several examples to the router; use equal-count "
                            "micro-batches")
    if getattr(args, "moe_expert_capacity_factor", None) is not None:
        problems.append(f"--moe-expert-capacity-factor {args.moe_expert_capacity_factor:g}: which tokens an expert "
                        "drops depends on the other tokens routed to it")
    if packed and getattr(args, "moe_z_loss_coeff", None):
        problems.append("--moe-z-loss-coeff with --orch-microbatching packed: a packed row's padding tail changes "
                        "with the packing; use equal-count micro-batches")
    return problems
