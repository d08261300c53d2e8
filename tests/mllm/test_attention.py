"""SDPAttention against megatron-core's DotProductAttention, packed rows' variable-length attention
against the dense block-diagonal mask (the reference, built here only), and the --transformer-impl
selection.

Single CPU process (gloo world of 1 through the CPU harness), fp32: the SDPA kernels and megatron's
unfused attention agree to rounding.
"""
import dataclasses
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.trainer import cpu_harness  # noqa: E402

cpu_harness.install()

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_orch.balance.cost import TRAINING_FLOPS_PER_FORWARD, TransformerShape  # noqa: E402
from megatron_orch.mllm.config import load_model_config  # noqa: E402
from megatron_orch.mllm import providers  # noqa: E402
from megatron_orch.trainer import arguments  # noqa: E402
from megatron_orch.mllm import model as model_module  # noqa: E402
from megatron_orch.mllm import attention as attention_module  # noqa: E402
from megatron_orch.mllm.attention import SDPAttention, dense_block_diagonal_mask, packed_attention  # noqa: E402
from megatron_orch.megatron.batch import Example, MicroBatch, PackedRowParams, collate, collate_packed  # noqa: E402
from megatron_orch.mllm.examples import assemble_example, batch_spec  # noqa: E402
from megatron_orch.mllm.model import (  # noqa: E402
    MLLMModel,
    ModelParallelSettings,
    transformer_config,
    transformer_layer_spec,
)
from megatron_orch.mllm.task import MLLM_TASK

SEQ_LENGTH = 128
TOLERANCE = 1e-5  # relative error, fp32


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


def attention_config(heads: int, groups: int, head_dim: int = 8, attention_dropout: float = 0.0):
    shape = TransformerShape(num_layers=1, hidden_size=heads * head_dim, ffn_hidden_size=4 * heads * head_dim,
                             num_attention_heads=heads, num_query_groups=groups, kv_channels=head_dim, causal=True)
    return transformer_config(shape, ModelParallelSettings(attention_dropout=attention_dropout),
                              pipeline_split=False)


def both_attentions(config, mask_type, **kwargs):
    common = dict(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self", **kwargs)
    return SDPAttention(**common), DotProductAttention(**common)


def forward_backward(attention, query, key, value, mask):
    """Output and the gradients of (query, key, value) for a fixed random upstream gradient."""
    inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
    output = attention(*inputs, mask, attn_mask_type=attention.attn_mask_type)
    output.backward(torch.randn(output.shape, generator=torch.Generator().manual_seed(1)))
    return [output.detach()] + [t.grad for t in inputs]


CASES = {
    # name: (heads, query groups, batch, seq, mask type, mask or None)
    "causal_no_mask": (4, 4, 2, 24, AttnMaskType.causal, None),
    "packed_block_diagonal": (4, 4, 1, 24, AttnMaskType.causal, dense_block_diagonal_mask([0, 5, 12, 20], 24)),
    "per_row_masks": (4, 4, 2, 16, AttnMaskType.causal, torch.cat([dense_block_diagonal_mask([0, 7, 16], 16),
                                                                  dense_block_diagonal_mask([0, 3, 10], 16)])),
    "bidirectional_no_mask": (4, 4, 2, 17, AttnMaskType.no_mask, None),
    "gqa_causal_no_mask": (8, 2, 2, 24, AttnMaskType.causal, None),
    "gqa_packed": (8, 2, 1, 24, AttnMaskType.causal, dense_block_diagonal_mask([0, 9, 24], 24)),
    "multi_query_bidirectional": (4, 1, 3, 10, AttnMaskType.no_mask, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_megatron_dot_product_attention_forward_and_backward(world_of_one, case):
    heads, groups, batch, seq, mask_type, mask = CASES[case]
    config = attention_config(heads, groups)
    sdpa, reference = both_attentions(config, mask_type)
    g = torch.Generator().manual_seed(0)
    query = torch.randn(seq, batch, heads, 8, generator=g)
    key, value = (torch.randn(seq, batch, groups, 8, generator=g) for _ in range(2))
    expected = forward_backward(reference, query, key, value, mask)
    actual = forward_backward(sdpa, query, key, value, mask)
    assert actual[0].shape == (seq, batch, heads * 8)
    for name, a, e in zip(("output", "query grad", "key grad", "value grad"), actual, expected):
        assert relative_error(a, e) <= TOLERANCE, (name, relative_error(a, e))


def test_explicit_softmax_scale_is_used(world_of_one):
    config = attention_config(4, 4)
    sdpa, reference = both_attentions(config, AttnMaskType.causal, softmax_scale=0.05)
    query, key, value = (torch.randn(12, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    expected, actual = reference(query, key, value, None), sdpa(query, key, value, None)
    assert relative_error(actual, expected) <= TOLERANCE
    default = SDPAttention(config, 1, AttnMaskType.causal, "self")(query, key, value, None)
    assert relative_error(default, expected) > 1e-2


def test_dropout_only_in_training(world_of_one):
    sdpa, reference = both_attentions(attention_config(4, 4, attention_dropout=0.5), AttnMaskType.causal)
    sdpa.eval(), reference.eval()
    query, key, value = (torch.randn(12, 2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    evaluated = sdpa(query, key, value, None)
    assert relative_error(evaluated, reference(query, key, value, None)) <= TOLERANCE
    sdpa.train()
    assert relative_error(sdpa(query, key, value, None), evaluated) > 1e-2


def test_unsupported_features_are_refused_by_name(world_of_one):
    config = attention_config(4, 4)
    sdpa = SDPAttention(config, 1, AttnMaskType.causal, "self")
    q = torch.randn(6, 1, 4, 8)
    with pytest.raises(NotImplementedError, match="attention_bias"):
        sdpa(q, q, q, None, attention_bias=torch.zeros(1, 4, 6, 6))
    with pytest.raises(NotImplementedError, match="as many keys as queries"):
        sdpa(q[:1], q, q, None)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        SDPAttention(dataclasses.replace(config, window_size=(4, 0)), 1, AttnMaskType.causal, "self")
    cp_sdpa = SDPAttention(dataclasses.replace(config, context_parallel_size=2), 1, AttnMaskType.causal, "self")
    with pytest.raises(NotImplementedError, match="context parallelism takes causal attention without a mask"):
        cp_sdpa(q, q, q, torch.ones(1, 1, 6, 6, dtype=torch.bool))


# --- packed rows: variable-length attention against the dense block-diagonal mask ------------------

def packed_row(lengths, tail=0) -> MicroBatch:
    """A text-only packed row of examples of ``lengths`` tokens and a padding tail of ``tail``."""
    examples = [Example(sample_index=i, tokens=torch.full((n,), 7), labels=torch.full((n,), 7), loss_mask=torch.ones(n))
                for i, n in enumerate(lengths)]
    return collate_packed(examples, batch_spec(load_model_config("tiny"), 4096), pad_to=sum(lengths) + tail)


def dense_reference_mask(lengths, tail, causal=True):
    """The reference: examples of ``lengths`` tokens then a padding tail, as a dense mask."""
    bounds = [0] + torch.tensor(lengths).cumsum(0).tolist()
    return dense_block_diagonal_mask(bounds, bounds[-1] + tail, causal)


@pytest.mark.parametrize("causal", [True, False])
def test_dense_reference_mask_against_owner_of_each_position(causal):
    lengths, tail = [3, 1, 4], 2
    owner = [i for i, n in enumerate(lengths) for _ in range(n)] + [-1] * tail
    expected = torch.tensor([[not (owner[q] == owner[k] and (k <= q or not causal)) for k in range(len(owner))]
                             for q in range(len(owner))])
    assert torch.equal(dense_reference_mask(lengths, tail, causal)[0, 0], expected)


PACKED_CASES = {
    # name: (heads, query groups, example lengths, padding tail, mask type)
    "mha": (4, 4, [5, 7, 8], 0, AttnMaskType.causal),
    "gqa_with_padding_tail": (8, 2, [9, 15], 5, AttnMaskType.causal),
    "one_example": (4, 4, [24], 0, AttnMaskType.causal),
    "many_short_multi_query": (4, 1, [1, 2, 3, 1, 5, 1, 7], 3, AttnMaskType.causal),
    "bidirectional": (4, 4, [6, 10], 2, AttnMaskType.no_mask),
}


def packed_inputs(heads, groups, length, seed=0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(length, heads, 8, generator=g)
    key, value = (torch.randn(length, groups, 8, generator=g) for _ in range(2))
    return query, key, value


def packed_and_reference(case, attention_kwargs=None):
    """(packed outputs and q/k/v grads, dense-mask reference's, the row's real token count): the upstream
    gradient is zero on the padding tail, as the loss mask makes it."""
    heads, groups, lengths, tail, mask_type = PACKED_CASES[case]
    config = attention_config(heads, groups)
    sdpa, reference = both_attentions(config, mask_type, **(attention_kwargs or {}))
    total = sum(lengths)
    query, key, value = packed_inputs(heads, groups, total + tail)
    upstream = torch.randn(total + tail, heads * 8, generator=torch.Generator().manual_seed(1))
    upstream[total:] = 0

    def run(attention, layout, **kwargs):
        inputs = [t.detach().clone().requires_grad_() for t in (query, key, value)]
        output = attention(*(layout(t) for t in inputs), attn_mask_type=mask_type, **kwargs).reshape(total + tail, -1)
        output.backward(upstream)
        return [output.detach()] + [t.grad for t in inputs]

    mask = dense_reference_mask(lengths, tail, causal=mask_type == AttnMaskType.causal)
    expected = run(reference, lambda t: t[:, None], attention_mask=mask)  # [T, b=1, heads, d]
    actual = run(sdpa, lambda t: t, attention_mask=None, packed_seq_params=packed_row(lengths, tail).packed_seq_params())
    return actual, expected, total


def assert_packed_equals_reference(actual, expected, total):
    """Outputs of the real tokens and every gradient within TOLERANCE; the tail attends to nothing."""
    assert torch.equal(actual[0][total:], torch.zeros_like(actual[0][total:]))
    pairs = [("output", actual[0][:total], expected[0][:total])]
    pairs += list(zip(("query grad", "key grad", "value grad"), actual[1:], expected[1:]))
    for name, a, e in pairs:
        assert relative_error(a, e) <= TOLERANCE, (name, relative_error(a, e))


@pytest.mark.parametrize("case", list(PACKED_CASES))
def test_packed_rows_equal_the_dense_mask_reference_forward_and_backward(world_of_one, case):
    assert not attention_module.uses_varlen_kernel(torch.zeros(1), 0.0)  # CPU: SDPA example by example
    assert_packed_equals_reference(*packed_and_reference(case))


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None,
                          window_size=(-1, -1), enable_gqa=False):
    """torch's ``varlen_attn`` as its docstring defines it (it runs on CUDA only), written with a dense
    mask per sequence, and checking the arguments' types as its flash kernel needs them."""
    assert query.shape[0] == key.shape[0] == int(cu_seq_q[-1]) and cu_seq_q.dtype == torch.int32
    assert cu_seq_k is cu_seq_q and isinstance(max_q, int) and isinstance(max_k, int)
    lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
    assert max_q == max_k == max(lengths)
    assert window_size in ((-1, -1), (-1, 0)) and enable_gqa == (key.shape[1] != query.shape[1])
    causal = window_size == (-1, 0)
    out = []
    for start, n in zip(cu_seq_q[:-1].tolist(), lengths):
        q, k, v = (t[start:start + n].transpose(0, 1) for t in (query, key, value))
        k, v = (t.repeat_interleave(q.shape[0] // t.shape[0], dim=0) for t in (k, v))
        scores = q @ k.transpose(1, 2) * scale
        if causal:
            scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        out.append((scores.softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("case", ["gqa_with_padding_tail", "many_short_multi_query", "bidirectional"])
def test_the_varlen_kernel_call_equals_the_dense_mask_reference(world_of_one, monkeypatch, case):
    """The one-launch path (CUDA bf16 without dropout) with torch's varlen_attn emulated on CPU from its
    documented contract: the arguments packed_attention passes give the reference's result."""
    calls = []

    def emulated(*args, **kwargs):
        calls.append(args[0].shape)
        return reference_varlen_attn(*args, **kwargs)
    monkeypatch.setattr(attention_module, "varlen_attn", emulated)
    monkeypatch.setattr(attention_module, "uses_varlen_kernel", lambda query, dropout: True)
    actual, expected, total = packed_and_reference(case)
    assert len(calls) == 1 and calls[0][0] == total  # one launch over the real tokens only
    assert_packed_equals_reference(actual, expected, total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen_attn (flash) runs on CUDA only")
def test_varlen_kernel_on_cuda_equals_sdpa_example_by_example():
    lengths, tail = [300, 17, 700, 1], 11
    params = packed_row(lengths, tail).to(torch.device("cuda")).packed_seq_params()
    query, key, value = (t.cuda().bfloat16().requires_grad_() for t in packed_inputs(8, 2, sum(lengths) + tail))
    assert attention_module.uses_varlen_kernel(query, 0.0)
    outputs = []
    for one_launch in (True, False):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(attention_module, "uses_varlen_kernel", lambda q, dropout: one_launch)
            out = packed_attention(query, key, value, params, scale=8 ** -0.5)
            grads = torch.autograd.grad(out.float().square().sum(), (query, key, value))
            outputs.append([out.float()] + [g.float() for g in grads])
    for a, e in zip(*outputs):
        assert relative_error(a, e) <= 2e-2


def test_packed_dropout_only_in_training(world_of_one):
    sdpa = SDPAttention(attention_config(4, 4, attention_dropout=0.5), 1, AttnMaskType.causal, "self").eval()
    params = packed_row([5, 9]).packed_seq_params()
    query, key, value = packed_inputs(4, 4, 14)
    evaluated = sdpa(query, key, value, None, packed_seq_params=params)
    reference = DotProductAttention(attention_config(4, 4), 1, AttnMaskType.causal, "self")
    expected = reference(query[:, None], key[:, None], value[:, None], dense_reference_mask([5, 9], 0))
    assert relative_error(evaluated, expected.reshape(14, -1)) <= TOLERANCE
    sdpa.train()
    assert relative_error(sdpa(query, key, value, None, packed_seq_params=params), evaluated) > 1e-2


def test_packed_rows_bad_parameters_are_refused(world_of_one):
    sdpa = SDPAttention(attention_config(4, 4), 1, AttnMaskType.causal, "self")
    query, key, value = packed_inputs(4, 4, 12)
    params = packed_row([5, 7]).packed_seq_params()
    with pytest.raises(TypeError, match="PackedRowParams"):
        sdpa(query, key, value, None, packed_seq_params=PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=params.cu_seqlens_q, cu_seqlens_kv=params.cu_seqlens_q))
    with pytest.raises(NotImplementedError, match="qkv_format='sbhd'"):
        sdpa(query, key, value, None, packed_seq_params=dataclasses.replace(params, qkv_format="sbhd"))
    with pytest.raises(NotImplementedError, match="padded bounds: True"):
        sdpa(query, key, value, None, packed_seq_params=dataclasses.replace(params, cu_seqlens_q_padded=params.cu_seqlens_q))
    with pytest.raises(ValueError, match="takes no attention_mask"):
        sdpa(query, key, value, dense_reference_mask([5, 7], 0), packed_seq_params=params)
    with pytest.raises(ValueError, match="end within the row"):
        sdpa(query[:10], key[:10], value[:10], None, packed_seq_params=params)


# --- the whole model -------------------------------------------------------------------------------

def build_model(config):
    torch.manual_seed(0)
    return MLLMModel(config, ModelParallelSettings(), SEQ_LENGTH)


def with_megatron_attention(model, config):
    """A model with ``model``'s weights whose core attentions are megatron's DotProductAttention."""
    reference = build_model(config)
    reference.load_state_dict(model.state_dict())
    attentions = [m for m in reference.modules() if hasattr(m, "core_attention")]
    for attention in attentions:
        sdpa = attention.core_attention
        attention.core_attention = DotProductAttention(
            config=sdpa.config, layer_number=sdpa.layer_number, attn_mask_type=sdpa.attn_mask_type,
            attention_type="self", softmax_scale=sdpa.softmax_scale)
    return reference, attentions


def make_example(model, index, vision_items, audio_items, answer_tokens):
    spec = model.spec
    g = torch.Generator().manual_seed(index)
    items = {phase: torch.randn(n, *spec.input(phase).item_shape, generator=g)
             for phase, n in (("vision", vision_items), ("audio", audio_items))}
    answer = torch.randint(97, 123, (answer_tokens,), generator=g).tolist()
    return assemble_example(index, [116, 58, 32], answer, items, spec)


def dense_mask_forward(model, batch):
    """The reference for a packed row: the model's forward with the backbone given the dense block-diagonal
    mask instead of the THD parameters."""
    lengths = batch.seq_lengths.tolist()
    mask = dense_reference_mask(lengths, batch.tokens.shape[1] - sum(lengths))
    backbone = model.backbone

    def with_dense_mask(*args, attention_mask, packed_seq_params, **kwargs):
        assert attention_mask is None and packed_seq_params is not None
        return type(backbone).forward(backbone, *args, attention_mask=mask, packed_seq_params=None, **kwargs)
    backbone.forward = with_dense_mask
    try:
        return model(batch)
    finally:
        del backbone.forward


def loss_and_grads(model, batch, forward=None):
    model.zero_grad(set_to_none=True)
    per_token = (forward or type(model).__call__)(model, batch)
    loss = (per_token * batch.loss_mask).sum()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["padded_mha", "packed_gqa", "packed_with_padding_tail"])
def test_model_with_sdpa_equals_model_with_megatron_attention(world_of_one, layout):
    config = load_model_config("tiny")
    if layout != "padded_mha":
        backbone = dataclasses.replace(config.backbone.transformer, num_query_groups=2)
        config = dataclasses.replace(config, backbone=dataclasses.replace(config.backbone, transformer=backbone))
    model = build_model(config)
    reference, attentions = with_megatron_attention(model, config)
    # 2 layers in each of the vision encoder, audio encoder and backbone.
    assert len(attentions) == 6
    assert sum(isinstance(m, SDPAttention) for m in model.modules()) == 6
    assert not any(isinstance(m, SDPAttention) for m in reference.modules())
    assert sorted(a.attn_mask_type.name for a in attentions) == ["causal"] * 2 + ["no_mask"] * 4

    examples = [make_example(model, 0, 2, 1, 10), make_example(model, 1, 0, 2, 5), make_example(model, 2, 1, 0, 20)]
    if layout == "padded_mha":
        batch, reference_forward = collate(examples, model.spec), None
    else:
        tail = 9 if layout == "packed_with_padding_tail" else 0
        batch = collate_packed(examples, model.spec, pad_to=sum(e.num_tokens for e in examples) + tail)
        reference_forward = dense_mask_forward
    assert (batch.packed_seq_params() is not None) == (layout != "padded_mha")
    loss, grads = loss_and_grads(model, batch)
    expected_loss, expected_grads = loss_and_grads(reference, batch, reference_forward)
    assert relative_error(loss, expected_loss) <= TOLERANCE
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        error = relative_error(grad, expected_grads[name])
        assert error <= TOLERANCE, (name, error)


class LargestTensor(TorchDispatchMode):
    """Records the shape of the largest tensor any op returns (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.numel, self.shape, self.op = 0, None, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.numel:
                self.numel, self.shape, self.op = tensor.numel(), tuple(tensor.shape), str(func)
        return out


def test_a_packed_row_allocates_no_t_by_t_tensor(world_of_one):
    """Forward and backward of the whole model over one packed row of T = 2048 tokens (4 examples): no op
    returns a tensor of T x T elements or more (a dense mask, its float bias or the scores would). The
    largest is the logits, T x vocabulary (1024)."""
    torch.manual_seed(0)
    model = MLLMModel(load_model_config("tiny"), ModelParallelSettings(), 2048)
    examples = [make_example(model, i, 2 - i % 3, i % 2, n) for i, n in enumerate((600, 400, 500, 400))]
    batch = collate_packed(examples, model.spec, pad_to=2048)
    length = batch.tokens.shape[1]
    assert length == 2048 and sum(batch.seq_lengths.tolist()) < length  # a padding tail too
    with LargestTensor() as largest:
        (model(batch) * batch.loss_mask).sum().backward()
    assert largest.numel < length * length, (largest.op, largest.shape)
    assert largest.numel >= length * 1024, (largest.op, largest.shape)  # the mode saw the logits


class TransformerEngineTHDContract(torch.nn.Module):
    """A core attention that takes a packed row the way megatron-core's ``TEDotProductAttention`` hands it to
    Transformer Engine (which does not run here): only ``PackedSeqParams``' own fields (the base class's,
    ``dataclasses.fields``), ``qkv_format='thd'``, int32 bounds on the tensors' device, int max lengths, and
    every token of the row inside a sequence (TE's THD kernels: ``cu_seqlens[-1] == t``); causal becomes
    ``padding_causal``. It computes from those fields alone (the device ``cu_seqlens``, never
    ``host_cu_seqlens``), per sequence."""

    def __init__(self, softmax_scale):
        super().__init__()
        self.softmax_scale, self.calls = softmax_scale, []

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        te_kwargs = {f.name: getattr(packed_seq_params, f.name) for f in dataclasses.fields(PackedSeqParams)}
        cu_seqlens = te_kwargs["cu_seqlens_q"]
        assert attention_mask is None and attention_bias is None and te_kwargs["qkv_format"] == "thd"
        assert attn_mask_type == AttnMaskType.causal  # TE is asked for padding_causal
        assert cu_seqlens.dtype == torch.int32 and cu_seqlens.device == query.device
        assert te_kwargs["cu_seqlens_kv"] is cu_seqlens and te_kwargs["cu_seqlens_q_padded"] is None
        assert int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == query.shape[0] == key.shape[0]
        self.calls.append(cu_seqlens.tolist())
        context = reference_varlen_attn(query, key, value, cu_seqlens, cu_seqlens, te_kwargs["max_seqlen_q"],
                                        te_kwargs["max_seqlen_kv"], scale=self.softmax_scale, window_size=(-1, 0),
                                        enable_gqa=key.shape[1] != query.shape[1])
        return context.reshape(context.shape[0], -1)


def test_transformer_engine_contract_of_a_packed_row(world_of_one):
    """With transformer_impl='transformer_engine' a packed row reaches the backbone's core attention as TE
    takes it (TransformerEngineTHDContract): the padding tail becomes one more sequence, and the whole
    model's loss and every gradient equal the dense-mask reference's. What needs a GPU and TE, the kernels
    themselves: test_transformer_engine_thd_on_cuda_equals_packed_attention."""
    config = load_model_config("tiny")
    backbone = dataclasses.replace(config.backbone.transformer, num_query_groups=2)
    config = dataclasses.replace(config, backbone=dataclasses.replace(config.backbone, transformer=backbone))
    model = build_model(config)
    reference, _ = with_megatron_attention(model, config)
    contracts = []
    for attention in [m for m in model.backbone.modules() if hasattr(m, "core_attention")]:  # HybridModel's
        contracts.append(TransformerEngineTHDContract(attention.core_attention.softmax_scale))  # MLP layers: none
        attention.core_attention = contracts[-1]
    model.transformer_impl = "transformer_engine"
    examples = [make_example(model, 0, 2, 1, 10), make_example(model, 1, 0, 2, 5), make_example(model, 2, 1, 0, 20)]
    total = sum(e.num_tokens for e in examples)
    batch = collate_packed(examples, model.spec, pad_to=total + 9)
    loss, grads = loss_and_grads(model, batch)
    expected_loss, expected_grads = loss_and_grads(reference, batch, dense_mask_forward)
    bounds = list(batch.host_cu_seqlens)
    assert [c.calls for c in contracts] == [[bounds + [total + 9]]] * len(contracts)
    assert relative_error(loss, expected_loss) <= TOLERANCE
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert relative_error(grad, expected_grads[name]) <= TOLERANCE, name


@pytest.mark.skipif(not (torch.cuda.is_available() and model_module.transformer_engine_available()),
                    reason="Transformer Engine's THD attention needs a GPU and transformer_engine")
def test_transformer_engine_thd_on_cuda_equals_packed_attention(world_of_one):
    """megatron-core's TEDotProductAttention over a packed row with a padding tail (bf16): the real tokens'
    outputs and q/k/v gradients equal packed_attention's. Not run where this project is developed."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention
    lengths, tail, heads, groups = [300, 17, 700, 1], 11, 8, 2
    config = dataclasses.replace(attention_config(heads, groups, head_dim=64), bf16=True,
                                 params_dtype=torch.bfloat16)
    te = TEDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    on_cuda = packed_row(lengths, tail).to(torch.device("cuda"))
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(total + tail, heads, 64, generator=generator)
    key, value = (torch.randn(total + tail, groups, 64, generator=generator) for _ in range(2))
    outputs = []
    for attend in (lambda q, k, v: te(q, k, v, None, attn_mask_type=AttnMaskType.causal,
                                      packed_seq_params=on_cuda.packed_seq_params(tail_as_sequence=True)),
                   lambda q, k, v: packed_attention(q, k, v, on_cuda.packed_seq_params(), scale=64 ** -0.5)):
        inputs = [t.cuda().bfloat16().requires_grad_() for t in (query, key, value)]
        out = attend(*inputs).reshape(total + tail, -1)[:total].float()
        grads = torch.autograd.grad(out.square().sum(), inputs)
        outputs.append([out] + [g[:total].float() for g in grads])
    for actual, expected in zip(*outputs):
        assert relative_error(actual, expected) <= 2e-2


class AttentionCalls(torch.overrides.TorchFunctionMode):
    """The (query, key) pairs and FLOPs of every ``scaled_dot_product_attention`` call: 4 * heads * head_dim
    per pair, s(s+1)/2 pairs for a causal call of s queries, s_q * s_k otherwise."""

    def __init__(self):
        super().__init__()
        self.flops, self.causal_calls = 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "scaled_dot_product_attention":
            query, key = args[0], args[1]
            sq, sk, causal = query.shape[-2], key.shape[-2], kwargs.get("is_causal", False)
            assert kwargs.get("attn_mask") is None  # no mask: every computed pair is an attended one
            self.causal_calls += causal
            self.flops += 4 * query.shape[-3] * query.shape[-1] * (sq * (sq + 1) // 2 if causal else sq * sk)
        return func(*args, **kwargs)


@pytest.mark.parametrize("kernel", ["sdpa_per_example", "varlen_attn"])
def test_a_packed_rows_modeled_cost_is_what_its_kernel_computes(world_of_one, monkeypatch, kernel):
    """The planner's backbone cost model (what it balances packed micro-batches with: the sum of the row's
    examples' costs) has exactly the attention FLOPs the kernel computes for the row: the examples' causal
    triangles, s(s+1)/2 pairs each, far from the T^2 of a dense mask. varlen_attn (CUDA) is counted from the
    arguments of its one launch per layer (emulated, as in the tests above)."""
    config = load_model_config("tiny")
    model = build_model(config)
    calls = AttentionCalls()
    if kernel == "varlen_attn":
        def counted(query, key, value, cu_q, cu_k, max_q, max_k, *, window_size, **kwargs):
            assert window_size == (-1, 0)
            lengths = (cu_q[1:] - cu_q[:-1]).tolist()
            calls.causal_calls += 1
            calls.flops += 4 * query.shape[1] * query.shape[2] * sum(n * (n + 1) // 2 for n in lengths)
            return reference_varlen_attn(query, key, value, cu_q, cu_k, max_q, max_k, window_size=window_size,
                                         **kwargs)
        monkeypatch.setattr(attention_module, "varlen_attn", counted)
        monkeypatch.setattr(attention_module, "uses_varlen_kernel", lambda query, dropout: True)
    examples = [make_example(model, i, 0, 0, n) for i, n in enumerate((20, 5, 40, 1, 15))]  # text only
    batch = collate_packed(examples, model.spec, pad_to=SEQ_LENGTH)
    lengths = np.array(batch.seq_lengths.tolist())
    with calls:
        model(batch)
    shape, cost = config.backbone.transformer, config.phases().backbone.cost
    assert calls.causal_calls == shape.num_layers * (len(lengths) if kernel == "sdpa_per_example" else 1)
    row_cost = float(cost.item_cost(lengths).sum())
    linear = TRAINING_FLOPS_PER_FORWARD * shape.linear_flops_per_token() * lengths.sum()
    assert row_cost - linear == pytest.approx(TRAINING_FLOPS_PER_FORWARD * calls.flops, rel=1e-12)
    dense = shape.num_layers * 4 * shape.query_size * SEQ_LENGTH ** 2
    assert calls.flops < 0.4 * dense  # what the dense mask's kernel computed


# --- --transformer-impl ----------------------------------------------------------------------------

ARGV = ["--seq-length", "64", "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3"]
CPU, GPU = ["--distributed-backend", "gloo"], ["--distributed-backend", "nccl"]


@pytest.fixture()
def transformer_engine(monkeypatch):
    """Make ``import transformer_engine`` succeed or fail, as arguments and model see it."""
    def imports(available: bool):
        for module in (arguments, model_module):
            monkeypatch.setattr(module, "transformer_engine_available", lambda: available)
    return imports


def test_transformer_impl_is_local_without_transformer_engine_or_on_cpu(transformer_engine):
    transformer_engine(False)
    for backend in (CPU, GPU):
        args = arguments.parse_args(MLLM_TASK, ARGV + backend, world_size=1)
        assert args.transformer_impl == "local"
        assert providers.model_parallel_settings(args).transformer_impl == "local"
    transformer_engine(True)
    assert arguments.parse_args(MLLM_TASK, ARGV + CPU, world_size=1).transformer_impl == "local"


def test_transformer_engine_is_refused_when_it_does_not_import(transformer_engine):
    transformer_engine(False)
    with pytest.raises(arguments.ArgumentError, match="--transformer-impl transformer_engine: Transformer Engine "
                                                      "does not import"):
        arguments.parse_args(MLLM_TASK, ARGV + GPU + ["--transformer-impl", "transformer_engine"], world_size=1)
    with pytest.raises(RuntimeError, match="needs Transformer Engine"):
        transformer_layer_spec("transformer_engine", encoder=False)
    with pytest.raises(ValueError, match="'local' or 'transformer_engine'"):
        transformer_layer_spec("inference_optimized", encoder=False)


def test_transformer_engine_when_it_imports(transformer_engine):
    transformer_engine(True)
    args = arguments.parse_args(MLLM_TASK, ARGV + GPU, world_size=1)
    assert args.transformer_impl == "transformer_engine"
    assert providers.model_parallel_settings(args).transformer_impl == "transformer_engine"
    local = ["--transformer-impl", "local"]
    assert arguments.parse_args(MLLM_TASK, ARGV + GPU + local, world_size=1).transformer_impl == "local"
    with pytest.raises(arguments.ArgumentError, match="transformer_engine needs GPUs"):
        arguments.parse_args(MLLM_TASK, ARGV + CPU + ["--transformer-impl", "transformer_engine"], world_size=1)
    # packed rows reach TE's attention as THD PackedSeqParams (test_transformer_engine_contract_of_a_packed_row)
    packed = arguments.parse_args(MLLM_TASK, ARGV + GPU + ["--orch-post-balancing", "--orch-microbatching", "packed"], world_size=1)
    assert packed.transformer_impl == "transformer_engine" and packed.orch_config.microbatching == "packed"
