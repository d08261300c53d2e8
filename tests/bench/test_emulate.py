"""Calibrate a (tiny-grid) CPU profile of the tiny model, then emulate DP 2 with it: every rank's phases are
timed, and the JSON's figures agree with the plans and with each other."""
import json
import warnings

import numpy as np
import pytest
import yaml

warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")

from megatron_orch.balance.cost_profile import load_cost_profile  # noqa: E402
from megatron_orch.balance.traces import DEFAULT_MIXTURE  # noqa: E402
from megatron_orch.balance.workload import phase_items  # noqa: E402
from megatron_orch.bench import calibrate, emulate  # noqa: E402
from megatron_orch.bench.common import draw_sizes, model_phases  # noqa: E402
from megatron_orch.mllm.config import load_model_config  # noqa: E402

DP, PER_RANK = 2, 3
PHASES = ("vision", "audio", "llm")  # tiny's phases


def test_calibrate_then_emulate_on_cpu(tmp_path, monkeypatch):
    profile_path, out, png = tmp_path / "tiny_cpu.yaml", tmp_path / "emulate.json", tmp_path / "emulate.png"
    monkeypatch.setattr(calibrate, "CPU_GRID", {"vit": [1, 8], "whisper": [1, 8], "llm": [(1, 16), (1, 64), (1, 128)]})
    calibrate.main(["--model", "tiny", "--device", "cpu", "--warmup", "0", "--repeats", "1",
                    "--out", str(profile_path)])
    tiny = load_model_config("tiny")
    profile = load_cost_profile(str(profile_path), tiny.phases())
    assert set(profile.phases) == set(PHASES) and profile.device.startswith("cpu") and profile.dtype == "fp32"
    assert profile.phases["llm"].num_points == 3 and profile.phases["vision"].num_points == 2

    _, _, sizes = draw_sizes(list(DEFAULT_MIXTURE), DP, PER_RANK, "tiny", 1)
    items = {"": phase_items(sizes, model_phases(tiny, profile)), emulate.FLOPS: phase_items(sizes, tiny.phases())}
    common = ["--model", "tiny", "--dp", str(DP), "--per-rank", str(PER_RANK), "--device", "cpu",
              "--gpus-per-node", "2", "--warmup", "0", "--repeats", "1", "--seed", "1",
              "--cost-profile", str(profile_path)]
    returned = emulate.main(common + ["--json", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert result == json.loads(json.dumps(returned)) and png.stat().st_size > 10_000
    assert result["params"]["device"].startswith("cpu") and result["params"]["timing"] == "rank"
    assert list(result["methods"]) == list(emulate.EMULATED_METHODS)
    check_consistent(result, items, profile)
    by_shape = emulate.main(common + ["--timing", "shape", "--llm-bucket", "16", "--compare-flops"])
    methods = list(emulate.EMULATED_METHODS)
    assert list(by_shape["methods"]) == methods + [m + emulate.FLOPS for m in methods]
    assert by_shape["methods"]["none_flops"]["phases"]["llm"]["measured_seconds"] == \
        by_shape["methods"]["none"]["phases"]["llm"]["measured_seconds"]  # one upstream, timed once
    check_consistent(by_shape, items, profile)


def check_consistent(result, items, profile):
    """Every item timed on one rank, ranks without items not timed, and the figures agree with each other."""
    steps = {}
    for method, figures in result["methods"].items():
        flops = method.endswith(emulate.FLOPS)
        own = items[emulate.FLOPS if flops else ""]
        for phase in PHASES:
            f = figures["phases"][phase]
            measured, modeled, counts = (np.array(f[k]) for k in ("measured_seconds", "modeled", "items_per_rank"))
            assert counts.sum() == len(own[phase])
            assert ((measured > 0) == (counts > 0)).all()
            fit = profile.phases[phase]
            if phase == "llm" or flops:  # modeled: the items' own costs (+ a profile's call per encoder rank)
                assert modeled.sum() == pytest.approx(own[phase].cost.sum())
            else:
                np.testing.assert_allclose(modeled, (fit.call_overhead + fit.c0 * counts) * (counts > 0))
            assert f["measured_max_over_mean"] == pytest.approx(measured.max() / measured.mean())
        loads = [np.array(figures["phases"][p]["measured_seconds"]) for p in PHASES]
        step = figures["step"]
        expected = sum(loads).max() if method.startswith("none") else sum(load.max() for load in loads)
        assert step["measured_seconds"] == pytest.approx(expected)
        perfect = sum(load.mean() for load in loads)
        assert step["measured_over_perfect_balance"] == pytest.approx(expected / perfect - 1)
        steps[method] = expected
    for method, figures in result["methods"].items():
        assert figures["step"]["measured_speedup"] == pytest.approx(steps["none"] / steps[method])  # one upstream
        assert figures["step"]["speedup_prediction_error"] == pytest.approx(
            figures["step"]["modeled_speedup"] / figures["step"]["measured_speedup"] - 1)


def test_calibrate_writes_the_profile_point_by_point_and_a_partial_one_is_refused(tmp_path, monkeypatch):
    """A calibration stopped midway (a device call's time limit) leaves the phases it could fit, with a note
    naming what is missing; loading it fails naming a missing phase. Measurement is faked: seconds from
    known coefficients, and the run stops after the third point."""
    from megatron_orch.bench import mfu

    path = tmp_path / "profile.yaml"
    monkeypatch.setattr(calibrate, "CPU_GRID", {"vit": [1, 8], "whisper": [1, 8], "llm": [(1, 16), (1, 64), (1, 128)]})
    seen = []

    def fake_run(config, device, settings, grid, warmup, repeats, peak, on_point, stop_after=None):
        for phase in config.phases().names:
            for point, size in mfu.grid_points(phase, config, grid):
                if len(seen) == stop_after:
                    raise KeyboardInterrupt("stopped by a time limit")
                point.ms, point.tflops = 2.0 + 0.5 * point.tokens / 100, 1.0  # more tokens, more time: a fit
                on_point(point)
                seen.append(yaml.safe_load(path.read_text()))
        return []

    monkeypatch.setattr(mfu, "run", lambda *a: fake_run(*a, stop_after=3))
    with pytest.raises(KeyboardInterrupt):
        calibrate.main(["--model", "tiny", "--device", "cpu", "--out", str(path)])
    assert len(seen) == 3 and seen[0]["phases"] == {}  # one vision point fits nothing (2 coefficients)
    assert "no fit yet of phase(s) vision, audio, llm" in seen[0]["notes"]
    partial = yaml.safe_load(path.read_text())
    assert list(partial["phases"]) == ["vision"] and partial["phases"]["vision"]["num_points"] == 2
    assert "no fit yet of phase(s) audio, llm" in partial["notes"] and "vision 2, audio 1, llm 0" in partial["notes"]
    with pytest.raises(ValueError, match=r"phases\.audio: missing \(the measured model has this phase\); its notes: "
                                         r"PARTIAL profile"):
        load_cost_profile(str(path))

    seen.clear()
    monkeypatch.setattr(mfu, "run", lambda *a: fake_run(*a))
    calibrate.main(["--model", "tiny", "--device", "cpu", "--out", str(path)])
    assert len(seen) == 7 and "notes" in seen[-2] and list(seen[-2]["phases"]) == ["vision", "audio"]
    final = yaml.safe_load(path.read_text())
    assert "notes" not in final and final["phases"]["llm"]["num_points"] == 3
    assert set(load_cost_profile(str(path), load_model_config("tiny").phases()).phases) == set(PHASES)
