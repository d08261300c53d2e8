"""The backbone as megatron-core's ``HybridModel`` (``megatron.core.models.hybrid``, 0.19+, where ``GPTModel``
is deprecated): the GPT backbone's transformer layers written as a hybrid layer pattern.

``HybridModel`` builds its stack from a pattern of layer symbols, one per layer (megatron-core's
``hybrid_layer_allocation.Symbols``), with ``|`` between pipeline segments: segment ``vp * PP + pp`` is
chunk ``vp`` of pipeline rank ``pp``, the layers ``GPTModel`` gives that chunk. Here one transformer layer
of the backbone is two layers of the stack, an attention layer (``*``: its norm, self-attention and the
residual add) then an MLP layer (``-``: its norm, the MLP and the residual add). :func:`hybrid_stack_spec`
cuts megatron-core's GPT layer spec into these two halves, so the stack computes what the GPT layers
compute, with the same modules created in the same order (the same initial weights, drawn from the same
generator), and the final norm is the GPT block's; an MoE backbone's FFN half is an MoE layer (``E``). The
config counts the stack's layers (``num_layers`` = 2 x transformer layers) with ``is_hybrid_model``, as
megatron-core's hybrid models do; with it the output-layer init is std / sqrt(stack layers), GPTModel's
std / sqrt(2 x transformer layers).

Parameter names differ from ``GPTModel``'s: transformer layer ``i`` is ``decoder.layers.{2i}`` (its
attention and input norm) and ``decoder.layers.{2i+1}`` (its MLP and pre-MLP norm), and the final norm is
``decoder.final_norm`` (``GPTModel``: ``decoder.layers.{i}``, ``decoder.final_layernorm``).

This module imports only where megatron-core has ``HybridModel`` (:data:`megatron_orch.mllm.model.HYBRID_BACKBONE`).
"""
from __future__ import annotations

import dataclasses

from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
from megatron.core.ssm.mlp_layer import MLPLayer
from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import LayerNormImpl
from megatron.core.transformer.transformer_layer import MoETransformerLayer, TransformerLayer

from megatron_orch.balance.cost import TransformerShape

# One transformer layer of the backbone in the stack: its attention layer, then its MLP layer.
TRANSFORMER_LAYER = Symbols.ATTENTION + Symbols.MLP


# An MoE backbone's transformer layer: its attention layer, then its MoE layer.
MOE_TRANSFORMER_LAYER = Symbols.ATTENTION + Symbols.MOE


def backbone_layer_pattern(num_layers: int, pipeline_segments: int, moe: bool = False) -> str:
    """The ``hybrid_layer_pattern`` of a backbone of ``num_layers`` transformer layers split evenly into
    ``pipeline_segments`` (PP x VPP) pipeline segments; the one place the backbone's pattern is made.
    ``moe``: every layer's FFN is megatron-core's MoE layer (``E``)."""
    if pipeline_segments < 1 or num_layers % pipeline_segments:
        raise ValueError(f"the backbone's {num_layers} layers do not split evenly into {pipeline_segments} pipeline "
                         "segments (pipeline stages x virtual stages)")
    layer = MOE_TRANSFORMER_LAYER if moe else TRANSFORMER_LAYER
    return Symbols.PIPE.join([layer * (num_layers // pipeline_segments)] * pipeline_segments)


def hybrid_config_fields(shape: TransformerShape) -> dict:
    """What the stack's ``TransformerConfig`` sets beyond a GPT backbone's (module docstring)."""
    return {"num_layers": shape.num_layers * len(TRANSFORMER_LAYER), "is_hybrid_model": True}


class BackboneHybridStack(HybridStack):
    """megatron-core's ``HybridStack`` with the final norm its spec names (megatron-core's own builds Transformer
    Engine's always)."""

    def __init__(self, config, submodules: HybridStackSubmodules, *args, final_norm: type,
                 post_layer_norm: bool = True, **kwargs):
        super().__init__(config, submodules, *args, post_layer_norm=False, **kwargs)
        self.post_layer_norm = post_layer_norm
        if self.post_process and post_layer_norm:
            self.final_norm = final_norm(config=config, hidden_size=config.hidden_size, eps=config.layernorm_epsilon)


def hybrid_stack_spec(layer_spec: ModuleSpec, final_norm: type = LayerNormImpl, moe: bool = False) -> ModuleSpec:
    """The stack spec whose attention and MLP layers are the two halves of the GPT layer ``layer_spec``, ending
    in ``final_norm`` (default the GPT block's: ``LayerNormImpl``, Transformer Engine's where it imports, else
    Apex's or torch's); ``moe``: its FFN half (megatron-core's MoE layer) is the stack's MoE layer
    (``MoETransformerLayer``)."""
    parts = layer_spec.submodules
    attention = dataclasses.replace(parts, pre_mlp_layernorm=IdentityOp, mlp=IdentityOp, mlp_bda=IdentityFuncOp)
    mlp = dataclasses.replace(parts, input_layernorm=IdentityOp, self_attention=IdentityOp,
                              self_attn_bda=IdentityFuncOp)
    ffn = {"moe_layer": ModuleSpec(module=MoETransformerLayer, submodules=mlp)} if moe else \
        {"mlp_layer": ModuleSpec(module=MLPLayer, submodules=mlp)}
    return ModuleSpec(module=BackboneHybridStack, params={"final_norm": final_norm}, submodules=HybridStackSubmodules(
        attention_layer=ModuleSpec(module=TransformerLayer, submodules=attention), **ffn))
