"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA) and, for packed
rows, torch's variable-length attention.

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores and
probabilities: attention then costs several times a linear layer's FLOP, and long sequences run out
of memory. :class:`SDPAttention` is a drop-in for it in a layer spec (``core_attention``), with the
same constructor arguments, call and output, but lets torch pick a fused kernel: flash attention
for causal rows without a mask, the encoders' bidirectional items, the math kernel on CPU where
flash cannot run. It is the core attention of ``--transformer-impl local``.

Packed rows (:class:`~megatron_orch.megatron.batch.PackedRowParams`, Megatron's THD format) never
build a mask: each example attends causally to its own tokens only, so a row costs the sum of its
examples' ``s(s+1)/2`` attended pairs (what the planner's backbone cost model balances,
:meth:`~megatron_orch.balance.cost.TransformerShape.attended_pairs`) and nothing is ``T x T``. The
kernel (:func:`packed_attention`): on CUDA in bf16/fp16 without attention dropout,
``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.9; flash attention over ``cu_seqlens``: one launch
per layer, tiles only inside each example's causal triangle); otherwise (CPU, fp32, attention dropout,
which ``varlen_attn`` does not take, or an older torch) SDPA example by example (``is_causal``: flash on CUDA and on CPU
without dropout, the math kernel over one example's ``s x s`` with dropout on CPU).

Context parallelism (the backbone's ``--context-parallel-size``) on CPU: :func:`context_parallel_attention`
all-gathers keys and values over the CP group and attends each local query exactly (the CPU path; on GPUs
context parallelism runs Transformer Engine's attention, ``--transformer-impl transformer_engine``).
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_orch.megatron.batch import PackedRowParams
from megatron_orch.megatron.sequence_layout import SequenceLayout

try:
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.9; setup.py allows 2.6
except ImportError:
    varlen_attn = None

HALF_PRECISION = (torch.float16, torch.bfloat16)


class SDPAttention(MegatronModule):
    """softmax(q k^T * scale + mask) v over this tensor-parallel rank's heads.

    Inputs are megatron's: query ``[sq, b, heads, d]``, key/value ``[sk, b, groups, d]`` (this rank's
    heads and query groups), ``attention_mask`` None or bool ``[b or 1, 1, sq, sk]`` with True =
    masked. Output ``[sq, b, heads * d]``. Like megatron's ``DotProductAttention``, a given mask is
    applied as is and ``attn_mask_type`` only decides what happens without one: causal, or
    bidirectional (``no_mask``, the encoders). A packed row comes as megatron's THD layout instead:
    ``packed_seq_params`` (:class:`PackedRowParams`), query ``[t, heads, d]``, key/value ``[t, groups,
    d]``, no mask, output ``[t, heads * d]`` (:func:`packed_attention`).

    No parameters and no state: a model's checkpoint is the same with it or ``DotProductAttention``.
    ``layer_number``, ``attention_type`` and ``cp_comm_type`` are accepted for the spec interface; the heads
    come from the tensors. With context parallelism (``config.context_parallel_size > 1``) the attention is
    :func:`context_parallel_attention` over ``pg_collection``'s CP group (megatron-core's, without one).
    Query-key layer scaling is an fp16 range trick whose scale cancels in megatron's softmax; SDPA keeps its
    softmax in fp32, so it is not needed here.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        unsupported = []
        if config.window_size is not None:
            unsupported.append(f"sliding-window attention (window_size={config.window_size})")
        if config.softmax_type != "vanilla":
            unsupported.append(f"softmax_type={config.softmax_type!r}")
        if unsupported:
            raise NotImplementedError(f"SDPAttention (--transformer-impl local) does not support "
                                      f"{', '.join(unsupported)}; use --transformer-impl transformer_engine")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.cp_group = None  # context parallelism: the CPU path (context_parallel_attention)
        if config.context_parallel_size > 1:
            self.cp_group = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias")
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        dropout = self.attention_dropout if self.training else 0.0
        # Each TP rank holds different heads: draw dropout from the model-parallel RNG, like megatron.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext()
        if self.cp_group is not None:
            if attention_mask is not None or attn_mask_type != AttnMaskType.causal:
                raise NotImplementedError(f"SDPAttention: context parallelism takes causal attention without a mask "
                                          f"(got attn_mask_type={attn_mask_type}, a mask: "
                                          f"{attention_mask is not None})")
            with rng:
                context = context_parallel_attention(query, key, value, self.cp_group, packed_seq_params,
                                                     scale=self.softmax_scale, dropout=dropout)
            return context.reshape(*context.shape[:-2], -1)
        if packed_seq_params is not None:
            if attention_mask is not None:
                raise ValueError("SDPAttention: a packed row (packed_seq_params) takes no attention_mask")
            with rng:
                context = packed_attention(query, key, value, packed_seq_params, scale=self.softmax_scale,
                                           causal=attn_mask_type == AttnMaskType.causal, dropout=dropout)
            return context.reshape(context.shape[0], -1)
        sq, b, heads, head_dim = query.shape
        is_causal = attention_mask is None and attn_mask_type == AttnMaskType.causal
        if is_causal and key.shape[0] != sq:
            raise NotImplementedError(f"SDPAttention: causal attention needs as many keys as queries "
                                      f"(got {sq} queries, {key.shape[0]} keys; no KV-cache inference)")
        # [s, b, n, d] -> [b, n, s, d], the layout SDPA expects.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask = None
        if attention_mask is not None:
            mask = ~attention_mask  # SDPA: True = attend
            # CUDA SDPA runs grouped-query attention only in the flash and math kernels, and flash
            # takes no mask: repeating the K/V heads keeps the memory-efficient kernel.
            key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
        with rng:
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=key.shape[1] != heads)
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)


def context_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group,
                               packed_seq_params: Optional[PackedRowParams], *, scale: float,
                               dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of this CP rank's queries, exactly: the CPU path of context parallelism.

    The rank holds its part of each sequence in megatron-core's layout
    (:class:`~megatron_orch.megatron.sequence_layout.SequenceLayout`: chunks ``r`` and ``2C-1-r`` of a padded row,
    or of every sequence of a packed row, whose ``host_cu_seqlens`` are the whole row's padded bounds): query
    ``[s / C, b, heads, d]`` (THD: ``[t / C, heads, d]``), key/value likewise with the query groups. Keys and
    values are all-gathered over ``group`` (megatron-core's ``gather_from_sequence_parallel_region``, whose
    backward sums their gradients back to the rank that holds them), put in sequence order, and each local query
    attends to the keys of its sequence at its position or before. On GPUs context parallelism runs Transformer
    Engine's attention instead (``--transformer-impl transformer_engine``); this gathers every key and value.
    """
    if query.is_cuda:
        raise NotImplementedError("SDPAttention's context-parallel attention is the CPU path (it gathers every key "
                                  "and value); on GPUs use --transformer-impl transformer_engine (TE's attention)")
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    thd = packed_seq_params is not None
    if thd:  # one row: [t, n, d] -> [t, 1, n, d]
        query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        sequences = tuple(zip(packed_seq_params.host_cu_seqlens, packed_seq_params.host_cu_seqlens[1:]))
    else:
        sequences = ((0, query.shape[0] * cp),)
    if sequences[-1][1] != query.shape[0] * cp:
        raise ValueError(f"context-parallel attention: {query.shape[0]} local tokens x CP {cp}, but the sequences "
                         f"end at {sequences[-1][1]}")
    order, _ = _context_parallel_order(cp, rank, sequences)
    key, value = (tensor_parallel.gather_from_sequence_parallel_region(t, True, group)[order] for t in (key, value))
    context = attend_context_parallel_shard(query, key, value, cp, rank, sequences, scale=scale, dropout=dropout)
    return context[:, 0] if thd else context


def attend_context_parallel_shard(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: int, rank: int,
                                  sequences, *, scale: float, dropout: float = 0.0) -> torch.Tensor:
    """CP rank ``rank``'s queries ``[s / C, b, heads, d]`` (megatron-core's layout of ``sequences``, the whole row's
    ``(start, end)``) against the whole row's keys and values ``[s, b, groups, d]`` in sequence order: each query
    attends causally within its sequence. Output ``[s / C, b, heads, d]``."""
    _, local = _context_parallel_order(cp, rank, tuple(sequences))
    heads = query.shape[2]
    key, value = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (key, value))
    parts = []
    for (start, end), (first, last) in zip(sequences, local):
        positions = torch.from_numpy(_positions(cp, rank, ((start, end),)) - start).to(query.device)
        allowed = positions[:, None] >= torch.arange(end - start, device=query.device)[None, :]  # [queries, keys]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query[first:last], key[start:end], value[start:end]))
        parts.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale)
                     .permute(2, 0, 1, 3))
    return torch.cat(parts)


def _positions(cp: int, rank: int, sequences) -> np.ndarray:
    return SequenceLayout(cp, rank).local_positions(sequences)


@functools.lru_cache(maxsize=256)
def _context_parallel_order(cp: int, rank: int, sequences):
    """(``order``: the gathered tokens' indices in sequence order, ``local``: each sequence's ``(first, last)``
    local token range on this rank)."""
    gathered = np.concatenate([_positions(cp, r, sequences) for r in range(cp)])
    order = np.empty_like(gathered)
    order[gathered] = np.arange(gathered.size)
    sizes = [(end - start) // cp for start, end in sequences]
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    return torch.from_numpy(order), tuple(zip(bounds[:-1].tolist(), bounds[1:].tolist()))


def uses_varlen_kernel(query: torch.Tensor, dropout: float) -> bool:
    """Whether :func:`packed_attention` runs ``varlen_attn`` (one flash launch) rather than SDPA example by
    example: CUDA, bf16/fp16, no attention dropout, and a torch that has it."""
    return varlen_attn is not None and query.is_cuda and query.dtype in HALF_PRECISION and not dropout


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: PackedRowParams, *,
                     scale: float, causal: bool = True, dropout: float = 0.0) -> torch.Tensor:
    """Attention of a packed row in THD layout: query ``[t, heads, d]``, key/value ``[t, groups, d]`` ->
    ``[t, heads, d]``. Sequence ``i`` (``params.host_cu_seqlens[i]:[i+1]``) attends to itself only,
    causally if ``causal``; tokens after the last sequence (the padding tail) attend to nothing and get
    zeros. The kernel: see the module docstring."""
    if not isinstance(params, PackedRowParams):
        raise TypeError(f"packed rows take PackedRowParams (MicroBatch.packed_seq_params(): the bounds on the "
                        f"host too), got {type(params).__name__}")
    padded = params.cu_seqlens_q_padded is not None or params.cu_seqlens_kv_padded is not None
    if params.qkv_format != "thd" or padded or params.cu_seqlens_kv is not params.cu_seqlens_q:
        raise NotImplementedError(f"SDPAttention: packed self-attention in THD layout only, without padded bounds "
                                  f"(got qkv_format={params.qkv_format!r}, padded bounds: {padded}, the same "
                                  f"cu_seqlens for keys: {params.cu_seqlens_kv is params.cu_seqlens_q})")
    bounds = params.host_cu_seqlens
    length, heads, groups = query.shape[0], query.shape[1], key.shape[1]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] > length or key.shape[0] != length:
        raise ValueError(f"packed row of {length} queries and {key.shape[0]} keys, sequence bounds "
                         f"{bounds[:4]}...{bounds[-1:]}: they must start at 0 and end within the row")
    total = bounds[-1]
    if uses_varlen_kernel(query, dropout):
        context = varlen_attn(query[:total], key[:total], value[:total], params.cu_seqlens_q, params.cu_seqlens_kv,
                              params.max_seqlen_q, params.max_seqlen_kv, scale=scale,
                              window_size=(-1, 0) if causal else (-1, -1), enable_gqa=groups != heads)
    else:
        if query.is_cuda and query.dtype not in HALF_PRECISION and groups != heads:
            # fp32 on CUDA is the memory-efficient kernel's, which takes no grouped K/V (see forward)
            key, value = (t.repeat_interleave(heads // groups, dim=1) for t in (key, value))
        parts = []
        for start, end in zip(bounds, bounds[1:]):
            q, k, v = (t[start:end].transpose(0, 1)[None] for t in (query, key, value))  # [1, heads, s, d]
            part = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal, scale=scale,
                                                  enable_gqa=k.shape[1] != heads)
            parts.append(part[0].transpose(0, 1))
        context = torch.cat(parts)
    if total < length:
        context = torch.cat([context, context.new_zeros(length - total, *context.shape[1:])])
    return context


def dense_block_diagonal_mask(host_cu_seqlens: Sequence[int], length: int, causal: bool = True) -> torch.Tensor:
    """The dense equivalent of a packed row's attention: bool ``[1, 1, T, T]``, True = masked; each sequence
    attends within itself (causally if ``causal``), the padding tail forms one more block. A reference for
    the tests and the benchmark (``T x T``: 256 MiB at 16k tokens), never built in training."""
    segment = torch.bucketize(torch.arange(length), torch.tensor(host_cu_seqlens[1:], dtype=torch.long), right=True)
    allowed = segment[:, None] == segment[None, :]
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    return ~allowed[None, None]
