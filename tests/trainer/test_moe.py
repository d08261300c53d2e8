"""Mixture-of-experts backbones under post-balancing (``configs/tiny_moe.yaml``: megatron-core's MoE layer in
every backbone layer, 4 experts, top-2).

What stays invariant when post-balancing regroups examples, tested on megatron-core's own router: the
per-sequence load-balancing loss (``seq_aux_loss``) and the z-loss give the router the same gradient
however four sequences are grouped into micro-batches; the micro-batch-level loss (``aux_loss``) does not,
which is why post-balancing refuses it (``megatron_orch.megatron.moe``). End to end on CPU over gloo: EP 2
inside DP 4 (4 ranks; the experts' data-parallel groups have 2 ranks) with the distributed optimizer, the
all-to-all token dispatcher, ``seq_aux_loss`` and the z-loss, dropout 0: upstream and post-balancing give
the same losses and parameters within 1e-5.
"""
import re
import warnings

import pytest
import torch

from megatron_orch.trainer import cpu_harness

cpu_harness.install()

from test_post_balancing import BALANCED, COMMON, SCENARIOS  # noqa: E402
from test_sharded import ITERS, assert_same_training, train  # noqa: E402
from megatron_orch.mllm.task import MLLM_TASK

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

HIDDEN, SEQ = 16, 12


def _router_gradient(load_balancing_type: str, groups, sequences, z_loss_coeff=None) -> torch.Tensor:
    """The router weight's gradient from its losses alone (the main loss' gradient is zero) over ``sequences``
    (each ``[SEQ, HIDDEN]``) run in micro-batches of the given index ``groups``, per-token loss scaling."""
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=8,
                               moe_router_load_balancing_type=load_balancing_type,
                               moe_aux_loss_coeff=0.1, moe_z_loss_coeff=z_loss_coeff, calculate_per_token_loss=True,
                               use_cpu_initialization=True, add_bias_linear=False)
    router = TopKRouter(config, pg_collection=get_default_pg_collection())
    router.set_layer_number(1)
    for group in groups:
        probs, _ = router(torch.stack([sequences[i] for i in group], dim=1))  # [s, b, h]
        probs.backward(torch.zeros_like(probs))
    return router.weight.grad.clone()


def test_per_sequence_losses_are_placement_free_the_micro_batch_loss_is_not(world_of_one):
    sequences = [torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(i)) for i in range(4)]
    placements = ([(0, 1), (2, 3)], [(0, 2), (3, 1)], [(3, 0), (1, 2)])
    for kind, z_loss in (("seq_aux_loss", None), ("none", 1e-2)):
        grads = [_router_gradient(kind, groups, sequences, z_loss) for groups in placements]
        assert grads[0].abs().sum() > 0, kind
        for other in grads[1:]:
            torch.testing.assert_close(other, grads[0], rtol=1e-5, atol=1e-7)
    grads = [_router_gradient("aux_loss", groups, sequences) for groups in placements]
    assert grads[0].abs().sum() > 0
    assert not torch.allclose(grads[1], grads[0], rtol=1e-3, atol=0), "the micro-batch-level loss moved with placement"


def test_moe_flags_are_checked_and_placement_dependent_losses_refused():
    from megatron_orch.trainer import arguments

    base = COMMON + ["--global-batch-size", "16", "--model-config", "tiny_moe", "--optimizer", "adam"]
    args = arguments.parse_args(MLLM_TASK, base + MOE[2:] + BALANCED, world_size=4)
    assert args.mllm_config.backbone.transformer.num_experts == 4 and args.expert_model_parallel_size == 2
    assert arguments.parse_args(MLLM_TASK, COMMON + ["--num-experts", "8"], world_size=1).mllm_config.backbone.transformer.is_moe
    for flags, message in ((["--expert-model-parallel-size", "3"], "must divide the 4 experts"),
                           (["--model-config", "tiny", "--expert-model-parallel-size", "2"], "needs a mixture-of"),
                           (["--tensor-model-parallel-size", "2"], "needs sequence parallelism"),
                           (["--moe-aux-loss-coeff", "1e-2", *BALANCED], "the micro-batch-level load-balancing loss"),
                           (["--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "1e-2",
                             *BALANCED], "global_aux_loss"),
                           (["--moe-expert-capacity-factor", "1.0", *BALANCED], "--moe-expert-capacity-factor 1"),
                           (["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
                             *BALANCED, "--orch-microbatching", "packed"], "a packed row is one sequence")):
        with pytest.raises(arguments.ArgumentError, match=re.escape(message)):
            arguments.parse_args(MLLM_TASK, base + flags, world_size=4)
    # without post-balancing every setting is upstream's to choose
    arguments.parse_args(MLLM_TASK, base + ["--moe-aux-loss-coeff", "1e-2", "--moe-expert-capacity-factor", "1.0"], world_size=4)


MOE = ["--model-config", "tiny_moe", "--expert-model-parallel-size", "2", "--use-distributed-optimizer",
       "--moe-token-dispatcher-type", "alltoall", "--moe-router-load-balancing-type", "seq_aux_loss",
       "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


@pytest.mark.distributed
def test_moe_ep2_inside_dp4_with_the_distributed_optimizer_is_invariant(tmp_path):
    upstream = train(tmp_path, "upstream", *MOE)
    balanced = train(tmp_path, "balanced", *MOE, *BALANCED)
    assert_same_training(balanced, upstream)
    assert upstream["losses"][ITERS] < upstream["losses"][1]
    long_step = balanced["post_balancing"][SCENARIOS.index("one_long_example")]
    assert long_step["intra-node MB"] + long_step["inter-node MB"] > 0, long_step
    assert long_step["llm after"] < long_step["llm before"], long_step
    # Expert parallelism ran: the EP group {0, 1} holds different experts (trained on other tokens), the
    # experts' data-parallel group {0, 2} the same ones.
    expert = next(name for name in upstream["params"][0] if ".experts." in name)
    assert not torch.equal(upstream["params"][0][expert], upstream["params"][1][expert])
    torch.testing.assert_close(upstream["params"][2][expert], upstream["params"][0][expert], rtol=0, atol=0)
