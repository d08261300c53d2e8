"""The iteration line round-trips through its parser (the comparison command reads logs with it)."""
import pytest

from megatron_orch.trainer.training_log import (LOAD_FIELDS, POST_BALANCING_FIELDS, IterationRecord,
                                                 parse_iteration_line)


def record(post_balancing):
    return IterationRecord(
        iteration=7, consumed_samples=224, elapsed_ms=312.5, learning_rate=1e-3, global_batch_size=32,
        lm_loss=5.4321, grad_norm=1.5, loss_scale=1.0, skipped=0, nan=0, tokens_per_s=1234.5,
        load_max=dict(zip(LOAD_FIELDS, (12.0, 3.0, 700.0))), load_mean=dict(zip(LOAD_FIELDS, (10.0, 2.5, 650.0))),
        phase_ms_max={"vision-encoder-forward": 20.5, "forward-backward": 100.5},
        phase_ms_mean={"vision-encoder-forward": 10.0, "forward-backward": 99.0}, post_balancing=post_balancing)


@pytest.mark.parametrize("balanced", [False, True])
def test_line_round_trips(balanced):
    figures = dict(zip(POST_BALANCING_FIELDS, (1.8, 1.01, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 12.5, 0.1, 3.5)))
    line = record(figures if balanced else None).line(20)
    assert line.startswith(" iteration        7/      20 |")
    parsed = parse_iteration_line(line)
    assert parsed["iteration"] == 7 and parsed["lm_loss"] == pytest.approx(5.4321)
    assert parsed["elapsed_ms"] == pytest.approx(312.5)
    assert parsed["load"] == {"vision items": (12.0, 10.0), "audio windows": (3.0, 2.5),
                              "backbone tokens": (700.0, 650.0)}
    assert parsed["time_ms"] == {"vision-encoder-forward": (20.5, 10.0), "forward-backward": (100.5, 99.0)}
    if balanced:
        assert parsed["post_balancing"] == pytest.approx(figures)
    else:
        assert "post_balancing" not in parsed
    assert parse_iteration_line(" > model config tiny: 1 parameters") is None


def test_logged_bytes_count_every_transfer_as_the_simulator_does(tmp_path):
    """The trainer's post-balancing figures (LoadMeter, the iteration line, TensorBoard) count every transfer
    of the step: raw inputs, text, and the embeddings forward and their gradients back, the same bytes as the
    cluster simulator's for the same plan."""
    import numpy as np
    import torch
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_orch.balance.model_config import load_model_config
    from megatron_orch.balance.topology import Topology
    from megatron_orch.balance.traces import DEFAULT_MIXTURE
    from megatron_orch.bench.common import PLAN_METHODS, draw_sizes
    from megatron_orch.megatron.post_balancing import BalancedStep
    from megatron_orch.orchestrator.step_plan import plan_step
    from megatron_orch.sim.cluster import LinkModel, simulate_step
    from megatron_orch.trainer.training_log import LoadMeter, TensorBoardLog

    dp, per_rank, gpus = 16, 4, 4
    model = load_model_config("tiny")
    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), dp, per_rank, "tiny", 1)
    plan = plan_step(sizes, model, PLAN_METHODS["equal_count"], Topology.uniform(dp, gpus), 1, per_rank)
    step = BalancedStep(microbatches=[], vision_inputs=torch.zeros(0), audio_inputs=torch.zeros(0), plan=plan,
                        rank=0, num_tokens=np.asarray(sizes.num_tokens), tokens_per_item={},
                        timings={"plan": 0.01, "plan_exposed": 0.0, "dispatch": 0.002})
    meter = LoadMeter(iter([step]))
    next(meter)
    figures = dict(zip(POST_BALANCING_FIELDS, meter.take_post_balancing().tolist()))
    simulated = simulate_step(sizes, model, LinkModel(gpus_per_node=gpus))["equal_count"]
    embeddings = sum(m["times"] * m["inter_node_bytes"] for name, m in simulated["comm"].items()
                     if "embeddings" in name)
    assert embeddings > 0  # the embeddings do cross nodes in this plan, so the count below includes them
    assert figures["inter-node MB"] * 1e6 == pytest.approx(simulated["inter_node_bytes"], rel=1e-12)
    assert figures["intra-node MB"] * 1e6 == pytest.approx(simulated["intra_node_bytes"], rel=1e-12)

    line = record(figures).line(20)
    logged = parse_iteration_line(line)["post_balancing"]
    assert logged["inter-node MB"] == pytest.approx(figures["inter-node MB"], abs=0.005)
    assert logged["intra-node MB"] == pytest.approx(figures["intra-node MB"], abs=0.005)
    tensorboard = TensorBoardLog(str(tmp_path))
    tensorboard.write(record(figures))
    tensorboard.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    for name in ("inter-node MB", "intra-node MB"):
        scalar = events.Scalars(f"post-balancing/{name.replace(' ', '-')}")[0].value
        assert scalar == pytest.approx(figures[name], rel=1e-6)
