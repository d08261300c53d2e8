"""SDPAttention against megatron-core's DotProductAttention, packed rows' variable-length attention
against the dense block-diagonal mask (the reference, built here only), and the --transformer-impl
selection.

Single CPU process (gloo world of 1 through the CPU harness), fp32: the SDPA kernels and megatron's
unfused attention agree to rounding.
"""
import dataclasses
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.trainer import cpu_harness  # noqa: E402

cpu_harness.install()

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402

from megatron_orch.balance.cost import TransformerShape  # noqa: E402
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
    with pytest.raises(NotImplementedError, match="context parallelism"):
        SDPAttention(dataclasses.replace(config, context_parallel_size=2), 1, AttnMaskType.causal, "self")


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
    """The reference for a packed row: the backbone with the dense block-diagonal mask, no THD."""
    lengths = batch.seq_lengths.tolist()
    embeds = {name: model.encode(name, items) for name, items in batch.items.items()}
    return model.backbone(input_ids=batch.tokens, position_ids=batch.position_ids,
                          attention_mask=dense_reference_mask(lengths, batch.tokens.shape[1] - sum(lengths)),
                          decoder_input=model.embed(batch.tokens, batch.position_ids, embeds), labels=batch.labels)


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
        args = arguments.parse_args(ARGV + backend, world_size=1)
        assert args.transformer_impl == "local"
        assert providers.model_parallel_settings(args).transformer_impl == "local"
    transformer_engine(True)
    assert arguments.parse_args(ARGV + CPU, world_size=1).transformer_impl == "local"


def test_transformer_engine_is_refused_when_it_does_not_import(transformer_engine):
    transformer_engine(False)
    with pytest.raises(arguments.ArgumentError, match="--transformer-impl transformer_engine: Transformer Engine "
                                                      "does not import"):
        arguments.parse_args(ARGV + GPU + ["--transformer-impl", "transformer_engine"], world_size=1)
    with pytest.raises(RuntimeError, match="needs Transformer Engine"):
        transformer_layer_spec("transformer_engine", encoder=False)
    with pytest.raises(ValueError, match="'local' or 'transformer_engine'"):
        transformer_layer_spec("inference_optimized", encoder=False)


def test_transformer_engine_when_it_imports(transformer_engine):
    transformer_engine(True)
    args = arguments.parse_args(ARGV + GPU, world_size=1)
    assert args.transformer_impl == "transformer_engine"
    assert providers.model_parallel_settings(args).transformer_impl == "transformer_engine"
    local = ["--transformer-impl", "local"]
    assert arguments.parse_args(ARGV + GPU + local, world_size=1).transformer_impl == "local"
    with pytest.raises(arguments.ArgumentError, match="transformer_engine needs GPUs"):
        arguments.parse_args(ARGV + CPU + ["--transformer-impl", "transformer_engine"], world_size=1)
    with pytest.raises(arguments.ArgumentError, match="--orch-microbatching packed is not supported with "
                                                      "--transformer-impl transformer_engine"):
        arguments.parse_args(ARGV + GPU + ["--orch-post-balancing", "--orch-microbatching", "packed"], world_size=1)
