"""Per-item cost of one transformer phase, derived from the model's own shape, and the interface every
cost model offers the planner (:class:`CostModel`: FLOPs from a shape, :class:`TransformerCost`; a
measured profile, :class:`~megatron_orch.balance.cost_profile.ProfileCost`; a user's function,
:class:`FunctionCost`).

The partitioner balances *training FLOPs* per rank, so only ratios between items matter; the
absolute figures are still real FLOP counts so that a modeled step time can be read off them.

Forward FLOPs of one sequence of ``s`` tokens through ``L`` layers (a multiply-add = 2 FLOPs):

* linear part, per token and layer: ``2 * (h*(q + 2*kv) + q*h + m*h*f)`` for the QKV projection,
  the attention output projection and the FFN (``m = 3`` for a gated/SwiGLU FFN, 2 otherwise), with
  ``q = heads * head_dim`` and ``kv = query_groups * head_dim`` (grouped-query attention);
* attention part, per attended (query, key) pair and layer: ``4 * q`` (``Q K^T`` and ``A V``). A full
  (encoder) attention attends ``s^2`` pairs; a causal (decoder) one ``s*(s+1)/2``, about half. A packed
  backbone row costs the sum of its examples: its kernel attends each example causally on its own
  (``megatron_orch.mllm.attention.packed_attention``: ``varlen_attn`` or SDPA per example, up to the
  kernel's tile rounding), not the row's ``T^2`` a dense block-diagonal mask would make it compute;
* a logits layer of width ``vocab_size`` (backbone only): ``2 * h * vocab_size`` per token.

Training = forward + backward ~= 3x forward.

A mixture-of-experts FFN (``num_experts`` set, every layer; Megatron-Core's MoE layer) runs each token
through its router (``2 * h * num_experts``: the gate's logits) and ``moe_router_topk`` experts of width
``moe_ffn_hidden_size`` (default ``ffn_hidden_size``), plus a shared expert of width
``moe_shared_expert_intermediate_size`` if set: the *active* parameters' FLOPs, what a token costs whichever
experts it picks. The expert dispatch (the all-to-all of tokens to their experts over the expert-parallel
group, and back) moves ``2 * topk * h`` values per token and layer inside one model replica; it is linear in
tokens like the FFN itself, so balancing tokens balances it, and it is none of post-balancing's moves (the
plan's byte accounting, ``StepPlan.traffic``, counts only those;
:meth:`TransformerShape.expert_dispatch_bytes_per_token` is the model's own traffic).

Activation memory per token and layer follows Korthikanti et al. 2022 ("Reducing Activation
Recomputation in Large Transformer Models", Table 2; bf16 = 2 bytes per element) with today's
practice: flash attention (the ``5*a*s`` softmax/dropout terms become one fp32 log-sum-exp per head),
no dropout masks, grouped-query K/V and a gated FFN. Bytes stored per token and layer:
``2*(2h)`` two norm inputs, ``2h`` QKV input, ``2*(q + 2kv)`` Q, K, V, ``2q`` attention output,
``4*heads`` log-sum-exp, ``2h`` FFN input, and ``2*(2f) + 2f`` (gated: both FC1 halves and the
activation output) or ``2f + 2f`` (non-gated: FC1 output and activation output). For the classic
GPT shape (f = 4h, MHA) this is ``32h + 4a`` bytes, the paper's ``34h`` minus its two dropout masks.
An MoE FFN keeps, per token, its input ``h``, each of its ``topk`` routed copies (the permuted input ``h``
and the expert's FC1 output and activation as above, of width ``moe_ffn_hidden_size``), the shared expert's
as a dense FFN, and the router's fp32 logits and probabilities (``8 * num_experts`` bytes).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional, Protocol, Tuple, runtime_checkable

import numpy as np

BF16_BYTES = 2
TRAINING_FLOPS_PER_FORWARD = 3.0


def _lengths(seq_len) -> np.ndarray:
    s = np.asarray(seq_len, dtype=np.float64)
    if s.size and not (np.all(np.isfinite(s)) and s.min() >= 0):
        bad = s.flat[int(np.flatnonzero(~(np.isfinite(s) & (s >= 0)))[0])]
        raise ValueError(f"sequence lengths must be finite and >= 0, got {bad}")
    return s


@dataclass(frozen=True)
class TransformerShape:
    """Shape of a transformer stack, named like Megatron-Core's ``TransformerConfig`` fields."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    causal: bool
    num_query_groups: Optional[int] = None  # None: multi-head attention (one K/V per head)
    kv_channels: Optional[int] = None  # head dim; None: hidden_size // num_attention_heads
    gated_linear_unit: bool = False  # SwiGLU-style FFN with two input projections
    vocab_size: int = 0  # width of the logits layer (backbone); 0 for encoders
    num_experts: Optional[int] = None  # None: a dense FFN; else every layer's FFN is a mixture of experts
    moe_router_topk: int = 2  # experts each token runs
    moe_ffn_hidden_size: Optional[int] = None  # one expert's FFN width; None: ffn_hidden_size
    moe_shared_expert_intermediate_size: Optional[int] = None  # a shared expert every token runs; None: none

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"TransformerShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_experts is not None and not 1 <= self.moe_router_topk <= self.num_experts:
            raise ValueError(f"moe_router_topk={self.moe_router_topk} must be in 1..num_experts={self.num_experts}")
        for name in ("moe_ffn_hidden_size", "moe_shared_expert_intermediate_size"):
            if getattr(self, name) is not None and (self.num_experts is None or getattr(self, name) < 1):
                raise ValueError(f"TransformerShape.{name}={getattr(self, name)} needs num_experts and must be >= 1")
        if self.num_query_groups is not None and (
                self.num_query_groups < 1 or self.num_attention_heads % self.num_query_groups):
            raise ValueError(f"num_query_groups={self.num_query_groups} must divide "
                             f"num_attention_heads={self.num_attention_heads}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                             f"{self.num_attention_heads}; set kv_channels")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return (self.num_query_groups or self.num_attention_heads) * self.head_dim

    @property
    def _ffn_inputs(self) -> int:
        return 2 if self.gated_linear_unit else 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        """One expert's FFN width (MoE)."""
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    def _ffn_weights(self, width: int) -> int:
        """Weights of one FFN of ``width`` (FC1, gated or not, and FC2)."""
        return (self._ffn_inputs + 1) * self.hidden_size * width

    def _active_ffn_weights(self) -> int:
        """The FFN weights one token multiplies with: the dense FFN, or the router, its top-k experts and the
        shared expert."""
        if not self.is_moe:
            return self._ffn_weights(self.ffn_hidden_size)
        shared = self.moe_shared_expert_intermediate_size
        experts = self.moe_router_topk * self._ffn_weights(self.expert_ffn_hidden_size)
        return self.hidden_size * self.num_experts + experts + (self._ffn_weights(shared) if shared else 0)

    def linear_flops_per_token(self) -> float:
        """Forward FLOPs per token that do not depend on the sequence length (all layers + logits); an MoE
        FFN counts the active parameters only (router, top-k experts, shared expert)."""
        h, q, kv = self.hidden_size, self.query_size, self.kv_size
        per_layer = 2 * (h * (q + 2 * kv) + q * h + self._active_ffn_weights())
        return float(self.num_layers * per_layer + 2 * h * self.vocab_size)

    def expert_dispatch_bytes_per_token(self, bytes_per_element: int = BF16_BYTES) -> float:
        """Bytes one token sends to its experts and receives back in the forward, all layers (0 for a dense
        FFN): the MoE layers' own all-to-all inside a model replica, not a post-balancing move."""
        if not self.is_moe:
            return 0.0
        return float(self.num_layers * 2 * self.moe_router_topk * self.hidden_size * bytes_per_element)

    def attended_pairs(self, seq_len) -> np.ndarray:
        """(query, key) pairs one sequence attends: s^2 (full) or s(s+1)/2 (causal)."""
        s = _lengths(seq_len)
        return s * (s + 1) / 2 if self.causal else s * s

    def forward_flops(self, seq_len) -> np.ndarray:
        """Forward FLOPs of one sequence of ``seq_len`` tokens (vectorised over an array of lengths)."""
        s = _lengths(seq_len)
        attention = self.num_layers * 4.0 * self.query_size * self.attended_pairs(s)
        return self.linear_flops_per_token() * s + attention

    def train_flops(self, seq_len) -> np.ndarray:
        """Forward + backward FLOPs (~3x forward): the cost the partitioner balances."""
        return TRAINING_FLOPS_PER_FORWARD * self.forward_flops(seq_len)

    def activation_bytes_per_token(self) -> float:
        """Activation bytes kept for backward per token, all layers (see the module docstring)."""
        h, q, kv = self.hidden_size, self.query_size, self.kv_size
        ffn = (self._ffn_inputs + 1) * self.ffn_hidden_size
        router = 0
        if self.is_moe:
            shared = self.moe_shared_expert_intermediate_size
            ffn = (self.moe_router_topk * (h + (self._ffn_inputs + 1) * self.expert_ffn_hidden_size)
                   + ((self._ffn_inputs + 1) * shared if shared else 0))
            router = 8 * self.num_experts  # fp32 logits and probabilities
        elements = 2 * h + h + (q + 2 * kv) + q + h + ffn
        per_layer = BF16_BYTES * elements + 4 * self.num_attention_heads + router
        return float(self.num_layers * per_layer)

    def activation_bytes(self, seq_len) -> np.ndarray:
        """Activation memory of one sequence (linear in its length thanks to flash attention)."""
        return self.activation_bytes_per_token() * _lengths(seq_len)

    def num_parameters(self) -> int:
        """Weights of the layers (QKV, projection, FFN, two norms each) and a final norm; an MoE FFN is the
        router, every expert and the shared expert.

        Biases are left out (< 0.1% of any shape here); embeddings are counted by the model config.
        """
        h, q, kv = self.hidden_size, self.query_size, self.kv_size
        ffn = self._ffn_weights(self.ffn_hidden_size)
        if self.is_moe:
            shared = self.moe_shared_expert_intermediate_size
            ffn = (h * self.num_experts + self.num_experts * self._ffn_weights(self.expert_ffn_hidden_size)
                   + (self._ffn_weights(shared) if shared else 0))
        per_layer = h * (q + 2 * kv) + q * h + ffn + 2 * h
        return self.num_layers * per_layer + h

    def num_active_parameters(self) -> int:
        """The weights one token multiplies with (:meth:`num_parameters` for a dense FFN)."""
        h, q, kv = self.hidden_size, self.query_size, self.kv_size
        return self.num_layers * (h * (q + 2 * kv) + q * h + self._active_ffn_weights() + 2 * h) + h


@dataclass(frozen=True)
class ProjectorShape:
    """Two-layer MLP from an encoder's merged output tokens to the backbone's hidden size.

    ``input_size`` is the encoder hidden size times the tokens merged into one output token (pixel
    shuffle / frame stacking concatenates them); costs are per *output* (LLM-side) token.
    """

    input_size: int
    ffn_hidden_size: int
    output_size: int

    def __post_init__(self):
        for name in ("input_size", "ffn_hidden_size", "output_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ProjectorShape.{name} must be >= 1, got {getattr(self, name)}")

    def forward_flops(self, num_tokens) -> np.ndarray:
        per_token = 2 * (self.input_size * self.ffn_hidden_size + self.ffn_hidden_size * self.output_size)
        return float(per_token) * _lengths(num_tokens)

    def train_flops(self, num_tokens) -> np.ndarray:
        return TRAINING_FLOPS_PER_FORWARD * self.forward_flops(num_tokens)

    def activation_bytes(self, num_tokens) -> np.ndarray:
        """Input norm input, FC1 input, FC1 output and activation output, bf16."""
        per_token = BF16_BYTES * (2 * self.input_size + 2 * self.ffn_hidden_size)
        return float(per_token) * _lengths(num_tokens)

    def num_parameters(self) -> int:
        """Input LayerNorm (weight + bias) and the two weight matrices."""
        return 2 * self.input_size + self.input_size * self.ffn_hidden_size + self.ffn_hidden_size * self.output_size


@runtime_checkable
class CostModel(Protocol):
    """What the planner asks of a phase's cost model, vectorised over items by the tokens each one runs:
    their cost (training FLOPs or seconds: only ratios matter to the balance) and their activation bytes.
    ``signature`` is what a measured cost of the phase depends on (a cost profile is refused for a phase
    of another signature)."""

    def item_cost(self, tokens: np.ndarray) -> np.ndarray: ...

    def item_memory(self, tokens: np.ndarray) -> np.ndarray: ...

    def signature(self) -> Dict[str, object]: ...


_SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                 "kv_channels", "gated_linear_unit", "vocab_size")
_MOE_FIELDS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size")


@dataclass(frozen=True)
class TransformerCost:
    """Training FLOPs and activation bytes of a transformer phase's items, from its shape: any encoder
    (``tokens`` = the tokens of one item, an optional projector over the ``projector_tokens`` rows one item
    gives the backbone) or the backbone (``tokens`` = an example's sequence length).

    ``details``: further fields a measured profile of the phase depends on (e.g. an input width the
    transformer's shape does not show).
    """

    transformer: TransformerShape
    projector: Optional[ProjectorShape] = None
    projector_tokens: int = 0
    details: Tuple[Tuple[str, object], ...] = ()

    def __post_init__(self):
        if self.projector_tokens < 0 or (self.projector is None and self.projector_tokens):
            raise ValueError(f"projector_tokens={self.projector_tokens} needs a projector and must be >= 0")

    def item_cost(self, tokens) -> np.ndarray:
        cost = self.transformer.train_flops(tokens)
        return cost + (0.0 if self.projector is None else float(self.projector.train_flops(self.projector_tokens)))

    def item_memory(self, tokens) -> np.ndarray:
        memory = self.transformer.activation_bytes(tokens)
        return memory + (0.0 if self.projector is None else
                         float(self.projector.activation_bytes(self.projector_tokens)))

    def signature(self) -> Dict[str, object]:
        fields = _SHAPE_FIELDS + (_MOE_FIELDS if self.transformer.is_moe else ())  # a dense shape's as ever
        out = {name: getattr(self.transformer, name) for name in fields}
        if self.projector is not None:
            out["projector_ffn_hidden_size"] = self.projector.ffn_hidden_size
        out.update(self.details)
        return out


@dataclass(frozen=True)
class FunctionCost:
    """A user's cost function: ``cost(tokens) -> cost per item`` (and optionally ``memory(tokens) ->
    activation bytes per item``; without it memory counts nothing), both vectorised over a numpy array."""

    cost: Callable[[np.ndarray], np.ndarray]
    memory: Optional[Callable[[np.ndarray], np.ndarray]] = None
    signature_fields: Tuple[Tuple[str, object], ...] = ()

    def item_cost(self, tokens) -> np.ndarray:
        return np.asarray(self.cost(_lengths(tokens)), dtype=np.float64)

    def item_memory(self, tokens) -> np.ndarray:
        s = _lengths(tokens)
        return np.zeros_like(s) if self.memory is None else np.asarray(self.memory(s), dtype=np.float64)

    def signature(self) -> Dict[str, object]:
        return dict(self.signature_fields)


@dataclass(frozen=True)
class ContextParallelCost:
    """A backbone cost model per context-parallel rank: an example of ``s`` tokens is padded to a multiple of
    ``2C`` and cut into ``2C`` chunks, each CP rank computing two (megatron-core's zig-zag), so every rank
    runs ``s' / C`` of its tokens and, causally, exactly ``1 / C`` of its attended pairs (chunks ``r`` and
    ``2C-1-r`` attend ``c^2 (2C-1) + c (c+1)`` pairs for any ``r``). Cost and activation memory are therefore
    the whole padded example's divided by ``C`` (the exchange of keys and values between CP ranks is not
    modeled). ``base``: the cost model of whole sequences."""

    base: CostModel
    context_parallel_size: int

    def __post_init__(self):
        if self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1, got {self.context_parallel_size}")

    def padded(self, tokens) -> np.ndarray:
        multiple = 2 * self.context_parallel_size if self.context_parallel_size > 1 else 1
        return np.ceil(_lengths(tokens) / multiple) * multiple

    def item_cost(self, tokens) -> np.ndarray:
        return np.asarray(self.base.item_cost(self.padded(tokens)), dtype=np.float64) / self.context_parallel_size

    def item_memory(self, tokens) -> np.ndarray:
        return np.asarray(self.base.item_memory(self.padded(tokens)), dtype=np.float64) / self.context_parallel_size

    def signature(self) -> Dict[str, object]:
        return self.base.signature()
