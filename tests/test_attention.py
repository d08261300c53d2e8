"""SDPAttention against megatron-core's DotProductAttention, and the --transformer-impl selection.

Single CPU process (gloo world of 1 through the CPU harness), fp32: the SDPA math kernel and
megatron's unfused attention agree to rounding.
"""
import dataclasses
import warnings

import pytest
import torch

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
from megatron_orch.mllm.attention import SDPAttention  # noqa: E402
from megatron_orch.megatron.batch import collate, collate_packed  # noqa: E402
from megatron_orch.mllm.examples import assemble_example  # noqa: E402
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


def block_diagonal_causal_mask(bounds, length):
    """Bool [1, 1, s, s], True = masked: causal within each [bounds[i], bounds[i+1]) and within the tail."""
    segment = torch.bucketize(torch.arange(length), torch.tensor(bounds[1:]), right=True)
    allowed = (segment[:, None] == segment[None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    return ~allowed[None, None]


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
    "packed_block_diagonal": (4, 4, 1, 24, AttnMaskType.causal, block_diagonal_causal_mask([0, 5, 12, 20], 24)),
    "per_row_masks": (4, 4, 2, 16, AttnMaskType.causal, torch.cat([block_diagonal_causal_mask([0, 7, 16], 16),
                                                                  block_diagonal_causal_mask([0, 3, 10], 16)])),
    "bidirectional_no_mask": (4, 4, 2, 17, AttnMaskType.no_mask, None),
    "gqa_causal_no_mask": (8, 2, 2, 24, AttnMaskType.causal, None),
    "gqa_packed": (8, 2, 1, 24, AttnMaskType.causal, block_diagonal_causal_mask([0, 9, 24], 24)),
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
    with pytest.raises(NotImplementedError, match="packed_seq_params.*'thd'"):
        sdpa(q, q, q, None, packed_seq_params=PackedSeqParams(qkv_format="thd"))
    with pytest.raises(NotImplementedError, match="as many keys as queries"):
        sdpa(q[:1], q, q, None)
    with pytest.raises(NotImplementedError, match="sliding-window"):
        SDPAttention(dataclasses.replace(config, window_size=(4, 0)), 1, AttnMaskType.causal, "self")
    with pytest.raises(NotImplementedError, match="context parallelism"):
        SDPAttention(dataclasses.replace(config, context_parallel_size=2), 1, AttnMaskType.causal, "self")


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


def loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    per_token = model(batch)
    loss = (per_token * batch.loss_mask).sum()
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("layout", ["padded_mha", "packed_gqa"])
def test_model_with_sdpa_equals_model_with_megatron_attention(world_of_one, layout):
    config = load_model_config("tiny")
    if layout == "packed_gqa":
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
    batch = collate_packed(examples, model.spec) if layout == "packed_gqa" else collate(examples, model.spec)
    assert (batch.attention_mask() is not None) == (layout == "packed_gqa")
    loss, grads = loss_and_grads(model, batch)
    expected_loss, expected_grads = loss_and_grads(reference, batch)
    assert relative_error(loss, expected_loss) <= TOLERANCE
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        assert grad is not None, name
        error = relative_error(grad, expected_grads[name])
        assert error <= TOLERANCE, (name, error)


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
