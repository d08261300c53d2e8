"""The iteration line round-trips through its parser (the comparison command reads logs with it), for the
configured phases: the project's three, or a model with a third encoder."""
import pytest

from megatron_orch.mllm.config import load_model_config
from megatron_orch.trainer.training_log import (IterationRecord, load_fields, parse_iteration_line, phase_timers,
                                                 post_balancing_fields)

TINY = load_model_config("tiny").phases()


def record(post_balancing, phases=TINY):
    fields = load_fields(phases)
    return IterationRecord(
        iteration=7, consumed_samples=224, elapsed_ms=312.5, learning_rate=1e-3, global_batch_size=32,
        lm_loss=5.4321, grad_norm=1.5, loss_scale=1.0, skipped=0, nan=0, tokens_per_s=1234.5,
        load_max=dict(zip(fields, (12.0, 3.0, 9.0, 700.0)[-len(fields):])),
        load_mean=dict(zip(fields, (10.0, 2.5, 8.0, 650.0)[-len(fields):])),
        phase_ms_max={"vision-encoder-forward": 20.5, "forward-backward": 100.5},
        phase_ms_mean={"vision-encoder-forward": 10.0, "forward-backward": 99.0}, post_balancing=post_balancing)


@pytest.mark.parametrize("balanced", [False, True])
def test_line_round_trips(balanced):
    figures = dict(zip(post_balancing_fields(TINY), (1.8, 1.01, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 12.5, 0.1, 3.5)))
    line = record(figures if balanced else None).line(20)
    assert line.startswith(" iteration        7/      20 |")
    parsed = parse_iteration_line(line)
    assert parsed["iteration"] == 7 and parsed["lm_loss"] == pytest.approx(5.4321)
    assert parsed["elapsed_ms"] == pytest.approx(312.5)
    assert parsed["load"] == {"vision items": (3.0, 2.5), "audio items": (9.0, 8.0), "llm tokens": (700.0, 650.0)}
    assert parsed["time_ms"] == {"vision-encoder-forward": (20.5, 10.0), "forward-backward": (100.5, 99.0)}
    if balanced:
        assert parsed["post_balancing"] == pytest.approx(figures)
    else:
        assert "post_balancing" not in parsed
    assert parse_iteration_line(" > model config tiny: 1 parameters") is None


def test_fields_follow_the_configured_phases():
    three = load_model_config("tiny_video").phases()
    assert load_fields(three) == ("vision items", "video items", "audio items", "llm tokens")
    assert phase_timers(three)[:3] == ("vision-encoder-forward", "video-encoder-forward", "audio-encoder-forward")
    fields = post_balancing_fields(three)
    assert fields[:8] == ("vision before", "vision after", "video before", "video after", "audio before",
                          "audio after", "llm before", "llm after")
    figures = dict(zip(fields, (1.8, 1.01, 1.6, 1.05, 2.0, 1.1, 1.3, 1.0, 0.25, 0.5, 12.5, 0.1, 3.5)))
    parsed = parse_iteration_line(record(figures, three).line(20))
    assert parsed["post_balancing"] == pytest.approx(figures)
    assert list(parsed["load"]) == list(load_fields(three))
