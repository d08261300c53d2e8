"""The MFU benchmark in-process on CPU with the tiny model: every point timed, FLOPs from the planner's cost model."""
import dataclasses
import json
import warnings

import pytest
import torch

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.mllm.config import load_model_config  # noqa: E402
from megatron_orch.bench import mfu  # noqa: E402

LAYERS = (1, 2, 3)  # not the config's (2, 2, 2): the override must reach the model and the FLOPs
LLM_GRID = mfu.QUICK_GRID["llm"] + [(1, 8192)]  # 8192 > tiny's 4096 positions: skipped
PHASES = ("vision", "audio", "llm")  # tiny's phases, in order
OOM_POINT = ("vision", 4)  # made to run out of memory: recorded, and the grid goes on


def test_every_point_is_timed_with_the_cost_models_flops(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(mfu.QUICK_GRID, "llm", LLM_GRID)
    built_layers = {}
    build_phase, call = mfu.build_phase, mfu.phase_call

    def spy_build(phase, *args):
        module = build_phase(phase, *args)
        per_layer = 1
        if getattr(module.config, "is_hybrid_model", False):  # a HybridModel (0.19+) counts attention and MLP layers
            from megatron_orch.mllm.hybrid import TRANSFORMER_LAYER
            per_layer = len(TRANSFORMER_LAYER)
        built_layers[phase] = module.config.num_layers // per_layer
        return module

    def call_or_oom(phase, module, config, size, device):
        if (phase, size) == OOM_POINT:
            def oom():
                raise torch.cuda.OutOfMemoryError("injected")
            return oom
        return call(phase, module, config, size, device)

    monkeypatch.setattr(mfu, "build_phase", spy_build)
    monkeypatch.setattr(mfu, "phase_call", call_or_oom)
    out = tmp_path / "mfu.json"
    returned = mfu.main(["--model", "tiny", "--quick", "--device", "cpu", "--layers", ",".join(map(str, LAYERS)),
                         "--json", str(out)])
    stdout = capsys.readouterr().out

    assert built_layers == dict(zip(PHASES, LAYERS))
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned))
    assert set(result) == {"model", "layers", "device", "torch", "megatron_core", "dtype", "transformer_impl",
                           "peak_tflops", "warmup", "repeats", "grid", "points"}
    assert (result["model"], result["layers"], result["dtype"], result["transformer_impl"], result["grid"]) == (
        "tiny", list(LAYERS), "fp32", "local", "quick")
    assert result["device"].startswith("cpu") and result["torch"] == torch.__version__
    assert result["peak_tflops"] is None  # no peak is assumed for a CPU (old code: an H200's, so MFU 0.0%)

    config = mfu.with_layers(load_model_config("tiny"), LAYERS)
    assert config.backbone.transformer.num_layers == 3 and config.encoders["vision"].transformer.num_layers == 1
    flops = {phase: float(config.encoder_cost(phase).item_cost(config.encoders[phase].item_tokens))
             for phase in ("vision", "audio")}
    expected = ([("vision", n, f"n={n}", n * flops["vision"]) for n in mfu.QUICK_GRID["vit"]]
                + [("audio", n, f"n={n}", n * flops["audio"]) for n in mfu.QUICK_GRID["whisper"]]
                + [("llm", (b, s), f"{b}x{s}", b * float(config.backbone.transformer.train_flops(s)))
                   for b, s in LLM_GRID])
    points = result["points"]
    assert [(p["phase"], p["shape"]) for p in points] == [(phase, shape) for phase, _, shape, _ in expected]
    for point, (phase, size, shape, flops) in zip(points, expected):
        assert set(point) == {f.name for f in dataclasses.fields(mfu.Point)}
        assert point["flops"] == pytest.approx(flops, rel=1e-12)
        status = "oom" if (phase, size) == OOM_POINT else "skipped" if size == (1, 8192) else "ok"
        assert point["status"] == status, point
        assert f"{shape:>9}" in stdout
        if status != "ok":
            assert point["ms"] is point["tflops"] is point["mfu"] is None
            continue
        assert point["ms"] > 0, point
        assert point["tflops"] == pytest.approx(flops / (point["ms"] / 1e3) / 1e12, rel=1e-9)
        assert point["mfu"] is None
        assert point["peak_memory_gib"] is None  # CPU
    assert "MFU: '-', no peak is assumed for a CPU" in stdout and "%" not in stdout.split("\n", 3)[3]
    assert len(stdout.splitlines()) == 3 + len(expected)  # header lines, then one row per point
    assert not torch.distributed.is_initialized()  # the world of one is torn down


def test_a_given_peak_gives_mfu_on_a_cpu(monkeypatch, capsys):
    monkeypatch.setitem(mfu.QUICK_GRID, mfu.BACKBONE_PHASE, mfu.QUICK_GRID[mfu.BACKBONE_PHASE][:1])
    for kind in ("vit", "whisper"):  # the encoders' kinds: no points
        monkeypatch.setitem(mfu.QUICK_GRID, kind, [])
    result = mfu.main(["--model", "tiny", "--quick", "--device", "cpu", "--peak-tflops", "0.5"])
    (point,) = result["points"]
    assert point["mfu"] == pytest.approx(point["tflops"] / 0.5, rel=1e-9)
    assert "ASSUMED peak of 0.5 TFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize("flags, message", [
    (["--layers", "2,2"], "--layers takes 3 numbers for model tiny (its phases vision, audio, llm), got 2"),
    (["--layers", "2,x,2"], "--layers takes positive integers, one per phase"),
    (["--transformer-impl", "transformer_engine"], "needs --device cuda"),
    (["--repeats", "0"], "--repeats >= 1"),
    (["--peak-tflops", "0"], "--peak-tflops must be > 0"),
])
def test_bad_flags_are_refused_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mfu.main(["--model", "tiny", "--quick", "--device", "cpu", *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
