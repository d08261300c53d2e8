"""The contract between post-balancing and a model, in one place.

**Phases** (:class:`~megatron_orch.balance.workload.ModelPhases`): the model's encoder phases, any number
(:class:`~megatron_orch.balance.workload.EncoderPhase`: name, cost model, tokens one item runs, raw bytes
per item, output rows per item and bytes per row), and one backbone phase
(:class:`~megatron_orch.balance.workload.BackbonePhase`: name, cost model, bytes per token). Cost models
(:class:`~megatron_orch.balance.cost.CostModel`): FLOPs from a transformer's shape
(:class:`~megatron_orch.balance.cost.TransformerCost`), a measured profile
(:class:`~megatron_orch.balance.cost_profile.ProfileCost`, ``--orch-cost-profile``) or a user's function
(:class:`~megatron_orch.balance.cost.FunctionCost`). The names are the model's; ``--orch-phases`` takes them.

**Batches** (:class:`~megatron_orch.megatron.batch.BatchSpec`): the data iterator that post-balancing
wraps yields :class:`~megatron_orch.megatron.batch.MicroBatch` objects (``micro_batch_size`` examples
each, built by :func:`~megatron_orch.megatron.batch.collate`); each example holds int64
``tokens``/``labels``, a float ``loss_mask``, and per encoder phase its raw items ``items[phase]``
``[n, *item_shape]``, whose ``n * output_rows`` placeholders (the phase's ``placeholder_id``) sit in the
tokens in item order. Padded rows use the spec's ``pad_token_id``.

**Model** (:class:`BalanceableModel`, the module inside Megatron's DDP / Float16Module wrappers): its
encoders by phase name on the pipeline stage that holds them (every parameter that ``encode`` uses
belongs to its phase's module); ``encode(phase, items)`` runs one phase over any number of its items and
returns their rows item by item; ``forward(batch, embeds=None)`` runs the backbone with ``embeds[phase]``
inserted at that phase's placeholders (``embeds=None``: the model encodes ``batch.items`` itself, the
upstream path); ``model_type`` and ``set_input_tensor``, which megatron-core's schedules read
(:class:`MegatronModelMixin` provides both). Under sequence or context parallelism every rank of a DP replica
gets the whole micro-batch and ``forward`` returns the per-token loss of the rank's part of the sequence, in
megatron-core's layout (:class:`~megatron_orch.megatron.sequence_layout.SequenceLayout`). An encoder without
items on a rank in a step gets zero gradients (Megatron DDP's ``--overlap-grad-reduce`` needs every parameter
to report each step). :func:`check_model` refuses a model that lacks a member, naming it; the modality-aware
schedule checks the rest on the first step (:mod:`~megatron_orch.megatron.first_step`).

**forward_step** (Megatron's ``forward_step_func``): what ``next(data_iterator)`` returns is a
:class:`~megatron_orch.megatron.post_balancing.BalancedMicroBatch` under post-balancing (its ``batch``
has text only, its ``embeds`` the encoder outputs of its examples) and a plain ``MicroBatch`` upstream;
:func:`forward_step` handles both for any :class:`BalanceableModel`.

Megatron-Core's ``MimoModel`` meets the contract through :mod:`megatron_orch.megatron.mimo`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Iterator, List, Mapping, Optional, Protocol, Tuple, runtime_checkable

import torch
from megatron.core.enums import ModelType

from megatron_orch.megatron.batch import MicroBatch
from megatron_orch.megatron.post_balancing import BalancedMicroBatch, BalancedStep, stock_schedule_error
from megatron_orch.megatron.sequence_layout import SequenceLayout


@runtime_checkable
class BalanceableModel(Protocol):
    """What the modality-aware schedule and :func:`forward_step` need of the (unwrapped) model."""

    def phase_encoders(self) -> Mapping[str, torch.nn.Module]:
        """This pipeline stage's encoder modules by phase name (empty on stages without encoders)."""

    def encode(self, phase: str, items: torch.Tensor) -> torch.Tensor:
        """Items ``[n, *item_shape]`` of encoder phase ``phase`` -> their rows ``[n * output_rows, hidden]``,
        item by item (``n`` may be 0). Called on consecutive chunks of a rank's items, and again on a chunk to
        recompute it: its randomness must come from torch's generators or Megatron's RNG tracker (replayed)."""

    def forward(self, batch: MicroBatch, embeds: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
        """The backbone over ``batch`` (on the model's device) with ``embeds[phase]`` at the placeholders;
        the per-token loss ``[b, s]`` on the last pipeline stage, else the hidden states it sends on."""

    model_type: ModelType  # megatron-core's schedules read it (ModelType.encoder_or_decoder)

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline parallelism: the previous stage's output, for the backbone (megatron-core's schedules
        call it before every forward, also without pipelining)."""


class MegatronModelMixin:
    """``model_type`` and ``set_input_tensor`` as megatron-core's schedules read them, for a model whose
    backbone is ``self.language_model`` (as Megatron-Core's ``LLaVAModel`` and ``MimoModel`` name theirs):
    ``class MyVLM(MegatronModelMixin, MegatronModule)``."""

    model_type = ModelType.encoder_or_decoder

    def set_input_tensor(self, input_tensor) -> None:
        self.language_model.set_input_tensor(input_tensor)


_MEMBERS = {"phase_encoders": "phase_encoders()", "encode": "encode(phase, items)",
            "forward": "forward(batch, embeds)", "model_type": "model_type", "set_input_tensor": "set_input_tensor"}


def unwrapped(model) -> torch.nn.Module:
    """The module inside Megatron's wrappers (DDP, Float16Module) of ``model`` (a model chunk or a list of them:
    the first)."""
    module = model[0] if isinstance(model, (list, tuple)) else model
    while hasattr(module, "module"):
        module = module.module
    return module


def check_model(model) -> BalanceableModel:
    """The model inside Megatron's wrappers, or a TypeError naming every member of :class:`BalanceableModel`
    it lacks (megatron-core itself would fail later without a hint: ``couldn't find attribute model_type``)."""
    module = unwrapped(model)
    missing = [call for name, call in _MEMBERS.items() if not hasattr(module, name)]
    if missing:
        fix = (" (inherit megatron_orch.megatron.MegatronModelMixin for model_type and set_input_tensor)"
               if {"model_type", "set_input_tensor"} & {m.split("(")[0] for m in missing} else "")
        raise TypeError(f"post-balancing: {type(module).__name__} lacks {', '.join(missing)} of "
                        f"megatron_orch.megatron.BalanceableModel{fix}")
    return module


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Per-token loss: (sum of token losses, number of loss tokens, report for logging).

    The schedule adds the token counts of all micro-batches and ``finalize_model_grads`` divides the
    gradients by their sum over the DP group (``calculate_per_token_loss``): the normalisation is by
    the global number of loss tokens, whichever rank holds which example.
    """
    mask = loss_mask.reshape(-1).float()
    loss = torch.sum(output_tensor.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.float()])
    return loss, num_tokens, {"lm loss": report}


@dataclasses.dataclass
class NonFiniteRecords:
    """Per micro-batch, its examples' sample ids and a flag per example (on the device, read by no one unless
    the step is not finite: no host sync per micro-batch). ``losses``: whether each example's own loss is not
    finite; ``gradients``: whether the gradient arriving at any of its encoder output rows is not finite
    (balanced micro-batches, whose ``embeds`` post-balancing moved: :func:`record_non_finite_gradients`)."""

    losses: List[Tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)
    gradients: List[Tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)


_non_finite_records: Optional[NonFiniteRecords] = None


@contextlib.contextmanager
def recording_non_finite_losses() -> Iterator[NonFiniteRecords]:
    """While active, :func:`forward_step`'s loss function and the modality-aware schedule's encoder outputs record
    into the yielded :class:`NonFiniteRecords` which examples' loss and gradient are not finite. A trainer names
    the examples of a non-finite loss or gradient norm from it, not the whole step."""
    global _non_finite_records
    outer, _non_finite_records = _non_finite_records, NonFiniteRecords()
    try:
        yield _non_finite_records
    finally:
        _non_finite_records = outer


def record_non_finite_gradients(batch: MicroBatch, embeds: Mapping[str, torch.Tensor]) -> None:
    """While :func:`recording_non_finite_losses` is active: flag, when their gradient arrives, the examples of
    ``batch`` (a balanced micro-batch) whose rows of ``embeds`` (its encoder outputs, at its placeholders in
    order) get a non-finite gradient. The gradient at an example's rows is its own (rows of other examples
    never mix in it), so a NaN the backbone's backward makes for one example names that one; one made inside
    an encoder's backward (from finite output gradients) is not seen here. Costs one finiteness test of the
    gradient rows, on the device."""
    records = _non_finite_records
    if records is None:
        return
    examples = None
    for phase, rows in embeds.items():
        where = batch.placeholders.get(phase)
        if not rows.requires_grad or where is None or where.shape[1] != rows.shape[0] or rows.shape[0] == 0:
            continue
        if examples is None:
            examples = _token_examples(batch, SequenceLayout())
        owner = examples[where[0], where[1]].to(rows.device, non_blocking=True)
        rows.register_hook(functools.partial(_flag_non_finite_rows, owner, batch.sample_ids, records.gradients))


def _flag_non_finite_rows(owner: torch.Tensor, sample_ids: torch.Tensor, records: list, grad: torch.Tensor) -> None:
    bad = ~torch.isfinite(grad.reshape(grad.shape[0], -1)).all(dim=1)
    counts = torch.zeros(sample_ids.numel(), device=grad.device).index_add_(0, owner, bad.float())
    records.append((sample_ids, counts > 0))


def _token_examples(batch: MicroBatch, layout: SequenceLayout) -> torch.Tensor:
    """The example (its place in ``batch``, -1 past every example) of each token of this rank's part of the
    sequence, laid out as its loss mask; read from the host's bounds, so nothing waits for the device."""
    rows, length = batch.tokens.shape
    device = batch.tokens.device
    if batch.is_packed:
        bounds = batch.host_cu_seqlens
        index = torch.full((rows, length), -1, dtype=torch.long)
        for i in range(batch.num_examples):
            index[0, bounds[i]:bounds[i + 1]] = i
        index = index.to(device, non_blocking=True)
    else:  # row i holds example i
        index = torch.arange(rows, device=device).unsqueeze(1).expand(rows, length)
    return index if layout.is_whole else layout.shard(dataclasses.replace(batch, position_ids=index)).position_ids


def _loss_func_recording(loss_mask: torch.Tensor, token_examples: torch.Tensor, sample_ids: torch.Tensor,
                         records: list, output_tensor: torch.Tensor):
    """:func:`loss_func`, recording which examples' own loss is not finite (a token's non-finite loss times its
    mask, what makes the sum non-finite) into ``records`` (:attr:`NonFiniteRecords.losses`)."""
    bad = ~torch.isfinite(output_tensor.reshape(-1).float() * loss_mask.reshape(-1).float())
    counts = torch.zeros(sample_ids.numel() + 1, device=bad.device)  # slot 0: tokens past every example
    counts.index_add_(0, token_examples.reshape(-1) + 1, bad.float())
    records.append((sample_ids, counts[1:] > 0))
    return loss_func(loss_mask, output_tensor)


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """One micro-batch through a :class:`BalanceableModel` (Megatron's ``forward_step_func``): a
    :class:`BalancedMicroBatch` brings the encoder outputs of its examples, a plain ``MicroBatch`` its raw
    items. Under sequence or context parallelism the loss is that of this rank's part of the sequence, whose
    loss mask :class:`~megatron_orch.megatron.sequence_layout.SequenceLayout` gives (megatron-core's layout)."""
    item = next(data_iterator)
    if isinstance(item, BalancedStep):
        raise stock_schedule_error()
    batch, embeds = (item.batch, item.embeds) if isinstance(item, BalancedMicroBatch) else (item, None)
    batch = batch.to(next(model.parameters()).device)
    layout = SequenceLayout.of_model(getattr(model, "config", None))  # Megatron's wrappers keep the config
    loss_mask = batch.loss_mask if layout.is_whole else layout.shard(batch).loss_mask
    if _non_finite_records is None:
        return model(batch, embeds=embeds), functools.partial(loss_func, loss_mask)
    return model(batch, embeds=embeds), functools.partial(
        _loss_func_recording, loss_mask, _token_examples(batch, layout), batch.sample_ids, _non_finite_records.losses)
