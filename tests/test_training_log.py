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
