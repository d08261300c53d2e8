"""The MFU benchmark on CPU with the tiny model: every point timed, FLOPs from the planner's cost model."""
import json
import subprocess
import sys

import pytest

from megatron_orch.balance.model_config import load_model_config
from megatron_orch.bench.mfu import QUICK_GRID, with_layers


def _run(tmp_path, *flags):
    out = tmp_path / "mfu.json"
    result = subprocess.run([sys.executable, "-m", "megatron_orch.bench.mfu", "--model", "tiny", "--quick",
                             "--device", "cpu", "--json", str(out), *flags],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text()), result.stdout


@pytest.mark.parametrize("layers", [None, (1, 1, 3)])
def test_every_point_is_timed_with_the_cost_models_flops(tmp_path, layers):
    flags = ["--layers", ",".join(map(str, layers))] if layers else []
    result, stdout = _run(tmp_path, *flags)
    config = with_layers(load_model_config("tiny"), layers)
    expected = ([("vision", f"n={n}", n * config.vision_item_train_flops()) for n in QUICK_GRID["vision"]]
                + [("audio", f"n={n}", n * config.audio_window_train_flops()) for n in QUICK_GRID["audio"]]
                + [("backbone", f"{b}x{s}", b * float(config.backbone.transformer.train_flops(s)))
                   for b, s in QUICK_GRID["backbone"]])
    points = result["points"]
    assert [(p["phase"], p["shape"]) for p in points] == [(phase, shape) for phase, shape, _ in expected]
    for point, (_, _, flops) in zip(points, expected):
        assert point["status"] == "ok" and point["ms"] > 0, point
        assert point["flops"] == pytest.approx(flops, rel=1e-12)
        assert point["tflops"] == pytest.approx(point["flops"] / (point["ms"] / 1e3) / 1e12, rel=1e-9)
        assert point["mfu"] == pytest.approx(point["tflops"] / result["peak_tflops"], rel=1e-9)
    assert result["dtype"] == "fp32" and result["transformer_impl"] == "local" and result["device"] == "cpu"
    assert stdout.count("\n") >= len(expected) + 2  # header lines and one row per point


def test_bad_layers_are_refused(tmp_path):
    result = subprocess.run([sys.executable, "-m", "megatron_orch.bench.mfu", "--model", "tiny", "--quick",
                             "--device", "cpu", "--layers", "2,2"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--layers takes three positive integers" in result.stderr
