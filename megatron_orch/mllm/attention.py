"""Core attention through ``torch.nn.functional.scaled_dot_product_attention`` (SDPA).

megatron-core's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` scores and
probabilities: attention then costs several times a linear layer's FLOP, and long sequences run out
of memory. :class:`SDPAttention` is a drop-in for it in a layer spec (``core_attention``), with the
same constructor arguments, call and output, but lets torch pick a fused kernel: flash attention
for causal rows without a mask, memory-efficient attention for a block-diagonal (packed) mask, the
math kernel on CPU. It is the core attention of ``--transformer-impl local``.
"""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class SDPAttention(MegatronModule):
    """softmax(q k^T * scale + mask) v over this tensor-parallel rank's heads.

    Inputs are megatron's: query ``[sq, b, heads, d]``, key/value ``[sk, b, groups, d]`` (this rank's
    heads and query groups), ``attention_mask`` None or bool ``[b or 1, 1, sq, sk]`` with True =
    masked. Output ``[sq, b, heads * d]``. Like megatron's ``DotProductAttention``, a given mask is
    applied as is and ``attn_mask_type`` only decides what happens without one: causal, or
    bidirectional (``no_mask``, the encoders).

    No parameters and no state: a model's checkpoint is the same with it or ``DotProductAttention``.
    ``layer_number``, ``attention_type``, ``cp_comm_type`` and ``pg_collection`` are accepted for the
    spec interface; the heads come from the tensors. Query-key layer scaling is an fp16 range trick whose scale
    cancels in megatron's softmax; SDPA keeps its softmax in fp32, so it is not needed here.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None):
        super().__init__(config=config)
        unsupported = []
        if config.context_parallel_size > 1:
            unsupported.append(f"context parallelism (context_parallel_size={config.context_parallel_size})")
        if config.window_size is not None:
            unsupported.append(f"sliding-window attention (window_size={config.window_size})")
        if config.softmax_type != "vanilla":
            unsupported.append(f"softmax_type={config.softmax_type!r}")
        if unsupported:
            raise NotImplementedError(f"SDPAttention (--transformer-impl local) does not support "
                                      f"{', '.join(unsupported)}; use --transformer-impl transformer_engine")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = 1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else softmax_scale
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None,
                packed_seq_params: Optional[PackedSeqParams] = None) -> torch.Tensor:
        if attention_bias is not None:
            raise NotImplementedError("SDPAttention does not support attention_bias")
        if packed_seq_params is not None:
            raise NotImplementedError(
                f"SDPAttention does not support packed_seq_params (qkv_format={packed_seq_params.qkv_format!r}); "
                "packed rows take a block-diagonal attention_mask instead")
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
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
        dropout = self.attention_dropout if self.training else 0.0
        # Each TP rank holds different heads: draw dropout from the model-parallel RNG, like megatron.
        rng = tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext()
        with rng:
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=mask, dropout_p=dropout, is_causal=is_causal,
                scale=self.softmax_scale, enable_gqa=key.shape[1] != heads)
        return context.permute(2, 0, 1, 3).reshape(sq, b, heads * head_dim)
