"""Cost model formulas against hand-computed values, and the configs' parameter counts."""
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, strategies as st

from megatron_orch.balance.cost import ProjectorShape, TransformerShape
from megatron_orch.mllm.config import load_model_config


def small(causal: bool) -> TransformerShape:
    return TransformerShape(num_layers=2, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2, causal=causal)


def test_forward_flops_by_hand():
    # per layer and token: QKV 2*8*24 + proj 2*8*8 + FFN 2*(2*8*32) = 384 + 128 + 1024 = 1536
    assert small(False).linear_flops_per_token() == 2 * 1536
    # full attention, s = 10: 2 layers * 4 * q(8) * 100 pairs = 6400
    assert small(False).forward_flops(10) == pytest.approx(2 * 1536 * 10 + 6400)
    # causal: 10 * 11 / 2 = 55 pairs -> 2 * 4 * 8 * 55 = 3520
    assert small(True).forward_flops(10) == pytest.approx(2 * 1536 * 10 + 3520)
    assert small(True).train_flops(10) == pytest.approx(3 * (2 * 1536 * 10 + 3520))


def test_gqa_gated_logits_by_hand():
    shape = TransformerShape(num_layers=1, hidden_size=8, ffn_hidden_size=16, num_attention_heads=4, causal=True,
                             num_query_groups=2, gated_linear_unit=True, vocab_size=10)
    assert (shape.head_dim, shape.query_size, shape.kv_size) == (2, 8, 4)
    # QKV 2*8*(8+8) = 256, proj 2*8*8 = 128, SwiGLU FFN 2*3*8*16 = 768, logits 2*8*10 = 160
    assert shape.linear_flops_per_token() == 256 + 128 + 768 + 160
    # weights: QKV 128 + proj 64 + FFN 384 + norms 16, final norm 8
    assert shape.num_parameters() == 128 + 64 + 384 + 16 + 8
    # activations (elements): norms 16 + QKV in 8 + QKV 16 + attn out 8 + FFN in 8 + FFN 48 = 104
    assert shape.activation_bytes_per_token() == 2 * 104 + 4 * 4


def test_activation_bytes_classic_gpt_is_paper_minus_dropout_masks():
    h, a, layers = 64, 4, 3
    shape = TransformerShape(layers, h, 4 * h, a, causal=True)
    assert shape.activation_bytes_per_token() == layers * (32 * h + 4 * a)
    np.testing.assert_allclose(shape.activation_bytes([0, 5, 10]), [0, 5 * layers * (32 * h + 4 * a),
                                                                     10 * layers * (32 * h + 4 * a)])


@given(st.integers(1, 5000))
def test_attention_term_is_quadratic_and_causal_halves_it(s):
    full, causal = small(False), small(True)
    lin = full.linear_flops_per_token()
    attn_full = full.forward_flops(s) - lin * s
    attn_causal = causal.forward_flops(s) - lin * s
    assert attn_full == pytest.approx(2 * 4 * 8 * s * s)
    assert attn_causal == pytest.approx(attn_full * (s + 1) / (2 * s))
    # doubling the length more than doubles the cost, by exactly the extra attention
    assert full.forward_flops(2 * s) - 2 * full.forward_flops(s) == pytest.approx(2 * attn_full)


def test_vectorised_matches_scalar():
    shape = load_model_config("mllm_10b").backbone.transformer
    lengths = np.array([0, 1, 17, 4096, 30000])
    np.testing.assert_allclose(shape.forward_flops(lengths), [shape.forward_flops(int(s)) for s in lengths])
    assert shape.forward_flops(0) == 0


def test_projector_by_hand():
    proj = ProjectorShape(input_size=12, ffn_hidden_size=5, output_size=7)
    assert proj.forward_flops(3) == pytest.approx(3 * 2 * (12 * 5 + 5 * 7))
    assert proj.activation_bytes(2) == pytest.approx(2 * 2 * (2 * 12 + 2 * 5))
    assert proj.num_parameters() == 24 + 60 + 35


@pytest.mark.parametrize("bad", [dict(num_layers=0), dict(num_query_groups=3), dict(vocab_size=-1)])
def test_bad_shapes_raise(bad):
    args = dict(num_layers=2, hidden_size=8, ffn_hidden_size=32, num_attention_heads=4, causal=True) | bad
    with pytest.raises(ValueError):
        TransformerShape(**args)


def test_negative_or_nan_lengths_raise():
    with pytest.raises(ValueError, match="sequence lengths"):
        small(True).forward_flops([3, -1])
    with pytest.raises(ValueError, match="sequence lengths"):
        small(True).activation_bytes([np.nan])


def test_qwen25_7b_backbone_matches_published_parameter_count():
    # Qwen2.5-7B has 7,615,616,512 parameters, 129,024 of which are QKV biases (28 * (3584 + 2 * 512)),
    # which the model leaves out; the model adds a learned position table (Qwen uses RoPE).
    backbone = load_model_config("mllm_10b").backbone
    qwen = replace(backbone, transformer=replace(backbone.transformer, num_layers=28))
    params = qwen.num_parameters()
    assert params == 7_615_616_512 - 28 * (3584 + 2 * 512) + backbone.max_position_embeddings * 3584


@pytest.mark.parametrize("name,low,high", [("mllm_10b", 9.5e9, 10.5e9), ("mllm_18b", 17e9, 19e9),
                                           ("mllm_84b", 80e9, 88e9), ("tiny", 1e5, 2e6)])
def test_config_parameter_counts(name, low, high):
    config = load_model_config(name)
    counts = config.num_parameters()
    print(f"{name}: " + ", ".join(f"{k} {v / 1e9:.3f}B" for k, v in counts.items()))
    assert low <= counts["total"] <= high


def test_parameters_of_the_tiny_model_by_hand():
    """configs/tiny.yaml counted by hand (every stack: 2 layers, hidden 64, FFN 256; biases of the
    transformer layers left out, as the cost model does); the built model is compared with the same
    count in test_model.py."""
    h, f, layers = 64, 256, 2
    stack = layers * (3 * h * h + h * h + 2 * h * f + 2 * h) + h  # QKV, proj, FFN, 2 norms; final norm
    projector = 2 * (4 * h) + (4 * h) * 64 + 64 * 64  # LayerNorm of 4 merged tokens, 256 -> 64 -> 64
    vision = stack + (3 * 4 * 4 + 1) * h + 17 * h + h + projector  # patch conv (+bias), 17 positions, class
    audio = stack + (16 * h * 3 + h * h * 3 + 2 * h) + 32 * h + projector  # conv stem, 32 positions
    backbone = stack + (2 * 1024 + 4096) * h  # untied input and output tables, 4096 positions
    counts = load_model_config("tiny").num_parameters()
    assert counts == {"llm": backbone, "vision": vision, "audio": audio,
                      "total": 491_840 + 123_904 + 137_152}
    assert backbone + vision + audio == 491_840 + 123_904 + 137_152


def test_item_flops_of_the_tiny_model_by_hand():
    """One vision tile and one audio window of configs/tiny.yaml, counted by hand (multiply-adds x 2,
    training = 3 x forward): 2 layers of QKV (3h^2), projection (h^2), FFN (2hf) and the attention
    score and value products (2 x s^2 x h), then the projector's two matrices per LLM token."""
    from megatron_orch.mllm.config import load_model_config

    config = load_model_config("tiny")
    h, f, layers = 64, 256, 2

    def encoder(seq):
        return layers * (2 * (4 * h * h + 2 * h * f) * seq + 2 * 2 * seq * seq * h)

    def projector(tokens, input_size):  # input -> FFN 64 -> backbone hidden 64
        return 2 * (input_size * 64 + 64 * 64) * tokens

    vision = encoder(17) + projector(4, 4 * h)   # 16 patches + class token; 2x2 pixel shuffle
    audio = encoder(32) + projector(8, 4 * h)    # 64 frames / stride 2; 4 tokens stacked per LLM token
    assert config.encoder_cost("vision").item_cost(17) == 3 * vision
    assert config.encoder_cost("audio").item_cost(32) == 3 * audio


def moe(**overrides) -> TransformerShape:
    fields = dict(num_layers=1, hidden_size=8, ffn_hidden_size=32, num_attention_heads=2, causal=True,
                  num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=4)
    return TransformerShape(**{**fields, **overrides})


def test_moe_flops_count_the_active_parameters_by_hand():
    shape = moe()
    # QKV 2*8*24 = 384, proj 2*8*8 = 128; router 2*8*4 = 64, two experts of width 4: 2 * 2*(2*8*4) = 256
    assert shape.linear_flops_per_token() == 384 + 128 + 64 + 256
    # every expert's weights are parameters, two of them are active: router 32 + 4 (resp. 2) * 64
    assert shape.num_parameters() == 8 * 24 + 8 * 8 + 32 + 4 * 64 + 2 * 8 + 8
    assert shape.num_active_parameters() == 8 * 24 + 8 * 8 + 32 + 2 * 64 + 2 * 8 + 8
    # activations (elements): norms 16, QKV in 8, QKV 24, attn out 8, FFN in 8, per routed copy 8 + 2*4
    assert shape.activation_bytes_per_token() == 2 * (64 + 2 * 16) + 4 * 2 + 8 * 4
    # tokens to their two experts and back, bf16
    assert shape.expert_dispatch_bytes_per_token() == 2 * 2 * 8 * 2
    shared = moe(moe_shared_expert_intermediate_size=6, gated_linear_unit=True)
    assert shared.linear_flops_per_token() == 384 + 128 + 64 + 2 * 2 * (3 * 8 * 4) + 2 * 3 * 8 * 6


@given(st.integers(1, 8), st.integers(1, 4000))
def test_moe_of_topk_narrow_experts_costs_a_dense_ffn_plus_its_router(topk, s):
    dense = TransformerShape(num_layers=3, hidden_size=16, ffn_hidden_size=8 * topk, num_attention_heads=4, causal=True)
    sparse = replace(dense, num_experts=8, moe_router_topk=topk, moe_ffn_hidden_size=8)
    router = 3 * 2 * 16 * 8
    assert sparse.forward_flops(s) == pytest.approx(dense.forward_flops(s) + router * s)
    assert dense.expert_dispatch_bytes_per_token() == 0 and dense.num_active_parameters() == dense.num_parameters()


def test_moe_shape_checks_and_signature():
    with pytest.raises(ValueError, match="moe_router_topk=5 must be in 1..num_experts=4"):
        moe(moe_router_topk=5)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=4 needs num_experts"):
        moe(num_experts=None)
    from megatron_orch.balance.cost import TransformerCost
    dense = TransformerCost(small(True)).signature()
    assert "num_experts" not in dense  # the signatures of dense phases (and the profiles measured on them) stay
    assert TransformerCost(moe()).signature()["num_experts"] == 4


@given(st.integers(1, 200), st.sampled_from([1, 2, 3, 4]))
def test_context_parallel_cost_is_each_cp_ranks_share_of_its_zigzag_chunks(tokens, cp):
    """Per CP rank: the example padded to 2 x CP, the rank's two zig-zag chunks (r and 2C-1-r), counted pair by
    pair: the same on every rank, and the whole padded example's cost and memory over C."""
    from megatron_orch.balance.cost import ContextParallelCost, TransformerCost

    shape, multiple = small(True), 2 * cp if cp > 1 else 1
    padded = -(-tokens // multiple) * multiple
    chunk = padded // (2 * cp) if cp > 1 else padded
    cost = ContextParallelCost(TransformerCost(shape), cp)
    for rank in range(cp):
        chunks = (rank, 2 * cp - 1 - rank) if cp > 1 else (0,)
        queries = np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])
        pairs = float((queries + 1).sum())  # query at position p attends keys 0..p
        flops = 3 * (shape.linear_flops_per_token() * queries.size + shape.num_layers * 4 * shape.query_size * pairs)
        assert cost.item_cost(np.array([tokens]))[0] == pytest.approx(flops, rel=1e-12)
        assert cost.item_memory(np.array([tokens]))[0] == pytest.approx(
            shape.activation_bytes_per_token() * queries.size, rel=1e-12)
    assert cost.signature() == TransformerCost(shape).signature()


def test_a_cost_model_of_ones_own_is_what_the_planner_balances():
    """examples/toy_cost_model.py (docs/integration.md, "Extending"): a backbone phase costed by measured points
    is a CostModel, and the plan's figures are its costs: before, max/mean of the ranks' sums as loaded."""
    import runpy
    from pathlib import Path

    from megatron_orch.balance.cost import CostModel
    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.workload import BackbonePhase, ModelPhases, StepSizes
    from megatron_orch.orchestrator.config import OrchestratorConfig
    from megatron_orch.orchestrator.step_plan import plan_step

    toy = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "toy_cost_model.py"))
    cost = toy["MeasuredCost"](tokens=(1, 64, 256), seconds=(0.001, 0.01, 0.09))
    assert isinstance(cost, CostModel)
    expected = [0.001 + 31 / 63 * 0.009, 0.09 + 0.08 / 192 * 256]  # between two points, beyond the last
    assert cost.item_cost(np.array([32, 512])).tolist() == pytest.approx(expected)
    with pytest.raises(ValueError, match="strictly increasing"):
        toy["MeasuredCost"](tokens=(64, 1), seconds=(0.01, 0.001))
    tokens = np.array([256] * 4 + [16] * 12)  # rank 0 loaded the long examples
    sizes = StepSizes(counts=np.full(4, 4), items={}, num_tokens=tokens)
    phases = ModelPhases(encoders=(), backbone=BackbonePhase("text", cost, token_bytes=20))
    plan = plan_step(sizes, phases, OrchestratorConfig(background=False), Topology.uniform(4, 2), 1, 4)
    loads = cost.item_cost(tokens).reshape(4, 4).sum(axis=1)
    assert plan.stats["text"].imbalance_before == pytest.approx(loads.max() / loads.mean())
    assert plan.stats["text"].imbalance_after == pytest.approx(1.0)  # one long and three short on every rank
