"""Megatron-Core's ``MimoModel`` (``megatron.core.models.mimo``, 0.16.1 and 0.19.x), balanced out of the box.

A ``MimoModel`` holds named modality submodules (each: its encoders and an input projection) and a language
model (``GPTModel`` or, 0.19+, ``HybridModel``: the adapter reads only what both have). Its forward runs
them all on one micro-batch: every modality submodule over that micro-batch's raw inputs
(``modality_inputs[name][encoder][keyword]``), text embeddings from the language model's embedding, each
modality's embeddings scattered at its ``special_token_ids`` placeholder in token order
(``align_embeddings_by_token_positions``), then the language model. Its own cross-layout communication moves
encoder outputs by equal batch slices, relying on a uniform token count per sample
(``mimo/comm/colocated_communicator.py``, 0.19).

:class:`MimoBalancing` wraps one so that it meets the contract (:mod:`megatron_orch.megatron.contract`):

* **phases**: one encoder phase per modality submodule (:class:`MimoModality`: the submodule's name,
  the encoder in it and the keyword its forward takes a batch of items by, the shape of one item, the
  rows (placeholders) one item gives the language model, a cost model); the language model is the
  backbone phase;
* **encode**: the modality submodule's own forward (encoders and input projection) over any items;
* **forward(batch, embeds)**: ``MimoModel.forward`` cannot take encoder outputs, nor run the language
  model without running the modality submodules on the same micro-batch. So with ``embeds`` the adapter
  calls ``MimoModel.forward`` with every modality submodule answering, for that call only, with the
  micro-batch's embeddings that post-balancing computed elsewhere (its ``forward`` shadowed on the
  instance). Text embeddings, the alignment by placeholder, 0.19's context/sequence-parallel sharding
  and the language model call stay MIMO's own, as the installed release does them (0.16.1 passes the
  attention mask and no position ids to the language model; 0.19 the position ids and no mask). Without
  ``embeds`` it is ``MimoModel.forward`` on the batch's raw items: upstream MIMO.

Refused, each with its reason in the error (MIMO itself does not support the first two with
Megatron's schedules, the others would break the invariance):

* a language model split over pipeline stages: ``MimoModel.forward`` embeds the text with the language
  model's embedding and runs every modality on every rank (0.16.1); 0.19's colocated layout is PP 1 by
  definition, and its pipeline parallelism is the non-colocated multi-module layout with MIMO's own
  bridges and schedule;
* ``module_to_grid_map`` (0.19) other than colocated grids of TP then DP, the modalities' at one TP dividing the
  language model's (:func:`encoder_grid_tensor_parallel_size`), or non-colocated grids of every modality on the
  same encoder ranks of their own at TP 1 beside a language model of TP then DP (:func:`own_encoder_ranks`: other
  non-colocated grids are refused by name, among them a language model over pipeline stages, encoder TP above 1,
  modalities on different ranks);
* a modality submodule with more than one encoder: it concatenates whole encoders' outputs (all rows
  of encoder 1, then encoder 2), so one item's rows are not contiguous and the outputs of some items are
  not a slice of the whole batch's;
* a modality submodule left out of ``modalities``: a balanced micro-batch carries no raw items;
* packed rows where the installed ``MimoModel`` cannot take them (the batch spec's ``cannot_pack`` says
  why: ``--orch-microbatching auto`` then gives equal-count micro-batches, DP rank 0 logging the reason
  once, and the post-balancing iterator refuses ``packed`` when it is built, before any collective):
  0.16.1's colocated forward takes no THD parameters and drops the attention mask, so a packed row would
  attend across its examples; on 0.19 a language model whose core attention is megatron-core's local
  ``DotProductAttention`` (it asserts ``packed_seq_params is None``), and context parallelism (MIMO shards a
  THD row with Transformer Engine's ``thd_get_partitioned_indices`` over per-sequence padded bounds, which
  the adapter does not build).
* sequence or context parallelism with 0.16.1's MimoModel, which does not shard the language model's input
  (0.19's shards it itself: its language model must then be built with
  ``scatter_embedding_sequence_parallel=False``, which MIMO asks for).

Non-colocated grids (0.19: the modalities on encoder ranks of their own, which hold no language model) train
post-balanced: :func:`own_encoder_ranks` gives the layout, each phase is balanced over the encoder ranks
(:func:`~megatron_orch.orchestrator.encoder_ranks.encode_on_own_ranks`, any number of items per example), the
encoder ranks run :class:`~megatron_orch.megatron.own_encoder_ranks.OwnEncoderRanksLoop` and the language ranks
the post-balancing iterator (``ParallelGroups.own_encoder_ranks``) and schedule, which hand the language rank's
MIMO the received embeddings as its input tensors (as its own bridge would). Not run that way: MIMO's own forward
(upstream, shadow mode, the checked first step), forward-only steps, ``post_balance()`` and the entry points built
on it (their groups are the global parallel state's).

A colocated ``module_to_grid_map`` (0.19) whose modalities have a grid of their own TP (below the language
model's) is the encoders on every rank at that TP (``EncoderRanks.ALL``): ``encoder_tensor_parallel_size`` says
which, ``post_balance`` checks its config against it, the plan balances each phase over the encoder grid's DP
ranks and moves the outputs to each example's language DP rank, and MIMO's colocated bridge (equal batch slices)
is skipped. MIMO's own forward is refused then: it would hand each encoder DP rank its language DP rank's whole
micro-batch.

Packed rows (0.19, feature-detected: ``MimoModel.forward`` takes ``packing_kwargs``): one row of examples
back to back (:func:`~megatron_orch.megatron.batch.collate_packed`), handed to ``MimoModel.forward`` with
``packing_kwargs`` of the row's bounds (``cu_seqlens_q`` = ``cu_seqlens_kv``, ``max_seqlen_q`` =
``max_seqlen_kv``), from which MIMO builds its THD ``PackedSeqParams`` for the language model: each example
attends causally to itself only. The placeholders need nothing more: MIMO scatters each modality's rows at its
placeholders in row order, and a packed row holds its examples' items in example order, as their
placeholders are. Position ids restart at each example (RoPE reads the bounds in THD); the loss mask is the
row's, 0 on any padding tail, which is one more sequence (megatron-core's THD RoPE splits the row by the
bounds, and Transformer Engine's kernels leave a token outside every sequence undefined). The params MIMO
built get the bounds as host ints too (:class:`~megatron_orch.megatron.batch.PackedRowParams`, which the
project's ``SDPAttention`` needs).

Under sequence or context parallelism (0.19) every rank of a replica gets the whole micro-batch, its rows
padded at the end to the multiple MIMO's sharding needs (2 x CP, x TP with SP; pad tokens of the batch
spec's pad id, loss mask 0; in a packed row, part of its padding tail); MIMO then shards the combined
embeddings, the labels and the loss mask as megatron-core does, the same layout whose loss mask ``forward_step`` applies
(:class:`~megatron_orch.megatron.sequence_layout.SequenceLayout`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, Mapping, Optional, Sequence, Tuple

import torch
from megatron.core.enums import ModelType
from megatron.core.transformer.module import MegatronModule

from megatron_orch.balance.cost import CostModel
from megatron_orch.balance.workload import BackbonePhase, EncoderPhase, ModelPhases
from megatron_orch.megatron.batch import BatchSpec, EncoderInput, MicroBatch, PackedRowParams
from megatron_orch.megatron.sequence_layout import SequenceLayout
from megatron_orch.orchestrator.encoder_ranks import OwnEncoderRanks

if TYPE_CHECKING:
    from megatron.core.models.mimo import MimoModel

LANGUAGE_PHASE = "language"  # MIMO's key of its language module (0.19: MIMO_LANGUAGE_MODULE_KEY)
# Why --orch-microbatching auto gives a MimoModel equal-count micro-batches (and packed is refused); the
# releases whose MimoModel.forward takes packing_kwargs (0.19) pack unless CANNOT_PACK_ATTENTION or _CP apply.
CANNOT_PACK = ("MimoBalancing does not hand packed rows to this MimoModel: its colocated forward takes no THD "
               "parameters (packing_kwargs, megatron-core 0.19+) and drops the attention mask, so a packed row "
               "would attend across its examples")
CANNOT_PACK_ATTENTION = ("MimoBalancing does not hand packed rows to this MimoModel: its language model's core "
                         "attention ({}) takes no THD parameters (megatron-core's local DotProductAttention asserts "
                         "packed_seq_params is None; Transformer Engine's attention and the project's SDPAttention "
                         "take them)")
CANNOT_PACK_ENCODER_RANK = ("MimoBalancing on an encoder rank of non-colocated grids holds no language model: the "
                            "language ranks decide whether rows are packed, and send the encoder ranks their decision "
                            "with each step's sizes")
CANNOT_PACK_CP = ("MimoBalancing does not hand packed rows to this MimoModel under context parallelism: MIMO shards a "
                  "THD row with Transformer Engine's thd_get_partitioned_indices over per-sequence padded bounds, "
                  "which the adapter does not build")


def takes_packing_kwargs(mimo) -> bool:
    """Whether the installed ``MimoModel.forward`` takes ``packing_kwargs`` (THD parameters; 0.19, not 0.16.1)."""
    return "packing_kwargs" in inspect.signature(type(mimo).forward).parameters


def _core_attentions(language_model) -> list:
    return [m.core_attention for m in language_model.modules() if isinstance(getattr(m, "core_attention", None),
                                                                            torch.nn.Module)]


def cannot_pack(mimo) -> Optional[str]:
    """Why the adapter does not hand packed rows to ``mimo`` (None: it does; module docstring)."""
    if not takes_packing_kwargs(mimo):
        return CANNOT_PACK
    if mimo.language_model is None:
        return CANNOT_PACK_ENCODER_RANK
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    local = sorted({type(a).__name__ for a in _core_attentions(mimo.language_model) if type(a) is DotProductAttention})
    if local:
        return CANNOT_PACK_ATTENTION.format(", ".join(local))
    if mimo.config.context_parallel_size > 1:
        return CANNOT_PACK_CP
    return None


@dataclass(frozen=True)
class MimoModality:
    """How one modality submodule of a ``MimoModel`` is balanced (one encoder phase).

    ``name``: its key in ``modality_submodules`` and ``special_token_ids`` (the phase's name, so it must
    be a lowercase identifier); ``encoder``: the submodule's encoder that takes the items; ``keyword``:
    the argument of that encoder's forward that takes a batch of items ``[n, *item_shape]``;
    ``rows_per_item``: embeddings one item gives the language model (its placeholders);
    ``item_tokens``: the sequence length the encoder runs per item (what ``cost`` is asked about);
    ``bytes_per_element``: of a raw item as it moves (bf16: 2).
    """

    name: str
    encoder: str
    keyword: str
    item_shape: Tuple[int, ...]
    rows_per_item: int
    item_tokens: int
    cost: CostModel
    bytes_per_element: int = 2


class MimoBalancing(MegatronModule):
    """A ``MimoModel`` that meets post-balancing's contract (module docstring); ``mimo`` is its child, so
    its parameters and state dict keys sit under ``mimo.``."""

    def __init__(self, mimo: "MimoModel", modalities: Sequence[MimoModality], backbone_cost: CostModel,
                 embedding_bytes_per_element: int = 2, token_bytes: int = 20):
        super().__init__(config=mimo.config)
        self.model_type = ModelType.encoder_or_decoder  # read by megatron-core's schedules
        self.mimo = mimo
        self.modalities = tuple(modalities)
        _check_supported(mimo, self.modalities)
        # the encoders' own TP size where a colocated module_to_grid_map gives them one (None: the language model's)
        self.encoder_tensor_parallel_size = encoder_grid_tensor_parallel_size(mimo)
        # non-colocated grids: the encoders on ranks of their own (None: every rank holds every module)
        self.own_encoder_ranks = own_encoder_ranks(mimo)
        self.cannot_pack = cannot_pack(mimo)  # why packed rows are not handed to it (None: they are)
        row_bytes = mimo.config.hidden_size * embedding_bytes_per_element
        encoders = tuple(EncoderPhase(m.name, m.cost, item_tokens=m.item_tokens,
                                      input_bytes=math.prod(m.item_shape) * m.bytes_per_element,
                                      output_rows=m.rows_per_item, output_row_bytes=row_bytes)
                         for m in self.modalities)
        self.phases = ModelPhases(encoders, BackbonePhase(LANGUAGE_PHASE, backbone_cost, token_bytes=token_bytes))

    def batch_spec(self, seq_length: int, pad_token_id: int) -> BatchSpec:
        """What the model's batches hold: each modality's items, placeholders at its special token id (the pad
        id also pads rows for sequence and context parallelism)."""
        inputs = tuple(EncoderInput(m.name, m.item_shape, self.mimo.special_token_ids[m.name])
                       for m in self.modalities)
        spec = BatchSpec(self.phases, inputs, pad_token_id=pad_token_id, seq_length=seq_length,
                         takes_packed_rows=self.cannot_pack is None, cannot_pack=self.cannot_pack)
        self.pad_token_id = pad_token_id
        return spec

    def set_input_tensor(self, input_tensor) -> None:
        self.mimo.set_input_tensor(input_tensor)

    def phase_encoders(self) -> Dict[str, torch.nn.Module]:
        """This rank's modality submodules (with non-colocated grids: all of them on an encoder rank, none on a
        language rank)."""
        return {m.name: self.mimo.modality_submodules[m.name] for m in self.modalities
                if m.name in self.mimo.modality_submodules}

    def encode(self, phase: str, items: torch.Tensor) -> torch.Tensor:
        """The modality submodule's forward (its encoder, then its input projection) over ``items``."""
        modality = next(m for m in self.modalities if m.name == phase)
        if items.shape[0] == 0:
            return torch.zeros(0, self.config.hidden_size, dtype=self.config.params_dtype, device=items.device)
        rows = self.mimo.modality_submodules[phase].forward(
            encoder_inputs={modality.encoder: {modality.keyword: items}})
        if rows.shape[0] != items.shape[0] * modality.rows_per_item:
            raise ValueError(f"modality {phase}: {items.shape[0]} items gave {rows.shape[0]} rows, expected "
                             f"rows_per_item={modality.rows_per_item} each")
        return rows

    def forward(self, batch: MicroBatch, embeds: Optional[Mapping[str, torch.Tensor]] = None) -> torch.Tensor:
        """``MimoModel.forward`` over ``batch``: on its raw items (upstream), or with ``embeds`` in place of
        its modality submodules' outputs (module docstring). Returns the language model's output."""
        layout = SequenceLayout.of_model(self.config)
        if not layout.is_whole:
            if not hasattr(self, "pad_token_id"):
                raise RuntimeError("MimoBalancing: call batch_spec() first; its pad id pads the rows for sequence "
                                   "and context parallelism")
        packing = {}
        if batch.is_packed:
            if self.cannot_pack is not None:
                raise NotImplementedError(self.cannot_pack)
            if not layout.is_whole:
                batch = _padded_tail(batch, layout.row_multiple, self.pad_token_id)
            # the bounds cover the whole row: megatron-core's THD RoPE splits the row by them, and Transformer
            # Engine's kernels leave a token outside every sequence undefined
            params = batch.packed_seq_params(tail_as_sequence=True)
            packing = {"packing_kwargs": {"cu_seqlens_q": params.cu_seqlens_q, "cu_seqlens_kv": params.cu_seqlens_kv,
                                          "max_seqlen_q": params.max_seqlen_q, "max_seqlen_kv": params.max_seqlen_kv}}
        elif not layout.is_whole:
            batch = layout.padded_rows(batch, self.pad_token_id)
        if embeds is None:
            if self.own_encoder_ranks is not None:
                raise NotImplementedError(
                    "MimoBalancing: this MimoModel's encoders run on ranks of their own (non-colocated grids); MIMO's "
                    "own forward would need its bridge between the grids: train it post-balanced (the encoder ranks "
                    "run OwnEncoderRanksLoop, the language ranks the modality-aware schedule), not upstream or in "
                    "shadow mode")
            if self.encoder_tensor_parallel_size is not None:
                raise NotImplementedError(
                    f"MimoBalancing: this MimoModel's encoders run on a grid of their own (TP "
                    f"{self.encoder_tensor_parallel_size}); MIMO's own forward would hand each of its encoder DP "
                    "ranks the whole micro-batch of its language DP rank: train it post-balanced (encoder_ranks ALL "
                    "at that encoder TP), not upstream or in shadow mode")
            modality_inputs = {m.name: {m.encoder: {m.keyword: batch.items[m.name]}}
                               for m in self.modalities if batch.items[m.name].shape[0]}
            answers = contextlib.nullcontext()
        elif self.own_encoder_ranks is not None:  # a language rank: MIMO reads the embeddings as its input tensors
            modality_inputs = None
            answers = _as_input_tensors(self.mimo, embeds)
        else:
            modality_inputs = {name: {} for name in embeds}  # present, so that each submodule is asked
            # the embeddings are the language DP rank's already (post-balancing moved them): MIMO's bridge is skipped
            answers = _answering(self.mimo, embeds)
        bounds = _host_bounds(self.mimo, params.host_cu_seqlens) if packing else contextlib.nullcontext()
        with answers, bounds:
            output, _ = self.mimo(input_ids=batch.tokens, position_ids=batch.position_ids, attention_mask=None,
                                  loss_mask=batch.loss_mask, labels=batch.labels, modality_inputs=modality_inputs,
                                  **packing)
        return output


def _padded_tail(batch: MicroBatch, multiple: int, pad_token_id: int) -> MicroBatch:
    """A packed row with its tail padded to a multiple of ``multiple`` (pad tokens, loss mask 0, outside every
    example), as MIMO's sequence-parallel sharding needs."""
    extra = -batch.tokens.shape[1] % multiple
    if not extra:
        return batch
    pad = lambda t, value: torch.nn.functional.pad(t, (0, extra), value=value)  # noqa: E731
    return dataclasses.replace(batch, tokens=pad(batch.tokens, pad_token_id), labels=pad(batch.labels, pad_token_id),
                               loss_mask=pad(batch.loss_mask, 0), position_ids=pad(batch.position_ids, 0))


@contextlib.contextmanager
def _host_bounds(mimo, host_cu_seqlens) -> Iterator[None]:
    """For the duration, the THD params MIMO builds from ``packing_kwargs`` carry the row's bounds as host ints
    too (:class:`PackedRowParams`, which the project's SDPAttention reads; megatron-core sees the base fields)."""
    build = getattr(type(mimo), "_build_packed_seq_params", None)
    if build is None:  # a release that builds them elsewhere: its own PackedSeqParams (Transformer Engine's kernels)
        yield
        return

    def with_bounds(packing_kwargs):
        params = build(mimo, packing_kwargs)
        if params is None:
            return None
        return PackedRowParams(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)},
                               host_cu_seqlens=tuple(host_cu_seqlens))

    mimo._build_packed_seq_params = with_bounds
    try:
        yield
    finally:
        del mimo._build_packed_seq_params


@contextlib.contextmanager
def _as_input_tensors(mimo, embeds: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """For the duration, a non-colocated language rank's MIMO takes ``embeds`` (the modality embeddings of the
    micro-batch, from the encoder ranks) as its input tensors, as its own bridge would hand them over."""
    mimo.input_tensors = dict(embeds)
    try:
        yield
    finally:
        mimo.input_tensors = None


@contextlib.contextmanager
def _answering(mimo, embeds: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """For the duration, each named modality submodule's forward returns its given embeddings, and MIMO's colocated
    bridges (0.19, per-module grids: encoder layout to the language model's) are not applied to them."""
    submodules = mimo.modality_submodules
    for name, rows in embeds.items():
        submodules[name].forward = lambda encoder_inputs=None, hidden_states=None, rows=rows: rows
    bridges = getattr(mimo, "colocated_comms", None)
    if bridges:
        mimo.colocated_comms = {}
    try:
        yield
    finally:
        for name in embeds:
            del submodules[name].forward
        if bridges:
            mimo.colocated_comms = bridges


def _tensor_then_data_parallel(name: str, grid) -> Tuple[int, int]:
    """(TP, DP) of a module's grid whose ranks are TP fastest, then DP (every other dimension of size 1): the
    layout of megatron-core's ``tp-cp-dp-pp`` ranks at CP 1 and PP 1, which the encoder group assumes."""
    sizes = dict(zip(grid.dim_names, grid.shape))
    live = [d for d in grid.dim_names if sizes[d] > 1]
    if "tp" not in sizes or "dp" not in sizes or live not in ([], ["tp"], ["dp"], ["tp", "dp"]):
        raise NotImplementedError(
            f"MimoBalancing: module_to_grid_map[{name!r}] has dims {grid.dim_names} of sizes {grid.shape}; only grids "
            "of TP (fastest) then DP are balanced (every other dimension 1: megatron-core's tp-cp-dp-pp rank order at "
            "CP 1 and PP 1)")
    return sizes["tp"], sizes["dp"]


def _language_grid(mimo, language) -> Tuple[int, int]:
    """(TP, DP) of the language model's grid, its TP checked against its config's."""
    tp, dp = _tensor_then_data_parallel(LANGUAGE_PHASE, language)
    if tp != mimo.config.tensor_model_parallel_size:
        raise ValueError(f"MimoBalancing: module_to_grid_map[{LANGUAGE_PHASE!r}] has TP {tp}, its language model "
                         f"config {mimo.config.tensor_model_parallel_size}")
    return tp, dp


def _grid_ranks(grids) -> str:
    return ", ".join(f"{n} ranks {g.rank_offset}..{g.rank_offset + g.size - 1}" for n, g in grids.items())


def encoder_grid_tensor_parallel_size(mimo) -> Optional[int]:
    """The encoders' own TP size that a colocated ``module_to_grid_map`` (0.19) gives them: every modality's grid
    over the language model's ranks at one TP size that divides the language model's (its encoder DP = the job's
    ranks / that TP), balanced as the encoders on every rank (``EncoderRanks.ALL`` at that encoder TP). None: no
    grid map, the modalities' grids are the language model's, or non-colocated grids (encoder ranks of their own:
    :func:`own_encoder_ranks`). Refused by name: other dims or rank orders, an encoder TP that does not divide the
    language model's."""
    grids = getattr(mimo.mimo_config, "module_to_grid_map", None)
    if not grids:
        return None
    language = grids[LANGUAGE_PHASE]
    if own_encoder_ranks(mimo) is not None:
        return None  # non-colocated: the encoders run on ranks of their own (MimoBalancing.own_encoder_ranks)
    tp, _ = _language_grid(mimo, language)
    encoder_tp = {name: _tensor_then_data_parallel(name, g)[0] for name, g in grids.items() if name != LANGUAGE_PHASE}
    sizes = set(encoder_tp.values())
    if len(sizes) > 1 or tp % min(sizes):
        raise NotImplementedError(
            f"MimoBalancing: the modalities' grids have TP {encoder_tp}; they are balanced as one encoder group, at "
            f"one TP size dividing the language model's ({tp}), each language TP group holding whole encoder replicas")
    etp = sizes.pop()
    return None if etp == tp else etp


def own_encoder_ranks(mimo) -> Optional[OwnEncoderRanks]:
    """Where a non-colocated ``module_to_grid_map`` (0.19) puts the encoders and the language model, as the ranks of
    the moves' group (the world's ranks): every modality's grid over the same ranks of their own at TP 1 (an encoder
    DP rank per rank), the language model's grid of TP then DP over other ranks. None: no grid map, or colocated
    grids. Refused by name: modalities on different ranks, encoder ranks that share ranks with the language model,
    encoder TP above 1, other dims or rank orders."""
    grids = getattr(mimo.mimo_config, "module_to_grid_map", None)
    if not grids:
        return None
    language = grids[LANGUAGE_PHASE]
    modalities = {name: g for name, g in grids.items() if name != LANGUAGE_PHASE}
    spans = {(g.rank_offset, g.size) for g in modalities.values()}
    if spans <= {(language.rank_offset, language.size)}:
        return None  # colocated (encoder_grid_tensor_parallel_size)
    ranks = _grid_ranks(grids)
    if len(spans) > 1:
        raise NotImplementedError(f"MimoBalancing: the modalities' grids span different ranks ({ranks}); encoder ranks "
                                  "of their own hold every modality's encoders (one encoder group)")
    offset, size = spans.pop()
    if offset < language.rank_offset + language.size and language.rank_offset < offset + size:
        raise NotImplementedError(f"MimoBalancing: the modalities' grid shares some ranks with the language model's "
                                  f"({ranks}); grids over the same ranks or over ranks of their own are balanced")
    tp, dp = _language_grid(mimo, language)
    encoder_tp = {name: _tensor_then_data_parallel(name, g)[0] for name, g in modalities.items()}
    if set(encoder_tp.values()) != {1}:
        raise NotImplementedError(f"MimoBalancing: encoder ranks of their own at TP {encoder_tp}; only TP 1 is "
                                  "balanced (each encoder rank a whole encoder replica, its outputs sent by it alone)")
    backbone = tuple(tuple(language.rank_offset + t + tp * d for t in range(tp)) for d in range(dp))
    return OwnEncoderRanks(tuple(range(offset, offset + size)), backbone,
                           num_ranks=max(offset + size, language.rank_offset + language.size))


def _check_supported(mimo, modalities: Sequence[MimoModality]) -> None:
    """Refuse, naming the reason, what the adapter cannot balance invariantly (module docstring)."""
    language = mimo.language_model  # None on an encoder rank of non-colocated grids
    split = language is not None and not (getattr(language, "pre_process", True)
                                          and getattr(language, "post_process", True))
    if split:
        raise NotImplementedError(
            "MimoBalancing: the language model is split over pipeline stages, which MimoModel does not run "
            "under Megatron's schedules (0.16.1: its forward embeds the text and runs every modality on every "
            "rank; 0.19: the colocated layout is PP 1, its pipeline parallelism the non-colocated multi-module "
            "layout with MIMO's own bridges)")
    config = mimo.config
    if (config.sequence_parallel or config.context_parallel_size > 1) and not hasattr(mimo, "partition_adapter"):
        raise NotImplementedError(
            "MimoBalancing: sequence or context parallelism with this release's MimoModel (megatron-core 0.16), which "
            "does not shard the language model's input; 0.19's MimoModel does")
    names = [m.name for m in modalities]
    specified = sorted(mimo.mimo_config.modality_submodules_spec)  # every rank's, built here or not
    if sorted(names) != specified or len(set(names)) != len(names):
        raise ValueError(f"MimoBalancing: modalities {names} must name every modality submodule of the model "
                         f"once ({specified}): a balanced micro-batch carries no raw items")
    for m in modalities:
        if m.name not in mimo.special_token_ids:
            raise ValueError(f"MimoBalancing: modality {m.name} has no special_token_ids entry (its placeholder)")
        if m.name not in mimo.modality_submodules:  # a language rank of non-colocated grids
            continue
        submodule = mimo.modality_submodules[m.name]
        if list(submodule.encoders) != [m.encoder]:
            raise NotImplementedError(
                f"MimoBalancing: modality {m.name} has encoders {list(submodule.encoders)}; exactly one ({m.encoder}) "
                "is supported: a submodule concatenates whole encoders' outputs, so one item's rows would not be "
                "contiguous nor some items' outputs a slice of the batch's")
