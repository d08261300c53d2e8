"""The per-GPU memory model against a count by hand, and the refusal of ``--orch-encoder-ranks all`` where it
does not fit (one line naming the bytes, from the flags alone: before any collective)."""
import pytest

from megatron_orch.mllm.config import load_model_config
from megatron_orch.orchestrator.gpu_memory import (GB, ParallelLayout, backbone_bytes_per_token,
                                                   encoder_ranks_all_refusal, in_flight, padded_in_flight_tokens,
                                                   stage_memory)

MODEL = load_model_config("mllm_84b")
PHASES = MODEL.phases()
PARAMS = {k: v for k, v in MODEL.num_parameters().items() if k != "total"}
ENCODERS = PARAMS["vision"] + PARAMS["audio"]


def test_in_flight_is_1f1b_warm_up_and_one():
    assert [in_flight(s, 4, 16) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]  # no more than the step's micro-batches


@pytest.mark.parametrize("ranks,etp", [("first-stage", None), ("all", None), ("all", 1)])
def test_every_stage_by_hand(ranks, etp):
    """DP 80 x TP 8 x PP 4: the backbone's parameters over 32 GPUs at 2 + 4 bytes and 12 over DP; the encoders
    whole over their TP on every GPU that encodes, their Adam over DP alone (the trainer's); the backbone's
    activations of the in-flight micro-batches over the stage's layers and TP; the encoders' on the encoding
    GPUs over their TP."""
    layout = ParallelLayout(80, 8, 4, ranks, etp)
    tokens = [4000.0, 3000.0, 2000.0, 1000.0]
    stages = stage_memory(layout, PARAMS, PHASES, tokens, encoder_activation_bytes=16e9)
    per_token = backbone_bytes_per_token(PHASES)
    for stage, m in enumerate(stages):
        encodes = ranks == "all" or stage == 0
        held = PARAMS["llm"] / 32 + (ENCODERS / (etp or 8) if encodes else 0)
        assert m.parameters == pytest.approx(2 * held) and m.gradients == pytest.approx(4 * held)
        assert m.optimizer == pytest.approx(12 * held / 80)
        assert m.backbone_activations == pytest.approx(tokens[stage] * per_token / 4 / 8)
        assert m.encoder_activations == pytest.approx(16e9 / (etp or 8) if encodes else 0.0)
        assert m.total == pytest.approx(m.model_state + m.backbone_activations + m.encoder_activations)
    # without the distributed optimizer every GPU holds Adam whole; without sequence parallelism all activations
    whole = stage_memory(ParallelLayout(80, 8, 4, ranks, etp, distributed_optimizer=False, sequence_parallel=False),
                         PARAMS, PHASES, tokens, 16e9)
    assert whole[0].optimizer == pytest.approx(80 * stages[0].optimizer)
    assert whole[0].backbone_activations == pytest.approx(8 * stages[0].backbone_activations)
    # the per-token figure is the cost model's, linear in length (flash attention)
    assert per_token * 1000 == pytest.approx(float(PHASES.backbone.cost.item_memory([1000])[0]))


def test_all_is_refused_where_it_does_not_fit_naming_the_bytes():
    """mllm_84b at encoder TP 1 under TP 8 holds its 6.6B encoder parameters whole on every GPU (40 GB of
    parameters and gradients): refused under 60 GB where encoder TP 8 fits (8192-token micro-batches); the line
    names each kind's bytes."""
    args = dict(parameters=PARAMS, phases=PHASES, seq_length=8192, micro_batch_size=1, num_microbatches=16)
    fits = encoder_ranks_all_refusal(ParallelLayout(80, 8, 4, "all"), gpu_memory_bytes=60e9, **args)
    assert fits is None
    refused = encoder_ranks_all_refusal(ParallelLayout(80, 8, 4, "all", 1), gpu_memory_bytes=60e9, **args)
    stages = stage_memory(ParallelLayout(80, 8, 4, "all", 1), PARAMS, PHASES,
                          padded_in_flight_tokens(ParallelLayout(80, 8, 4), 8192, 1, 16))
    assert refused.startswith("OrchestratorConfig.encoder_ranks=all does not fit gpu_memory_bytes (60.0 GB): pipeline "
                              f"stage 0's GPUs need {stages[0].total / GB:.1f} GB = parameters "
                              f"{stages[0].parameters / GB:.1f} + gradients {stages[0].gradients / GB:.1f}"), refused
    assert stages[0].total > 60e9 and "\n" not in refused and "OrchestratorConfig.encoder_ranks=first-stage:" in refused
    assert encoder_ranks_all_refusal(ParallelLayout(80, 8, 4, "all", 1), gpu_memory_bytes=None, **args) is None
    assert encoder_ranks_all_refusal(ParallelLayout(80, 8, 4, "first-stage"), gpu_memory_bytes=1.0, **args) is None
    with pytest.raises(ValueError, match="encoder_tensor_parallel 3 must divide tensor_parallel 8"):
        ParallelLayout(80, 8, 4, "all", 3)
